"""Lane kernels: a horizontally fused pointwise kernel made of identical independent chains.

Horizontal fusion (:mod:`kiln.passes.fuse`) puts the per-parameter updates of equal-shaped
parameters into one kernel: AdamW's update of 22 parameters of one shape, or the bias-correction
scalars of every parameter's ``step`` (12 members each, up to ``MAX_GROUP`` members).  Emitted as
one loop body, the source repeats the chain once per parameter (GPT-2's optimizer graph: two
kernels of ~19,000 characters, one g++ unit each), and a graph whose parameters group differently
compiles another copy.  Such a body splits into *lanes*: connected components of the body (linked
by values and by shared inputs) that are the same computation on their own inputs.

:func:`find_lanes` finds them; :func:`lane_kernel` emits each class of identical lanes as one
function of (a lane's row of a ``P``-index table, an element range), called lane after lane
(below ``PARALLEL_MIN`` elements in all lanes together, with no OpenMP region) or, in one parallel
region, by each thread for its range of every lane.  The calling convention is unchanged (same ``P``/``I``/``D``,
same :class:`KernelSpec`), so executors and the native launcher call it as any pointwise kernel;
the source no longer grows with the number of lanes (the table does, a few characters a pointer),
and sizes stay run-time arguments: the same chains, lane count and table are one compiled
function for any parameter sizes.

Needs: a pointwise kernel without rolls, broadcast/strided inputs, Python-number inputs or
stochastic rounding (others are emitted as before).  Guarantees: each lane computes exactly the
formulas the flat kernel computed (same emitter, same element order per lane); lanes are
independent (no shared input, no value crossing lanes, no output placed by the memory plan over
another lane's input), so their order does not matter.
"""

from __future__ import annotations

from typing import Any

from kiln.codegen.cpp.emit import (
    _ABBR_CT,
    _DTYPE,
    _STORE_CT,
    PARALLEL_MIN,
    WIDE_VECTOR_OPS,
    WIDE_VECTORS,
    KernelSpec,
    _Emitter,
)
from kiln.ir.graph import In, Node
from kiln.ir.kernel import FusedKernel, LoopKind, OutKind, Val
from kiln.precision import cpp as lowp

MIN_LANES = 2
ENABLED = True  # off: every kernel is emitted flat (A/B measurements, tests)


def _canon(v: Any, local_val: dict[int, int], local_in: dict[int, int]) -> Any:
    """``v`` with body references and inputs renumbered within the lane."""
    if isinstance(v, Val):
        return ("V", local_val[v.i])
    if isinstance(v, In):
        if v.k not in local_in:
            local_in[v.k] = len(local_in)
        return ("I", local_in[v.k])
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, tuple(_canon(x, local_val, local_in) for x in v))
    return ("C", type(v).__name__, repr(v))


def _refs(v: Any, vals: list[int], ins: list[int]) -> None:
    if isinstance(v, Val):
        vals.append(v.i)
    elif isinstance(v, In):
        ins.append(v.k)
    elif isinstance(v, (tuple, list)):
        for x in v:
            _refs(x, vals, ins)


def find_lanes(
    body: tuple, outs: tuple, modes: dict[int, tuple], alias: tuple = ()
) -> list[list[tuple]] | None:
    """The body's independent chains grouped into classes of identical ones, when some class has
    ``MIN_LANES`` or more (else None).  A lane is ``(body entries, inputs in first-use order,
    output positions, the outputs' entries in lane numbering)``.  ``modes``: tensor input ->
    (dtype, mode), part of a lane's signature.  ``alias``: (input, output position) pairs whose
    buffers may be one (an output placed over an input that dies here): one lane.  (A kernel cut at ``MAX_GROUP`` members holds
    a partial chain at its end: a class of its own.)"""
    n = len(body)
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    reader: dict[int, int] = {}  # input -> first entry reading it
    for j, (_, args, kwargs, _) in enumerate(body):
        vals: list[int] = []
        ins: list[int] = []
        _refs(args, vals, ins)
        _refs(tuple(v for _, v in kwargs), vals, ins)
        for i in vals:
            parent[find(i)] = find(j)
        for k in ins:
            if k not in modes:
                return None  # a Python-number input: not handled here
            if k in reader:
                parent[find(reader[k])] = find(j)
            else:
                reader[k] = j
    for k, o in alias:  # lane by lane, an output written over another lane's input: merged
        if k in reader:
            parent[find(reader[k])] = find(outs[o])
    comps: dict[int, list[int]] = {}
    for j in range(n):
        comps.setdefault(find(j), []).append(j)
    if len(comps) < MIN_LANES or len(reader) != len(modes):
        return None
    out_pos = {b: o for o, b in enumerate(outs)}
    classes: dict[tuple, list[tuple]] = {}  # signature -> its lanes, in body order
    for entries in sorted(comps.values()):
        local_val = {j: x for x, j in enumerate(entries)}
        local_in: dict[int, int] = {}
        sig = []
        for j in entries:
            op, args, kwargs, dt = body[j]
            sig.append(
                (op, _canon(args, local_val, local_in), _canon(kwargs, local_val, local_in), dt)
            )
        lane_outs = sorted((out_pos[j], local_val[j]) for j in entries if j in out_pos)
        ins = sorted(local_in, key=local_in.get)
        key = (tuple(sig), tuple(x for _, x in lane_outs), tuple(modes[k] for k in ins))
        lane = (entries, ins, [o for o, _ in lane_outs], [x for _, x in lane_outs])
        classes.setdefault(key, []).append(lane)
    if max(len(c) for c in classes.values()) < MIN_LANES:
        return None
    return list(classes.values())


def _renumber(v: Any, local_val: dict[int, int], local_in: dict[int, int]) -> Any:
    if isinstance(v, Val):
        return Val(local_val[v.i])
    if isinstance(v, In):
        return In(local_in[v.k])
    if isinstance(v, tuple):
        return tuple(_renumber(x, local_val, local_in) for x in v)
    if isinstance(v, list):
        return [_renumber(x, local_val, local_in) for x in v]
    return v


def lane_body(body: tuple, lane: tuple) -> tuple[tuple, tuple]:
    """(body, outputs) of one lane, renumbered: its inputs are In(0..), its entries Val(0..)."""
    entries, ins, _, outs = lane
    local_val = {j: x for x, j in enumerate(entries)}
    local_in = {k: x for x, k in enumerate(ins)}
    sub = tuple(
        (
            op,
            _renumber(args, local_val, local_in),
            tuple((k, _renumber(v, local_val, local_in)) for k, v in kwargs),
            dt,
        )
        for op, args, kwargs, dt in (body[j] for j in entries)
    )
    return sub, tuple(outs)


def lanes_ok(kind: LoopKind, modes: list[str], n_scalars: int, body: tuple, sr: bool) -> bool:
    """Whether a kernel may be emitted as lanes at all (see the module's Needs)."""
    return (
        kind is LoopKind.POINTWISE
        and not any(e[0] == "roll.default" for e in body)
        and not sr
        and n_scalars == 0
        and all(m in ("full", "one") for m in modes)
    )


def lane_kernel(spec: KernelSpec, node: Node, in_types: list, in_slots: tuple) -> str | None:
    """The lane form of the kernel for ``node`` (``spec``: its call spec from
    :func:`~kiln.codegen.cpp.emit.kernel_spec`, ``out_kinds`` and ``out_dtypes`` filled in here),
    or None where it has none (the caller then emits it flat: :func:`~kiln.codegen.cpp.emit.
    emit_flat`, whose source is never made for a lane kernel).  ``in_slots``: per node input,
    the memory-plan slot its value sits in (None: none, ``"?"``: unknown)."""
    if not ENABLED:
        return None
    kernel = FusedKernel.of(node)
    if not lanes_ok(kernel.kind, spec.input_modes, len(spec.scalar_inputs), kernel.body, spec.sr):
        return None
    src = lane_source(spec, node, in_types, kernel.body, kernel.outputs, in_slots)
    # element i of a lane's outputs from element i of its inputs, every input of one shape
    spec.flat = src is not None
    return src


def lane_source(
    spec: Any, node: Any, in_types: list, body: tuple, outs: tuple, in_slots: tuple | None
) -> str | None:
    """The lane kernel's source for the kernel ``spec`` describes (its ``out_kinds`` and
    ``out_dtypes`` then filled in as the flat kernel's would be; ``spec`` untouched when None),
    or None when its body is not lanes.
    ``in_slots``: per node input, its memory-plan slot (None: none); unknown (None): no lanes."""
    if in_slots is None:
        return None
    modes = {k: (str(in_types[k].dtype), m) for k, m in zip(spec.tensor_inputs, spec.input_modes)}
    alias = []
    for o, place in enumerate(node.kwarg("placement") or ()):
        if isinstance(place, tuple):  # ("arg", q): in place over input q
            alias.append((place[1], o))
        elif place is not None:  # a slot: the buffer of any input placed in the same slot
            alias += [(k, o) for k, s in enumerate(in_slots) if s in (place, "?")]
    classes = find_lanes(body, outs, modes, tuple(alias))
    if classes is None:
        return None
    p_of = {k: p for p, k in enumerate(spec.tensor_inputs)}
    nin = len(spec.tensor_inputs)
    lines: list[str] = []
    tables, calls = [], []
    for c, lanes in enumerate(classes):
        lines += _class_function(c, lanes, spec, node, in_types, body, modes)
        rows = [
            "{" + ", ".join([str(p_of[k]) for k in ins] + [str(nin + o) for o in outs]) + "}"
            for _, ins, outs, _ in lanes
        ]
        width = len(lanes[0][1]) + len(lanes[0][2])
        tables.append(
            f"  static const int32_t T{c}_[{len(lanes)}][{max(width, 1)}] = {{{', '.join(rows)}}};"
        )
        calls.append(
            f"for (int64_t g_ = 0; g_ < {len(lanes)}; ++g_) {spec.name}_c{c}(P, T{c}_[g_], i0_, i1_);"
        )
    lines.append(f'extern "C" void {spec.name}(void** P, const int64_t* I, const double* D) {{')
    lines += tables
    lines += [f"  const int64_t s{d} = I[{d}];" for d in range(spec.rank)]
    n = " * ".join(f"s{d}" for d in range(spec.rank)) or "1"
    lines.append(f"  const int64_t N = {n};")
    lines.append("  if (N == 0) return;")
    # small (all lanes together below PARALLEL_MIN elements): lane after lane on this thread (no
    # OpenMP region); large: each thread takes one range of elements of every lane
    total = sum(len(lanes) for lanes in classes)
    lines.append(f"  if (N * {total} < {PARALLEL_MIN}) {{")
    lines.append("    const int64_t i0_ = 0, i1_ = N;")
    lines += [f"    {x}" for x in calls]
    lines.append("    return;")
    lines.append("  }")
    lines.append("  #pragma omp parallel")
    lines.append("  {")
    lines.append("    const int64_t nt_ = omp_get_num_threads(), t_ = omp_get_thread_num();")
    lines.append("    const int64_t i0_ = N * t_ / nt_, i1_ = N * (t_ + 1) / nt_;")
    lines += [f"    {x}" for x in calls]
    lines.append("  }")
    lines.append("}")
    spec.out_kinds[:] = [OutKind.FULL] * len(outs)
    spec.out_dtypes[:] = [_DTYPE[body[b][3]] for b in outs]
    return "\n".join(lines) + "\n"


def _class_function(
    c: int,
    lanes: list[tuple],
    spec: Any,
    node: Any,
    in_types: list,
    body: tuple,
    modes: dict[int, tuple],
) -> list[str]:
    """One class's chain as a function of one lane's pointer table row and an element range
    (the chain emitted once, by the flat kernel's emitter, on lane 0's renumbered body)."""
    sub_body, sub_outs = lane_body(body, lanes[0])
    ins0 = lanes[0][1]
    sub = KernelSpec(
        spec.name,
        spec.kind,
        spec.rank,
        spec.static_shape,
        list(range(len(ins0))),
        [modes[k][1] for k in ins0],
        [],
        [OutKind.FULL] * len(sub_outs),
    )
    e = _Emitter(sub, node, [in_types[k] for k in ins0], sub_body, sub_outs)
    a, b = len(ins0), len(sub_outs)
    math = any(op.split(".", 1)[0] in WIDE_VECTOR_OPS for op, *_ in sub_body)
    attr = WIDE_VECTORS if math else ""  # as the flat kernel's (kiln.codegen.cpp.emit)
    e.w(
        f"static {attr}void {spec.name}_c{c}(void** P, const int32_t* T, int64_t i0_, int64_t i1_) {{"
    )
    for k in range(a):
        ct = e.storage_of_input(k)
        e.w(f"  const {ct}* in{k} = (const {ct}*)P[T[{k}]];")
    for o in range(b):
        abbr = sub_body[sub_outs[o]][3]
        ct = lowp.STORAGE.get(abbr) or _STORE_CT.get(_ABBR_CT[abbr], _ABBR_CT[abbr])
        e.w(f"  {ct}* out{o} = ({ct}*)P[T[{a + o}]];")
    for p in range(a):
        if sub.input_modes[p] == "one":
            e.w(f"  const {e.ctype_of_input(p)} one{p} = {e.wrap_load(p, f'in{p}[0]')};")
    e.w("  #pragma omp simd")
    e.w("  for (int64_t i = i0_; i < i1_; ++i) {")
    vals: dict = {}
    e.pointwise(vals, "    ")
    e.store_full(vals, "    ")
    e.w("  }")
    e.w("}")
    return e.lines
