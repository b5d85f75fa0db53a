"""Fresh Python processes for the frontend tests that need one (import order, fork, caches)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def start_python(code: str, **env: str) -> subprocess.Popen:
    """``python -c code`` in a fresh process, PyTorch's device-backend autoload switch unset
    unless ``env`` sets it; stdout and stderr captured as text."""
    e = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    e.update(env)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_json(code: str, *args: str, **env: str) -> Any:
    """Run ``python -c code args...`` to the end (rc 0 required) and parse its last stdout line
    as JSON."""
    p = subprocess.run(
        [sys.executable, "-c", code, *args],
        check=False,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])
