"""Run one fuzz program in eager (float32 and float64), compile mode and on the lazy device.

Each run returns the program's outputs, the gradients of ``sum(out * cotangent)`` with respect to
every gradient input (taken at the leaf the input was made from, so a transposed, strided or
broadcast input's gradient is checked in its base's layout), and the final values of the inputs
the program updates in place.

Tolerance (``compare``): a tensor passes when every element is within ``RTOL * |eager| + ATOL`` of
float32 eager (1e-5 / 1e-6: a few float32 ulps of the values these programs make, which are O(1)),
or else when, measured against the float64 result, Kiln's error is at most ``SLACK`` (4) times
float32 eager's own error over the tensor (root mean square, and worst element plus the band).
The second test is there because Kiln may round differently from ATen (double accumulators in
reductions, a 2-ulp exp) and some results are ill-conditioned (a layer norm of a near-constant row
multiplies rounding by rstd ~ 316): there both float32 results are far apart in relative terms yet
equally close to the exact value.  A Kiln error several times ATen's own is a mismatch.  NaNs and
infinities must be at the same places.

An ``expanded`` input's gradient is a sum over its broadcast positions: the gradient of the
expanded view (checked too, as ``vgrads``, element by element) summed.  Where those terms cancel
(a layer norm of a row of one broadcast value: terms of ~300 whose exact sum is 0), the float32
sum is the terms' rounding, noise of ~1e-5 on both sides; eager lands exactly on 0 in 9-24% of
such rows (measured), so a comparison with eager's own error alone fails on chance.  There the
base gradient also passes element by element within ``RTOL`` of the summed magnitudes
(float64, ``sum |view gradient|`` over the positions folded into each element) plus ``SLACK``
times eager's error.

Last, eager's error on one draw can be luck.  Where a result is ill-conditioned in the rounding of
an intermediate (the input gradient of a layer norm of a layer norm over rows of 2: the float
``rstd`` the forward saves is rounded, and ``1 - xhat^2`` cancels, so half an ulp of ``rstd``
moves the gradient by ~1e-5 relative; or a broadcast input's gradient whose terms cancel), both
float32 results are ulps of ``rstd`` times a large factor off float64, and which one lands closer
is chance: eager is 10x closer than its own typical error on a few rows in ten thousand.  So a
tensor that failed both tests above is measured once more against eager's *typical* error at
this point (``near``): eager float32 and float64 rerun on ``NEAR_DRAWS`` copies of the inputs,
each element moved by up to ``NEAR_ULPS`` float32 ulps (the same conditioning, other rounding),
and per element the median over the draws of eager's error against its own float64 result.
Kiln's error must be within ``SLACK`` times that (root mean square and worst element, as above).
A median, so one draw that crosses a branch (``where``, ``relu``, ``maximum``) does not widen the
band; a well-conditioned result has a typical error of an ulp or two, no looser than before.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from fuzz_programs import Input, Program

RTOL, ATOL, SLACK = 1e-5, 1e-6, 4.0
NEAR_DRAWS, NEAR_ULPS = 16, 2
# how many tensors passed on eager's typical error alone (the third test of ``compare``)
COUNTS = {"near_passes": 0}

_counter = [0]


def make_function(prog: Program) -> Callable:
    """``prog.source`` as a Python function (registered with linecache, so tracebacks and
    torch.compile's stack traces show the program's own lines)."""
    _counter[0] += 1
    filename = f"<kiln-fuzz-{_counter[0]}>"
    src = prog.source
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    ns: dict[str, Any] = {"torch": torch, "F": F}
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - the generated program
    return ns["program"]


@dataclass
class Data:
    """Concrete data for a program's inputs: one base tensor per input (the leaf)."""

    bases: list[torch.Tensor]
    cots: list[torch.Tensor] | None = None


def _base_shape(inp: Input) -> tuple:
    s = inp.shape
    if inp.layout == "transposed" and len(s) >= 2:
        return s[:-2] + (s[-1], s[-2])
    if inp.layout == "heads" and len(s) >= 3:
        return s[:-3] + (s[-2], s[-3], s[-1])
    if inp.layout == "strided" and len(s) >= 1:
        return s[:-1] + (2 * s[-1] + 1,)
    if inp.layout == "expanded":
        d = next((i for i, n in enumerate(s) if n != 1), None)
        if d is not None:
            return s[:d] + (1,) + s[d + 1 :]
    return s


def _view(inp: Input, base: torch.Tensor) -> torch.Tensor:
    s = inp.shape
    if inp.layout == "transposed" and len(s) >= 2:
        return base.transpose(-1, -2)
    if inp.layout == "heads" and len(s) >= 3:
        return base.transpose(-3, -2)
    if inp.layout == "strided" and len(s) >= 1:
        return base[..., 1::2]
    if inp.layout == "expanded":
        return base.expand(s)
    return base


def make_data(prog: Program, seed: int) -> Data:
    g = torch.Generator().manual_seed(seed)
    bases = []
    for inp in prog.inputs:
        shape = _base_shape(inp)
        if inp.role == "mask":
            bases.append(torch.rand(shape, generator=g) > 0.5)
        else:
            bases.append(torch.randn(shape, generator=g))
    return Data(bases)


@dataclass
class Result:
    outs: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    bufs: list[torch.Tensor]
    # per gradient input: the gradient of its expanded view (None: not an expanded input)
    vgrads: list[torch.Tensor | None] = field(default_factory=list)


def make_batch_function(progs: list[Program]) -> Callable:
    """One function running ``progs`` side by side: it takes every program's arguments in order
    and returns every program's outputs in order (each program is its own function, which Dynamo
    inlines, so the batch is one graph)."""
    _counter[0] += 1
    filename = f"<kiln-fuzz-batch-{_counter[0]}>"
    ns: dict[str, Any] = {f"prog{i}": make_function(p) for i, p in enumerate(progs)}
    params, calls, k = [], [], 0
    for i, p in enumerate(progs):
        names = [f"a{k + j}" for j in range(len(p.inputs))]
        k += len(p.inputs)
        params += names
        calls.append(f"*prog{i}({', '.join(names)})")
    src = f"def batch({', '.join(params)}):\n    return ({', '.join(calls)},)\n"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), ns)  # noqa: S102 - the generated program
    return ns["batch"]


def run(
    prog: Program,
    fn: Callable,
    data: Data,
    dtype: torch.dtype = torch.float32,
    device: Any = None,
    after: Callable[[], None] | None = None,
) -> Result:
    """Run ``fn`` (the program, compiled or not) on ``data``; ``device`` is where the inputs go
    (None: CPU); ``after`` runs once everything was recorded (the lazy device's ``mark_step``)."""
    return run_many([prog], fn, [data], dtype, device, after)[0]


def run_many(
    progs: list[Program],
    fn: Callable,
    datas: list[Data],
    dtype: torch.dtype = torch.float32,
    device: Any = None,
    after: Callable[[], None] | None = None,
) -> list[Result]:
    """As :func:`run` for a batch: ``fn`` takes all programs' arguments and returns all their
    outputs (:func:`make_batch_function`); one backward over the sum of every program's
    ``sum(out * cotangent)`` (the programs share no tensors, so each program's gradients are
    exactly its own); one ``after``."""
    leaves, args, metas, views = [], [], [], []
    for prog, data in zip(progs, datas):
        mine, vs = [], []
        for inp, base in zip(prog.inputs, data.bases):
            t = base.clone() if inp.role == "mask" else base.to(dtype).clone()
            if device is not None:
                t = t.to(device)
            if inp.role == "grad":
                t.requires_grad_(True)
            mine.append(t)
            args.append(_view(inp, t))
            if inp.role == "grad":
                vs.append(args[-1] if inp.layout == "expanded" and args[-1] is not t else None)
        leaves.append(mine)
        views.append(vs)
    flat = list(fn(*args))
    outs_per, k = [], 0
    for prog in progs:
        outs_per.append(flat[k : k + len(prog.outputs)])
        k += len(prog.outputs)
    if k != len(flat):
        raise AssertionError(f"the batch returned {len(flat)} outputs, its programs {k}")
    loss = None
    all_grad_leaves: list[torch.Tensor] = []
    for prog, data, outs, mine in zip(progs, datas, outs_per, leaves):
        n_bufs = sum(1 for i in prog.inputs if i.role == "buf" and i.name in prog.outputs)
        main = outs[: len(outs) - n_bufs]
        if data.cots is None:
            g = torch.Generator().manual_seed(len(main))
            data.cots = [torch.randn(tuple(o.shape), generator=g) for o in main]
        grad_leaves = [t for t, i in zip(mine, prog.inputs) if i.role == "grad"]
        metas.append((len(all_grad_leaves), len(grad_leaves)))
        all_grad_leaves += grad_leaves
        for o, c in zip(main, data.cots):
            if o.requires_grad:
                term = (o * c.to(dtype).to(o.device)).sum()
                loss = term if loss is None else loss + term
    all_views = [v for vs in views for v in vs if v is not None]
    grads: list[torch.Tensor | None] = [None] * len(all_grad_leaves)
    vgrads: list[torch.Tensor | None] = [None] * len(all_views)
    if loss is not None:
        got = torch.autograd.grad(loss, all_grad_leaves + all_views, allow_unused=True)
        grads, vgrads = list(got[: len(all_grad_leaves)]), list(got[len(all_grad_leaves) :])
    vgrad_of = iter(vgrads)
    if after is not None:
        after()
    cpu = lambda t: None if t is None else t.detach().to("cpu")
    results = []
    for prog, outs, mine, (g0, ng), vs in zip(progs, outs_per, leaves, metas, views):
        bufs = [t for t, i in zip(mine, prog.inputs) if i.role == "buf"]
        results.append(
            Result(
                [cpu(o) for o in outs],
                [cpu(g) for g in grads[g0 : g0 + ng]],
                [cpu(b) for b in bufs],
                [None if v is None else cpu(next(vgrad_of)) for v in vs],
            )
        )
    return results


def perturbed(prog: Program, data: Data, k: int) -> Data:
    """``data`` with every float input element moved by up to ``NEAR_ULPS`` float32 ulps (draw
    ``k``; masks kept, the same cotangents)."""
    g = torch.Generator().manual_seed(1_000_003 * (k + 1))
    bases = []
    for b in data.bases:
        if not b.is_floating_point():
            bases.append(b)
            continue
        u = torch.rand(b.shape, generator=g, dtype=torch.float64) * 2 - 1
        bases.append((b.double() * (1 + u * NEAR_ULPS * 2.0**-23)).to(b.dtype))
    return Data(bases, data.cots)


Near = Callable[[], list[tuple[Result, Result]]]


def near_references(prog: Program, fn: Callable, data: Data) -> Near:
    """A function giving eager's float32 and float64 results at ``NEAR_DRAWS`` inputs next to
    ``data`` (:func:`perturbed`), run on the first call only (a tensor that failed both plain
    tests); [] when eager refuses one of them."""
    cache: list[list[tuple[Result, Result]]] = []

    def get() -> list[tuple[Result, Result]]:
        if not cache:
            pairs = []
            try:
                for k in range(NEAR_DRAWS):
                    d = perturbed(prog, data, k)
                    pairs.append((run(prog, fn, d), run(prog, fn, d, torch.float64)))
            except (RuntimeError, IndexError, ValueError):
                pairs = []
            cache.append(pairs)
        return cache[0]

    return get


def compare(
    what: str, got: Result, ref32: Result, ref64: Result, near: Near | None = None
) -> list[str]:
    """Mismatch descriptions (empty: all match).  ``near``: eager's results next to these inputs
    (:func:`near_references`), for the typical-error test; None: no such test."""
    bad = []
    for kind in ("outs", "grads", "bufs", "vgrads"):
        gs, es, rs = getattr(got, kind), getattr(ref32, kind), getattr(ref64, kind)
        if len(gs) != len(es):
            bad.append(f"{what}: {len(gs)} {kind}, eager has {len(es)}")
            continue
        for i, (g, e, r) in enumerate(zip(gs, es, rs)):
            folded = None
            if kind == "grads" and r is not None and ref64.vgrads[i] is not None:
                folded = ref64.vgrads[i].abs().sum_to_size(r.shape)
            typical = None if near is None else (lambda kind=kind, i=i: _typical(near, kind, i))
            msg = _compare_one(g, e, r, folded, typical)
            if msg:
                bad.append(f"{what}: {kind}[{i}] {msg}")
    return bad


def _typical(near: Near, kind: str, i: int) -> torch.Tensor | None:
    """Per element, the median over the near draws of eager's float32 error against its float64
    result (NaN where a draw is not finite there); None without draws."""
    errs = []
    for e32, e64 in near():
        e, r = getattr(e32, kind)[i], getattr(e64, kind)[i]
        if e is None or r is None:
            return None
        err = (e.double() - r.double()).abs()
        errs.append(torch.where(torch.isfinite(err), err, torch.nan))
    if not errs:
        return None
    return torch.stack(errs).nanmedian(dim=0).values


def _within(ke: torch.Tensor, ee: torch.Tensor, r: torch.Tensor) -> bool:
    """Kiln's error ``ke`` at most SLACK times ``ee`` (root mean square and worst element)."""
    rms = lambda t: float(t.square().mean().sqrt())
    return rms(ke) <= SLACK * rms(ee) + ATOL and float(ke.max()) <= SLACK * float(ee.max()) + (
        ATOL + RTOL * float(r.abs().max())
    )


def _compare_one(
    g: Any,
    e: Any,
    r: Any,
    folded: torch.Tensor | None = None,
    typical: Callable[[], torch.Tensor | None] | None = None,
) -> str | None:
    """``folded``: for an expanded input's gradient, the float64 sum of the magnitudes of the
    view-gradient terms summed into each element; ``typical``: eager's typical error per element
    at nearby inputs (:func:`_typical`)."""
    if e is None or g is None:
        if e is None and g is None:
            return None
        z = e if g is None else g  # one side has no gradient: the other must be all zeros
        return None if not z.count_nonzero() else "gradient missing on one side"
    if g.shape != e.shape or g.dtype != e.dtype:
        return f"shape/dtype {tuple(g.shape)}/{g.dtype} vs eager {tuple(e.shape)}/{e.dtype}"
    if g.numel() == 0:
        return None
    if g.dtype == torch.bool:
        return None if torch.equal(g, e) else "bool values differ"
    gn, en = torch.isnan(g), torch.isnan(e)
    if not torch.equal(gn, en):
        return f"NaN at {int((gn ^ en).sum())} places where eager has none (or the reverse)"
    g, e, r = g.double(), e.double(), r.double()
    keep = ~en
    g, e, r = g[keep], e[keep], r[keep]
    inf_ok = torch.isinf(g) | torch.isinf(e)
    if not torch.equal(g[inf_ok], e[inf_ok]):
        return "infinities differ"
    g, e, r = g[~inf_ok], e[~inf_ok], r[~inf_ok]
    ok = (g - e).abs() <= ATOL + RTOL * e.abs()
    if bool(ok.all()):
        return None
    detail = ""
    if bool(torch.isfinite(r).all()):
        # measured against float64: Kiln's error at most SLACK times float32 eager's own, over
        # the tensor (root mean square and worst element), as Inductor's fp64-reference check
        ke, ee = (g - r).abs(), (e - r).abs()
        if _within(ke, ee, r):
            return None
        if folded is not None:
            # a sum over broadcast positions: within RTOL of what was summed (float32 rounding
            # of the terms, which cancel) plus SLACK times eager's own error, element by element
            f = folded.double()[keep][~inf_ok]
            if bool((ke <= SLACK * ee + ATOL + RTOL * f).all()):
                return None
        t = None if typical is None else typical()
        if t is not None:
            # eager's error at this point may be luck: held to its median error nearby
            t = t[keep][~inf_ok]
            if bool(torch.isfinite(t).all()) and _within(ke, t, r):
                COUNTS["near_passes"] += 1
                return None
        detail = f"; max error vs float64: kiln {float(ke.max()):.3g} eager {float(ee.max()):.3g}"
        if t is not None:
            detail += f" (eager nearby, median {float(t.max()):.3g})"
    i = int((~ok).nonzero()[0])
    return (
        f"{int((~ok).sum())}/{ok.numel()} elements off; first: kiln {g[i].item():.9g} "
        f"eager {e[i].item():.9g} float64 {r[i].item():.9g}{detail}"
    )
