"""One rank of tests/distributed/test_funcol_lazy.py: functional collectives on kiln tensors."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import kiln
from kiln.frontends.lazy import native

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
dev = kiln.device()
out: dict = {}

# funcol without wait_tensor: the result waits by itself, as in eager
x = torch.arange(4.0, device=dev) + rank
y = funcol.all_reduce(x, "sum", dist.group.WORLD)
z = y * 2
kiln.mark_step()
out["funcol"] = z.cpu().tolist()
out["native"] = native.is_native(x)

# with an explicit wait: the same
w = funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD)) + 1
kiln.mark_step()
out["waited"] = w.cpu().tolist()

# the raw op used before its wait: a Python exception that says what to do
group = dist.group.WORLD.group_name
r = torch.ops._c10d_functional.all_reduce(torch.ones(3, device=dev), "sum", group) * 3
try:
    kiln.mark_step()
    out["raw"] = "no error"
except RuntimeError as e:
    out["raw"] = f"{type(e).__name__}: {e}"

dist.destroy_process_group()
json.dump(out, sys.stdout)
