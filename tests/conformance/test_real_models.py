"""Real ``transformers`` models (and a tiny in-house GPT) trained through both Kiln modes.

Each model is built from a small config (no weights downloaded, dropout 0, eager attention), copied
three times from the same initial weights, and trained 20 steps with AdamW (lr 1e-3, weight decay)
on fixed random token batches: in eager PyTorch, on the lazy device, and with
``torch.compile(backend="kiln")``.  The loss must match eager within 1e-4 relative at every step.
On the lazy device the training loop must settle: nothing compiles and nothing recompiles after
the second step.  A second process reusing the same ``KILN_CACHE_DIR`` must compile nothing.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kiln

transformers = pytest.importorskip("transformers")

STEPS = 20
BATCH, SEQ, VOCAB = 2, 16, 256
RTOL = 1e-4


# ---------------------------------------------------------------------------------------------
# models


class TinyGPT(nn.Module):
    """A minimal pre-norm GPT block stack, written the way users write one."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln1=nn.LayerNorm(d),
                    qkv=nn.Linear(d, 3 * d),
                    proj=nn.Linear(d, d),
                    ln2=nn.LayerNorm(d),
                    up=nn.Linear(d, 4 * d),
                    down=nn.Linear(4 * d, d),
                )
            )
            for _ in range(layers)
        )
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.tok(ids) + self.pos[:t]
        mask = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](x)).chunk(3, dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            att = (q @ k.transpose(-1, -2)) / (q.shape[-1] ** 0.5)
            att = att.masked_fill(~mask, float("-inf")).softmax(-1)
            x = x + blk["proj"]((att @ v).transpose(1, 2).reshape(b, t, -1))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


class HFLoss(nn.Module):
    """A transformers model as ``(ids, labels) -> loss``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return HFLoss(transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="eager"))


def bert() -> nn.Module:
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return HFLoss(transformers.BertForMaskedLM._from_config(cfg, attn_implementation="eager"))


def llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_dropout=0.0,
        use_cache=False,
    )
    return HFLoss(transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager"))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "tiny_gpt": TinyGPT,
    "gpt2": gpt2,
    "bert": bert,
    "llama": llama,
}


# ---------------------------------------------------------------------------------------------
# training in each mode


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append((ids, ids.clone()))
    return out


def make_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def train_eager(model: nn.Module, data: list) -> list[float]:
    opt = make_opt(model)
    losses = []
    for ids, labels in data:
        opt.zero_grad(set_to_none=True)
        loss = model(ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_compile(model: nn.Module, data: list) -> list[float]:
    torch._dynamo.reset()
    cmodel = torch.compile(model, backend="kiln", fullgraph=False, dynamic=False)
    opt = make_opt(model)
    losses = []
    for ids, labels in data:
        opt.zero_grad(set_to_none=True)
        loss = cmodel(ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_lazy(model: nn.Module, data: list) -> tuple[list[float], list[dict]]:
    """Losses, and a snapshot of ``kiln.metrics.counters()`` after every step."""
    dev = kiln.device()
    model.to(dev)  # tied weights stay tied (see test_module_to_kiln_keeps_tied_parameters)
    opt = make_opt(model)
    losses, snaps = [], []
    for ids, labels in data:
        opt.zero_grad(set_to_none=True)
        loss = model(ids.to(dev), labels.to(dev))
        loss.backward()
        opt.step()
        kiln.mark_step()
        losses.append(loss.cpu().item())
        snaps.append(kiln.metrics.counters())
    return losses, snaps


def assert_losses_match(name: str, mode: str, got: list[float], want: list[float]) -> None:
    assert len(got) == len(want) == STEPS
    for step, (a, e) in enumerate(zip(got, want), 1):
        assert abs(a - e) <= RTOL * abs(e), (
            f"{name} {mode}: step {step} loss {a!r} vs eager {e!r} "
            f"(rel diff {abs(a - e) / abs(e):.2e})\n  kiln:  {got}\n  eager: {want}"
        )


@pytest.fixture(scope="module")
def data() -> list:
    return batches()


@pytest.fixture(scope="module")
def eager_losses(data: list) -> dict[str, tuple[nn.Module, list[float]]]:
    """Each model's initial weights and its eager losses (computed once for both modes)."""
    out = {}
    for name, build in MODELS.items():
        torch.manual_seed(0)
        base = build()
        out[name] = (copy.deepcopy(base), train_eager(base, data))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_lazy_training_matches_eager(name: str, data: list, eager_losses: dict) -> None:
    base, want = eager_losses[name]
    kiln.metrics.reset()
    got, snaps = train_lazy(copy.deepcopy(base), data)
    assert_losses_match(name, "lazy", got, want)
    # Step 1 has no optimizer state yet (AdamW creates exp_avg/exp_avg_sq/step in it), so step 2
    # traces a different graph; from step 3 on every step must hit the compile cache.
    after2, after_last = snaps[1], snaps[-1]
    assert after_last["graphs_compiled"] == after2["graphs_compiled"], (
        f"{name}: steps 3..{STEPS} compiled "
        f"{after_last['graphs_compiled'] - after2['graphs_compiled']} new graphs; recompiles: "
        f"{after_last['recompile_reasons'][len(after2['recompile_reasons']) :]}"
    )
    assert after_last["recompile_reasons"] == after2["recompile_reasons"]
    assert after_last.get("cache_hits_memory", 0) >= STEPS - 2


@pytest.mark.parametrize("name", list(MODELS))
def test_compile_training_matches_eager(name: str, data: list, eager_losses: dict) -> None:
    base, want = eager_losses[name]
    kiln.metrics.reset()
    got = train_compile(copy.deepcopy(base), data)
    assert_losses_match(name, "compile", got, want)
    assert kiln.metrics.counters().get("graphs_executed", 0) >= 2 * STEPS  # fwd + bwd per step


def test_module_to_kiln_keeps_tied_parameters() -> None:
    """kiln switches Module.to() to swap parameters in place, so a tie survives the move."""
    lin = nn.Linear(4, 4, bias=False)
    emb = nn.Embedding(4, 4)
    emb.weight = lin.weight
    model = nn.ModuleDict(dict(emb=emb, lin=lin)).to(kiln.device())
    assert model["emb"].weight is model["lin"].weight


# ---------------------------------------------------------------------------------------------
# a second process finds everything in the disk cache

CHILD = textwrap.dedent(
    """
    import json, torch, kiln
    torch.manual_seed(0)
    dev = kiln.device()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 4)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x.to(dev)), y.to(dev))
        loss.backward()
        opt.step()
        kiln.mark_step()
    print(json.dumps({"loss": loss.cpu().item(), **kiln.metrics.counters()}))
    """
)


def test_second_process_hits_disk_cache(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "KILN_DISK_CACHE"}
    env["KILN_CACHE_DIR"] = str(tmp_path / "cache")

    def run() -> dict:
        p = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240
        )
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    first, second = run(), run()
    assert first["graphs_compiled"] > 0
    assert second.get("cache_hits_disk", 0) > 0, second
    assert second.get("graphs_compiled", 0) == 0, second
    assert second["loss"] == first["loss"]
