"""``kiln ls``, ``kiln top`` and ``kiln profile``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

_ROOT = click.option(
    "--root",
    default="/",
    show_default=True,
    help="prefix of the sysfs/procfs/devfs paths read (a fake tree, for tests)",
)
_RUNTIME_DIR = click.option(
    "--runtime-dir",
    default=None,
    help="where Kiln processes publish their state [default: KILN_RUNTIME_DIR]",
)


@click.command("ls")
@click.option("--json", "as_json", is_flag=True, help="print everything as JSON")
@click.option("--wide", is_flag=True, help="add owner PID, command and Kiln version")
@_ROOT
@_RUNTIME_DIR
def ls(as_json: bool, wide: bool, root: str, runtime_dir: str | None) -> None:
    """List CPUs, NUMA nodes, caches, memory, GPUs and Neuron devices, and which Kiln process
    holds which cores and devices."""
    from kiln.observe import ls as ls_mod
    from kiln.observe.inventory import inventory

    inv = inventory(root, runtime_dir)
    if as_json:
        click.echo(json.dumps(inv, indent=1))
    else:
        ls_mod.console().print(ls_mod.render(inv, wide))


@click.command("top")
@click.option("--once", is_flag=True, help="print one frame and exit (for scripts)")
@click.option(
    "--view",
    type=click.Choice(["processes", "graphs", "devices", "all"]),
    default="processes",
    show_default=True,
)
@click.option("--interval", default=1.0, show_default=True, help="seconds between frames")
@_ROOT
@_RUNTIME_DIR
def top(once: bool, view: str, interval: float, root: str, runtime_dir: str | None) -> None:
    """Live view of per-core utilization and every Kiln process: graphs, step, compile and
    execute time, memory.  Keys: p/g/d/a views, s sort, q quit."""
    from kiln.config import config
    from kiln.observe import ls as ls_mod
    from kiln.observe import top as top_mod

    if interval <= 0:
        raise click.BadParameter("must be > 0", param_hint="--interval")
    t = top_mod.Top(runtime_dir or config.runtime_dir, root, view)
    if once:
        ls_mod.console().print(top_mod.once(t, min(interval, 0.5)))
    else:
        top_mod.live(t, interval)


@click.command("profile", context_settings={"ignore_unknown_options": True})
@click.option("--steps", default=3, show_default=True, help="training steps to record")
@click.option("--skip", default=0, show_default=True, help="steps to run before recording")
@click.option(
    "-o", "--output", default="kiln-trace.json", show_default=True, help="Chrome trace to write"
)
@click.option("--png", default=None, help="also draw the last profiled step into this PNG")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def profile(steps: int, skip: int, output: str, png: str | None, cmd: tuple[str, ...]) -> None:
    """Run CMD under torch.profiler for a few steps; write a Chrome trace with Kiln's stages
    (record, compile, kernels, fallbacks, syncs) as named ranges, then print a summary."""
    import subprocess

    from kiln.observe.trace_summary import format_summary, summarize

    if not cmd:
        raise click.UsageError("give the command to run after --, e.g. -- python train.py")
    if steps < 1 or skip < 0:
        raise click.BadParameter("--steps must be >= 1 and --skip >= 0")
    out = Path(output).resolve()
    out.unlink(missing_ok=True)
    env = {
        **os.environ,
        "KILN_PROFILE": str(out),
        "KILN_PROFILE_STEPS": str(steps),
        "KILN_PROFILE_SKIP": str(skip),
        "KILN_MAX_STEPS": str(skip + steps),
    }
    rc = subprocess.run(list(cmd), check=False, env=env).returncode
    if not out.exists():
        raise click.ClickException(
            f"no trace written to {out} (exit {rc}): does the command import kiln and run steps?"
        )
    trace = json.loads(out.read_text())
    click.echo(format_summary(summarize(trace)))
    if png:
        from kiln.observe.trace_picture import render_step

        click.echo(f"kiln profile: {render_step(trace, png)} drawn in {png}")
    click.echo(f"kiln profile: trace of {steps} steps in {out}; exit {rc}")
    sys.exit(rc)
