"""The ``kiln`` command.

    kiln --help
    kiln version
    kiln cluster --help

Each area of Kiln adds its own click group here; this file only assembles them.
"""

from __future__ import annotations

import importlib

import click

# (module, attribute) of each sub-command group; a group whose module is absent is skipped.
_GROUPS = [
    ("kiln.cluster.cli", "cluster"),
    ("kiln.tools.compile_cli", "precompile"),
    ("kiln.tools.compile_cli", "explain"),
    ("kiln.distributed.cli", "run"),
    ("kiln.observe.cli", "ls"),
    ("kiln.observe.cli", "top"),
    ("kiln.observe.cli", "profile"),
]


@click.group()
def main() -> None:
    """Kiln: a training compiler and lazy accelerator runtime for PyTorch."""


@main.command()
def version() -> None:
    """Print Kiln's and torch's versions."""
    import torch

    import kiln

    click.echo(f"kiln {kiln.__version__} (torch {torch.__version__})")


def _attach() -> None:
    for mod, attr in _GROUPS:
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name == mod:
                continue
            raise
        main.add_command(getattr(m, attr))


_attach()

if __name__ == "__main__":
    main()
