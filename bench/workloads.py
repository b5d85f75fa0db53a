"""The benchmark's training workloads: a model, its batches and its loss, built from a seed.

    from bench.workloads import WORKLOADS, build
    wl = build("gpt", quick=False, n_batches=13)
    loss = wl.loss(model, wl.batches[0])

Every workload is deterministic for a given seed, so each mode starts from identical weights and
sees identical batches.  Two size classes (``SIZES``): the small one, where one eager training step
takes roughly 10-100 ms on two CPU cores, and the large one (``*-large``: 4-layer d=256
transformers at batch 8 x seq 128, an MLP and a CNN of comparable cost), a few hundred ms per
step; ``quick=True`` shrinks everything for the smoke test.  The ``transformers`` models are
built from small configs (no weight download), with dropout 0 and the library's default attention
(SDPA), as users run them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass
class Workload:
    name: str
    model: nn.Module
    batches: list[Batch]
    loss: LossFn
    desc: str
    seq_batch: Callable[[int], Batch] | None = None  # a batch of sequence length T (dynamic shapes)
    max_len: int = 0


def _xent(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _mlp(quick: bool, n: int, g: torch.Generator, large: bool = False) -> Workload:
    d_in, hidden, batch = (32, 64, 8) if quick else (1024, 2048, 512) if large else (512, 1024, 128)
    model = nn.Sequential(
        nn.Linear(d_in, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, 10),
    )
    data = [
        (torch.randn(batch, d_in, generator=g), torch.randint(0, 10, (batch,), generator=g))
        for _ in range(n)
    ]
    name = "mlp-large" if large else "mlp"
    return Workload(name, model, data, _xent, f"MLP {d_in}-{hidden}-{hidden}-10, batch {batch}")


class _CNN(nn.Module):
    def __init__(self, c: int, size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, c, 3, padding=1)
        self.conv2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.fc = nn.Linear(2 * c * (size // 4) ** 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def _cnn(quick: bool, n: int, g: torch.Generator, large: bool = False) -> Workload:
    c, size, batch = (4, 8, 2) if quick else (32, 64, 32) if large else (16, 32, 32)
    data = [
        (
            torch.randn(batch, 3, size, size, generator=g),
            torch.randint(0, 10, (batch,), generator=g),
        )
        for _ in range(n)
    ]
    return Workload(
        "cnn-large" if large else "cnn",
        _CNN(c, size),
        data,
        _xent,
        f"CNN 2 conv ({c},{2 * c} ch) {size}x{size}, batch {batch}",
    )


def _gpt(quick: bool, n: int, g: torch.Generator, large: bool = False) -> Workload:
    from examples.tinygpt import GPT, GPTConfig, batches

    layers, block, embd, batch = (
        (1, 16, 32, 2) if quick else (4, 128, 256, 8) if large else (2, 64, 128, 8)
    )
    model = GPT(GPTConfig(n_layer=layers, block_size=block, n_embd=embd))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))

    def seq_batch(t: int) -> Batch:
        return next(iter(batches(batch, t, 1, seed=seed + t)))

    return Workload(
        "gpt-large" if large else "gpt",
        model,
        list(batches(batch, block, n, seed=seed)),
        _lm_loss,
        f"tinygpt {layers}L d{embd}, batch {batch}x{block}",
        seq_batch,
        block,
    )


def _lm_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return model(x, y)


def _hf_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    # the library's defaults, as users call it: with config.use_cache (True) the forward also
    # builds a DynamicCache of every layer's keys and values, which the step then drops
    return model(input_ids=x, labels=y).loss


def _hf(
    kind: str,
    quick: bool,
    n: int,
    g: torch.Generator,
    large: bool = False,
    checkpointed: bool = False,
) -> Workload:
    """A ``transformers`` model; ``checkpointed``: with the library's default dropout and
    gradient checkpointing on (its random ops replayed in backward), as fine-tuning recipes run it."""
    import transformers as tf

    layers, hidden, seq, batch = (
        (1, 32, 8, 2) if quick else (4, 256, 128, 8) if large else (2, 128, 64, 4)
    )
    vocab = 100 if quick else 1000
    common = {
        "vocab_size": vocab,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": 4,
        "intermediate_size": 4 * hidden,
        "max_position_embeddings": 128,
    }
    if kind == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=vocab,
            n_positions=128,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            **({} if checkpointed else {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = tf.GPT2LMHeadModel
    elif kind == "bert":
        drop = (
            {}
            if checkpointed
            else {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
        )
        cfg = tf.BertConfig(**common, **drop)
        cls = tf.BertForMaskedLM
    else:
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, attention_dropout=0.0)
        cls = tf.LlamaForCausalLM
    model = cls(cfg)  # the default attention implementation (SDPA), as users get it
    if checkpointed:
        model.gradient_checkpointing_enable()
    data = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        if kind == "bert":  # masked LM: predict 15% of the tokens, mask them in the input
            masked = torch.rand(batch, seq, generator=g) < 0.15
            masked[:, 0] = True
            labels[~masked] = -100
            ids = ids.masked_fill(masked, 0)
        data.append((ids, labels))
    head = "masked LM" if kind == "bert" else "causal LM"
    return Workload(
        f"{kind}-large" if large else f"{kind}-ckpt" if checkpointed else kind,
        model,
        data,
        _hf_loss,
        f"HF {cls.__name__} {layers}L d{hidden} ({head}), batch {batch}x{seq}"
        + (", dropout 0.1, gradient checkpointing" if checkpointed else ""),
    )


WORKLOADS: dict[str, Callable[[bool, int, torch.Generator], Workload]] = {
    "mlp": _mlp,
    "gpt": _gpt,
    "cnn": _cnn,
    "gpt2": lambda q, n, g: _hf("gpt2", q, n, g),
    "bert": lambda q, n, g: _hf("bert", q, n, g),
    "llama": lambda q, n, g: _hf("llama", q, n, g),
    # the larger size class (--size large): 4-layer d=256 transformers at batch 8 x seq 128, an
    # MLP and a CNN of comparable step time
    "mlp-large": lambda q, n, g: _mlp(q, n, g, large=True),
    "gpt-large": lambda q, n, g: _gpt(q, n, g, large=True),
    "llama-large": lambda q, n, g: _hf("llama", q, n, g, large=True),
    "cnn-large": lambda q, n, g: _cnn(q, n, g, large=True),
    # not in a size class: fine-tuning set-ups (bench/step_cpu.py --workload gpt2-ckpt)
    "gpt2-ckpt": lambda q, n, g: _hf("gpt2", q, n, g, checkpointed=True),
    "bert-ckpt": lambda q, n, g: _hf("bert", q, n, g, checkpointed=True),
}
SIZES = {
    "small": ["mlp", "gpt", "cnn", "gpt2", "bert", "llama"],
    "large": ["mlp-large", "gpt-large", "llama-large", "cnn-large"],
}


def build(name: str, quick: bool, n_batches: int, seed: int = 0) -> Workload:
    """The workload ``name`` with ``n_batches`` batches; same seed -> same weights and batches."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    wl = WORKLOADS[name](quick, n_batches, g)
    wl.model.train()
    return wl
