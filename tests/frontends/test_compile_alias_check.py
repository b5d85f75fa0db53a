"""alias_check: a Kiln graph's first run skips AOTAutograd's custom-op aliasing mode only where
the mode cannot fire (built-in ops only), with eager's results; a graph with a custom op still
runs under it and its warning still comes; a user's dispatch mode still sees every op."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._functorch._aot_autograd import runtime_wrappers
from torch.utils._python_dispatch import TorchDispatchMode

from kiln import metrics

torch.library.define("kilntest_alias::same", "(Tensor x) -> Tensor")


@torch.library.impl("kilntest_alias::same", "CPU")
def _same(x: torch.Tensor) -> torch.Tensor:
    return x  # claims to be functional, returns its input: what the check warns about


@torch.library.register_fake("kilntest_alias::same")
def _same_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@pytest.fixture
def mode_calls(monkeypatch):
    """How many ops AOTAutograd's checking mode saw."""
    calls = []
    mode = runtime_wrappers._AnalyzeCustomOpInputOutputMode
    orig = mode.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        calls.append(func)
        return orig(self, func, types, args, kwargs)

    monkeypatch.setattr(mode, "__torch_dispatch__", counted)
    return calls


def _mlp_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().mean()
    loss.backward()
    return loss


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_builtin_graph_first_run_skips_the_mode(mode_calls):
    torch._dynamo.reset()
    x = torch.randn(5, 8)
    want_model, got_model = _model(), _model()
    want = _mlp_step(want_model, x)
    before = metrics.get("aot_alias_checks_skipped")
    got = torch.compile(_mlp_step, backend="kiln")(got_model, x)  # the first run
    assert metrics.get("aot_alias_checks_skipped") > before
    assert mode_calls == []  # no op of the graph went through Python
    torch.testing.assert_close(got, want)
    for p, q in zip(got_model.parameters(), want_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    # with the check switched off, nothing is skipped (nothing to skip)
    torch._dynamo.reset()
    before = metrics.get("aot_alias_checks_skipped")
    with torch._functorch.config.patch(check_custom_op_aliasing=False):
        torch.compile(_mlp_step, backend="kiln")(_model(), x)
    assert metrics.get("aot_alias_checks_skipped") == before


def test_eager_backend_still_checks(mode_calls):
    """The mode itself is untouched: other backends' first runs go through it."""
    torch._dynamo.reset()
    torch.compile(_mlp_step, backend="aot_eager")(_model(), torch.randn(5, 8))
    assert mode_calls  # ATen ops went through the mode


def _custom(x: torch.Tensor) -> torch.Tensor:
    return torch.ops.kilntest_alias.same(x * 2) + 1


def test_graph_with_custom_op_is_still_checked(mode_calls):
    torch._dynamo.reset()
    x = torch.randn(6, requires_grad=True)  # a training graph: through AOTAutograd
    before = metrics.get("aot_alias_checks_skipped")
    # the check warns (error_on_custom_op_aliasing defaults to True where CI is set: raises)
    with (
        torch._functorch.config.patch(error_on_custom_op_aliasing=False),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        got = torch.compile(_custom, backend="kiln")(x)
    assert any("must not also be an input" in str(w.message) for w in caught)
    assert metrics.get("aot_alias_checks_skipped") == before
    assert torch.ops.kilntest_alias.same.default in mode_calls
    torch.testing.assert_close(got, (x * 2 + 1).detach())
    # where it is set to raise, the error reaches the caller from Kiln's first run as well
    torch._dynamo.reset()
    with torch._functorch.config.patch(error_on_custom_op_aliasing=True):
        with pytest.raises(RuntimeError, match="must not also be an input"):
            torch.compile(_custom, backend="kiln")(x)


class _Counting(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(a @ b) + 1


def test_user_mode_still_sees_the_ops(mode_calls):
    torch._dynamo.reset()
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    fn = torch.compile(_mm, backend="kiln")
    with _Counting() as user:
        got = fn(a, b)  # compiled and first run under the user's mode
    torch.testing.assert_close(got, _mm(a, b))
    assert torch.ops.aten.mm.default in user.ops
