"""Running a test's program in a fresh Python process, without this process's Kiln settings."""

from __future__ import annotations

import os
import subprocess
import sys


def clean_env(*keep: str) -> dict[str, str]:
    """This process's environment less every ``KILN_*`` variable but those named in ``keep``."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KILN_") or k in keep}


def run_clean(*args: str, keep: tuple[str, ...] = ()) -> str:
    """``python *args`` in a fresh process (:func:`clean_env`); asserts it exits 0 and returns its
    standard output."""
    p = subprocess.run(
        [sys.executable, *args],
        env=clean_env(*keep),
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout
