"""``kiln run``: torchrun with Kiln's choices filled in.

    kiln run --nproc-per-node 2 train.py --lr 1e-3
    kiln run --nproc-per-node 2 --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 train.py

torchrun (``torch.distributed.run``) starts, watches and stops the workers and runs the
rendezvous; this layer only decides what torchrun leaves to the user:

- the cores: this node's cores (its affinity mask, or ``--cpu-list``) are split into one block per
  worker, each worker pinned to its block with as many torch threads as cores (no
  oversubscription; a warning when there are more workers than cores);
- the devices: when the node was handed accelerators (``NEURON_RT_VISIBLE_CORES``,
  ``CUDA_VISIBLE_DEVICES``), each worker gets an equal, disjoint share;
- the process-group backend that :func:`kiln.distributed.init_process_group` uses (gloo on CPU).

Rank information (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...) is torchrun's, passed through.
A failed worker stops the whole job (torchrun's default, no restarts) and ``kiln run`` exits 1
with the failed rank, its exit code or signal, and its error.
"""

from __future__ import annotations

import os
import signal
import sys
import uuid
import warnings
from dataclasses import dataclass, field

from kiln.distributed.topology import (
    TopologyError,
    available_cpus,
    format_list,
    oversubscribed,
    parse_list,
    split_cpus,
    worker_device_env,
)

BACKENDS = ("auto", "gloo", "nccl", "kiln")


class LaunchError(RuntimeError):
    pass


@dataclass
class LaunchSpec:
    script: str
    script_args: list[str] = field(default_factory=list)
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    rdzv_timeout: int = 60  # seconds the nodes wait for each other (join and last call)
    cpu_list: str = ""  # cores of this node to use; default: this process's affinity mask
    backend: str = "auto"
    module: bool = False  # script is a module name (python -m)
    max_restarts: int = 0
    monitor_interval: float = 0.2

    def cpus(self) -> list[int]:
        cpus = parse_list(self.cpu_list) if self.cpu_list else available_cpus()
        allowed = set(available_cpus())
        outside = [c for c in cpus if c not in allowed]
        if outside:
            raise LaunchError(
                f"--cpu-list names cores {format_list(outside)} this process may not use "
                f"(allowed: {format_list(sorted(allowed))})"
            )
        return cpus


def validate(spec: LaunchSpec) -> None:
    if spec.nproc_per_node < 1:
        raise LaunchError(f"--nproc-per-node must be >= 1, got {spec.nproc_per_node}")
    if spec.nnodes < 1:
        raise LaunchError(f"--nnodes must be >= 1, got {spec.nnodes}")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise LaunchError(f"--node-rank must be in [0, {spec.nnodes}), got {spec.node_rank}")
    if spec.nnodes > 1 and not spec.rdzv_endpoint:
        raise LaunchError(
            "a multi-node job needs --rdzv-endpoint HOST:PORT (the same on every node; the "
            "node that owns that address hosts the rendezvous)"
        )
    if spec.backend not in BACKENDS:
        raise LaunchError(f"--backend must be one of {', '.join(BACKENDS)}, got {spec.backend!r}")
    if not spec.module and not os.path.isfile(spec.script):
        raise LaunchError(f"training script {spec.script!r} not found")
    try:
        for r in range(spec.nproc_per_node):  # every worker's device share exists
            worker_device_env(os.environ, r, spec.nproc_per_node)
    except TopologyError as e:
        raise LaunchError(str(e)) from None


def torchrun_argv(spec: LaunchSpec) -> list[str]:
    """The ``torchrun`` command line (without the program name) for ``spec``."""
    cpus = spec.cpus()
    argv = [f"--nproc-per-node={spec.nproc_per_node}", f"--max-restarts={spec.max_restarts}"]
    argv.append(f"--monitor-interval={spec.monitor_interval}")
    if spec.nnodes == 1 and not spec.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0"]
        argv.append(f"--rdzv-id={spec.rdzv_id or uuid.uuid4().hex}")
    else:
        argv += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={spec.rdzv_id or 'kiln'}",
            (
                f"--rdzv-conf=join_timeout={spec.rdzv_timeout},"
                f"last_call_timeout=1,close_timeout={min(spec.rdzv_timeout, 10)}"
            ),
        ]
    argv += ["-m", "kiln.distributed.worker", f"--cpus={format_list(cpus)}"]
    argv += [f"--backend={spec.backend}"]
    if spec.module:
        argv.append("-m")
    argv += [spec.script, "--", *spec.script_args]
    return argv


def worker_env(spec: LaunchSpec) -> dict[str, str]:
    """Environment the launcher adds for its workers (thread count; torchrun adds the ranks)."""
    cpus = spec.cpus()
    per = split_cpus(cpus, spec.nproc_per_node)
    if oversubscribed(cpus, spec.nproc_per_node):
        warnings.warn(
            f"kiln run: {spec.nproc_per_node} workers on {len(cpus)} cores: workers share "
            "cores (one thread each); use --nproc-per-node <= the number of cores",
            stacklevel=2,
        )
    return {"OMP_NUM_THREADS": str(min(len(p) for p in per))}


def run(spec: LaunchSpec) -> int:
    """Launch the job on this node and wait for it; the exit status for ``kiln run``."""
    validate(spec)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    os.environ.update(worker_env(spec))
    args = get_args_parser().parse_args(torchrun_argv(spec))
    try:
        torchrun(args)
    except ChildFailedError as e:
        print(describe_failure(e), file=sys.stderr, flush=True)
        return 1
    return 0


# torchrun's message for a worker that left no error file (it exited without raising)
_NO_ERROR_FILE = "To enable traceback see"


def describe_failure(e: object) -> str:
    """One line per failed worker: rank, exit code or signal, its error message.  Workers that
    failed on their own come first; those ``kiln run`` stopped (SIGTERM) after them come last,
    marked so (their error, often a lost connection to the failed rank, follows from it)."""
    lines = ["kiln run: the job failed and was stopped:"]
    failures = getattr(e, "failures", {})
    n_stopped = sum(f.exitcode == -signal.SIGTERM for f in failures.values())
    # failed on their own first, then the stopped ones; each group by rank
    order = sorted(failures, key=lambda rank: (failures[rank].exitcode == -signal.SIGTERM, rank))
    for rank in order:
        f = failures[rank]
        how = f"exit code {f.exitcode}"
        if f.exitcode is not None and f.exitcode < 0:
            how = f"killed by signal {f.signal_name()}"
        msg = f.message.get("message") if isinstance(f.message, dict) else f.message
        first = str(msg).strip().splitlines()[0] if msg else ""
        if not first or first.startswith(_NO_ERROR_FILE):
            first = "no Python error recorded (it exited without raising: os._exit, sys.exit(n))"
        if "Signal" in first and f.exitcode is not None and f.exitcode < 0:
            first = "the process was killed (no Python error)"
        if f.exitcode == -signal.SIGTERM and n_stopped < len(failures):
            how = "stopped by kiln run (SIGTERM) after the failure above; its last error"
        lines.append(f"  rank {rank} (local rank {f.local_rank}, pid {f.pid}): {how}: {first}")
    return "\n".join(lines)
