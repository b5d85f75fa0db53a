"""Running one OpInfo op through a Kiln mode, every sample, forward and gradients, against eager.

One Kiln run per op covers both checks: all samples of the op are batched (``chunk(mode)`` at a time)
into one compiled function (compile mode: one Dynamo compile and one backward graph per chunk
instead of one per sample and check) or one lazy step (lazy mode: the forwards of the chunk, then
their gradients).  The forward outputs are read before any gradient is computed, and the Kiln
counters are read between the two phases, so a fallback or a missing Kiln graph is attributed to
the check it belongs to: ``fwd`` sees the forward phase, ``grad`` the whole run (forward and
backward), as when each check ran alone.  When a batched run raises, each of its samples is run
alone, so the error names its sample.

Rules (see test_opinfo's docstring): a sample whose eager run raises is skipped; a Kiln error or
a value different from eager (``torch.testing.assert_close`` defaults) fails; random ops compare
shapes and dtypes only.
"""

from __future__ import annotations

import itertools
import os
import sys
import types
import unittest
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.testing._internal.common_utils as _common_utils
import torch.testing._internal.opinfo.core as _opinfo_core
from torch.utils._pytree import tree_flatten, tree_map

import kiln


def extract_test_fn() -> Callable | None:
    """``torch.testing._internal.common_utils.extract_test_fn`` (the unittest test method on the
    stack, whose per-sample skips and seed OpInfo's sample iterators use), walking the frames
    instead of ``inspect.stack()``: that reads every frame's source lines and searched
    ``sys.modules`` for each, once per sample iterator, ~7% of the compile sweep's time (cProfile,
    ops 100:160) for a result that is None under pytest's plain test functions.  Same answer."""
    frame = sys._getframe(1)
    while frame is not None:
        self_val = frame.f_locals.get("self")
        if isinstance(self_val, unittest.TestCase):
            *_, cls_name, test_name = self_val.id().rsplit(".", 2)
            if cls_name == type(self_val).__name__ and test_name.startswith("test"):
                # (the original returns None where this lookup raises)
                return getattr(getattr(self_val, test_name, None), "__func__", None)
        frame = frame.f_back
    return None


# OpInfo's sample iterators look the test method up through these two module globals
STACK_EXTRACT_TEST_FN = _common_utils.extract_test_fn  # torch's own (its test compares)
_common_utils.extract_test_fn = extract_test_fn
_opinfo_core.extract_test_fn = extract_test_fn

# Samples per op, spread evenly over the op's sample list (first and last included, so the plain
# cases, the broadcasting / zero-size / non-contiguous ones OpInfo lists later, and the stress
# cases at the end are all represented).  Lazy mode: at most 128 (the lazy sweep, ~265 CPU-s on the
# 2-core machine with every sample; 677 ops have 18,835 samples, 11,336 with the cap, which only
# the ~25 ops with more than 128 trim: max_pool2d and its backward 1,440, logspace 1,201,
# max_pool1d 864, ...).  Compile mode: at most 12.  Its cost is Dynamo's and
# AOTAutograd's tracing per sample: every sample of the 702 ops took ~850 CPU-s (2026-12-01); ops
# 200:300 took 401 CPU-s with every sample and 89 with 8 (2026-12-02), and CI has 20 minutes for
# everything.  KILN_TEST_OPINFO_SAMPLES=all runs every sample in both modes (the full sweep,
# before a release or after a change to lowering); =N caps both modes at N.


def max_samples(mode: str) -> int | None:
    n = os.environ.get("KILN_TEST_OPINFO_SAMPLES", "")
    if not n:
        return COMPILE_SAMPLES if mode == "compile" else LAZY_SAMPLES
    return None if n == "all" else int(n)


COMPILE_SAMPLES = 12
LAZY_SAMPLES = 128


# Samples run side by side in one Kiln run, per mode; KILN_TEST_OPINFO_CHUNK=N sets both
# (1: each sample alone, one compile per sample: slower, the layout the per-sample runs used to
# have).  Compile mode takes 64: fewer Dynamo/AOTAutograd rounds per op (every 10th op, every
# sample, one process on a loaded machine: 76 CPU-s with 64 against 109 with 32, of it g++ 20
# against 39 s, before the kernel-level build cache, which now builds a kernel repeated in several
# chunks once; with it, ops 100:160, every sample, 2 workers, loaded machine: 114.0 CPU-s with 64,
# 116.1 with 256).
CHUNKS = {"lazy": 32, "compile": 64}


def chunk(mode: str) -> int:
    env = os.environ.get("KILN_TEST_OPINFO_CHUNK", "")
    return int(env) if env else CHUNKS[mode]


class EagerFailed(Exception):
    """The eager reference itself raised: the sample is skipped."""


@dataclass
class Outcome:
    status: str  # "pass" | "fail" | "skip"
    detail: str = ""
    fallbacks: dict = field(default_factory=dict)
    kiln_graphs: int = 0  # graphs Kiln executed (0: nothing reached Kiln)
    samples: int = 0  # samples compared


def samples(op: Any, n: int | None, requires_grad: bool) -> list[Any]:
    """The op's first ``n`` float32 CPU samples (all with None)."""
    it = op.sample_inputs("cpu", torch.float32, requires_grad=requires_grad)
    return list(itertools.islice(it, n))


def spread(every: list[Any], n: int | None) -> list[Any]:
    """At most ``n`` of ``every`` (all with None), spread evenly, the first and the last kept."""
    if n is None or len(every) <= n:
        return every
    if n <= 1:
        return every[:n]
    last = len(every) - 1
    return [every[round(i * last / (n - 1))] for i in range(n)]


def _leaf(t: Any, to: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(t, torch.Tensor):
        out = to(t.detach())
        if t.requires_grad and (out.is_floating_point() or out.is_complex()):
            out.requires_grad_(True)
        return out
    return t


def call_args(sample: Any, to: Callable[[torch.Tensor], torch.Tensor], dev: Any = None):
    """Fresh copies of a sample's (args, kwargs), tensors mapped through ``to``; a ``device``
    keyword naming the CPU is replaced by ``dev`` (factory ops)."""
    args = tree_map(lambda t: _leaf(t, to), (sample.input, *sample.args))
    kwargs = tree_map(lambda t: _leaf(t, to), dict(sample.kwargs))
    if dev is not None and "device" in kwargs and torch.device(kwargs["device"]).type == "cpu":
        kwargs["device"] = dev
    return args, kwargs


def grad_parts(args: Any, kwargs: Any, out: Any) -> tuple[list, list]:
    """(inputs that require grad, outputs that require grad) of one call."""
    ins = [
        t
        for t in tree_flatten((args, kwargs))[0]
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    return ins, outs


def grad_outputs(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs]


def run_eager(op: Any, sample: Any, want_grad: bool) -> tuple[Any, Any, str]:
    """(forward output, gradients or None, why there are none) of one eager run of a sample;
    raises EagerFailed when the forward raises."""
    args, kwargs = call_args(sample, lambda t: t.clone())
    # the CPU generator alone: torch.manual_seed also seeds every accelerator module (~1 ms)
    torch.default_generator.manual_seed(0)
    try:
        out = op.op(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the sample is skipped, with this reason
        raise EagerFailed(f"{type(e).__name__}: {e}") from e
    if not want_grad:
        return out, None, ""
    ins, outs = grad_parts(args, kwargs, out)
    if not ins or not outs:
        return out, None, "no differentiable inputs/outputs"
    try:
        return out, torch.autograd.grad(outs, ins, grad_outputs(outs), allow_unused=True), ""
    except Exception as e:  # noqa: BLE001 - the gradient of this sample is skipped
        return out, None, f"eager raised: {type(e).__name__}: {e}"


def to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, torch.device) and x.type == "kiln":
        return torch.device("cpu")
    return x


# ---------------------------------------------------------------------------------------------
# the Kiln runs: forward(op, samples) -> (outputs on the CPU, finish); finish(mask) -> gradients


Finish = Callable[[list[bool]], list[Any]]


def _grads_of(calls: list, outs: list, mask: list[bool], dev: Any = None) -> list[Any]:
    """Gradients of every masked call, in one ``autograd.grad`` over all of them (a batched
    compiled forward has one backward: it can run once)."""
    per = [grad_parts(a, k, o) if m else ([], []) for (a, k), o, m in zip(calls, outs, mask)]
    all_ins = [t for ins, _ in per for t in ins]
    all_outs = [t for _, os_ in per for t in os_]
    gouts = [g for _, os_ in per for g in grad_outputs(os_)]
    if dev is not None:
        # each on its output's device, as eager has them: the kiln device's, or the CPU for an
        # output copied off it (``x.to("cpu")``; PyTorch rejects a kiln gradient for a CPU
        # output, "invalid gradient ... expected device cpu", unless the tensor is a Python
        # subclass, which the Python recorder's are and the native recorder's are not)
        gouts = [g.to(o.device) for g, o in zip(gouts, all_outs)]
    flat = torch.autograd.grad(all_outs, all_ins, gouts, allow_unused=True) if all_outs else ()
    res, k = [], 0
    for (ins, _), m in zip(per, mask):
        res.append(tuple(flat[k : k + len(ins)]) if m else None)
        k += len(ins)
    return res


def _seeded(op: Any, *args: Any, **kwargs: Any) -> Any:
    torch.manual_seed(42)
    return op(*args, **kwargs)


def compilable(fn: Callable) -> Callable:
    """``fn`` with OpInfo's ``wrapper_set_seed`` replaced by a plain seeding: its
    ``freeze_rng_state`` enters ``no_dispatch()``, which Dynamo cannot trace, so the random op
    inside ran eagerly and never reached Kiln (a compiled ``torch.bernoulli(x)`` does).  Random
    ops are compared by shape and dtype only: the RNG state it restores does not matter here."""
    code = getattr(fn, "__code__", None)
    if code is None or "wrapper_set_seed" not in code.co_names:
        return fn
    scope = {**fn.__globals__, "wrapper_set_seed": _seeded}
    return types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)


def forward_compile(op: Any, ss: list[Any]) -> tuple[list[Any], Finish]:
    torch._dynamo.reset()
    calls = [call_args(s, lambda t: t.clone()) for s in ss]
    fn = compilable(op.op)

    def f(calls: list) -> list:
        return [fn(*a, **k) for a, k in calls]

    cf = torch.compile(f, backend="kiln", fullgraph=False, dynamic=False)
    torch.manual_seed(0)
    # a graph break inside an op's Python code resumes in a frame compiled once per sample:
    # Dynamo's default limit (8 per frame) would run the samples after the 8th eagerly, unseen by
    # Kiln; each sample compiled alone (after a reset) never hit it
    limit = 8 * len(ss)
    with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=4 * limit):
        outs = cf(calls)

    def finish(mask: list[bool]) -> list[Any]:
        return [tree_map(to_cpu, g) for g in _grads_of(calls, outs, mask)]

    return [tree_map(to_cpu, o) for o in outs], finish


def forward_lazy(op: Any, ss: list[Any]) -> tuple[list[Any], Finish]:
    dev = kiln.device()
    calls = [call_args(s, lambda t: t.to(dev), dev) for s in ss]
    torch.manual_seed(0)
    outs = [op.op(*a, **k) for a, k in calls]
    kiln.mark_step()

    def finish(mask: list[bool]) -> list[Any]:
        grads = _grads_of(calls, outs, mask, dev)
        kiln.mark_step()
        return [tree_map(to_cpu, g) for g in grads]

    return [tree_map(to_cpu, o) for o in outs], finish


FORWARD = {"lazy": forward_lazy, "compile": forward_compile}


# ---------------------------------------------------------------------------------------------
# comparing


def _max_abs_diff(actual: Any, expected: Any) -> str:
    diffs = []
    for a, e in zip(tree_flatten(actual)[0], tree_flatten(expected)[0]):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor) and a.shape == e.shape:
            if a.numel() and (a.is_floating_point() or a.is_complex()):
                d = (a.double() - e.double()).abs()
                d = torch.where(torch.isnan(a) & torch.isnan(e), 0, d)
                diffs.append(float(d.nan_to_num(float("inf")).max()))
            elif a.numel():
                diffs.append(float((a != e).sum()))
    return f"max abs diff {max(diffs):.3g}" if diffs else "structure differs"


def compare(actual: Any, expected: Any, random_op: bool) -> str | None:
    """None when equal (as eager), else a one-line description of the difference."""
    if random_op:
        fa, fe = tree_flatten(actual)[0], tree_flatten(expected)[0]

        def meta(xs: list) -> list:
            return [
                (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x) for x in xs
            ]

        if meta(fa) != meta(fe):
            return f"wrong result: shapes/dtypes {meta(fa)} vs eager {meta(fe)}"
        return None
    try:
        torch.testing.assert_close(actual, expected, equal_nan=True)
    except AssertionError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"wrong result: {_max_abs_diff(actual, expected)} ({first})"
    return None


# How much larger than eager's a Kiln result's error may be, both measured against a float64 run
# of the sample, for a difference from eager beyond assert_close's tolerance to count as rounding
# (:func:`rounding_only`).
ROUNDING_FACTOR = 4.0

_DOWN = {torch.float64: torch.float32, torch.complex128: torch.complex64}


def _float64_run(op: Any, sample: Any, check: str) -> Any:
    """The sample run in float64: its forward output (``check == "fwd"``), or its gradients for
    the float32 run's output gradients, cast to float64."""

    def up(t: torch.Tensor) -> torch.Tensor:
        return t.double() if t.dtype == torch.float32 else t

    args, kwargs = call_args(sample, lambda t: up(t.clone()))
    torch.default_generator.manual_seed(0)
    out = op.op(*args, **kwargs)
    if check == "fwd":
        return out
    ins, outs = grad_parts(args, kwargs, out)
    g = torch.Generator().manual_seed(1234)  # grad_outputs' draws, in the float32 run's dtypes
    gouts = [
        torch.randn(o.shape, generator=g, dtype=_DOWN.get(o.dtype, o.dtype)).to(o.dtype)
        for o in outs
    ]
    return torch.autograd.grad(outs, ins, gouts, allow_unused=True)


def _error(x: torch.Tensor, exact: torch.Tensor) -> float:
    """Largest |x - exact|; NaN where ``exact`` is NaN counts as exact, NaN elsewhere as inf."""
    d = (x.to(exact.dtype) - exact).abs()
    d = torch.where(torch.isnan(x) & torch.isnan(exact), 0, d)
    return float(d.nan_to_num(float("inf")).max()) if d.numel() else 0.0


def rounding_only(op: Any, sample: Any, check: str, actual: Any, expected: Any) -> bool:
    """Whether Kiln's result ``actual``, beyond assert_close's tolerance of eager's ``expected``,
    is as accurate as eager's: against a float64 run of the sample, each floating tensor's largest
    error is at most ``ROUNDING_FACTOR`` times eager's (or within assert_close's tolerance of the
    float64 value); every other part equal.  False when the float64 run is not possible."""
    try:
        exact = _float64_run(op, sample, check)
    except Exception:  # noqa: BLE001 - no float64 judgement: the difference stays a failure
        return False
    fa, fe, fx = (tree_flatten(x)[0] for x in (actual, expected, exact))
    if not len(fa) == len(fe) == len(fx):
        return False
    for a, e, x in zip(fa, fe, fx):
        if not isinstance(a, torch.Tensor) or not (a.is_floating_point() or a.is_complex()):
            if compare(a, e, False) is not None:
                return False
            continue
        if not isinstance(x, torch.Tensor) or a.shape != e.shape or a.shape != x.shape:
            return False
        x = x.detach().to(torch.complex128 if x.is_complex() else torch.float64)
        if _error(a, x) > ROUNDING_FACTOR * _error(e, x) and compare(a, x.to(a.dtype), False):
            return False
    return True


def first_lines(msg: str) -> str:
    """The error's first line (and the next one when the first only introduces it)."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    out = " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines or [""])[0]
    return out[:300]


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {first_lines(str(e))}"


# ---------------------------------------------------------------------------------------------
# one op: every sample, both checks


@dataclass
class _Error:
    """A Kiln run that raised (in place of its result)."""

    msg: str


@dataclass
class _Phases:
    """Kiln counters summed over the runs of one op: forward phase, and the whole run."""

    fwd: Counter = field(default_factory=Counter)
    all: Counter = field(default_factory=Counter)
    fwd_graphs: int = 0
    all_graphs: int = 0

    def add(self, mid: dict, end: dict) -> None:
        self.fwd.update(mid["fallbacks"])
        self.fwd_graphs += mid.get("graphs_executed", 0)
        self.all.update(end["fallbacks"])
        self.all_graphs += end.get("graphs_executed", 0)

    def merge(self, other: "_Phases") -> None:
        self.fwd.update(other.fwd)
        self.all.update(other.all)
        self.fwd_graphs += other.fwd_graphs
        self.all_graphs += other.all_graphs


def _flush() -> None:
    """Drop whatever a previous (failed) run left pending on the lazy device."""
    try:
        kiln.mark_step()
    except Exception:  # noqa: BLE001 - the run that left it already reported it
        pass


def _run_chunk(
    mode: str, op: Any, ss: list, mask: list[bool], ph: _Phases
) -> tuple[list, list, str | None]:
    """(outputs, gradients, error of the gradient phase or None) of a chunk of samples; raises
    what the forward phase raised."""
    _flush()
    kiln.metrics.reset()
    try:
        outs, finish = FORWARD[mode](op, ss)
    except Exception:
        c = kiln.metrics.counters()
        ph.add(c, c)
        raise
    mid = kiln.metrics.counters()
    grads: list = [None] * len(ss)
    error = None
    try:
        if any(mask):
            grads = finish(mask)
    except Exception as e:  # noqa: BLE001 - reported per sample by the caller
        error = _err(e)
    ph.add(mid, kiln.metrics.counters())
    return outs, grads, error


def kiln_results(mode: str, op: Any, ss: list, mask: list[bool]) -> tuple[list, list, _Phases]:
    """Per sample: forward output and gradients (None: not asked), or an ``_Error``."""
    ph = _Phases()
    fwd: list[Any] = []
    grad: list[Any] = []
    n = chunk(mode)
    for i in range(0, len(ss), n):
        part, pmask = ss[i : i + n], mask[i : i + n]
        if len(part) > 1:
            tried = _Phases()  # counted only when the chunk succeeds
            try:
                o, g, error = _run_chunk(mode, op, part, pmask, tried)
            except Exception as e:  # noqa: BLE001 - rerun one sample at a time to name the culprit
                o, g, error = [], [], _err(e)
            if error is None:
                ph.merge(tried)
                fwd += o
                grad += g
                continue
        for s, m in zip(part, pmask):
            try:
                o, g, error = _run_chunk(mode, op, [s], [m], ph)
                fwd += o
                grad += [_Error(error)] if error is not None else g
            except Exception as e:  # noqa: BLE001
                fwd.append(_Error(_err(e)))
                grad.append(_Error(f"forward raised {_err(e)}"))
    return fwd, grad, ph
