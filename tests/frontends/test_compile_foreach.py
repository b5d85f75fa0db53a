"""Compile mode's ``_foreach_*`` ops as per-element ops (kiln/lowering/foreach.py): each
decomposition gives ATen's CPU loop's bits on every overload it covers (odd shapes, a zero-size
and a non-contiguous element), and optimizers with ``foreach=True`` compile to fused kernels
with no foreach call left, matching eager (losses, parameters, optimizer state)."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.lowering.foreach import FOREACH_DECOMPOSITIONS
from kiln.observe.node_times import node_times
from tests.optim_cases import check_compiled_step_matches_eager


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(3, 5, generator=g) + 0.5  # positive: sqrt, log, rsqrt, pow stay real
    b = torch.rand(7, generator=g) + 0.5
    c = torch.empty(0, 4)
    d = (torch.rand(4, 6, generator=g) + 0.5).t()  # non-contiguous
    return [a, b, c, d]


def _arg(t: str, k: int, seed: int) -> object:
    if t == "List[Tensor]":
        return _tensors(seed + k)
    if t in ("List[Scalar]", "List[number]"):
        return [0.75, -1.25, 2.0, 0.5]
    if t in ("Scalar", "number"):
        return 0.625 if k else 1.5  # a first argument (pow's base) above 1
    if t == "Tensor":
        return torch.tensor(0.375)
    raise NotImplementedError(t)


def _sample(op: torch._ops.OpOverload) -> tuple[list, dict]:
    args, kwargs = [], {}
    for k, a in enumerate(op._schema.arguments):
        t = str(a.type)
        if a.kwarg_only:
            if t in ("Scalar", "number"):
                kwargs[a.name] = 0.5
            continue
        if a.has_default_value() and t not in ("Scalar", "number"):
            continue
        args.append(_arg(t, k, 3 * k))
    return args, kwargs


@pytest.mark.parametrize("op", sorted(FOREACH_DECOMPOSITIONS, key=str), ids=str)
def test_decomposition_gives_atens_bits(op):
    args, kwargs = _sample(op)
    want = op(*args, **kwargs)
    got = FOREACH_DECOMPOSITIONS[op](*args, **kwargs)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


def test_the_tensor_scalars_forms_are_left_to_aten():
    # their per-element values are a tensor's data, which ATen's loop reads
    assert torch.ops.aten._foreach_addcdiv.Tensor not in FOREACH_DECOMPOSITIONS
    assert torch.ops.aten._foreach_addcmul.Tensor not in FOREACH_DECOMPOSITIONS
    assert torch.ops.aten._foreach_norm.Scalar not in FOREACH_DECOMPOSITIONS


OPTIMIZERS = [
    ("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True)),
    ("adam", lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True)),
    ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True)),
    ("rmsprop", lambda ps: torch.optim.RMSprop(ps, lr=1e-2, foreach=True)),
    ("adagrad", lambda ps: torch.optim.Adagrad(ps, lr=1e-2, foreach=True)),
]


@pytest.mark.parametrize("make_opt", [m for _, m in OPTIMIZERS], ids=[i for i, _ in OPTIMIZERS])
def test_foreach_optimizers_match_eager(make_opt):
    torch._dynamo.reset()
    check_compiled_step_matches_eager(make_opt, kiln.compile)


@pytest.mark.needs_backend("cpp", reason="counts the C++ backend's generated kernels")
def test_a_foreach_step_runs_no_foreach_call():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    f = torch.compile(step, backend="kiln")
    x = torch.randn(5, 8)
    f(x)
    with node_times() as t:
        f(x)
    if not t.native:
        pytest.skip("the native launcher is not available: no per-node times")
    names = {name for (_, name) in t.seconds}
    assert not any(n.startswith("_foreach") for n in names), sorted(names)
    assert t.by_kind().get("kernel", 0) > 0  # the update ran as generated kernels
