"""Shared helpers: a Kiln training process to observe, fake Neuron sysfs trees, a fake NVML."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

# A lazy-device training loop that runs until the stop file exists, then exits normally.
TRAIN = textwrap.dedent(
    """
    import os, sys, time, torch, kiln
    os.sched_setaffinity(0, {int(os.environ["TEST_CPU"])})
    torch.set_num_threads(1)  # one core: more OpenMP threads would only contend
    dev = kiln.device()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16).to(dev), torch.randn(8, 4).to(dev)
    stop = sys.argv[1]
    while not os.path.exists(stop):
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step(); opt.zero_grad()
        kiln.mark_step()
        time.sleep(0.02)
    """
)


def kiln_cli(*args: str) -> Any:
    """``kiln ARGS`` through click's runner (in this process: no second torch import)."""
    from click.testing import CliRunner

    from kiln.tools.cli import main

    return CliRunner().invoke(main, list(args), catch_exceptions=False)


class Trainer:
    """The training loop above as a subprocess, publishing into ``runtime_dir``."""

    def __init__(self, tmp: Path, runtime_dir: Path, env: dict[str, str]) -> None:
        script = tmp / "train.py"
        script.write_text(TRAIN)
        self.stop_file = tmp / "stop"
        self.runtime_dir = runtime_dir
        self.cpu = min(os.sched_getaffinity(0))
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(self.stop_file)],
            env={
                **os.environ,
                "KILN_RUNTIME_DIR": str(runtime_dir),
                "TEST_CPU": str(self.cpu),
                **env,
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def record(self, min_steps: int = 2, timeout_s: float = 240.0) -> dict[str, Any]:
        """Wait for the trainer's published record to show ``min_steps`` steps."""
        path = self.runtime_dir / f"proc-{self.proc.pid}.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"trainer exited early:\n{self.proc.stdout.read()}")
            if path.exists():
                rec = json.loads(path.read_text())
                if rec["steps"] >= min_steps:
                    return rec
            time.sleep(0.2)
        raise AssertionError(f"no record with {min_steps} steps in {path} after {timeout_s} s")

    def stop(self) -> int:
        self.stop_file.touch()
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def fake_neuron(root: Path, index: int, cores: int = 2, name: str | None = None) -> None:
    entry = root / "sys/class/neuron_device" / f"neuron{index}"
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "core_count").write_text(f"{cores}\n")
    if name is not None:
        (entry / "info/architecture").mkdir(parents=True, exist_ok=True)
        (entry / "info/architecture/device_name").write_text(name + "\n")
    (root / "dev").mkdir(exist_ok=True)
    (root / "dev" / f"neuron{index}").touch()


class _NVMLError(Exception):
    pass


def fake_pynvml(gpus: int = 2, processes: dict[int, list[int]] | None = None) -> types.ModuleType:
    """A ``pynvml`` module with ``gpus`` H100s; GPU 1 does not report utilization."""
    m = types.ModuleType("pynvml")
    m.NVMLError = _NVMLError  # type: ignore[attr-defined]
    m.nvmlInit = lambda: None  # type: ignore[attr-defined]
    m.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    m.nvmlDeviceGetCount = lambda: gpus  # type: ignore[attr-defined]
    m.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    m.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"  # type: ignore[attr-defined]
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{h:04d}"  # type: ignore[attr-defined]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        total=80 * 2**30, used=(h + 1) * 2**30
    )

    def util(h: int) -> Any:
        if h == 1:
            raise _NVMLError("Not Supported")
        return types.SimpleNamespace(gpu=37, memory=5)

    m.nvmlDeviceGetUtilizationRates = util  # type: ignore[attr-defined]
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        busId=f"00000000:{h + 0x10:02X}:00.0".encode()
    )
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        types.SimpleNamespace(pid=pid, usedGpuMemory=512 * 2**20)
        for pid in (processes or {}).get(h, [])
    ]
    return m
