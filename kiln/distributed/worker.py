"""Worker bootstrap: what ``kiln run`` has torchrun start in every worker process.

    python -m kiln.distributed.worker --cpus 0-3 --backend gloo -- train.py --lr 1e-3

Before the training script runs, the worker takes its share of the machine from its local rank
(torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``): it pins itself to its block of cores
(``sched_setaffinity``), sizes torch's thread pool to it (``torch.set_num_threads``, and
``OMP_NUM_THREADS`` for its children), and narrows the device variables it inherited
(``NEURON_RT_VISIBLE_CORES``, ``CUDA_VISIBLE_DEVICES``) to its own devices.  Then the script runs
as ``__main__``, exactly as ``python train.py`` would run it.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from kiln.distributed import state
from kiln.distributed.topology import (
    format_list,
    parse_list,
    split_cpus,
    worker_device_env,
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kiln.distributed.worker")
    p.add_argument("--cpus", required=True, help="cores of this node to split (e.g. 0-3)")
    p.add_argument("--backend", default="auto", help="process-group backend for init()")
    p.add_argument("-m", dest="module", action="store_true", help="script is a module name")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def pin(cpus: list[int]) -> None:
    """Run this process (and the threads torch starts later) on ``cpus`` only."""
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    torch.set_num_threads(len(cpus))


@record
def main(argv: list[str] | None = None) -> None:
    ns = _parser().parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    nlocal = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    mine = split_cpus(parse_list(ns.cpus), nlocal)[local_rank]
    os.environ.update(worker_device_env(os.environ, local_rank, nlocal))
    pin(mine)
    state.LAUNCH.update(backend=ns.backend, cpus=format_list(mine))
    args = list(ns.args)
    if args[:1] == ["--"]:
        args = args[1:]
    if ns.module:
        sys.argv = [ns.script, *args]
        runpy.run_module(ns.script, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [ns.script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
        runpy.run_path(ns.script, run_name="__main__")


if __name__ == "__main__":
    main()
