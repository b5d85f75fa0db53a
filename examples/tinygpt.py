"""A small GPT (nanoGPT-style) and a built-in character corpus, used by the main job and benchmarks.

from examples.tinygpt import GPT, GPTConfig, batches
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

CORPUS = """\
The kiln is hot and the clay is ready. A potter shapes the wet clay on the wheel, turning it
slowly, pressing with the thumbs until the walls rise thin and even. Then the pot dries in the
shade for days, and only when it rings like a bell when tapped does it go into the fire. Too fast
and it cracks; too slow and the glaze runs. The fire must climb, hold, and fall at the right pace.
Every pot that comes out whole is a small victory over heat and time and patience. The old potter
said: watch the color of the flame, listen to the draft, and never open the door too soon.
"""


@dataclass
class GPTConfig:
    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.n_embd)
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.ln2 = nn.LayerNorm(c.n_embd)
        self.fc = nn.Linear(c.n_embd, 4 * c.n_embd)
        self.fc2 = nn.Linear(4 * c.n_embd, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.n_head = c.n_head
        mask = torch.tril(torch.ones(c.block_size, c.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, c.block_size, c.block_size), persistent=False)

    def attn(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~self.mask[:, :, :T, :T], float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.drop(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.fc2(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(c.vocab_size, c.n_embd)
        self.wpe = nn.Embedding(c.block_size, c.n_embd)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def encode(text: str = CORPUS) -> torch.Tensor:
    return torch.tensor([min(ord(ch) - 32, 95) if ord(ch) >= 32 else 0 for ch in text])


def batches(batch: int, block: int, steps: int, seed: int = 0):
    """``steps`` (x, y) batches of random windows of the built-in corpus, the same for every mode."""
    data = encode()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ix = torch.randint(0, len(data) - block - 1, (batch,), generator=g)
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
        yield x, y
