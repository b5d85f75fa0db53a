"""Recurrent layers on the kiln device: on a device other than the CPU, ATen computes ``nn.LSTM``
/ ``nn.GRU`` (and the cells) with the device's fused cell kernels, which the CPU lacks -- the
device raised ``NotImplementedError: Could not run 'aten::_thnn_fused_lstm_cell' ... 'CPU'
backend``.  Kiln spells them out (``lazy/rnn_cells.py``); here two training steps (AdamW) of each
layer, with and without biases, one and two layers, one and two directions, are compared with
eager: loss, every gradient and every parameter."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import kiln

DEV = kiln.device()


class _Seq(nn.Module):
    """A recurrent layer over a (B, T, F) input, its outputs and last state into one loss."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, state = self.rnn(x)
        states = state if isinstance(state, tuple) else (state,)
        return out.pow(2).mean() + sum(s.sin().sum() for s in states)


class _Cell(nn.Module):
    """A cell stepped over the time dim (the user's own loop)."""

    def __init__(self, cell: nn.Module, hidden: int) -> None:
        super().__init__()
        self.cell, self.hidden = cell, hidden

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], self.hidden)
        state = (h, h) if isinstance(self.cell, nn.LSTMCell) else h
        loss = x.new_zeros(())
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            hy = state[0] if isinstance(state, tuple) else state
            loss = loss + hy.tanh().sum()
        return loss


CASES = {
    "lstm": lambda: _Seq(nn.LSTM(6, 8, batch_first=True)),
    "lstm_2layer_bidir": lambda: _Seq(nn.LSTM(6, 8, num_layers=2, bidirectional=True)),
    "lstm_no_bias": lambda: _Seq(nn.LSTM(6, 8, bias=False, batch_first=True)),
    "gru": lambda: _Seq(nn.GRU(6, 8, batch_first=True)),
    "gru_bidir_no_bias": lambda: _Seq(nn.GRU(6, 8, bias=False, bidirectional=True)),
    "lstm_cell": lambda: _Cell(nn.LSTMCell(6, 8), 8),
    "gru_cell": lambda: _Cell(nn.GRUCell(6, 8), 8),
}


def _train(model: nn.Module, xs: list[torch.Tensor], dev: torch.device) -> tuple:
    model = model.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for x in xs:
        loss = model(x.to(dev))
        loss.backward()
        grads.append([p.grad.detach().cpu().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if dev.type == "kiln":
            kiln.mark_step()
        losses.append(loss.item())
    return losses, grads, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(CASES))
def test_recurrent_layer_trains_as_in_eager(name):
    torch.manual_seed(0)
    base = CASES[name]()
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 5, 6, generator=g) for _ in range(2)]
    want = _train(copy.deepcopy(base), xs, torch.device("cpu"))
    got = _train(copy.deepcopy(base), xs, DEV)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for step_got, step_want in zip(got[1], want[1]):
        for a, b in zip(step_got, step_want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for a, b in zip(got[2], want[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
