"""Data-parallel training script the distributed tests launch (not a test module).

    kiln run --nproc-per-node 2 dp_train.py --modes compile,lazy --out result.json
    python dp_train.py --modes compile,lazy --out ref.json          # single process, same batch

A tiny transformer trains for --steps AdamW steps on a fixed global batch; each rank takes its
contiguous shard of the batch.  Modes: ``compile`` (DistributedDataParallel, torch.compile with
backend="kiln"), ``lazy`` (kiln device, kiln.distributed.GradientSync: bucketed all-reduce in the
step graph), ``fsdp`` (FSDP2 ``fully_shard``, compiled with
backend="kiln"), ``compile_funcol`` (the all-reduce of
the gradients inside a function compiled with backend="kiln"), ``lazy_pg`` (kiln device, ``dist.all_reduce(p.grad)`` through the "kiln" process
group backend).  Rank 0 writes the global loss of every step and every rank's kiln.metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import kiln
import kiln.distributed as kd
import kiln.distributed.checkpoint
import kiln.frontends.lazy.native

V, D, H, T, B = 64, 32, 2, 8, 8  # vocab, width, heads, sequence length, global batch


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (z.view(b, t, H, D // H).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (D // H) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, D)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        self.block = Block()
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos
        logits = self.head(self.ln(self.block(x)))
        return F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    data = torch.randint(0, V, (B, T + 1), generator=g)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def global_loss(loss: torch.Tensor, world: int) -> float:
    v = loss.detach().cpu().clone()
    if world > 1:
        torch.distributed.all_reduce(v)
        v /= world
    return float(v)


def average_grads(grads: list[torch.Tensor], world: int) -> None:
    for g in grads:
        torch.distributed.all_reduce(g)
        g.div_(world)


def train(
    mode: str, steps: int, rank: int, world: int, kill_at: int, pg: object, ckpt: str
) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT()
    x, y = (shard(t, rank, world) for t in batch())
    losses = []
    if mode == "fsdp":
        # FSDP2: parameters sharded over the ranks (the block, then the rest), compiled by Kiln
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        mode = "compile_plain"
    if mode in ("compile_funcol", "compile_plain"):
        # the gradient all-reduce inside a compiled function: Dynamo puts the collectives in
        # the graph (_c10d_functional.all_reduce + wait_tensor) and Kiln compiles that graph
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        fwd = torch.compile(model, backend="kiln")
        sync = torch.compile(average_grads, backend="kiln")
        for i in range(steps):
            loss = fwd(x, y)
            loss.backward()
            if world > 1 and mode == "compile_funcol":
                sync([p.grad for p in model.parameters()], world)
            opt.step()
            opt.zero_grad()
            losses.append(global_loss(loss, world))
        return losses
    if mode == "compile":
        if world > 1:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step_fn = torch.compile(model, backend="kiln")
        for i in range(steps):
            if i == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = step_fn(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(global_loss(loss, world))
        if ckpt:
            kd.checkpoint.save(ckpt, model, opt)
        return losses
    dev = kiln.device()
    model = model.to(dev)
    if mode == "lazy_ddp" and world > 1:
        # PyTorch's DistributedDataParallel on a kiln-device model: its C++ reducer buckets the
        # kiln gradients and all-reduces them through the process group
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = kd.GradientSync(model, bucket_cap_mb=0.02) if mode == "lazy" and world > 1 else None
    xd, yd = x.to(dev), y.to(dev)
    for i in range(steps):
        if i == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = model(xd, yd)
        loss.backward()
        if mode == "lazy_pg" and world > 1:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG, group=pg)
        opt.step()
        opt.zero_grad()
        kiln.mark_step()
        losses.append(global_loss(loss, world))
    if sync is not None:
        sync.remove()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="compile,lazy")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default="", help="save the compile-mode model + optimizer here")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=-1)
    a = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    pg = None
    if world > 1:
        kd.init_process_group(timeout_s=60)
        if "lazy_pg" in a.modes:
            pg = torch.distributed.new_group(backend="kiln")
    # Graphs already in the cache before training (kiln's import-time device probe, in the
    # launcher and in each worker) are not the job's: count them, then start the metrics afresh.
    # Taken between two synchronization points, so no rank has started training yet.
    cache = os.path.join(kiln.config.cache_dir, "graphs")
    pre = len([f for f in os.listdir(cache) if f.endswith(".kgc")]) if os.path.isdir(cache) else 0
    if world > 1:
        torch.distributed.barrier()
    kiln.metrics.reset()
    rank = kd.rank()
    kill_at = a.kill_step if rank == a.kill_rank else -1
    out: dict = {"world": world, "losses": {}, "graphs_before": pre}
    t0 = time.perf_counter()
    out["fallbacks"] = {}
    for mode in a.modes.split(","):
        before = dict(kiln.metrics.counters()["fallbacks"])
        out["losses"][mode] = train(mode, a.steps, rank, world, kill_at, pg, a.ckpt)
        after = kiln.metrics.counters()["fallbacks"]
        out["fallbacks"][mode] = {
            k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)
        }
    out["seconds"] = time.perf_counter() - t0
    mine = {
        "rank": rank,
        "cpus": sorted(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
        "NEURON_RT_VISIBLE_CORES": os.environ.get("NEURON_RT_VISIBLE_CORES"),
        "metrics": kiln.metrics.counters(),
        # the kiln device's recorder made native tensors (KILN_LAZY_RECORDER=native)
        "native": kiln.frontends.lazy.native.loaded(),
    }
    ranks = [mine]
    if world > 1:
        ranks = [None] * world if rank == 0 else None
        torch.distributed.gather_object(mine, ranks, dst=0)
    out["ranks"] = ranks
    if rank == 0:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f)
        os.replace(tmp, a.out)
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
