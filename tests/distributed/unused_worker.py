"""A data-parallel step with parameters some ranks do not use, run by ``kiln run`` (2 workers) in
``test_unused_parameters.py``: GradientSync on the kiln device against eager
DistributedDataParallel(find_unused_parameters=True) on the CPU, same data, AdamW with weight
decay.  Writes what rank 0 saw as JSON (argv[1])."""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kiln
import kiln.distributed as kd

STEPS = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.sometimes = nn.Linear(16, 16)  # used on rank (step % 2) only
        self.never = nn.Linear(16, 16)  # used by no rank
        self.h = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, use: bool) -> torch.Tensor:
        z = torch.relu(self.a(x))
        if use:
            z = z + torch.tanh(self.sometimes(z))
        return self.h(z)


def train(model: nn.Module, net: nn.Module, dev: torch.device, rank: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    grads = []
    for step in range(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
        x, y = x.chunk(2)[rank].to(dev), y.chunk(2)[rank].to(dev)
        opt.zero_grad()
        nn.functional.mse_loss(net(x, step % 2 == rank), y).backward()
        opt.step()
        if dev.type == "kiln":
            kiln.mark_step()
        grads.append(
            {
                n: None if p.grad is None else p.grad.cpu().tolist()
                for n, p in model.named_parameters()
            }
        )
    return {"grads": grads, "params": {n: p.cpu().tolist() for n, p in model.named_parameters()}}


def ddp_error() -> str | None:
    """The error a backward of DistributedDataParallel(find_unused_parameters=True) over a
    kiln-device model raises (None if it ran)."""
    model = Net().to(kiln.device())
    net = DistributedDataParallel(model, find_unused_parameters=True)
    try:
        net(torch.randn(4, 8, device=kiln.device()), False).sum().backward()
        kiln.mark_step()
    except RuntimeError as e:
        return str(e)
    return None


def main() -> None:
    dev = kiln.device()
    kd.init_process_group(device=dev)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    eager = train(
        reference,
        DistributedDataParallel(reference, find_unused_parameters=True),
        torch.device("cpu"),
        rank,
    )
    model.to(dev)
    sync = kd.GradientSync(model)
    lazy = train(model, model, dev, rank)
    sync.remove()
    error = ddp_error()
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"eager": eager, "lazy": lazy, "ddp_error": error}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
