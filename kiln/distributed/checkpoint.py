"""Distributed checkpoints in PyTorch's format (torch.distributed.checkpoint), rank-aware.

    kd.checkpoint.save(path, model, optimizer)   # every rank calls it; each writes its share
    kd.checkpoint.load(path, model, optimizer)   # any world size, even a plain single process

Model and optimizer state go through ``torch.distributed.checkpoint.state_dict``, which names
parameters by their fully qualified names (no DDP ``module.`` prefix, optimizer state keyed by
parameter name, not index), so a checkpoint written by N ranks loads on M ranks or on one.
Values on the kiln device are saved from their CPU values and loaded back into the device.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _to_cpu(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    if isinstance(tree, torch.Tensor) and tree.device.type == "kiln":
        return tree.detach().cpu()
    return tree


def _state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    opts = StateDictOptions(ignore_frozen_params=False)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": _to_cpu(get_model_state_dict(model, options=opts))}
    msd, osd = get_state_dict(model, optimizer, options=opts)
    return {"model": _to_cpu(msd), "optim": _to_cpu(osd)}


def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None) -> None:
    """Write ``model`` (and ``optimizer``) to the checkpoint folder ``path`` (all ranks call)."""
    state = _state(model, optimizer)
    # per_thread_copy_ahead=0: the serial CPU loader.  The overlapping one asks the current
    # accelerator (kiln, once registered) for streams, which the lazy device does not have.
    writer = dcp.FileSystemWriter(str(path), per_thread_copy_ahead=0)
    dcp.save(state, storage_writer=writer, no_dist=not _dist())


def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None) -> None:
    """Load ``path`` into ``model`` (and ``optimizer``), whatever world size wrote it."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint folder at {path}")
    if optimizer is not None and not optimizer.state:
        _init_optimizer_state(optimizer)
    state = _state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path), no_dist=not _dist())
    opts = StateDictOptions(ignore_frozen_params=False)
    with torch.no_grad():
        if optimizer is None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            set_model_state_dict(model, state["model"], options=opts)
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=opts,
            )


def _init_optimizer_state(optimizer: Any) -> None:
    """A fresh optimizer has no state to load into: create it with one zero-gradient step at
    learning rate 0 (torch.distributed.checkpoint's own recipe)."""
    saved = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = 0.0 if not isinstance(g["lr"], torch.Tensor) else g["lr"].zero_()
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for g, lr in zip(optimizer.param_groups, saved):
        if lr is not None:
            g["lr"] = lr
