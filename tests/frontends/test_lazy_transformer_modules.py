"""torch.nn's transformer modules on the kiln device, in their inference fast paths and in training.

In eval mode without gradients, ``nn.TransformerEncoderLayer`` and ``nn.MultiheadAttention`` call
fused ATen ops (``_transformer_encoder_layer_fwd``, ``_native_multi_head_attention``) for devices
of type cpu, cuda and the PrivateUse1 backend, which the kiln device is: they run as fallbacks and
must equal eager.  ``nn.TransformerEncoder`` with a padding mask goes further and packs its input
into a nested tensor, which the device cannot hold: that raises an error naming the two ways
around it (before, it failed inside the fallback's wrapper with "NestedTensorImpl doesn't support
strides"), the device keeps working, and either way around gives eager's values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln

MASK = torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 2 + [True] * 4])


def _encoder(**kw: object) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    return nn.TransformerEncoder(layer, 2, **kw).eval()


def test_encoder_fast_path_with_padding_mask_raises_a_clear_error() -> None:
    dev = kiln.device()
    enc = _encoder()
    x = torch.randn(3, 6, 16)
    on_dev = _encoder().to(dev)
    with torch.no_grad(), pytest.raises(NotImplementedError) as e:
        on_dev(x.to(dev), src_key_padding_mask=MASK.to(dev))
    assert str(e.value) == (
        "aten::_nested_tensor_from_mask returned a nested tensor, which the kiln device does not "
        "support. nn.TransformerEncoder builds one in its inference fast path (eval mode, no grad, "
        "a src_key_padding_mask): run it with torch.backends.mha.set_fastpath_enabled(False), or "
        "build it with enable_nested_tensor=False (the same values at unpadded positions; padded "
        "positions are computed instead of zero, as under torch.compile)."
    )
    with torch.no_grad():  # the device still works, and the way around gives eager's values
        want = enc(x, src_key_padding_mask=MASK)
        torch.backends.mha.set_fastpath_enabled(False)
        try:
            got = on_dev(x.to(dev), src_key_padding_mask=MASK.to(dev))
            kiln.mark_step()
            slow = enc(x, src_key_padding_mask=MASK)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    torch.testing.assert_close(got.cpu(), slow, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu()[~MASK], want[~MASK], rtol=1e-5, atol=1e-5)


def test_encoder_without_nested_tensor_matches_eager() -> None:
    dev = kiln.device()
    enc = _encoder(enable_nested_tensor=False)
    x = torch.randn(3, 6, 16)
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=MASK)
        got = enc.to(dev)(x.to(dev), src_key_padding_mask=MASK.to(dev))
        kiln.mark_step()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_dense_fast_paths_match_eager() -> None:
    dev = kiln.device()
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True).eval()
    mha = nn.MultiheadAttention(16, 2, batch_first=True).eval()
    x = torch.randn(3, 6, 16)
    with torch.no_grad():
        want = (layer(x), mha(x, x, x, key_padding_mask=MASK)[0], mha(x, x, x)[0])
        xd = x.to(dev)
        layer, mha = layer.to(dev), mha.to(dev)
        got = (layer(xd), mha(xd, xd, xd, key_padding_mask=MASK.to(dev))[0], mha(xd, xd, xd)[0])
        kiln.mark_step()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_training_matches_eager(norm_first: bool) -> None:
    """Forward, gradients and SGD-updated parameters over three steps (SGD: a parameter whose
    true gradient is zero, the key projection's bias, would turn rounding noise into full AdamW
    steps in any mode)."""
    dev = kiln.device()
    torch.manual_seed(2)
    ref = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first)
    mine = nn.TransformerEncoderLayer(
        8, 2, 16, dropout=0.0, batch_first=True, norm_first=norm_first
    )
    mine.load_state_dict(ref.state_dict())
    mine.to(dev)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, mine)]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(2, 5, 8, generator=g)
        losses = []
        for m, opt, d in ((ref, opts[0], "cpu"), (mine, opts[1], dev)):
            loss = m(x.to(d), src_key_padding_mask=MASK[:2, :5].to(d)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        kiln.mark_step()
        torch.testing.assert_close(losses[1].cpu(), losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), mine.parameters()):
        torch.testing.assert_close(q.detach().cpu(), p.detach(), rtol=1e-5, atol=1e-6, msg=name)
