"""An fp8 linear layer for training: E4M3 forward, E5M2 gradients, dynamic scaling.

    model = kiln.precision.convert_to_fp8(model, scaling="rowwise")   # every nn.Linear, Conv1D
    layer = Fp8Linear(256, 64, scaling="tensorwise")                  # or build one directly

Forward: the input and the weight are quantized to E4M3 (saturating), each with a dynamic scale
``fmt.max / amax`` computed from the tensor itself: one per tensor (``"tensorwise"``) or one per
row (``"rowwise"``: per token of the input, per output feature of the weight, so that one large
value only coarsens its own row).  Backward: the output gradient is quantized to E5M2, scaled per
row along the dimension each product keeps (rows of ``grad`` for the input gradient, rows of
``grad.T`` for the weight gradient).  The products multiply the dequantized values in fp32: the
numerics of an fp8 GEMM with fp32 accumulation (this CPU has no fp8 units, so there is no speed
gain).  Master weights, bias and optimizer state stay in their own dtype.  Quantize and
dequantize are Kiln's generated kernels (:mod:`kiln.precision.quant`).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.precision.formats import E4M3, E5M2, FloatFormat, fp8_format
from kiln.precision.quant import dequantize, quantize

SCALINGS = ("tensorwise", "rowwise")
_EPS = 1e-12


@torch.library.custom_op("kiln::fp8_fake_quant", mutates_args=(), device_types="cpu")
def _fake_quant_op(x: torch.Tensor, fmt: str, rowwise: bool) -> torch.Tensor:
    """``x`` (2-D, float32, CPU) through the fp8 format named ``fmt`` with a dynamic scale, back
    in float32: one op to PyTorch, so that Dynamo and the lazy device take it whole (their
    graphs call it on the CPU buffers when they run) instead of tracing the generated kernels'
    raw pointers."""
    if x.numel() == 0:
        return x.clone()
    f = fp8_format(fmt)
    amax = x.abs().amax(dim=-1) if rowwise else x.abs().amax()
    scale = f.max / amax.clamp_min(_EPS)
    return dequantize(quantize(x, f, scale, saturate=True), f, scale)


@_fake_quant_op.register_fake
def _(x: torch.Tensor, fmt: str, rowwise: bool) -> torch.Tensor:
    return torch.empty(x.shape, dtype=torch.float32, device=x.device)


def _fake_quant(x: torch.Tensor, fmt: FloatFormat, rowwise: bool) -> torch.Tensor:
    """``x`` (2-D, float32) through ``fmt`` (one of the named formats) with a dynamic scale, back
    in float32."""
    return _fake_quant_op(x, fmt.name, rowwise)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rowwise: bool, dtype: torch.dtype):
        x2 = x.reshape(-1, x.shape[-1]).float()
        xq = _fake_quant(x2, E4M3, rowwise)
        wq = _fake_quant(weight.float(), E4M3, rowwise)
        out = xq @ wq.t()
        if bias is not None:
            out = out + bias.float()
        ctx.save_for_backward(xq, wq)
        ctx.rowwise, ctx.x_shape, ctx.has_bias = rowwise, x.shape, bias is not None
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(dtype)

    @staticmethod
    def backward(ctx, grad):
        xq, wq = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).float()
        gx = _fake_quant(g, E5M2, ctx.rowwise) @ wq  # scales along rows of g (kept in grad_x)
        gt = _fake_quant(g.t().contiguous(), E5M2, ctx.rowwise)  # per output feature
        gw = gt @ xq
        gb = g.sum(0) if ctx.has_bias else None
        xd, wd, bd = ctx.dtypes
        gb = gb.to(bd) if gb is not None else None
        return gx.reshape(ctx.x_shape).to(xd), gw.to(wd), gb, None, None


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    scaling: str = "tensorwise",
) -> torch.Tensor:  # fmt: skip
    """``F.linear`` with fp8 (E4M3 / E5M2) numerics; the result has ``x``'s dtype."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if {x.device.type, weight.device.type} - {"cpu", "kiln"}:
        raise ValueError(
            f"fp8_linear runs on CPU and kiln tensors (Kiln's fp8 kernels are CPU kernels), got "
            f"{x.device} and {weight.device}"
        )
    return _Fp8Linear.apply(x, weight, bias, scaling == "rowwise", x.dtype)


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose matmuls run with fp8 numerics (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 scaling: str = "tensorwise", device=None, dtype=None) -> None:  # fmt: skip
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        super().__init__(in_features, out_features, bias, device, dtype)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.bias, self.scaling)

    @classmethod
    def from_linear(cls, lin: nn.Linear, scaling: str = "tensorwise") -> Fp8Linear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features, new.scaling = lin.in_features, lin.out_features, scaling
        new.weight, new.bias = (
            lin.weight,
            lin.bias,
        )  # the same Parameters: optimizers still see them
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        return new

    def extra_repr(self) -> str:
        return super().extra_repr() + f", scaling={self.scaling}"


class Fp8Conv1D(nn.Module):
    """``transformers``' ``Conv1D`` (GPT-2's projections: ``x @ weight + bias`` with ``weight``
    of shape ``(in, out)``) with fp8 numerics: :func:`fp8_linear` of its transposed weight, so
    rowwise scales are per output feature as in :class:`Fp8Linear`.  Shares the layer's
    parameters (optimizers and tied weights still see them)."""

    def __init__(self, conv: nn.Module, scaling: str = "tensorwise") -> None:
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        super().__init__()
        self.nf, self.scaling = conv.weight.shape[1], scaling
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight.t(), self.bias, self.scaling)

    def extra_repr(self) -> str:
        return f"nf={self.nf}, nx={self.weight.shape[0]}, scaling={self.scaling}"


def _is_hf_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (by name: transformers is not a dependency)."""
    cls = type(module)
    return (
        cls.__name__ == "Conv1D"
        and cls.__module__.startswith("transformers.")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
    )


def convert_to_fp8(model: nn.Module, scaling: str = "tensorwise") -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by an :class:`Fp8Linear` and every
    ``transformers`` ``Conv1D`` (GPT-2's attention and MLP projections) by an
    :class:`Fp8Conv1D`, sharing their parameters; returns ``model``.  A model with neither
    raises: nothing would run in fp8."""
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    if not _convert(model, scaling):
        raise ValueError(
            f"convert_to_fp8: {type(model).__name__} has no nn.Linear or transformers Conv1D "
            "layer to convert (subclasses of nn.Linear are left as they are: their callers may "
            "read the weight directly, as nn.MultiheadAttention does)"
        )
    return model


def _convert(model: nn.Module, scaling: str) -> int:
    """Convert ``model``'s layers in place; how many."""
    n = 0
    for name, child in list(model.named_children()):
        if type(child) is nn.Linear:
            setattr(model, name, Fp8Linear.from_linear(child, scaling))
            n += 1
        elif _is_hf_conv1d(child):
            setattr(model, name, Fp8Conv1D(child, scaling))
            n += 1
        else:
            n += _convert(child, scaling)
    return n
