"""Rows kernels with an epilogue (kiln/passes/fuse.py, kiln/codegen/cpp/emit.py) and the
expand sinking before them (kiln/passes/sink_expand.py): RMS norm forward in one kernel,
backward in two, against eager PyTorch and the reference interpreter."""

from __future__ import annotations

import pytest
import torch
from kiln_codegen_testlib import check_compiled_vs_eager, cpp_only, op, poison_outputs, run_both, t

from kiln.config import config
from kiln.ir.graph import GraphBuilder, In
from kiln.passes import row_epilogue
from kiln.runtime.compiler import executables


class RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, written out (the same ops)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = x.to(torch.float32)
        v = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(v + self.eps)
        return self.weight * h.to(dt)


def _kernels_run(fn) -> list[dict]:
    runs = {id(e): e.runs for e in executables()}
    fn()
    ran = [e for e in executables() if e.runs > runs.get(id(e), 0)]
    return [k for e in ran for k in e.info.get("kernels", [])]


def _check(norm: torch.nn.Module, x: torch.Tensor) -> list[dict]:
    """Compiled vs eager: output, input gradient, weight gradient."""
    torch._dynamo.reset()
    xe = x.detach().clone().requires_grad_(x.is_floating_point())
    ref = norm(xe)
    g = torch.randn(ref.shape, dtype=ref.dtype)
    ref.backward(g)
    we = norm.weight.grad.clone()
    norm.weight.grad = None
    xk = x.detach().clone().requires_grad_(x.is_floating_point())
    compiled = torch.compile(norm, backend="kiln")

    def run():
        out = compiled(xk)
        out.backward(g)
        torch.testing.assert_close(out, ref)

    kernels = _kernels_run(run)
    torch.testing.assert_close(xk.grad, xe.grad)
    torch.testing.assert_close(norm.weight.grad, we)
    norm.weight.grad = None
    return kernels


@pytest.mark.parametrize(
    "shape", [(4, 64, 128), (3, 5, 37), (7, 1), (2, 3, 1), (1, 129), (0, 16), (5, 0, 8)]
)
def test_rms_norm_matches_eager(shape):
    torch.manual_seed(0)
    kernels = _check(RMSNorm(shape[-1]), torch.randn(shape))
    if config.backend == "cpp" and shape == (4, 64, 128):
        # forward: one rows kernel; backward: the weight gradient's column sum + one rows kernel
        kinds = sorted(k["kind"] for k in kernels)
        assert kinds == ["cols", "rows", "rows"], kinds


def test_rms_norm_non_contiguous_and_bf16_input():
    torch.manual_seed(1)
    x = torch.randn(6, 40, 3).transpose(1, 2)  # [6, 3, 40], rows strided
    assert not x.is_contiguous()
    _check(RMSNorm(40), x)
    _check(RMSNorm(24, eps=1e-5), torch.randn(5, 24, dtype=torch.bfloat16))


def test_rms_norm_on_the_transformers_module():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(2)
    m = llama.LlamaRMSNorm(48, eps=1e-5)
    with torch.no_grad():
        m.weight.normal_()
    _check(m, torch.randn(2, 11, 48))


def test_softmax_written_out_matches_eager():
    """exp, row sum, divide: the divide is the rows kernel's epilogue."""
    check_compiled_vs_eager(
        lambda x: (
            torch.exp(x - x.amax(-1, keepdim=True))
            / torch.exp(x - x.amax(-1, keepdim=True)).sum(-1, keepdim=True)
        ),
        torch.randn(9, 33),
    )


def test_row_values_that_broadcast_wrongly_stay_out():
    """A reduction without keepdim, [8, 8], read by an [8, 8, 8] op broadcasts along the wrong
    dims for a row epilogue: it must not join (and the values must still match)."""
    check_compiled_vs_eager(lambda x: x * x.sum(-1), torch.randn(8, 8, 8))


@cpp_only
@pytest.mark.parametrize("epilogue", [True, False])
def test_epilogue_kernel_with_row_and_full_outputs(monkeypatch, epilogue):
    """Every kind of epilogue member written out: a row value (``[R, 1]``), a full value, read
    by ATen afterwards; a row-shaped external input and a per-column one."""
    poison_outputs(monkeypatch)
    monkeypatch.setattr(row_epilogue, "ROW_EPILOGUE", epilogue)
    b = GraphBuilder()
    x = b.input(t((3, 5, 7)))
    w = b.input(t((7,)))
    c = b.input(t((3, 5, 1)))
    sq = op(b, "mul.Tensor", [x, x], (In(0), In(1)), t((3, 5, 7)))
    m = op(b, "mean.dim", [sq], (In(0), [-1], True), t((3, 5, 1)))
    r = op(b, "add.Tensor", [m, c], (In(0), In(1)), t((3, 5, 1)))
    rs = op(b, "rsqrt.default", [r], (In(0),), t((3, 5, 1)))
    y = op(b, "mul.Tensor", [x, rs], (In(0), In(1)), t((3, 5, 7)))
    yw = op(b, "mul.Tensor", [y, w], (In(0), In(1)), t((3, 5, 7)))
    s = op(b, "sum.dim_IntList", [yw], (In(0), [0]), t((5, 7)))  # ATen's (not a rows reduction)
    g = b.build([yw, rs, s])
    xs = [torch.randn(3, 5, 7), torch.randn(7), torch.rand(3, 5, 1) + 0.1]
    want, got, info = run_both(g, xs)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)
    rows = [k for k in info["kernels"] if k["kind"] == "rows"]
    assert len(rows) == 1
    assert len(info["kernels"]) == (1 if epilogue else 3), [k["kind"] for k in info["kernels"]]


def test_reduction_over_an_empty_dim_keeps_its_readers():
    """Found by the fuzzer: a sum over a zero-size dim (keepdim) read by an add.  Over an empty
    row the kernel only writes its reductions' identities, so such a group takes no epilogue."""

    def program(x0, x1, x2):
        v1 = torch.sum(x0, dim=[0], keepdim=True) + x1 * 0.5
        return torch.cat([v1, x2]).mean(0, keepdim=True) + v1.sum()

    check_compiled_vs_eager(program, torch.randn(0), torch.randn(()), torch.randn(2))
    check_compiled_vs_eager(
        lambda x, c: x.sum(-1, keepdim=True) * c, torch.randn(3, 0), torch.randn(3, 1)
    )
