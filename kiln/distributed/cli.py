"""``kiln run``: the command-line face of :mod:`kiln.distributed.launch`."""

from __future__ import annotations

import sys

import click

from kiln.distributed.launch import BACKENDS, LaunchError, LaunchSpec
from kiln.distributed.launch import run as launch_run
from kiln.distributed.topology import TopologyError


@click.command(
    "run",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("--nproc-per-node", type=int, default=1, show_default=True, help="workers here")
@click.option("--nnodes", type=int, default=1, show_default=True, help="nodes in the job")
@click.option("--node-rank", type=int, default=0, show_default=True, help="this node's rank")
@click.option("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (multi-node)")
@click.option("--rdzv-id", default="", help="job id shared by all nodes (default: kiln)")
@click.option("--rdzv-timeout", type=int, default=60, show_default=True, help="seconds")
@click.option("--cpu-list", default="", help="cores to split between workers (e.g. 0-7)")
@click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True)
@click.option("-m", "module", is_flag=True, help="the script is a module name (python -m)")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run(script: str, script_args: tuple[str, ...], **kw: object) -> None:
    """Run SCRIPT on NPROC_PER_NODE data-parallel workers of this node (through torchrun).

    Each worker is pinned to its own block of cores and gets its share of this node's
    accelerators; ranks come from torchrun (RANK, LOCAL_RANK, WORLD_SIZE, ...).  A failed worker
    stops the job: the command exits 1 and names the failed rank.
    """
    spec = LaunchSpec(script=script, script_args=list(script_args), **kw)  # type: ignore[arg-type]
    try:
        code = launch_run(spec)
    except (LaunchError, TopologyError) as e:
        raise click.ClickException(str(e)) from None
    sys.exit(code)
