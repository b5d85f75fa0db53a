"""C++ source for fused nodes.

One function per fused node, ``extern "C" void <name>(void** P, const int64_t* I, const double* D)``:

  P  data pointers: the node's tensor inputs (in order), then its outputs
  I  the iteration shape (one int64 per dim), then, for each broadcast input, one stride per dim
     (0 where the input is broadcast)
  D  the node's Python-number inputs (``scalar`` graph inputs)

Sizes are run-time arguments, so one compiled kernel serves every batch size / sequence length;
only the rank, the dtypes and which inputs broadcast are compiled in.  The :class:`KernelSpec`
returned next to the source tells the executor how to marshal the arguments.

Kernel shapes:
  pointwise  a flat ``parallel for simd`` loop, or rows x last-dim loops when an input broadcasts
  rows       per row (parallel): the pointwise prologue, then sums/means/amaxes over the last dim
             (sums in ATen's order, :mod:`kiln.codegen.cpp.sum_order`), or one softmax /
             log_softmax computed in the output row; then the epilogue, if any
             (:mod:`kiln.codegen.cpp.row_phases`): its one-per-row values, and a second pass over
             the row for the others
  cols       sums over all leading dims, block by block of rows: the pointwise prologue (the
             threads share the rows), then each column's values added in ATen's order (the
             threads share the columns as ATen's do)

A pointwise kernel with ``roll`` members (one shift ``K`` along the last dim, of kernel inputs
only: :mod:`kiln.passes.fuse`) runs rows x last-dim loops, the last-dim loop in two segments,
``j < K`` reading element ``j - K + L`` of the rolled input and ``j >= K`` element ``j - K``, so
both stay contiguous, vectorizable loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.codegen.cpp import scalars, sum_order
from kiln.codegen.cpp.ops import CTYPE, FORMULAS, Operand, cast, literal
from kiln.codegen.cpp.row_phases import closure, inputs_of, row_phases
from kiln.ir.graph import In, Node, dtype_abbr
from kiln.ir.kernel import FusedKernel, Lit, LoopKind, OutKind, Val
from kiln.precision import cpp as lowp
from kiln.precision import rounding

# Elements: below this a kernel runs on one thread (fork/join costs more than it saves).  Measured
# on a quiet 2-core machine, 32k beats 1M (tiny GPT step 25.4 vs 29.7 ms); on a heavily loaded one,
# a descheduled team member stalls a parallel kernel at its barrier, but that hurts ATen alike.
PARALLEL_MIN = 32768
# On every `omp simd reduction` loop: gcc 12 keeps one accumulator per possible lane (64 when a
# byte-sized input is in the loop) and folds them with a scalar loop after every row; capping the
# lane count at 16 (one AVX-512 register of floats) cut a causal-softmax row kernel ~2x.
SAFELEN = "safelen(16)"
# Kernels that evaluate transcendental functions (exp/erf/tanh polynomials, libmvec calls) are
# compiled for full-width AVX-512 vectors: gcc's -march=native tuning on these Xeons prefers 256-bit
# vectors, and such loops are compute-bound (1 thread, CPU time, kernel + call: GELU 8x64x512
# 311-325 -> 283-289 us, GELU backward + column sum 431-436 -> 334-351 us, GPT-2's tanh GELU
# 4x64x512 154-186 -> 88-100 us).  Memory-bound kernels (adds, AdamW, softmax rows, layer-norm
# forward) measured 3-8% slower at 512 bits, so they keep the default.  A function attribute, so
# it only changes the code gcc emits for vector loops (same operations, same rounding).
WIDE_VECTOR_OPS = frozenset(
    {
        "gelu",
        "gelu_backward",
        "tanh",
        "tanh_backward",
        "exp",
        "exp2",
        "expm1",
        "erf",
        "erfc",
        "sigmoid",
        "sigmoid_backward",
        "silu",
        "silu_backward",
        "log",
        "log1p",
        "log2",
        "log10",
        "softplus",
        "softplus_backward",
        "mish",
        "mish_backward",
        "sin",
        "cos",
    }
)
WIDE_VECTORS = '__attribute__((target("prefer-vector-width=512"))) '
# Row kernels compiled the same way: a log-softmax over a vocabulary-sized row is bound by its
# exp (the loss of a language model: 256x1000, 1 thread, C++ timing loop, 222 -> 174 us).
WIDE_ROW_OPS = frozenset({"_log_softmax.default"})

# bf16 / fp16 values are computed in float, rounded where computed (kiln.precision.cpp)
_ABBR_CT = {"f32": "float", "b8": "bool", "i64": "int64_t", "bf16": "float", "f16": "float"}
_STORE_CT = {"bool": "uint8_t"}  # how a dtype sits in memory (torch.bool is one byte, 0 or 1)
_DTYPE = {
    "f32": torch.float32,
    "b8": torch.bool,
    "i64": torch.int64,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
}


@dataclass
class KernelSpec:
    """What the executor needs to call one generated kernel."""

    name: str
    kind: str
    rank: int
    static_shape: tuple
    tensor_inputs: list[int]  # positions (in the fused node's inputs) of tensor inputs
    input_modes: list[str]  # per tensor input: "full" | "one" | "bcast" | "bcast_inner"
    scalar_inputs: list[int]  # positions of Python-number inputs
    out_kinds: list[OutKind]  # per output
    out_dtypes: list[torch.dtype] = field(default_factory=list)
    # per tensor input: the dtype the graph says it has, which the kernel's C++ reads it as
    # (checked per call: another dtype raises rather than being read as this one)
    in_dtypes: list[torch.dtype] = field(default_factory=list)
    members: tuple = ()
    source: str = ""
    sr: bool = False  # rounds stochastically: takes a random key after the scalars in D
    # one flat loop, element i of every output from element i of every full input (no
    # broadcast, no roll): the inputs may share any one dense layout (channels-last), read as
    # stored, the outputs made in it
    flat: bool = False


def _mode(shape: tuple, it: tuple) -> str:
    if tuple(shape) == tuple(it):
        return "full"
    if all(s == 1 for s in shape):
        return "one"
    if len(shape) and shape[-1] != 1:
        return "bcast_inner"  # last dim present: contiguous along it (stride 1)
    return "bcast"  # last dim broadcast: one value per row


def kernel_spec(name: str, node: Node, in_types: list) -> KernelSpec:
    """The call spec of one ``fused`` node's kernel (``in_types``: its inputs' types), before any
    source: ``out_kinds``/``out_dtypes`` are filled in by the emitter that writes the source
    (:func:`emit_flat`, or the lane form of :mod:`kiln.codegen.cpp.lanes`)."""
    kernel = FusedKernel.of(node)
    kind, shape, body = kernel.kind, kernel.shape, kernel.body
    rank = len(shape)
    tensor_inputs, modes, scalars = [], [], []
    strided = set(kernel.strided)
    for k, t in enumerate(in_types):
        if t.dtype is None:
            scalars.append(k)
        else:
            tensor_inputs.append(k)
            m = _mode(t.shape, shape)
            # a permuted/sliced view is read through its strides (rows of the last dim)
            modes.append("bcast_inner" if m == "full" and k in strided and rank > 1 else m)
    spec = KernelSpec(
        name, kind, rank, shape, tensor_inputs, modes, scalars, [], members=kernel.members
    )
    spec.sr = rounding.enabled() and any(e[3] in lowp.LOWP for e in body)
    return spec


def emit_flat(spec: KernelSpec, node: Node, in_types: list) -> str:
    """The kernel's C++ source, one loop nest over its whole body (``spec``: :func:`kernel_spec`'s,
    its ``out_kinds``, ``out_dtypes`` and ``source`` filled in here)."""
    kernel = FusedKernel.of(node)
    kind, body = kernel.kind, kernel.body
    e = _Emitter(spec, node, in_types, body, kernel.outputs)
    src = e.source()
    math = any(op.split(".", 1)[0] in WIDE_VECTOR_OPS for op, *_ in body)
    wide_row = kind is LoopKind.ROWS and any(op in WIDE_ROW_OPS for op, *_ in body)
    if (math and kind in (LoopKind.POINTWISE, LoopKind.COLS)) or wide_row:
        src = src.replace('extern "C" ', 'extern "C" ' + WIDE_VECTORS, 1)
    spec.source = src
    return src


class _Emitter:
    def __init__(self, spec: KernelSpec, node: Node, in_types, body, outs) -> None:
        self.spec, self.node, self.in_types, self.body, self.outs = spec, node, in_types, body, outs
        self.R = spec.rank
        self.pos = {k: p for p, k in enumerate(spec.tensor_inputs)}
        self.spos = {k: p for p, k in enumerate(spec.scalar_inputs)}
        self.lines: list[str] = []
        self.before_rows: list[str] = []  # lines each thread runs before its rows
        # body entry -> rolled kernel input; their one shift; the loop segment being emitted
        self.rolls = {b: e[1][0].k for b, e in enumerate(body) if e[0] == "roll.default"}
        shifts = {body[b][1][1][0] for b in self.rolls}
        if len(shifts) > 1 or (self.rolls and spec.kind != LoopKind.POINTWISE):
            raise ValueError("rolls of one shift, in pointwise kernels only")
        self.shift = shifts.pop() if shifts else None
        self.segment = ""

    # ---- helpers -------------------------------------------------------------------------
    def w(self, s: str) -> None:
        self.lines.append(s)

    def ctype_of_input(self, k: int) -> str:
        t = self.in_types[k]
        if t.dtype is None:
            return "double"
        return CTYPE[t.dtype]

    def load(self, k: int) -> str:
        if k in self.spos:
            return f"d{k}"
        if self.spec.input_modes[self.pos[k]] == "one":
            return f"one{k}"  # loaded once, before the loops (see prologue)
        return f"x{k}"  # loaded at the top of the loop body (see pointwise)

    def element(self, k: int) -> str:
        """The expression that reads tensor input ``k``'s element inside the loops."""
        mode = self.spec.input_modes[self.pos[k]]
        if mode == "full":
            ref = f"in{k}[i]"
        elif mode == "bcast_inner":
            ref = f"in{k}[off{k} + j]"
        else:
            ref = f"in{k}[off{k}]"
        return self.wrap_load(k, ref)

    def rolled(self, k: int) -> str:
        """Input ``k``'s element at the rotated index of the current loop segment."""
        mode = self.spec.input_modes[self.pos[k]]
        if mode == "one":
            return f"one{k}"
        if mode == "bcast":  # broadcast along the last dim: every index holds the same value
            return self.wrap_load(k, f"in{k}[off{k}]")
        src = "j - K_ + L" if self.segment == "lo" else "j - K_"
        base = "r * L" if mode == "full" else f"off{k}"
        return self.wrap_load(k, f"in{k}[{base} + {src}]")

    def wrap_load(self, k: int, ref: str) -> str:
        abbr = dtype_abbr(self.in_types[k].dtype)
        if abbr in lowp.LOWP:
            return lowp.load_expr(abbr, ref)
        # bool tensors are read as bytes: gcc vectorizes uint8_t loads, not bool ones
        return f"({ref} != 0)" if self.ctype_of_input(k) == "bool" else ref

    def storage_of_input(self, k: int) -> str:
        abbr = dtype_abbr(self.in_types[k].dtype)
        if abbr in lowp.LOWP:
            return lowp.STORAGE[abbr]
        ct = self.ctype_of_input(k)
        return _STORE_CT.get(ct, ct)

    def operand(self, v: Any, vals: dict[int, tuple[str, str]]) -> Operand:
        if isinstance(v, In):
            t = self.in_types[v.k]
            if t.dtype is None:  # a lifted Python number
                return Operand(self.load(v.k), "double")
            one = self.spec.input_modes[self.pos[v.k]] == "one"
            abbr = dtype_abbr(t.dtype)
            return Operand(self.load(v.k), CTYPE[t.dtype], None, abbr, len(t.shape) == 0, one)
        if isinstance(v, Val):
            expr, ct = vals[v.i]
            return Operand(expr, ct, None, self.body[v.i][3], False, False)
        if isinstance(v, Lit):
            ct = _ABBR_CT[v.dtype]
            return Operand(f"(({ct}){literal(v.value)})", ct, None, v.dtype)
        if v is None:
            return Operand("0", None, None)
        return Operand(literal(v), None, v)

    def pointwise(
        self, vals: dict[int, tuple[str, str]], indent: str, only: set[int] | None = None
    ) -> None:
        """Statements computing every pointwise body entry (reductions are skipped); ``only``:
        just these entries, reading just their inputs (a rows kernel's phases).

        Every input is read first, unconditionally, into a local: a load under a condition
        (``where(mask, c, x)`` reads ``x`` only where the mask is false) becomes a masked load
        that keeps gcc from vectorizing mixed-width loops."""
        used = None if only is None else inputs_of([self.body[b] for b in only])
        for p, k in enumerate(self.spec.tensor_inputs):
            if self.spec.input_modes[p] != "one" and (used is None or k in used):
                self.w(f"{indent}const {self.ctype_of_input(k)} x{k} = {self.element(k)};")
        for idx, (op, args, kwargs, dt) in enumerate(self.body):
            if only is not None and idx not in only:
                continue
            if idx in self.rolls:
                ct = _ABBR_CT[dt]
                self.w(f"{indent}const {ct} v{idx} = ({ct})({self.rolled(self.rolls[idx])});")
                vals[idx] = (f"v{idx}", ct)
                continue
            if op not in FORMULAS:
                continue
            ct = _ABBR_CT[dt]
            given = [self.operand(a, vals) for a in args]
            kw = {k: self.operand(v, vals) if isinstance(v, In) else v for k, v in kwargs}
            # a bf16 / fp16 op's other operands rounded first, as ATen's kernels round them
            ops, kw, narrow = scalars.narrow(op, given, kw)
            half = scalars.half_formula(op, ops, ct) if dt == "f16" else None
            if half is not None:
                expr = half
            elif narrow is not None and op == "pow.Tensor_Scalar":
                x = cast(ops[0], ct)
                expr = scalars.pow_tensor_scalar(x, given[1].literal, ops[1], ct, narrow)
            else:
                expr = FORMULAS[op](ops, kw, ct)
            if dt in lowp.LOWP:  # rounded where computed, as eager rounds each op's result
                expr = lowp.round_expr(dt, f"(float)({expr})", self.spec.sr, idx)
            self.w(f"{indent}const {ct} v{idx} = ({ct})({expr});")
            vals[idx] = (f"v{idx}", ct)

    def prologue(self) -> None:
        nm = self.spec.name
        self.w(f'extern "C" void {nm}(void** P, const int64_t* I, const double* D) {{')
        for p, k in enumerate(self.spec.tensor_inputs):
            ct = self.storage_of_input(k)
            self.w(f"  const {ct}* in{k} = (const {ct}*)P[{p}];")
        nin = len(self.spec.tensor_inputs)
        for o, b in enumerate(self.outs):
            abbr = self.body[b][3]
            ct = lowp.STORAGE.get(abbr) or _STORE_CT.get(_ABBR_CT[abbr], _ABBR_CT[abbr])
            self.w(f"  {ct}* out{o} = ({ct}*)P[{nin + o}];")
            self.spec.out_dtypes.append(_DTYPE[self.body[b][3]])
        for p, k in enumerate(self.spec.scalar_inputs):
            self.w(f"  const double d{k} = D[{p}];")
        if self.spec.sr:
            self.w(lowp.key_prologue(str(len(self.spec.scalar_inputs))))
        for d in range(self.R):
            self.w(f"  const int64_t s{d} = I[{d}];")
        n = " * ".join(f"s{d}" for d in range(self.R)) or "1"
        self.w(f"  const int64_t N = {n};")
        self.zero_size_exit()
        for p, k in enumerate(self.spec.tensor_inputs):
            if self.spec.input_modes[p] == "one":
                # hoisted: a load under a condition (where(mask, c, x)) keeps gcc from vectorizing
                ct = self.ctype_of_input(k)
                self.w(f"  const {ct} one{k} = {self.wrap_load(k, f'in{k}[0]')};")
        slot = self.R
        self.bcast = [
            k
            for p, k in enumerate(self.spec.tensor_inputs)
            if self.spec.input_modes[p] in ("bcast", "bcast_inner")
        ]
        for k in self.bcast:
            for d in range(self.R - 1):
                self.w(f"  const int64_t st{k}_{d} = I[{slot + d}];")
            slot += self.R
        if self.R:
            self.w(f"  const int64_t L = s{self.R - 1};")
            self.w("  const int64_t rows = N / L;")
        if self.shift is not None:  # N > 0 here, so L > 0
            self.w(f"  const int64_t K_ = (({self.shift}LL % L) + L) % L;")

    def zero_size_exit(self) -> None:
        """No elements to iterate: a reduction output still has elements when only the reduced
        dims are empty (a bias gradient over an empty batch), and gets the reduction's identity
        (sum 0, mean NaN as ATen's 0/0, amax -inf) instead of being left uninitialized."""
        fills = []
        for o, b in enumerate(self.outs):
            kind = self.spec.out_kinds[o]
            if kind is OutKind.FULL:
                continue
            ct = _ABBR_CT[self.body[b][3]]
            ident = {"amax.default": "-INFINITY", "mean.dim": "NAN"}.get(self.body[b][0], "0")
            if kind in (OutKind.ROW, OutKind.ROWK):
                count = " * ".join(f"s{d}" for d in range(self.R - 1)) or "1"
            else:
                count = f"s{self.R - 1}"
            fills.append(f"    for (int64_t q = 0; q < {count}; ++q) out{o}[q] = ({ct})({ident});")
        if not fills:
            self.w("  if (N == 0) return;")
            return
        self.w("  if (N == 0) {")
        self.lines += fills
        self.w("    return;")
        self.w("  }")

    def rows_begin(self, parallel: bool = True, block: bool = False) -> None:
        """Open the loop over rows ``r``.  Each thread takes one contiguous block of rows; the
        offsets of broadcast / strided inputs are computed for the block's first row and then
        advanced row by row (a division per dim per row dominated rows of 32 elements).
        ``parallel=False``: already inside a parallel region; ``block``: the threads share rows
        ``[b0_, b1_)`` instead of all of them."""
        if parallel:
            self.w(f"  #pragma omp parallel if(N >= {PARALLEL_MIN})")
        self.w("  {")
        self.w("  const int64_t nt_ = omp_get_num_threads(), t_ = omp_get_thread_num();")
        if block:
            self.w("  const int64_t r0_ = b0_ + (b1_ - b0_) * t_ / nt_;")
            self.w("  const int64_t r1_ = b0_ + (b1_ - b0_) * (t_ + 1) / nt_;")
        else:
            self.w("  const int64_t r0_ = rows * t_ / nt_, r1_ = rows * (t_ + 1) / nt_;")
        outer = range(self.R - 1)
        if self.bcast:
            self.w("  int64_t rem_ = r0_;")
            for d in reversed(outer):
                self.w(f"  int64_t id{d}_ = rem_ % s{d}; rem_ /= s{d};")
            for k in self.bcast:
                terms = " + ".join(f"id{d}_ * st{k}_{d}" for d in outer) or "0"
                self.w(f"  int64_t off{k} = {terms};")
        self.lines += self.before_rows
        self.w("  for (int64_t r = r0_; r < r1_; ++r) {")

    def rows_end(self, after: list[str] | None = None) -> None:
        """Advance the offsets to the next row (carrying into outer dims), close the loop;
        ``after``: lines run by each thread after its rows."""
        if self.bcast and self.R > 1:
            self._advance(self.R - 2, "    ")
        self.w("  }")
        self.lines += after or []
        self.w("  }")

    def _advance(self, d: int, indent: str) -> None:
        for k in self.bcast:
            self.w(f"{indent}off{k} += st{k}_{d};")
        if d == 0:
            return
        self.w(f"{indent}if (++id{d}_ == s{d}) {{")
        self.w(f"{indent}  id{d}_ = 0;")
        for k in self.bcast:
            self.w(f"{indent}  off{k} -= st{k}_{d} * s{d};")
        self._advance(d - 1, indent + "  ")
        self.w(f"{indent}}}")

    def store_full(self, vals, indent: str, only: set[int] | None = None) -> None:
        for o, b in enumerate(self.outs):
            if only is not None and b not in only:
                continue
            if self.body[b][0] in FORMULAS or b in self.rolls:
                v, abbr = vals[b][0], self.body[b][3]
                self.w(
                    f"{indent}out{o}[i] = {lowp.store_expr(abbr, v) if abbr in lowp.LOWP else v};"
                )

    # ---- kernels -------------------------------------------------------------------------
    def source(self) -> str:
        kind = self.spec.kind
        self.phases = (
            row_phases(self.body, self.spec.input_modes, self.pos)
            if kind is LoopKind.ROWS
            else None
        )
        for b in self.outs:
            op = self.body[b][0]
            if self.phases is not None and b in self.phases.scalar:
                self.spec.out_kinds.append(OutKind.ROWK)  # an epilogue value of one per row
            elif op in FORMULAS or op in (
                "_softmax.default",
                "_log_softmax.default",
                "roll.default",
            ):
                self.spec.out_kinds.append(OutKind.FULL)
            else:
                keep = bool(dict(self.body[b][2]).get("keepdim", False)) or (
                    len(self.body[b][1]) > 2 and bool(self.body[b][1][2])
                )
                if kind is LoopKind.ROWS:
                    self.spec.out_kinds.append(OutKind.ROWK if keep else OutKind.ROW)
                else:
                    self.spec.out_kinds.append(OutKind.COLK if keep else OutKind.COL)
        self.prologue()
        if kind is LoopKind.POINTWISE:
            self.k_pointwise()
        elif kind is LoopKind.ROWS:
            self.k_rows()
        else:
            self.k_cols()
        if kind is LoopKind.COLS or any(e[0] in ("sum.dim_IntList", "mean.dim") for e in self.body):
            self.lines.insert(0, sum_order.SOURCE)
        self.w("}")
        return "\n".join(self.lines) + "\n"

    def k_pointwise(self) -> None:
        if self.shift is not None:
            self.rows_begin()
            for seg, lo, hi in (("lo", "0", "K_"), ("hi", "K_", "L")):
                self.segment = seg
                self.w("    #pragma omp simd")
                self.w(f"    for (int64_t j = {lo}; j < {hi}; ++j) {{")
                self.w("      const int64_t i = r * L + j;")
                vals: dict = {}
                self.pointwise(vals, "      ")
                self.store_full(vals, "      ")
                self.w("    }")
            self.rows_end()
            return
        if not self.bcast:
            self.spec.flat = not self.spec.sr  # stochastic rounding draws by element index
            # "parallel:" matters: a bare if() on a combined construct also switches simd off,
            # which left every kernel below PARALLEL_MIN scalar (one libm call per element).
            self.w(f"  #pragma omp parallel for simd if(parallel: N >= {PARALLEL_MIN})")
            self.w("  for (int64_t i = 0; i < N; ++i) {")
            vals: dict = {}
            self.pointwise(vals, "    ")
            self.store_full(vals, "    ")
            self.w("  }")
            return
        self.rows_begin()
        self.w("    #pragma omp simd")
        self.w("    for (int64_t j = 0; j < L; ++j) {")
        self.w("      const int64_t i = r * L + j;")
        vals = {}
        self.pointwise(vals, "      ")
        self.store_full(vals, "      ")
        self.w("    }")
        self.rows_end()

    def _reduce_operand(self, b: int, vals) -> str:
        return self.operand(self.body[b][1][0], vals).expr

    def row_sum(self, value: str) -> None:
        """``float s``: the sum of ``value`` over the row in ATen's softmax order
        (:func:`kiln.codegen.cpp.sum_order.softmax_row_sum`)."""
        self.lines += sum_order.softmax_row_sum(value, "    ")

    def k_rows(self) -> None:
        reds = [(b, e) for b, e in enumerate(self.body) if e[0] not in FORMULAS]
        out_of = {b: o for o, b in enumerate(self.outs)}
        special = [(b, e) for b, e in reds if e[0] in ("_softmax.default", "_log_softmax.default")]
        log = bool(special) and special[0][1][0] == "_log_softmax.default"
        sums = [b for b, e in reds if e[0] in ("sum.dim_IntList", "mean.dim")]
        if log:  # each row's max and sum, for the logs taken after the rows (vectorized)
            self.before_rows = ["  float* mxs_ = kiln_buf<float>(2 * (r1_ - r0_) + 1, 0);"]
        elif sums:  # each thread's row buffer per sum: the values, then added in ATen's order
            self.w("  const int64_t pool_ = omp_get_max_threads();")
            self.before_rows = [f"  float* q{b}_ = kiln_buf<float>(L, 0);" for b in sums]
        self.rows_begin()
        self.before_rows = []
        if special:
            b, e = special[0]
            o = out_of[b]
            self.w(f"    float* y = out{o} + r * L;")
            self.w("    float mx = -INFINITY;")
            self.w(f"    #pragma omp simd reduction(max:mx) {SAFELEN}")
            self.w("    for (int64_t j = 0; j < L; ++j) {")
            self.w("      const int64_t i = r * L + j;")
            vals: dict = {}
            self.pointwise(vals, "      ")
            self.store_full(vals, "      ")
            x = self.operand(e[1][0], vals)
            self.w(f"      const float x = (float)({x.expr});")
            self.w("      y[j] = x;")
            self.w("      mx = x > mx ? x : mx;")
            self.w("    }")
            self.w("    if (mx == -INFINITY) mx = 0.0f;")
            if e[0] == "_softmax.default":
                self.row_sum("(y[{j}] = km::exp(y[{j}] - mx))")  # stored as it is added
                self.w("    const float inv = 1.0f / s;")
                self.w("    #pragma omp simd")
                self.w("    for (int64_t j = 0; j < L; ++j) y[j] *= inv;")
            else:
                self.row_sum("km::exp(y[{j}] - mx)")
                self.w("    mxs_[2 * (r - r0_)] = mx;")
                self.w("    mxs_[2 * (r - r0_) + 1] = s;")
                # after the rows: the logs of the sums, vectorized (one row's log_vec is a long
                # dependent chain that stalled its row: 1024x96 140 -> 164 us), then per row
                # (x - max) - log(sum), as ATen: x - (max + log(sum)) rounds the sum to the
                # row's magnitude (logits of 1e38: log-probabilities 0 instead of -log(L))
                after = [
                    "  #pragma omp simd",
                    (
                        "  for (int64_t k = 0; k < r1_ - r0_; ++k) "
                        "mxs_[2 * k + 1] = km::log_vec(mxs_[2 * k + 1]);"
                    ),
                    "  for (int64_t r = r0_; r < r1_; ++r) {",
                    f"    float* y = out{o} + r * L;",
                    "    const float mx = mxs_[2 * (r - r0_)], ls = mxs_[2 * (r - r0_) + 1];",
                    "    #pragma omp simd",
                    "    for (int64_t j = 0; j < L; ++j) y[j] = (y[j] - mx) - ls;",
                    "  }",
                    "  kiln_free(mxs_);",
                ]
                self.rows_end(after)
                return
            self.rows_end()
            return
        clauses = []
        for b, e in reds:
            if e[0] == "amax.default":
                # a NaN anywhere in the row makes ATen's amax NaN; a max reduction drops it
                self.w(f"    float acc{b} = -INFINITY;")
                self.w(f"    int nan{b} = 0;")
                clauses.append(f"reduction(max:acc{b}) reduction(|:nan{b})")
        ph = self.phases
        self.w(f"    #pragma omp simd {' '.join(clauses)} {SAFELEN}".rstrip())
        self.w("    for (int64_t j = 0; j < L; ++j) {")
        self.w("      const int64_t i = r * L + j;")
        vals = {}
        first = (ph.pre | {b for b, _ in reds}) if ph.after else None  # + the reductions' inputs
        self.pointwise(vals, "      ", first)
        self.store_full(vals, "      ", first)
        for b, e in reds:
            x = self._reduce_operand(b, vals)
            if e[0] == "amax.default":
                self.w(
                    f"      {{ const float t = (float)({x}); acc{b} = t > acc{b} ? t : acc{b}; "
                    f"nan{b} |= (t != t); }}"
                )
            else:
                self.w(f"      q{b}_[j] = (float)({x});")
        self.w("    }")
        for b, e in reds:
            # sums as ATen's sum (kiln_inner_sum); a mean as ATen's: the sum, divided by L
            val = f"kiln_inner_sum(q{b}_, L, rows, pool_)"
            if e[0] == "mean.dim":
                val = f"{val} / (float)L"
            elif e[0] == "amax.default":
                val = f"(nan{b} ? NAN : acc{b})"
            self.w(f"    const float red{b} = {val};")
            self.w(f"    out{out_of[b]}[r] = red{b};")
        if ph.after:
            self.k_rows_epilogue(reds, out_of)
        self.rows_end([f"  kiln_free(q{b}_);" for b in sums])

    def k_rows_epilogue(self, reds: list, out_of: dict[int, int]) -> None:
        """The members after the reductions: once per row those of one value per row (and the
        prologue values they read), then a second pass over the row for the others."""
        ph = self.phases
        rowvals: dict = {b: (f"red{b}", "float") for b, _ in reds}
        scalar_need = closure(self.body, ph.scalar, stop=set(rowvals))
        self.pointwise(rowvals, "    ", scalar_need)
        for b in sorted(ph.scalar):
            if b in out_of:
                self.w(f"    out{out_of[b]}[r] = {rowvals[b][0]};")
        full = ph.after - ph.scalar
        if not full:
            return
        loop_need = closure(self.body, full, stop=set(rowvals))
        self.w("    #pragma omp simd")
        self.w("    for (int64_t j = 0; j < L; ++j) {")
        self.w("      const int64_t i = r * L + j;")
        vals = dict(rowvals)
        self.pointwise(vals, "      ", loop_need)
        self.store_full(vals, "      ", full)
        self.w("    }")

    def k_cols(self) -> None:
        """Sums over the leading dims of a row-major ``[rows, L]``, each column's float values
        added in the order ATen's CPU sum kernel adds them (:mod:`kiln.codegen.cpp.sum_order`),
        so that a fused bias gradient is eager's to the bit.  Block by block of rows, in one
        parallel region: the threads share the block's rows for the pointwise prologue (whole
        rows, contiguous memory), writing each summand where it is a kernel output anyway, else
        into a buffer of two blocks; after a barrier each adds the block's rows of its columns (split as
        ATen's threads split them), while they are still in cache.  (The prologue split by
        columns, half rows per thread, ran GELU backward + column sum at 4096x1024 on 2 threads
        in 3.6 ms against 2.2 with double sums; the whole prologue before all the sums, 2.5.)"""
        reds = [b for b, e in enumerate(self.body) if e[0] not in FORMULAS]
        out_of = {b: o for o, b in enumerate(self.outs)}
        stored: dict[int, str] = {}  # reduction -> the full-size array its summand is written to
        for b in reds:
            v = self.body[b][1][0]
            if (
                isinstance(v, Val)
                and v.i in out_of
                and self.body[v.i][0] in FORMULAS
                and self.body[v.i][3] == "f32"
            ):
                stored[b] = f"out{out_of[v.i]}"
        temps = [b for b in reds if b not in stored]
        self.w("  const int64_t pool_ = omp_get_max_threads();")
        # rows a block: 131072 floats of each array (512 KB), still in cache when added up
        self.w("  const int64_t br_ = L >= 131072 ? 1 : 131072 / L;")
        for b in temps:  # two blocks' worth, used in turn (block k + 2 is written after the
            # barrier of block k + 1, which every thread reaches after adding up block k)
            self.w(f"  float* q{b} = kiln_buf<float>(2 * br_ * L, 0);")
            stored[b] = f"q{b}"
        self.w(f"  #pragma omp parallel if(N >= {sum_order.GRAIN} && pool_ > 1)")
        self.w("  {")
        self.w("  int64_t cb_, ce_;")
        self.w("  const int mine_ = kiln_col_range(L, &cb_, &ce_);")
        for b in reds:
            self.w(f"  kiln_col_sums c{b};")
            self.w(f"  if (mine_) kiln_col_sums_init(&c{b}, rows, L, cb_, ce_, pool_);")
        self.w("  for (int64_t b0_ = 0; b0_ < rows; b0_ += br_) {")
        self.w("  const int64_t b1_ = b0_ + br_ < rows ? b0_ + br_ : rows;")
        if temps:  # row r of the block at q + qo_ + r * L
            self.w("  const int64_t qo_ = ((b0_ / br_) % 2) * br_ * L - b0_ * L;")
        self.rows_begin(parallel=False, block=True)
        self.w("      #pragma omp simd")
        self.w("      for (int64_t j = 0; j < L; ++j) {")
        self.w("        const int64_t i = r * L + j;")
        vals: dict = {}
        self.pointwise(vals, "        ")
        self.store_full(vals, "        ")
        for b in temps:
            self.w(f"        q{b}[qo_ + i] = (float)({self._reduce_operand(b, vals)});")
        self.w("      }")
        self.rows_end()
        # the block's rows are all written (the next block's are other rows: no second barrier)
        self.w("  #pragma omp barrier")
        self.w("  if (mine_) {")
        for b in reds:
            self.w(
                f"    for (int64_t r = b0_; r < b1_; ++r) "
                f"kiln_col_sums_add(&c{b}, r, {stored[b]}{' + qo_' if b in temps else ''}"
                " + r * L + cb_);"
            )
        self.w("  }")
        self.w("  }")
        self.w("  if (mine_) {")
        for b in reds:
            self.w(f"    kiln_col_sums_finish(&c{b}, out{out_of[b]} + cb_);")
        self.w("  }")
        self.w("  }")
        for b in temps:
            self.w(f"  kiln_free(q{b});")
