"""Training loops for the real-model conformance tests: eager, the lazy device, compile mode.

Each loop trains a copy of the same initial model for ``STEPS`` steps on a new batch every step and
records, after every step, the loss, every parameter's gradient and every parameter and floating
buffer after the optimizer step (``Record``), so a mode can be compared with eager step by step.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

import kiln

STEPS = 10
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    # plain SGD: a wrong gradient scale moves the parameters by the same factor
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01),
}


@dataclass
class Record:
    loss: float
    grads: dict[str, torch.Tensor | None]
    state: dict[str, torch.Tensor]  # parameters and floating buffers after the step


@dataclass
class Run:
    records: list[Record] = field(default_factory=list)
    counters: list[dict] = field(default_factory=list)  # kiln.metrics after every step


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _record(model: nn.Module, loss: torch.Tensor) -> Record:
    grads = {n: None if p.grad is None else _cpu(p.grad) for n, p in model.named_parameters()}
    state = {n: _cpu(p) for n, p in model.named_parameters()}
    state.update({n: _cpu(b) for n, b in model.named_buffers() if b.is_floating_point()})
    return Record(float(loss.detach().to("cpu")), grads, state)


def _to(batch: dict, dev: torch.device | str) -> dict:
    return {k: v.to(dev) for k, v in batch.items()}


def train_eager(model: nn.Module, opt_name: str, data: list[dict]) -> Run:
    opt = OPTIMIZERS[opt_name](model)
    run = Run()
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = model(batch)
        loss.backward()
        opt.step()
        run.records.append(_record(model, loss))
    return run


def train_lazy(model: nn.Module, opt_name: str, data: list[dict]) -> Run:
    dev = kiln.device()
    model.to(dev)  # tied weights stay tied (Module.to swaps parameters in place)
    opt = OPTIMIZERS[opt_name](model)
    kiln.metrics.reset()
    run = Run()
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = model(_to(batch, dev))
        loss.backward()
        opt.step()
        kiln.mark_step()
        run.records.append(_record(model, loss))
        run.counters.append(kiln.metrics.counters())
    return run


def train_compiled_step(model: nn.Module, opt_name: str, data: list[dict]) -> Run:
    """The whole step (zero_grad, forward, backward, optimizer step) in one compiled function."""
    torch._dynamo.reset()
    opt = OPTIMIZERS[opt_name](model)

    def step(batch: dict) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = model(batch)
        loss.backward()
        opt.step()
        return loss

    cstep = torch.compile(step, backend="kiln")
    kiln.metrics.reset()
    run = Run()
    for batch in data:
        loss = cstep(batch)
        run.records.append(_record(model, loss))
        run.counters.append(kiln.metrics.counters())
    return run


def train_compiled_model(model: nn.Module, opt_name: str, data: list[dict]) -> Run:
    """The model compiled, the optimizer eager."""
    torch._dynamo.reset()
    cmodel = torch.compile(model, backend="kiln")
    opt = OPTIMIZERS[opt_name](model)
    kiln.metrics.reset()
    run = Run()
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = cmodel(batch)
        loss.backward()
        opt.step()
        run.records.append(_record(model, loss))
        run.counters.append(kiln.metrics.counters())
    return run


MODES: dict[str, Callable[[nn.Module, str, list[dict]], Run]] = {
    "lazy": train_lazy,
    "compile_step": train_compiled_step,
    "compile_model": train_compiled_model,
}


def fresh(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# ---------------------------------------------------------------------------------------------
# comparing with eager

LOSS_RTOL = 1e-5
# A tensor matches when max|kiln - eager| <= TENSOR_RTOL * max|eager| + TENSOR_ATOL: a gradient
# scaled by 3 or 0.5 is off by 2x or 0.5x of its own size and fails (see test_comparison_catches_*).
TENSOR_RTOL, TENSOR_ATOL = 1e-3, 1e-7


def tensor_mismatch(got: torch.Tensor | None, want: torch.Tensor | None) -> str | None:
    if got is None or want is None:
        return None if got is None and want is None else f"gradient {got is None=} {want is None=}"
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    if not got.numel():
        return None
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return f"non-finite values ({int((~torch.isfinite(g)).sum())})"
    scale = float(w.abs().max())
    err = float((g - w).abs().max())
    if err > TENSOR_RTOL * scale + TENSOR_ATOL:
        return (
            f"max abs err {err:.3g} vs max |eager| {scale:.3g} (rel {err / max(scale, 1e-30):.3g})"
        )
    return None


# AdamW divides each gradient element by its own running magnitude, so an element whose gradient
# is rounding noise (a key bias under softmax: zero in exact arithmetic) gets a full-size update
# whose sign is the noise's.  Such elements (eager gradient below NOISE times the model's largest
# gradient element at some step) are left out of the parameter comparison for scale-invariant
# optimizers; their gradients are still compared.
NOISE = 1e-4


def mismatches(got: Run, want: Run, scale_invariant: bool = False) -> list[str]:
    """Every difference from eager, as ``step N <what>: <how>`` lines (empty when equal)."""
    out = []
    assert len(got.records) == len(want.records)
    noisy: dict[str, torch.Tensor] = {}
    for step, (a, e) in enumerate(zip(got.records, want.records), 1):
        if abs(a.loss - e.loss) > LOSS_RTOL * abs(e.loss):
            rel = abs(a.loss - e.loss) / abs(e.loss)
            out.append(f"step {step} loss {a.loss!r} vs {e.loss!r} (rel {rel:.2e})")
        if a.grads.keys() != e.grads.keys() or a.state.keys() != e.state.keys():
            out.append(f"step {step}: names differ")
            continue
        top = max((float(g.abs().max()) for g in e.grads.values() if g is not None and g.numel()),
                  default=0.0)  # fmt: skip
        for name, ge in e.grads.items():
            bad = tensor_mismatch(a.grads[name], ge)
            if bad:
                out.append(f"step {step} grad {name}: {bad}")
            if scale_invariant and ge is not None and ge.numel():
                low = ge.abs() <= NOISE * top
                noisy[name] = low | noisy[name] if name in noisy else low
        for name, pe in e.state.items():
            pa = a.state[name]
            if name in noisy and pa.shape == pe.shape:
                keep = ~noisy[name]
                pa, pe = pa[keep], pe[keep]
            bad = tensor_mismatch(pa, pe)
            if bad:
                out.append(f"step {step} param {name}: {bad}")
    return out
