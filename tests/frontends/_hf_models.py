"""Small ``transformers`` models for compile-mode tests, built offline from library defaults."""

from __future__ import annotations

import pytest
import torch


def tiny_gpt2_lm() -> torch.nn.Module:
    """GPT2LMHeadModel, 2 layers of width 64, vocabulary 97, library-default attention and loss
    (its config names no ``loss_type``: the library logs a warning in its loss); dropout 0, as
    compiled random masks are not eager's draws (as with Inductor).  Skips without transformers."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=97,
        n_positions=32,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)
