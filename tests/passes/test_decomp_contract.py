"""Every decomposition the compile backend applies reproduces *all* outputs of its op.

A forward op's extra outputs (a log-sum-exp, a mean/rstd, a buffer, indices) are saved for its
backward.  When the forward is decomposed but the backward is not (ATen's kernel, or one Kiln
keeps whole), the backward reads what the decomposition returned: torch's decomposition of
``_scaled_dot_product_flash_attention_for_cpu`` returns the attention probabilities where the
kernel returns the log-sum-exp, which made every SDPA gradient wrong in compile mode.

The check runs the OpInfo samples of the ops with such outputs under a dispatch mode that, on
every call to a multi-output op in the backend's decomposition table, also runs the decomposition
and compares each output with ATen's.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from kiln.frontends.compile.backend import _DECOMPS

# OpInfos whose ATen calls include every multi-output op of the table that a training step
# differentiates through (the rest, e.g. LAPACK factorizations, are fallbacks).
OPINFOS = (
    "nn.functional.logsigmoid",
    "nn.functional.nll_loss",
    "nn.functional.multilabel_margin_loss",
    "nn.functional.max_pool1d",
    "nn.functional.adaptive_max_pool1d",
    "nn.functional.embedding_bag",
    "nn.functional.rms_norm",
    "nn.functional.scaled_dot_product_attention",
    "var_mean",
    "std_mean",
    "aminmax",
)

SAMPLES = 6  # per OpInfo: their first samples cover the argument variants (weights, reductions)


def _multi(op) -> bool:
    return (
        isinstance(op, torch._ops.OpOverload)
        and sum(1 for r in op._schema.returns if str(r.type) == "Tensor") > 1
    )


class _Contract(TorchDispatchMode):
    def __init__(self, table: dict) -> None:
        super().__init__()
        self.table = {k: v for k, v in table.items() if _multi(k)}
        self.checked: dict[str, int] = {}
        self.bad: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        decomp = self.table.get(func)
        if decomp is None:
            return out
        with _disable_current_modes():
            got = decomp(*args, **kwargs)
        self.checked[str(func)] = self.checked.get(str(func), 0) + 1
        for i, (a, b) in enumerate(zip(out, got)):
            if not isinstance(a, torch.Tensor):
                continue
            same = a.shape == b.shape and (
                a.numel() == 0
                or torch.allclose(a.double(), b.double(), rtol=1e-4, atol=1e-5, equal_nan=True)
            )
            if not same:
                self.bad.append(
                    f"{func} output {i}: ATen {tuple(a.shape)}, decomposition {tuple(b.shape)}"
                )
        return out


def _sweep(table: dict) -> _Contract:
    mode = _Contract(table)
    ops = [o for o in op_db if o.name in OPINFOS]
    assert len({o.name for o in ops}) == len(OPINFOS), "an OpInfo name changed"
    for o in ops:
        samples = list(o.sample_inputs("cpu", torch.float32))
        for s in samples if "attention" in o.name else samples[:SAMPLES]:
            with mode:
                o(s.input, *s.args, **s.kwargs)
    return mode


@pytest.mark.filterwarnings("ignore")
def test_backend_decompositions_keep_every_output():
    mode = _sweep(_DECOMPS)
    assert not mode.bad, "\n".join(mode.bad)
    # the sweep reached the multi-output decompositions it is about (nll_loss_forward's is not
    # used any more: the op is kept whole, kiln/ir/ops.py says why)
    for name in ("aten.log_sigmoid_forward.default", "aten.std_mean.correction"):
        assert mode.checked.get(name, 0) > 0, (name, mode.checked)
    assert torch.ops.aten.nll_loss_forward.default not in _DECOMPS


@pytest.mark.filterwarnings("ignore")
def test_contract_check_catches_the_sdpa_decomposition():
    """The check is not vacuous: torch's own table (SDPA's CPU kernel decomposed) fails it."""
    from torch._decomp import core_aten_decompositions

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    mode = _sweep({op: core_aten_decompositions()[op]})
    assert any("flash_attention_for_cpu" in b for b in mode.bad), mode.checked
