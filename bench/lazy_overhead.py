"""Lazy-device overhead microbenchmark: per-op recording cost and mark_step overhead.

    python bench/lazy_overhead.py                 # defaults: 4,000-op chain, 5,000-op graph
    python bench/lazy_overhead.py --reps 7 --ops 4000 --graph-ops 5000

1. Recording: a chain of ``--ops`` small pointwise ops (add, mul, relu, sub, in turn, on a
   64-element tensor, a Python float as second operand) recorded on the kiln device, timed up to
   (not including) ``mark_step``; the same chain recorded by the native recorder (stage 2,
   kiln/frontends/lazy/native: C++ op capture, not yet the kiln device's recorder; skipped with
   the reason where it cannot be built) and run in eager on the CPU, for comparison.  The three
   are interleaved within each repetition.
2. mark_step on a steady graph: ``--graph-ops`` ops recorded, then ``mark_step`` timed; from the
   second repetition on the graph is a cache hit, so mark_step is cut + lookup + launch + the
   kernels themselves; the kernel time the runtime measured (``kiln.metrics`` execute time) is
   printed beside it, and the difference is the overhead.  The native recorder's
   ``native.mark_step`` on the same chain (cut, recognised graph, values, launch, kernels) is
   timed in each repetition too.

3. Other ops, per op: pairs of views of one 8x8 tensor (``x.t().unsqueeze(0)``: no node, a view
   link each), ``relu(x @ w)`` chains on 8x8 tensors, and ``x.cumsum(1).flip(1)`` chains (a
   quarter as long: ops outside the native recorder's table, recorded by its Python fallback), on
   the kiln device, the native recorder and eager, interleaved.
4. A training step recorded (an MLP with layer norm: forward, backward, a functional SGD
   update), thread CPU ms per step up to ``mark_step``, on the kiln device and the native
   recorder (whose Python fallback takes the ops outside its table), and eager running it.

``--mode device`` measures the kiln device itself with its recorder switch
(``config.lazy_recorder``, docs/native_recorder.md) on and off: ``kiln.device()`` tensors made by
``.to(dev)`` under ``"python"`` and under ``"native"``, the same chain, the fallback-op chain
(cumsum + flip), the functional training step, and an ``nn.Module`` step with ``AdamW``
(library defaults: the foreach path; forward, ``backward()``, ``step()``, ``zero_grad()``, timed
up to and then including ``mark_step``; and ``step()`` + ``zero_grad()`` alone), then per call
of a training step's ops (layer norm, log-softmax, NLL loss, GELU's backward), interleaved,
thread CPU medians; eager beside them.

Medians over ``--reps`` repetitions (after one warm-up); the machine is shared, so numbers vary.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

import kiln
from kiln import metrics
from kiln.frontends.lazy import native


def chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for i in range(n):
        k = i % 4
        if k == 0:
            x = x + 0.5
        elif k == 1:
            x = x * 0.75
        elif k == 2:
            x = torch.relu(x)
        else:
            x = x - 0.25
    return x


def record_cost(n: int, reps: int) -> dict[str, float]:
    """Medians, us/op: kiln recording (Python recorder), the native recorder and eager CPU, by
    wall clock and by this thread's CPU time (less sensitive to other processes on a shared
    machine).  ``native`` keys are missing where the native recorder is unavailable."""
    dev = kiln.device()
    base = torch.randn(64)
    has_native = native.available()
    out: dict[str, list[float]] = {}

    def timed(key: str, x: torch.Tensor, keep: bool) -> torch.Tensor:
        c0, t0 = time.thread_time(), time.perf_counter()
        y = chain(x, n)
        c1, t1 = time.thread_time(), time.perf_counter()
        if keep:
            out.setdefault(key, []).append((t1 - t0) / n * 1e6)
            out.setdefault(key + "_cpu", []).append((c1 - c0) / n * 1e6)
        return y

    for r in range(reps + 1):
        x = base.to(dev)
        kiln.mark_step()
        y = timed("lazy", x, r > 0)
        kiln.mark_step()
        del y
        if has_native:
            y = timed("native", native.tensor(base), r > 0)
            native.mark_step()
            del y
        timed("eager", base, r > 0)
    return {k: statistics.median(v) for k, v in out.items()}


def mark_step_cost(n: int, reps: int) -> dict[str, float]:
    """Medians on a steady ``n``-op graph, ms: mark_step (wall and thread CPU time), the kernel
    execution inside it (kiln.metrics), and recording the graph."""
    dev = kiln.device()
    base = torch.randn(64)
    x = base.to(dev)
    kiln.mark_step()
    has_native = native.available()
    out: dict[str, list[float]] = {"step": [], "step_cpu": [], "exec": [], "record": []}
    for r in range(reps + 1):
        t0 = time.perf_counter()
        y = chain(x, n)
        t1 = time.perf_counter()
        e0 = metrics.snapshot().get("execute_s", 0.0)
        c1 = time.thread_time()
        kiln.mark_step()
        c2 = time.thread_time()
        t2 = time.perf_counter()
        e1 = metrics.snapshot().get("execute_s", 0.0)
        del y
        if r:
            out["step"].append((t2 - t1) * 1e3)
            out["step_cpu"].append((c2 - c1) * 1e3)
            out["exec"].append((e1 - e0) * 1e3)
            out["record"].append((t1 - t0) * 1e3)
        if has_native:  # the same graph recorded natively, interleaved
            y = chain(native.tensor(base), n)
            c1 = time.thread_time()
            native.mark_step()
            c2 = time.thread_time()
            del y
            if r:
                out.setdefault("native_step_cpu", []).append((c2 - c1) * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


def _views(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n // 2):
        y = x.t().unsqueeze(0)
    return y


def _mm_relu(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n // 2):
        x = torch.relu(x @ w)
    return x


def _fallback_ops(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n // 2):
        x = x.cumsum(1).flip(1)  # (softmax is in the C++ table since the training ops moved)
    return x


MIXES = {"views": 1, "mm+relu": 1, "python-fallback": 4}  # ops / this = the chain's length


def mix_cost(n: int, reps: int) -> dict[tuple[str, str], float]:
    """Medians, us/op of thread CPU time, per (ops, recorder): views, mm + relu, and ops outside
    the native table (cumsum, flip: the native recorder's Python fallback)."""
    dev = kiln.device()
    base, wb = torch.randn(8, 8), torch.randn(8, 8)
    makers = {"lazy": lambda t: t.to(dev), "eager": lambda t: t}
    if native.available():
        makers["native"] = native.tensor
    out: dict[tuple[str, str], list[float]] = {}
    for r in range(reps + 1):
        for name, make in makers.items():
            x, w = make(base), make(wb)
            for what, div in MIXES.items():
                m = n // div
                c0 = time.thread_time()
                if what == "views":
                    y = _views(x, m)
                elif what == "mm+relu":
                    y = _mm_relu(x, w, m)
                else:
                    y = _fallback_ops(x, m)
                c1 = time.thread_time()
                del y
                if r:
                    out.setdefault((what, name), []).append((c1 - c0) / m * 1e6)
            if name == "native":
                native.mark_step()
            elif name == "lazy":
                kiln.mark_step()
    return {k: statistics.median(v) for k, v in out.items()}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.GELU(),
        torch.nn.LayerNorm(128),
        torch.nn.Linear(128, 10),
    )


def _train_step(m: torch.nn.Module, state: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    ps = {k: v.detach().requires_grad_() for k, v in state.items()}
    out = torch.func.functional_call(m, ps, (x,))
    torch.nn.functional.cross_entropy(out, y).backward()
    with torch.no_grad():
        return {k: p - 0.01 * p.grad for k, p in ps.items()}


def train_step_cost(reps: int) -> dict[str, float]:
    """Medians, ms of thread CPU time per training step recorded (an MLP 64-128-10 with GELU and
    layer norm, batch 32: forward, backward, a functional SGD update), up to mark_step: the kiln
    device, the native recorder (its C++ table, which holds layer norm, log-softmax, the loss and
    their backward ops, and its Python fallback), and eager running it; interleaved."""
    dev = kiln.device()
    m = _mlp()
    cpu_state = {k: v.detach().clone() for k, v in m.named_parameters()}
    xs, ys = torch.randn(32, 64), torch.randint(0, 10, (32,))
    makers = {"lazy": lambda t: t.to(dev), "eager": lambda t: t}
    if native.available():
        makers["native"] = native.tensor
    states = {name: {k: make(v) for k, v in cpu_state.items()} for name, make in makers.items()}
    out: dict[str, list[float]] = {}
    for r in range(reps + 1):
        for name, make in makers.items():
            x, y = make(xs), make(ys)
            f0 = sum(native.python_ops().values()) if name == "native" else 0
            c0 = time.thread_time()
            states[name] = _train_step(m, states[name], x, y)
            c1 = time.thread_time()
            if name == "native":
                native.mark_step()
                out.setdefault("native_python_ops", []).append(
                    sum(native.python_ops().values()) - f0
                )
            elif name == "lazy":
                kiln.mark_step()
            if r:
                out.setdefault(name, []).append((c1 - c0) * 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


RECORDERS = ("python", "native")


def device_switch_cost(n: int, reps: int) -> dict[tuple[str, str], float]:
    """Medians of thread CPU time per (what, recorder) on ``kiln.device()`` tensors, the switch
    ``config.lazy_recorder`` set to each recorder in turn (and eager): the table-op chain and the
    fallback-op chain in us/op, the training step in ms/step; interleaved per repetition."""
    dev = kiln.device()
    before = kiln.config.lazy_recorder
    base, b8 = torch.randn(64), torch.randn(8, 8)
    m = _mlp()
    cpu_state = {k: v.detach().clone() for k, v in m.named_parameters()}
    xs, ys = torch.randn(32, 64), torch.randint(0, 10, (32,))
    states: dict[str, dict] = {}
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    out: dict[tuple[str, str], list[float]] = {}

    def module_and_opt(to: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        mod = copy.deepcopy(m)
        mod = mod.to(to) if to is not None else mod
        return mod, torch.optim.AdamW(mod.parameters(), lr=1e-3)  # library defaults: foreach

    try:
        for rec in RECORDERS:
            kiln.config.update(lazy_recorder=rec)
            states[rec] = {k: v.to(dev) for k, v in cpu_state.items()}
            models[rec] = module_and_opt(dev)
        states["eager"] = dict(cpu_state)
        models["eager"] = module_and_opt(None)
        for r in range(reps + 1):
            for rec in (*RECORDERS, "eager"):
                if rec != "eager":
                    kiln.config.update(lazy_recorder=rec)
                make = (lambda t: t) if rec == "eager" else (lambda t: t.to(dev))
                x, x8, xb, yb = make(base), make(b8), make(xs), make(ys)
                kiln.mark_step()
                c0 = time.thread_time()
                y = chain(x, n)
                c1 = time.thread_time()
                z = _fallback_ops(x8, n // 4)
                c2 = time.thread_time()
                states[rec] = _train_step(m, states[rec], xb, yb)
                c3 = time.thread_time()
                kiln.mark_step()
                mod, opt = models[rec]
                c4 = time.thread_time()
                torch.nn.functional.cross_entropy(mod(xb), yb).backward()
                c4b = time.thread_time()
                opt.step()
                opt.zero_grad()
                c5 = time.thread_time()
                kiln.mark_step()
                c6 = time.thread_time()
                del y, z
                if r:
                    out.setdefault(("adamw-step", rec), []).append((c5 - c4) * 1e3)
                    out.setdefault(("adamw-step+mark_step", rec), []).append((c6 - c4) * 1e3)
                    out.setdefault(("adamw-opt.step", rec), []).append((c5 - c4b) * 1e3)
                    out.setdefault(("chain", rec), []).append((c1 - c0) / n * 1e6)
                    out.setdefault(("python-fallback", rec), []).append((c2 - c1) / (n // 4) * 1e6)
                    out.setdefault(("train-step", rec), []).append((c3 - c2) * 1e3)
    finally:
        kiln.config.update(lazy_recorder=before)
    return {k: statistics.median(v) for k, v in out.items()}


def _training_ops(dev: Any) -> dict[str, Any]:
    """One call each of a training step's ops (no autograd), on tensors on ``dev``."""
    x, w, b = torch.randn(32, 128).to(dev), torch.randn(128).to(dev), torch.randn(128).to(dev)
    y = torch.randint(0, 128, (32,)).to(dev)
    return {
        "layer_norm": lambda: torch.nn.functional.layer_norm(x, (128,), w, b),
        "log_softmax": lambda: torch.nn.functional.log_softmax(x, -1),
        "nll_loss": lambda: torch.nn.functional.nll_loss(x, y),
        "gelu_backward": lambda: torch.ops.aten.gelu_backward(x, x),
    }


def training_op_cost(reps: int, calls: int = 200) -> dict[tuple[str, str], float]:
    """Medians of thread CPU us per call of a training step's ops (layer norm: three outputs;
    NLL loss: two), per (op, recorder) on ``kiln.device()`` and eager, interleaved per rep."""
    dev = kiln.device()
    before = kiln.config.lazy_recorder
    out: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(reps + 1):
            for rec in (*RECORDERS, "eager"):
                if rec != "eager":
                    kiln.config.update(lazy_recorder=rec)
                ops = _training_ops(torch.device("cpu") if rec == "eager" else dev)
                for name, fn in ops.items():
                    kiln.mark_step()
                    c0 = time.thread_time()
                    res = [fn() for _ in range(calls)]
                    c1 = time.thread_time()
                    del res
                    kiln.mark_step()
                    if r:
                        out.setdefault((name, rec), []).append((c1 - c0) / calls * 1e6)
    finally:
        kiln.config.update(lazy_recorder=before)
    return {k: statistics.median(v) for k, v in out.items()}


def main_device(a: argparse.Namespace) -> None:
    if not native.available():
        print("native recorder: unavailable here (no C++ compiler or a failed build)")
        return
    dc = device_switch_cost(a.ops, a.reps)
    parts = (
        ("chain", "us/op"),
        ("python-fallback", "us/op"),
        ("train-step", "ms/step"),
        ("adamw-step", "ms/step"),
        ("adamw-step+mark_step", "ms/step"),
        ("adamw-opt.step", "ms/step"),
    )
    for what, unit in parts:
        line = ", ".join(f"{rec} {dc[(what, rec)]:.3f}" for rec in (*RECORDERS, "eager"))
        print(f"kiln.device() {what}, thread CPU {unit}: lazy_recorder={line}")
    tc = training_op_cost(a.reps)
    for what in _training_ops(torch.device("cpu")):
        line = ", ".join(f"{rec} {tc[(what, rec)]:.3f}" for rec in (*RECORDERS, "eager"))
        print(f"kiln.device() {what}, thread CPU us/call: lazy_recorder={line}")
    c = metrics.counters()
    print(
        f"graphs compiled: {c.get('graphs_compiled', 0)}, forced syncs: {c.get('forced_syncs', 0)}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=4000, help="ops in the recording chain")
    ap.add_argument("--graph-ops", type=int, default=5000, help="ops in the mark_step graph")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--mode",
        choices=("recorders", "device"),
        default="recorders",
        help="recorders: parts 1-4; device: kiln.device() with lazy_recorder python vs native",
    )
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.mode == "device":
        main_device(a)
        return
    rc = record_cost(a.ops, a.reps)
    print(
        f"recording: {rc['lazy']:.2f} us/op on kiln "
        f"(eager CPU runs the op in {rc['eager']:.2f} us); "
        f"thread CPU time: {rc['lazy_cpu']:.2f} vs {rc['eager_cpu']:.2f} us/op"
    )
    if "native" in rc:
        print(
            f"native recorder (stage 2): {rc['native']:.2f} us/op, thread CPU time "
            f"{rc['native_cpu']:.2f} us/op (Python recorder {rc['lazy_cpu']:.2f}, "
            f"eager {rc['eager_cpu']:.2f})"
        )
    else:
        print("native recorder: unavailable here (no C++ compiler or a failed build)")
    ms = mark_step_cost(a.graph_ops, a.reps)
    print(
        f"mark_step, steady {a.graph_ops}-op graph: {ms['step']:.3f} ms "
        f"(kernels {ms['exec']:.3f} ms, overhead {ms['step'] - ms['exec']:.3f} ms; "
        f"thread CPU time {ms['step_cpu']:.3f} ms); recording it took {ms['record']:.1f} ms"
    )
    if "native_step_cpu" in ms:
        print(
            f"native recorder mark_step, same graph: thread CPU time {ms['native_step_cpu']:.3f} ms"
        )
    mc = mix_cost(a.ops, a.reps)
    for what in MIXES:
        line = ", ".join(
            f"{name} {mc[(what, name)]:.2f}"
            for name in ("native", "lazy", "eager")
            if (what, name) in mc
        )
        print(f"{what}: thread CPU us/op: {line}")
    ts = train_step_cost(a.reps)
    line = ", ".join(f"{k} {ts[k]:.3f}" for k in ("native", "lazy", "eager") if k in ts)
    extra = (
        f" ({ts['native_python_ops']:.0f} ops per step through the native Python fallback)"
        if "native_python_ops" in ts
        else ""
    )
    print(f"training step recorded (MLP, forward+backward+SGD): thread CPU ms/step: {line}{extra}")
    c = metrics.counters()
    print(
        f"graphs compiled: {c.get('graphs_compiled', 0)}, forced syncs: {c.get('forced_syncs', 0)}"
    )


if __name__ == "__main__":
    main()
