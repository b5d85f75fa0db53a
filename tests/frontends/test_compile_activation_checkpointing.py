"""Activation checkpointing (``torch.utils.checkpoint``) inside a compiled training step.

Batch norm: the checkpoint marks the region's values to be recomputed in backward; Kiln's
partition marks every read of an input the forward mutates to be saved (batch norm in training
reads its running statistics, which it updates; kiln/frontends/compile/partition.py).  Batch
norm's functional op returns a tuple, which is never saved itself, and its elements were left to
the checkpoint's policy: AOTAutograd's partitioner then failed ("failed to partition the joint
forward-backward graph ... cannot save: non-tensor output") and the step did not compile, with
either ``use_reentrant``.  The elements are now saved with their op.  Eager's recompute runs batch
norm in training mode a second time, so eager updates the running statistics twice a step under
checkpointing; a compiled step (Kiln's, as Inductor's) updates them once, as the same step
without checkpointing does (README, Known gaps).  Losses, gradients and parameters are eager's.

Attention: ATen's CPU SDPA kernel is tagged random (for its dropout) even at ``dropout_p=0``, so
the partitioner wrapped its forward and recomputed calls in ``run_and_save_rng_state`` /
``run_with_rng_state``, which Kiln does not lower: the whole graph of a checkpointed model with
SDPA attention (transformers' GPT-2, BERT, ViT with gradient checkpointing) ran on ATen op by op
(a counted ``graph:`` fallback).  Such calls are now recomputed as the untagged op
(kiln/frontends/compile/sdpa_no_draws.py), and ``dropout(p=0)`` is removed inside the checkpoint's
body as at the top level.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from optim_cases import loss_and_grads_step
from torch import nn
from torch.utils.checkpoint import checkpoint

import kiln


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.lin = (
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.Linear(8, 8),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.bn(self.conv(x)))
        return x + self.lin(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _Net(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 5)
        self.blocks = nn.ModuleList([_Block() for _ in range(2)])
        self.mode = mode  # "reentrant", "non_reentrant" or "none"

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            if self.mode == "none":
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return F.cross_entropy(self.head(h.mean((2, 3))), y)


Batch = tuple[torch.Tensor, torch.Tensor]


def _train(
    model: nn.Module, batches: list[Batch], compiled: bool, lr: float = 0.05
) -> tuple[list[torch.Tensor], list[dict], dict]:
    """SGD steps (AdamW would turn a key bias's rounding-noise gradient, 0 in exact arithmetic,
    into full-size steps of either sign: tests/conformance/_training.py); the losses, every
    step's gradients and the final state."""
    step = loss_and_grads_step(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="kiln")
    losses, grads = [], []
    for x, y in batches:
        loss, grad = step(x, y)
        losses.append(loss)
        grads.append(grad)
    return losses, grads, copy.deepcopy(model.state_dict())


def _assert_trained_alike(got: tuple, want: tuple) -> None:
    """Two :func:`_train` results agree: losses, every step's gradients, the final state."""
    for g, w in zip(got[0], want[0]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=0)
    for step, (g, w) in enumerate(zip(got[1], want[1])):
        for name in w:
            torch.testing.assert_close(
                g[name], w[name], rtol=1e-4, atol=1e-6, msg=f"step {step} grad {name}"
            )
    for name, w in want[2].items():
        torch.testing.assert_close(got[2][name], w, rtol=1e-4, atol=1e-6, msg=name)


def _images() -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g))
        for _ in range(3)
    ]


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_a_checkpointed_batch_norm_block_compiles_and_matches_eager(mode: str) -> None:
    torch.manual_seed(0)
    base = _Net(mode)
    want_losses, want_grads, want_state = _train(copy.deepcopy(base), _images(), False)
    got_losses, got_grads, got_state = _train(copy.deepcopy(base), _images(), True)
    for got, want in zip(got_losses, want_losses):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for step, (got, want) in enumerate(zip(got_grads, want_grads)):
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=f"step {step} grad {name}")
    for name, _ in base.named_parameters():
        torch.testing.assert_close(got_state[name], want_state[name], msg=name)
    # the running statistics: updated once a step, as without checkpointing
    unchecked = copy.deepcopy(base)
    unchecked.mode = "none"
    _, _, once = _train(unchecked, _images(), False)
    for name, buf in once.items():
        if "running" in name or "num_batches" in name:
            torch.testing.assert_close(got_state[name], buf, msg=name)
            assert not torch.equal(got_state[name], want_state[name]), (
                f"{name}: eager updated twice"
            )


class _AttentionBlock(nn.Module):
    """Pre-norm attention with SDPA (a float mask, dropout 0) and a p=0 dropout, as transformers
    models are built."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(32), nn.Linear(32, 96), nn.Linear(32, 32)
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.drop(self.out(a.transpose(1, 2).reshape(b, t, 32)))


class _AttentionNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(50, 32), nn.Linear(32, 50)
        self.blocks = nn.ModuleList([_AttentionBlock() for _ in range(2)])

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = ids.size(1)
        mask = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -1e4)
        h = self.emb(ids)
        for block in self.blocks:
            h = checkpoint(block, h, mask, use_reentrant=False)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _tokens() -> list[Batch]:
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, 50, (4, 12), generator=g) for _ in range(3)]
    return [(x, x.roll(-1, 1)) for x in ids]


@pytest.mark.parametrize("recompute", [True, False], ids=["min_cut", "save_all"])
def test_checkpointed_sdpa_compiles_into_kiln_graphs_and_matches_eager(recompute: bool) -> None:
    torch.manual_seed(0)
    base = _AttentionNet()
    want_losses, want_grads, want_state = _train(copy.deepcopy(base), _tokens(), False, lr=0.1)
    kiln.metrics.reset()
    with kiln.config.scoped(recompute=recompute, disk_cache=False):
        got_losses, got_grads, got_state = _train(copy.deepcopy(base), _tokens(), True, lr=0.1)
    counters = kiln.metrics.counters()
    assert not counters.get("fallbacks"), counters.get("fallbacks")  # no graph ran on ATen
    assert counters.get("sdpa_rng_wrappers_avoided", 0) >= 2  # forward calls of both blocks
    assert counters.get("dropout_p0_removed", 0) >= 2  # inside the checkpoint bodies
    _assert_trained_alike((got_losses, got_grads, got_state), (want_losses, want_grads, want_state))


class _RandomBlock(nn.Module):
    """A checkpointed region that draws random numbers: dropout (``native_dropout``, two outputs),
    SDPA with ``dropout_p > 0``, and a hand-written mask from ``rand_like`` (one output)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.qkv, self.out = nn.LayerNorm(32), nn.Linear(32, 96), nn.Linear(32, 32)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)
        h = self.drop(self.out(a.transpose(1, 2).reshape(b, t, 32)))
        return x + h * (torch.rand_like(h) > 0.1) / 0.9


class _RandomNet(_AttentionNet):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_RandomBlock() for _ in range(2)])

    def forward(self, ids: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def _seeded_train(model: nn.Module, compiled: bool) -> tuple[list, list, dict, torch.Tensor]:
    """:func:`_train` from one seed, and the generator's next draw after it."""
    torch.manual_seed(1234)
    losses, grads, state = _train(model, _tokens(), compiled, lr=0.1)
    return losses, grads, state, torch.rand(4)


def test_random_ops_in_a_checkpointed_region_compile_and_draw_eagers_numbers() -> None:
    """The forward's draws and the backward's replay of them run in Kiln's graphs (until
    2026-12-05 AOTAutograd's replay wrappers sent the whole graph to ATen): eager's losses,
    gradients and parameters from the same seed, so the same masks, and the generator left where
    eager leaves it."""
    torch.manual_seed(0)
    base = _RandomNet()
    want_losses, want_grads, want_state, want_next = _seeded_train(copy.deepcopy(base), False)
    kiln.metrics.reset()
    with kiln.config.scoped(disk_cache=False):
        got_losses, got_grads, got_state, got_next = _seeded_train(copy.deepcopy(base), True)
    counters = kiln.metrics.counters()
    assert not counters.get("fallbacks"), counters.get("fallbacks")  # no graph ran on ATen
    torch.testing.assert_close(got_next, want_next, rtol=0, atol=0)
    _assert_trained_alike((got_losses, got_grads, got_state), (want_losses, want_grads, want_state))
    # the masks are random: another seed gives other losses
    torch.manual_seed(99)
    other, _, _ = _train(copy.deepcopy(base), _tokens(), True, lr=0.1)
    assert not torch.equal(other[0], want_losses[0])


def test_the_replay_ops_draw_again_what_was_drawn_and_restore_the_generator() -> None:
    from kiln.ir.semantics import resolve

    saved = resolve("rng_saved.aten::native_dropout.default")
    replayed = resolve("rng_replayed.aten::native_dropout.default")
    x = torch.randn(64)
    state, out, mask = saved(x, 0.5, True)
    after = torch.get_rng_state()
    torch.rand(3)  # the generator moves on
    moved = torch.get_rng_state()
    again, again_mask = replayed(state, x, 0.5, True)
    torch.testing.assert_close(again, out, rtol=0, atol=0)
    assert torch.equal(again_mask, mask) and not mask.all() and mask.any()
    assert torch.equal(torch.get_rng_state(), moved)  # restored, not left at the replay's end
    assert not torch.equal(after, moved)
    one = resolve("rng_saved.aten::rand.default")
    state, r = one([5], device=torch.device("cpu"), pin_memory=False)
    torch.testing.assert_close(
        resolve("rng_replayed.aten::rand.default")(
            state, [5], device=torch.device("cpu"), pin_memory=False
        ),
        r,
        rtol=0,
        atol=0,
    )


def _dropout_region(x: torch.Tensor) -> torch.Tensor:
    return checkpoint(lambda t: F.dropout(t.sin(), 0.3) * 2, x, use_reentrant=False).sum()


@pytest.mark.parametrize("case", ["empty", "transposed"])
def test_a_checkpointed_dropout_of_an_empty_or_transposed_input_replays_its_mask(case: str) -> None:
    """The replay nodes on an input with no elements and on a transposed view: the backward's
    replayed mask is the forward's (the gradient's nonzero pattern gives back the forward's
    sum).  A random op draws in memory order, and Kiln's forward kernel handed the recomputation
    another layout than the forward's: the first version replayed another mask on the transposed
    input (forward -8.46, the gradient's mask summing to 6.19), a gradient that did not belong to
    the forward; both replay nodes now draw over row-major inputs.  With no elements: eager's
    result (until 2026-12-05 the kernel after ATen's dropout refused the float mask ATen's CPU
    kernel returns for an empty input, where torch's shape function says bool)."""
    base = torch.randn(0, 16) if case == "empty" else torch.randn(16, 8).t()
    x = base.clone(memory_format=torch.preserve_format).requires_grad_()
    torch._dynamo.reset()
    kiln.metrics.reset()
    with kiln.config.scoped(disk_cache=False):
        out = torch.compile(_dropout_region, backend="kiln")(x)
        out.backward()
    assert not kiln.metrics.counters().get("fallbacks")
    kept = x.grad != 0  # the backward's mask
    torch.testing.assert_close(
        (kept * base.sin() * 2 / 0.7).sum(), out.detach(), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(x.grad, kept * base.cos() * 2 / 0.7, rtol=1e-6, atol=0)
    if case == "transposed":  # a random mask: about 70% kept
        assert 0.5 < kept.float().mean() < 0.9
