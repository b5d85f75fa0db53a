"""Random small tensor programs for the differential fuzzer.

A program is straight-line Python source over a few inputs, drawn from the op families Kiln fuses
or keeps whole: pointwise chains (broadcasting binaries, unaries), row/column reductions,
softmax/log_softmax/layer norm, matmul/linear with bias, scaled dot-product attention,
views/transposes/slices/expand/cat, and in-place updates (of intermediates, through views, and of
non-gradient inputs, as an optimizer updates its state).  Shapes are drawn per program with 0- and
1-sized dims; inputs are contiguous, transposed, strided (every other element) or broadcast
(expanded from size-1 dims).

Every choice goes through ``draw`` (a hypothesis ``data.draw``), so a failing program shrinks.
The program is rendered as source (``Program.source``) so that a failure prints a runnable repro.
The choices are kept (``Program.draws``): ``resized`` replays them with other dimension sizes,
the same program at other sizes (the fuzzer's ``lazy-sizes`` check, ``size_plan``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

DIMS = (0, 1, 2, 3, 4, 5, 8)
DIM_WEIGHTS = st.sampled_from((1, 1, 2, 2, 3, 3, 4, 5, 8, 0, 1, 3))
LAYOUTS = ("contiguous", "contiguous", "transposed", "heads", "strided", "expanded")
# transposed: the last two dims swapped; heads: dims -3/-2 swapped (q/k/v as transformers passes
# them, (B, L, H, E) transposed to (B, H, L, E)); strided: every other element of the last dim;
# expanded: broadcast from a size-1 dim (stride 0)
ATTN_LAYOUTS = ("contiguous", "heads", "heads", "transposed")

UNARY = (
    "torch.tanh({a})",
    "torch.sigmoid({a})",
    "torch.relu({a})",
    "F.gelu({a})",
    "F.gelu({a}, approximate='tanh')",
    "F.silu({a})",
    "torch.exp({a} * 0.5)",
    "torch.sin({a})",
    "torch.erf({a})",
    "torch.rsqrt({a} * {a} + 1.0)",
    "torch.log1p(torch.abs({a}))",
    "torch.square({a})",
    "torch.clamp({a}, -0.5, 0.7)",
    "torch.pow({a}, 3)",
    "torch.reciprocal({a} * {a} + 1.0)",
    "({a} * -1.5 + 0.25)",
)
BINARY = (
    "({a} + {b})",
    "({a} - {b})",
    "({a} * {b})",
    "({a} / ({b} * {b} + 1.0))",
    "torch.maximum({a}, {b})",
    "torch.minimum({a}, {b})",
    "torch.where({a} > {b}, {a}, {b} * 2.0)",
    "torch.add({a}, {b}, alpha=0.5)",
    "torch.lerp({a}, {b}, 0.3)",
    "torch.addcmul({a}, {b}, {b}, value=0.5)",
)
REDUCE = ("sum", "mean", "amax", "var")


@dataclass
class Input:
    name: str
    shape: tuple
    role: str  # "grad" (requires grad), "buf" (updated in place, no grad), "mask" (bool)
    layout: str = "contiguous"


@dataclass
class Program:
    inputs: list[Input] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    families: list[str] = field(default_factory=list)
    # the generator's choices, in order ([kind, value]): rebuilds the program at other sizes
    draws: list[list] = field(default_factory=list)

    @property
    def source(self) -> str:
        args = ", ".join(i.name for i in self.inputs)
        body = "\n".join("    " + ln for ln in self.lines)
        outs = ", ".join(self.outputs)
        return f"def program({args}):\n{body}\n    return ({outs},)\n"

    def describe(self) -> str:
        ins = "\n".join(
            f"#   {i.name}: shape={i.shape} role={i.role} layout={i.layout}" for i in self.inputs
        )
        return f"# families: {self.families}\n# inputs:\n{ins}\n{self.source}"


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    out = []
    for i in range(max(len(a), len(b))):
        x = a[len(a) - 1 - i] if i < len(a) else 1
        y = b[len(b) - 1 - i] if i < len(b) else 1
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


class Builder:
    """Draws one program.  ``vals`` maps a value's name to (shape, owned): ``owned`` values were
    computed by the program (not views of inputs), so in-place updates on them are legal."""

    def __init__(
        self,
        draw: Callable[[Any], Any] | None,
        replay: list | None = None,
        sizes: dict[int, int] | None = None,
    ) -> None:
        self.draw = draw
        self.p = Program()
        self.vals: dict[str, tuple[tuple, bool]] = {}
        self.n = 0
        self.trace: list[list] = []  # every choice made, in order: [kind, value]
        self.replay = None if replay is None else [list(x) for x in replay]
        self.sizes = sizes or {}
        self.desync = False  # a replayed choice did not meet its kind: the program differs

    # ---- helpers ----------------------------------------------------------------------------
    def _take(self, kind: str, strategy: st.SearchStrategy, fit: Callable[[Any], Any]) -> Any:
        """One choice: drawn (and recorded in ``trace``), or, when replaying, the recorded one
        made to fit the choice at hand (``fit``: None when it cannot; then the first option)."""
        if self.replay is None:
            v = self.draw(strategy)
            self.trace.append([kind, v])
            return v
        if self.replay and self.replay[0][0] == kind:
            v = fit(self.replay.pop(0)[1])
            if v is not None:
                return v
        self.desync = True
        return fit(None)

    def pick(self, seq: Any) -> Any:
        items = list(seq)
        if self.replay is None:
            v = self.draw(st.sampled_from(items))
            self.trace.append(["pick", items.index(v)])
            return v
        i = self._take("pick", st.nothing(), lambda v: 0 if v is None else int(v) % len(items))
        return items[i]

    def intin(self, lo: int, hi: int) -> int:
        return self._take(
            "int", st.integers(lo, hi), lambda v: lo if v is None else min(max(int(v), lo), hi)
        )

    def flag(self) -> bool:
        return self._take("flag", st.booleans(), lambda v: bool(v))

    def dim(self) -> int:
        """A dimension size: drawn, or when replaying at other sizes, the recorded size mapped
        through ``sizes`` (a size not in it stays)."""
        v = self._take("dim", DIM_WEIGHTS, lambda v: 2 if v is None else int(v))
        return self.sizes.get(v, v) if self.replay is not None else v

    def dims_list(self, r: int) -> list[int]:
        """Reduction dims of a rank-``r`` value (at least one)."""
        got = self._take(
            "dims",
            st.lists(st.integers(0, r - 1), min_size=1),
            lambda v: [d for d in (v or []) if 0 <= d < r] or None,
        )
        return got if got is not None else [0]

    def perm(self, r: int) -> list[int]:
        ok = lambda v: list(v) if v is not None and sorted(v) == list(range(r)) else None
        got = self._take("perm", st.permutations(list(range(r))), ok)
        return got if got is not None else list(range(r))

    def fresh(self) -> str:
        self.n += 1
        return f"v{self.n}"

    def new_input(self, shape: tuple, role: str = "grad", layout: str | None = None) -> str:
        name = f"x{len(self.p.inputs)}"
        if layout is None:
            layout = self.pick(LAYOUTS) if role == "grad" else "contiguous"
        if layout == "transposed" and len(shape) < 2:
            layout = "strided"
        if layout == "heads" and len(shape) < 3:
            layout = "transposed" if len(shape) == 2 else "contiguous"
        if layout == "expanded" and not any(s != 1 for s in shape):
            layout = "contiguous"
        self.p.inputs.append(Input(name, tuple(shape), role, layout))
        if role == "grad":
            self.vals[name] = (tuple(shape), False)
        return name

    def emit(self, expr: str, shape: tuple, owned: bool = True) -> str:
        name = self.fresh()
        self.p.lines.append(f"{name} = {expr}")
        self.vals[name] = (tuple(shape), owned)
        return name

    def any_val(self, min_rank: int = 0) -> str | None:
        """A value to build on: the newest one half of the time (deep chains), else any."""
        names = [k for k, (s, _) in self.vals.items() if len(s) >= min_rank]
        if not names:
            return None
        return names[-1] if self.flag() else self.pick(names)

    def bcast_shape(self, shape: tuple) -> tuple:
        """A shape that broadcasts against ``shape``: a suffix of it, some dims set to 1."""
        k = self.intin(0, len(shape))
        suffix = shape[len(shape) - k :]
        return tuple(1 if self.flag() else s for s in suffix)

    # ---- op families ------------------------------------------------------------------------
    def unary(self) -> None:
        a = self.any_val()
        self.emit(self.pick(UNARY).format(a=a), self.vals[a][0])

    def binary(self) -> None:
        a = self.any_val()
        sa = self.vals[a][0]
        others = [k for k, (s, _) in self.vals.items() if _broadcast(sa, s) is not None]
        if self.flag() and others:
            b = self.pick(others)
        else:
            b = self.new_input(self.bcast_shape(sa))
        out = _broadcast(sa, self.vals[b][0])
        a, b = (a, b) if self.flag() else (b, a)
        self.emit(self.pick(BINARY).format(a=a, b=b), out)

    def masked(self) -> None:
        a = self.any_val()
        sa = self.vals[a][0]
        if self.flag():
            m = self.new_input(self.bcast_shape(sa), role="mask")
        else:
            m = f"({a} > 0.3)"
        fill = self.pick(("-1.5", "0.0", "2.0"))
        self.emit(f"{a}.masked_fill({m}, {fill})", sa)

    def reduce(self) -> None:
        a = self.any_val(min_rank=1)
        if a is None:
            return self.unary()
        sa = self.vals[a][0]
        op = self.pick(REDUCE)
        keep = self.flag()
        if self.flag() or len(sa) == 1:
            dims = [self.intin(0, len(sa) - 1)]
        else:
            dims = sorted(set(self.dims_list(len(sa))))
        if op == "amax" and any(sa[d] == 0 for d in dims):
            op = "sum"  # ATen refuses an amax over nothing (eager raises)
        if op == "var":
            expr = f"torch.var({a}, dim={dims}, correction={self.pick((0, 1))}, keepdim={keep})"
        else:
            expr = f"torch.{op}({a}, dim={dims}, keepdim={keep})"
        out = tuple(1 if i in dims else s for i, s in enumerate(sa) if keep or i not in dims)
        self.emit(expr, out)

    def softmax(self) -> None:
        a = self.any_val(min_rank=1)
        if a is None:
            return self.unary()
        sa = self.vals[a][0]
        d = self.pick((-1, -1, len(sa) - 1, 0))
        fn = self.pick(("torch.softmax", "torch.log_softmax"))
        self.emit(f"{fn}({a}, dim={d})", sa)

    def layer_norm(self) -> None:
        a = self.any_val(min_rank=1)
        if a is None:
            return self.unary()
        sa = self.vals[a][0]
        if self.flag():
            w = self.new_input(sa[-1:], layout="contiguous")
            b = self.new_input(sa[-1:], layout="contiguous")
            self.emit(f"F.layer_norm({a}, ({sa[-1]},), {w}, {b})", sa)
        else:
            self.emit(f"F.layer_norm({a}, ({sa[-1]},), eps=1e-3)", sa)

    def matmul(self) -> None:
        a = self.any_val(min_rank=1)
        if a is None:
            return self.unary()
        sa = self.vals[a][0]
        n = self.dim()
        kind = self.pick(("linear_bias", "linear", "matmul", "bmm"))
        if kind == "bmm" and len(sa) == 3:
            w = self.new_input((sa[0], sa[2], n))
            self.emit(f"torch.bmm({a}, {w})", (sa[0], sa[1], n))
        elif kind == "matmul":
            w = self.new_input((sa[-1], n))
            self.emit(f"({a} @ {w})", sa[:-1] + (n,))
        else:
            w = self.new_input((n, sa[-1]))
            bias = f", {self.new_input((n,))}" if kind == "linear_bias" else ""
            self.emit(f"F.linear({a}, {w}{bias})", sa[:-1] + (n,))

    def attention(self) -> None:
        cands = [k for k, (s, _) in self.vals.items() if len(s) == 4]
        if cands and self.flag():
            q = self.pick(cands)
            B, H, L, E = self.vals[q][0]
        else:
            B, H, L, E = (self.dim(), self.pick((1, 2, 4)), self.dim(), self.pick((1, 2, 4, 8)))
            q = self.new_input((B, H, L, E), layout=self.pick(ATTN_LAYOUTS))
        gqa = H % 2 == 0 and self.flag()
        Hk = H // 2 if gqa else H
        S = L if self.flag() else self.dim()
        ev = E if self.flag() else self.pick((1, 3, 8))
        k = self.new_input((B, Hk, S, E), layout=self.pick(ATTN_LAYOUTS))
        v = self.new_input((B, Hk, S, ev), layout=self.pick(ATTN_LAYOUTS))
        kw = []
        mode = self.pick(("none", "causal", "bool", "float", "float_grad"))
        if mode == "causal":
            kw.append("is_causal=True")
        elif mode == "bool":
            kw.append(f"attn_mask={self.new_input((L, S), role='mask')}")
        elif mode in ("float", "float_grad"):
            shape = self.pick(((L, S), (B, 1, L, S), (1, H, L, S)))
            role = "grad" if mode == "float_grad" else "buf"
            kw.append(f"attn_mask={self.new_input(shape, role=role, layout='contiguous')}")
        if self.flag():
            kw.append(f"scale={self.pick((0.1, 0.5, 1.3))}")
        if gqa:
            kw.append("enable_gqa=True")
        args = ", ".join([q, k, v] + kw)
        self.emit(f"F.scaled_dot_product_attention({args})", (B, H, L, ev))

    def view(self) -> None:
        a = self.any_val()
        sa, owned = self.vals[a]
        r = len(sa)
        kind = self.pick(("transpose", "slice", "expand", "reshape", "select", "permute", "cont"))
        if kind == "transpose" and r >= 2:
            i, j = self.intin(0, r - 1), self.intin(0, r - 1)
            s = list(sa)
            s[i], s[j] = s[j], s[i]
            self.emit(f"{a}.transpose({i}, {j})", tuple(s), owned)
        elif kind == "permute" and r >= 2:
            perm = self.perm(r)
            self.emit(f"{a}.permute({list(perm)})", tuple(sa[p] for p in perm), owned)
        elif kind == "slice" and r >= 1:
            d = self.intin(0, r - 1)
            start = self.intin(0, sa[d])
            stop = self.intin(start, sa[d])
            step = self.pick((1, 1, 2))
            idx = ", ".join([":"] * d + [f"{start}:{stop}:{step}"])
            self.emit(f"{a}[{idx}]", sa[:d] + (len(range(start, stop, step)),) + sa[d + 1 :], owned)
        elif kind == "expand":
            k = self.pick((1, 2, 3))
            d = self.intin(0, r)
            s = sa[:d] + (k,) + sa[d:]
            self.emit(f"{a}.unsqueeze({d}).expand({list(s)})", s, False)  # expanded: no writes
        elif kind == "select" and r >= 1 and sa[0] > 0:
            i = self.intin(0, sa[0] - 1)
            self.emit(f"{a}[{i}]", sa[1:], owned)
        elif kind == "reshape" and r >= 2:
            s = sa[:-2] + (sa[-2] * sa[-1],)
            self.emit(f"{a}.reshape({list(s)})", s, owned)
        else:
            self.emit(f"{a}.contiguous()", sa, True)

    def cat(self) -> None:
        a = self.any_val(min_rank=1)
        if a is None:
            return self.unary()
        sa = self.vals[a][0]
        d = self.intin(0, len(sa) - 1)
        s = sa[:d] + (self.dim(),) + sa[d + 1 :]
        b = self.new_input(s)
        self.emit(f"torch.cat([{a}, {b}], dim={d})", sa[:d] + (sa[d] + s[d],) + sa[d + 1 :])

    def inplace(self) -> None:
        owned = [k for k, (s, o) in self.vals.items() if o]
        if not owned:
            a = self.any_val()
            owned = [self.emit(f"({a} * 1.0)", self.vals[a][0])]
        a = self.pick(owned)
        sa = self.vals[a][0]
        kind = self.pick(("mul_", "add_", "slice_mul_", "slice_copy_", "buffer"))
        if kind == "mul_":
            self.p.lines.append(f"{a}.mul_({self.pick(('1.5', '-0.5'))})")
        elif kind == "add_":
            b = self.new_input(self.bcast_shape(sa))
            self.p.lines.append(f"{a}.add_({b}, alpha=0.5)")
        elif kind in ("slice_mul_", "slice_copy_") and len(sa) >= 1:
            d = self.intin(0, len(sa) - 1)
            start = self.intin(0, sa[d])
            stop = self.intin(start, sa[d])
            idx = ", ".join([":"] * d + [f"{start}:{stop}"])
            if kind == "slice_mul_":
                self.p.lines.append(f"{a}[{idx}].mul_(2.0)")
            else:
                src = self.new_input(sa[:d] + (stop - start,) + sa[d + 1 :])
                self.p.lines.append(f"{a}[{idx}].copy_({src})")
        else:  # an optimizer-like update of an input that takes no gradient
            buf = self.new_input(sa, role="buf")
            self.p.lines.append(f"{buf}.mul_(0.9).add_({a}.detach(), alpha=0.1)")
            self.p.outputs.append(buf)


FAMILIES: dict[str, Callable[[Builder], None]] = {
    "pointwise": lambda b: getattr(b, b.pick(["unary", "binary", "masked"]))(),
    "reduce": Builder.reduce,
    "softmax": Builder.softmax,
    "layer_norm": Builder.layer_norm,
    "matmul": Builder.matmul,
    "attention": Builder.attention,
    "view": Builder.view,
    "cat": Builder.cat,
    "inplace": Builder.inplace,
}


def _build(b: Builder, max_ops: int) -> Program:
    fams = b._take(
        "fams",
        st.lists(st.sampled_from(sorted(FAMILIES)), min_size=1, max_size=3, unique=True),
        lambda v: [f for f in (v or []) if f in FAMILIES] or None,
    ) or ["pointwise"]
    b.p.families = fams
    rank = b.intin(1, 4)
    b.new_input(tuple(b.dim() for _ in range(rank)))
    for _ in range(b.intin(1, max_ops)):
        FAMILIES[b.pick(fams)](b)
    last = f"v{b.n}" if b.n else "x0"
    float_vals = list(b.vals)
    extra = b.pick(float_vals)
    outs = [last] + ([extra] if extra != last else [])
    # a value that is the program's input itself is returned as a copy (outputs aliasing
    # inputs are legal but not what this fuzzer checks)
    b.p.outputs = [o if o.startswith("v") else f"({o} * 1.0)" for o in outs] + b.p.outputs
    b.p.draws = b.trace
    return b.p


@st.composite
def programs(draw: Callable[[Any], Any], max_ops: int = 5) -> Program:
    """A program of 1..max_ops ops from at most three op families (a small vocabulary per
    program keeps the generated kernels few and shared between programs).  Its choices are kept
    (``Program.draws``), so :func:`resized` can rebuild it at other sizes."""
    return _build(Builder(draw), max_ops)


def drawn_sizes(prog: Program) -> list[int]:
    """The distinct dimension sizes the program's generator drew, ascending."""
    return sorted({int(v) for k, v in prog.draws if k == "dim"})


def resized(prog: Program, sizes: dict[int, int]) -> Program | None:
    """``prog`` rebuilt with every drawn dimension size ``n`` replaced by ``sizes.get(n, n)``.

    The same choices are replayed, so sizes tied in the program (the same drawn size, a
    broadcast, a matmul's inner dim, a cat's parts) change together and every shape the
    program spells out (a layer norm's shape, a reshape or expand size) follows.  A choice that
    depends on a size (a slice bound, which values broadcast) is the recorded one clamped into
    its new range, so the program stays valid; None when the replay left the recorded choices
    (a size 0 that removed a branch): not the same program at other sizes."""
    b = Builder(None, replay=prog.draws, sizes=sizes)
    out = _build(b, 10**6)  # the recorded op count
    if b.desync or b.replay:
        return None
    out.draws = prog.draws
    return out


def size_plan(prog: Program, seed: int) -> list[list[list[int]]]:
    """Two or three other sizes to run ``prog`` at, after its own (the ``lazy-sizes`` check):
    each a list of ``[drawn size, new size]`` pairs for :func:`resized`, every drawn size >= 2
    moved (sizes 0 and 1 stay: they are not sizes a shape-generic graph serves).  The first
    other size makes the lazy device compile a shape-generic graph, the last one reuses it.
    A third of the programs also get, between the two, one size set to 0 or 1 (a graph of its
    own, which must neither use nor break the generic one).  Deterministic in ``seed``; empty
    when the program drew no size >= 2."""
    rng = random.Random(seed)
    sizes = [s for s in drawn_sizes(prog) if s >= 2]
    if not sizes:
        return []
    if rng.random() < 0.5:  # shifted: n+a, then n+b
        a = rng.randint(1, 3)
        b = a + rng.randint(1, 3)
        maps = [{s: s + a for s in sizes}, {s: s + b for s in sizes}]
    else:  # doubled: 2n, then 2n+1
        maps = [{s: 2 * s for s in sizes}, {s: 2 * s + 1 for s in sizes}]
    plan = [sorted(m.items()) for m in maps]
    if rng.random() < 1 / 3:
        small = dict(maps[0])
        small[rng.choice(sizes)] = rng.choice((0, 1))
        plan.insert(1, sorted(small.items()))
    return [[list(p) for p in m] for m in plan]
