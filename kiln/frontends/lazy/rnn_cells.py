"""The fused recurrent cells ATen asks of an accelerator, spelled out for the kiln device.

On a device other than the CPU, ATen's ``nn.LSTM`` / ``nn.GRU`` (and ``LSTMCell`` / ``GRUCell``)
compute each step's gates with the device's fused cell kernels (``_thnn_fused_lstm_cell``,
``_thnn_fused_gru_cell``) and take their gradients from the matching backward kernels; the CPU
has none of them, so the kiln device's fallback could not run them on the values
(``NotImplementedError`` from the CPU backend).  Here each is its pointwise formula, recorded like
any other ops (and fused by Kiln).  A forward returns, as its workspace, what its own backward
reads: the two are only ever used together (the autograd formula of the forward calls the
backward on the forward's workspace).

    LSTM: i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of the summed gates (+ biases)
          cy = f * cx + i * g;  hy = o * tanh(cy);             workspace = [i, f, g, o]
    GRU:  r, z = sigmoid(ir + hr), sigmoid(iz + hz);  n = tanh(in + r * hn)
          hy = (1 - z) * n + z * hx;                            workspace = [r, z, n, hn, hx]
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def _plus(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x if bias is None else x + bias


def lstm_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    cx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gates = _plus(_plus(input_gates, input_bias) + hidden_gates, hidden_bias)
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def lstm_cell_backward(
    grad_hy: torch.Tensor | None,
    grad_cy: torch.Tensor | None,
    cx: torch.Tensor,
    cy: torch.Tensor,
    workspace: torch.Tensor,
    has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the summed gates (before their activations), of ``cx`` and of the bias."""
    i, f, g, o = workspace.chunk(4, 1)
    tanh_cy = cy.tanh()
    ghy = torch.zeros_like(cy) if grad_hy is None else grad_hy
    gcy = ghy * o * (1 - tanh_cy * tanh_cy)
    if grad_cy is not None:
        gcy = grad_cy + gcy
    grad_gates = torch.cat(
        [
            gcy * g * i * (1 - i),
            gcy * cx * f * (1 - f),
            gcy * i * (1 - g * g),
            ghy * tanh_cy * o * (1 - o),
        ],
        1,
    )
    # (without a bias the third result is not read: the sum stands in for an absent tensor)
    return grad_gates, gcy * f, grad_gates.sum(0)


def gru_cell(
    input_gates: torch.Tensor,
    hidden_gates: torch.Tensor,
    hx: torch.Tensor,
    input_bias: torch.Tensor | None = None,
    hidden_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    ir, iz, in_ = _plus(input_gates, input_bias).chunk(3, 1)
    hr, hz, hn = _plus(hidden_gates, hidden_bias).chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = (1 - z) * n + z * hx
    return hy, torch.cat([r, z, n, hn, hx], 1)


def gru_cell_backward(
    grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the input gates, the hidden gates, ``hx`` and the two biases."""
    r, z, n, hn, hx = workspace.chunk(5, 1)
    gn = grad_hy * (1 - z) * (1 - n * n)  # through the new gate's tanh
    gz = grad_hy * (hx - n) * z * (1 - z)
    gr = gn * hn * r * (1 - r)
    grad_input = torch.cat([gr, gz, gn], 1)
    grad_hidden = torch.cat([gr, gz, gn * r], 1)
    return grad_input, grad_hidden, grad_hy * z, grad_input.sum(0), grad_hidden.sum(0)


DECOMPOSITIONS: dict[Any, Any] = {
    aten._thnn_fused_lstm_cell.default: lstm_cell,
    aten._thnn_fused_lstm_cell_backward_impl.default: lstm_cell_backward,
    aten._thnn_fused_gru_cell.default: gru_cell,
    aten._thnn_fused_gru_cell_backward.default: gru_cell_backward,
}
