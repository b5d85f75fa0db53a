"""Activation checkpointing over batch norm, the whole training step compiled.

``torch.utils.checkpoint`` marks the checkpointed region's values to be recomputed in backward;
Kiln's partition marks every read of an input the forward mutates to be saved (batch norm in
training reads its running statistics, which it updates; kiln/frontends/compile/partition.py).
Batch norm's functional op returns a tuple, which is never saved itself, and its elements were
left to the checkpoint's policy: AOTAutograd's partitioner then failed ("failed to partition the
joint forward-backward graph ... cannot save: non-tensor output") and the step did not compile,
with either ``use_reentrant``.  The elements are now saved with their op.

Eager's recompute runs batch norm in training mode a second time, so eager updates the running
statistics twice a step under checkpointing; a compiled step (Kiln's, as Inductor's) updates them
once, as the same step without checkpointing does (README, Known gaps).  Losses, gradients and
parameters are eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


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


def _train(model: _Net, compiled: bool) -> tuple[list[torch.Tensor], list[dict], dict]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model(x, y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        return loss.detach(), grads

    if compiled:
        torch._dynamo.reset()
        step = torch.compile(step, backend="kiln")
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    for _ in range(3):
        x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
        loss, grad = step(x, y)
        losses.append(loss)
        grads.append(grad)
    return losses, grads, copy.deepcopy(model.state_dict())


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_a_checkpointed_batch_norm_block_compiles_and_matches_eager(mode: str) -> None:
    torch.manual_seed(0)
    base = _Net(mode)
    want_losses, want_grads, want_state = _train(copy.deepcopy(base), compiled=False)
    got_losses, got_grads, got_state = _train(copy.deepcopy(base), compiled=True)
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
    _, _, once = _train(unchecked, compiled=False)
    for name, buf in once.items():
        if "running" in name or "num_batches" in name:
            torch.testing.assert_close(got_state[name], buf, msg=name)
            assert not torch.equal(got_state[name], want_state[name]), (
                f"{name}: eager updated twice"
            )
