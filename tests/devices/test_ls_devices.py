"""``kiln ls`` shows Neuron devices from a fake sysfs tree and GPUs from a fake NVML, with the
processes holding them; a GPU query NVML does not support leaves that field empty."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.devices.nvml import GpuStatus, gpu_status
from kiln.tools.cli import main

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "observe"))
from observe_testlib import fake_neuron, fake_pynvml


def _ls(*args: str) -> dict:
    out = CliRunner().invoke(main, ["ls", "--json", *args], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    return json.loads(out.output)


def test_fake_neuron_tree(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for chip in range(3):
        fake_neuron(root, chip, cores=4)  # inf1-style chips: 4 cores each
    inv = _ls("--root", str(root), "--runtime-dir", str(tmp_path / "run"))
    assert [d["id"] for d in inv["devices"]] == ["neuron0", "neuron1", "neuron2"]
    assert [d["core_ids"] for d in inv["devices"]] == ["0-3", "4-7", "8-11"]
    assert {(d["kind"], d["cores"], d["name"]) for d in inv["devices"]} == {
        ("neuron", 4, "inferentia")
    }
    table = CliRunner().invoke(main, ["ls", "--root", str(root), "--runtime-dir", str(tmp_path)])
    assert "neuron2" in table.output and "inferentia" in table.output


def test_fake_nvml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(2, processes={0: [4242]}))
    assert gpu_status()[1] == GpuStatus(
        1, "NVIDIA H100 80GB HBM3", "GPU-0001", 81920, 2048, None, "00000000:11:00.0", []
    )
    inv = _ls("--runtime-dir", str(tmp_path))
    gpus = [d for d in inv["devices"] if d["kind"] == "gpu"]
    assert [g["id"] for g in gpus] == ["gpu0", "gpu1"]
    assert gpus[0]["utilization_pct"] == 37 and gpus[0]["memory_used_mib"] == 1024
    assert gpus[0]["processes"] == [[4242, 512]] and gpus[0]["holders"] == [4242]
    assert gpus[1]["utilization_pct"] is None and gpus[1]["holders"] == []
    table = CliRunner().invoke(main, ["ls", "--wide", "--runtime-dir", str(tmp_path)]).output
    assert "gpu1" in table and "NVIDIA H100" in table and "37%" in table


def test_nvml_absent_or_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert gpu_status() == []
    broken = fake_pynvml(1)

    def fail() -> None:
        raise broken.NVMLError("Driver Not Loaded")

    broken.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    assert gpu_status() == []
