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
from _training_compare import assert_same_training
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


def _train(model: nn.Module, xs: list[torch.Tensor], dev: torch.device, sgd: bool = False) -> tuple:
    model = model.to(dev)
    if sgd:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
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


def _compare(
    base: nn.Module, xs: list[torch.Tensor], rtol: float = 1e-5, sgd: bool = False
) -> None:
    want = _train(copy.deepcopy(base), xs, torch.device("cpu"), sgd)
    got = _train(copy.deepcopy(base), xs, DEV, sgd)
    assert_same_training(got, want, rtol)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_layer_at_a_real_size(kind):
    # two layers of 256 over 32 steps of a batch of 8 (a language model's encoder); SGD, whose
    # update is the gradient itself (AdamW turns the float noise of the few elements whose
    # gradient is ~0 into full-size updates, in any mode)
    torch.manual_seed(0)
    rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(128, 256, num_layers=2, batch_first=True)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8, 32, 128, generator=g) for _ in range(2)]
    _compare(_Seq(rnn), xs, rtol=1e-4, sgd=True)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_layer_on_a_non_contiguous_input(kind):
    # (T, B, F) read from a (B, T, F) tensor: a transposed view on the device
    torch.manual_seed(0)
    base = _Seq((nn.LSTM if kind == "lstm" else nn.GRU)(6, 8))

    class _Transposed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x.transpose(0, 1))

    g = torch.Generator().manual_seed(1)
    _compare(_Transposed(), [torch.randn(3, 5, 6, generator=g) for _ in range(2)])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_layer_on_a_zero_size_batch(kind):
    torch.manual_seed(0)
    rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(6, 8)
    want, _ = copy.deepcopy(rnn)(torch.randn(5, 0, 6))
    got, _ = copy.deepcopy(rnn).to(DEV)(torch.randn(5, 0, 6).to(DEV))
    kiln.mark_step()
    assert got.shape == want.shape == (5, 0, 8)
    assert got.cpu().numel() == 0


class _Packed(nn.Module):
    """Variable-length sequences through ``pack_padded_sequence`` (CPU lengths, as required)."""

    def __init__(self, rnn: nn.Module, lengths: list[int], sorted_: bool) -> None:
        super().__init__()
        self.rnn, self.lengths, self.sorted = rnn, lengths, sorted_

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = torch.tensor(self.lengths)
        packed = nn.utils.rnn.pack_padded_sequence(
            x, lengths, batch_first=True, enforce_sorted=self.sorted
        )
        out, state = self.rnn(packed)
        assert out.batch_sizes.device.type == "cpu"  # as on every device
        padded, out_lengths = nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        assert out_lengths.tolist() == self.lengths
        h = state[0] if isinstance(state, tuple) else state
        return padded.pow(2).mean() + h.sin().sum()


@pytest.mark.parametrize(
    ("kind", "lengths", "sorted_"),
    [("lstm", [5, 3, 2], True), ("gru", [2, 5, 1], False), ("lstm", [4, 4, 4], True)],
)
def test_packed_sequences_train_as_in_eager(kind, lengths, sorted_):
    # pack_padded_sequence kept its batch_sizes on the kiln device, which PackedSequence refuses
    torch.manual_seed(0)
    rnn = (nn.LSTM if kind == "lstm" else nn.GRU)(6, 8, batch_first=True)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(3, 5, 6, generator=g) for _ in range(2)]
    _compare(_Packed(rnn, lengths, sorted_), xs)


def test_packing_unsorted_lengths_raises_as_eager():
    x = torch.randn(3, 4, 2)
    lengths = torch.tensor([2, 4, 1])
    with pytest.raises(RuntimeError, match="sorted in decreasing order"):
        nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
    with pytest.raises(RuntimeError, match="sorted in decreasing order"):
        nn.utils.rnn.pack_padded_sequence(x.to(DEV), lengths, batch_first=True)
