"""``kiln precompile`` and ``kiln explain``: run a training script for a few steps under Kiln.

    kiln precompile --steps 3 -- python train.py --lr 1e-3
    kiln explain --steps 2 --source -- python train.py

``precompile`` fills the persistent compile cache (``KILN_CACHE_DIR``) so that a later run, or
every rank of a distributed job, starts with zero compiles (compile mode: with AOTAutograd's
entries too, so that only Dynamo traces again).  ``explain`` prints, for every graph
the script compiled, the passes it went through, what was fused into which kernel (optionally with
the generated C++), and every op that fell back to eager ATen with the reason; then, for the run, the
forced syncs that cut its steps into several graphs and the ops run on ATen between graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click


def _run(cmd: tuple[str, ...], env: dict[str, str]) -> int:
    if not cmd:
        raise click.UsageError("give the command to run after --, e.g. -- python train.py")
    return subprocess.run(list(cmd), env={**os.environ, **env}, check=False).returncode


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--steps", default=3, show_default=True, help="training steps to run")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def precompile(steps: int, cmd: tuple[str, ...]) -> None:
    """Run CMD for a few steps to fill the persistent compile cache."""
    from kiln.config import config
    from kiln.frontends.compile.inference import INFERENCE_FOLDER

    graphs = Path(config.cache_dir) / "graphs"
    # compile mode: AOTAutograd's entries (Dynamo graph -> Kiln graphs), and the lowered graphs
    # that need no autograd (the optimizer step), kiln.frontends.compile
    aot = Path(config.cache_dir) / "torch" / "aotautograd"
    direct = Path(config.cache_dir) / INFERENCE_FOLDER

    kinds = ((graphs, "*.kgc"), (aot, "*/*"), (direct, "*.kgc"))

    def counts() -> list[int]:
        return [len(list(f.glob(p))) if f.exists() else 0 for f, p in kinds]

    before, aot_before, direct_before = counts()
    rc = _run(cmd, {"KILN_MAX_STEPS": str(steps)})
    after, aot_after, direct_after = counts()
    click.echo(
        f"kiln precompile: {after - before} new graphs in {graphs} ({after} in all), "
        f"{aot_after - aot_before} new AOTAutograd entries ({aot_after} in all), "
        f"{direct_after - direct_before} new graphs without autograd ({direct_after} in all); "
        f"exit {rc}"
    )
    sys.exit(rc)


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--steps", default=2, show_default=True, help="training steps to run")
@click.option("--source", is_flag=True, help="print the generated C++ of every kernel")
@click.option("--json", "as_json", is_flag=True, help="print the reports as JSON")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def explain(steps: int, source: bool, as_json: bool, cmd: tuple[str, ...]) -> None:
    """Run CMD for a few steps and explain every graph Kiln compiled."""
    from kiln.runtime.explain import format_report, format_run

    with tempfile.TemporaryDirectory(prefix="kiln-explain-") as d:
        rc = _run(cmd, {"KILN_MAX_STEPS": str(steps), "KILN_EXPLAIN_DIR": d})
        files = sorted(Path(d).glob("*.json"))
        reports = [json.loads(p.read_text()) for p in files if not p.name.startswith("run-")]
        runs = [json.loads(p.read_text()) for p in files if p.name.startswith("run-")]
    if as_json:
        click.echo(json.dumps(reports + runs, indent=1))
    else:
        for rep in reports:
            click.echo(format_report(rep, source=source))
            click.echo()
        for run in runs:
            click.echo(format_run(run))
            click.echo()
        click.echo(f"{len(reports)} graphs explained; exit {rc}")
    sys.exit(rc)
