"""``kiln ls --json`` and ``kiln top --once`` find a running Kiln training process: its pid, its
cores, the Neuron cores it was given, its scheduler task and its compiled graphs."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from observe_testlib import Trainer, fake_neuron, kiln_cli

from kiln.config import config


def test_ls_and_top_find_a_training_process(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    root = tmp_path / "root"
    for chip in range(2):
        fake_neuron(root, chip, cores=2, name="Trainium")
    arn = "arn:aws:ecs:us-east-1:000000000000:task/default/0123456789abcdef"
    trainer = Trainer(
        tmp_path,
        runtime,
        {"NEURON_RT_VISIBLE_CORES": "2-3", "CLUSTER_TASK_ARN": arn, "KILN_EXPLAIN_DIR": ""},
    )
    try:
        rec = trainer.record(min_steps=2)
        pid = trainer.proc.pid

        out = kiln_cli("ls", "--json", "--root", str(root), "--runtime-dir", str(runtime))
        assert out.exit_code == 0, out.output
        inv = json.loads(out.stdout)
        (proc,) = [p for p in inv["processes"] if p["pid"] == pid]
        assert proc["cpus"] == [trainer.cpu]
        assert inv["cpu"]["holders"][str(trainer.cpu)] == [pid]
        assert proc["task"] == arn
        assert proc["steps"] >= 2 and proc["kiln_version"]
        assert proc["graphs"], "the trainer compiled at least one graph"
        graph = proc["graphs"][0]
        assert graph["nodes"] > 0 and graph["runs"] >= 1
        assert graph["kernels"] >= 1 or config.backend != "cpp"  # the interpreter runs none
        assert graph["hash"] == rec["graphs"][0]["hash"]
        # NEURON_RT_VISIBLE_CORES=2-3 is chip 1 (2 cores per chip), not chip 0
        devices = {d["id"]: d for d in inv["devices"]}
        assert set(devices) == {"neuron0", "neuron1"}
        assert devices["neuron0"]["holders"] == [] and devices["neuron1"]["holders"] == [pid]
        assert devices["neuron1"]["core_ids"] == "2-3" and devices["neuron1"]["name"] == "trainium"

        table = kiln_cli("ls", "--wide", "--root", str(root), "--runtime-dir", str(runtime)).stdout
        row = next(line for line in table.splitlines() if line.startswith("neuron1"))
        assert re.search(rf"\b{pid}\s+{pid}\b", row), row  # held by, owner pid (--wide)
        assert "train.py" in table  # its command (--wide)

        top = kiln_cli(
            "top", "--once", "--view", "all", "--root", str(root), "--runtime-dir", str(runtime)
        )
        assert top.exit_code == 0, top.output
        frame = top.stdout
        assert "1 Kiln process" in frame
        core_line = next(
            line for line in frame.splitlines() if line.startswith(f"cpu{trainer.cpu} ")
        )
        assert f"kiln {pid}" in core_line
        proc_line = next(line for line in frame.splitlines() if line.startswith(f"{pid} "))
        assert "train.py" in proc_line
        assert graph["hash"][:16] in frame  # the graphs view lists its graphs
    finally:
        rc = trainer.stop()
    assert rc == 0
    # a normal exit removes the record: ls no longer lists the process
    assert not (runtime / f"proc-{trainer.proc.pid}.json").exists()
    after = json.loads(kiln_cli("ls", "--json", "--runtime-dir", str(runtime)).stdout)
    assert after["processes"] == []
    assert os.listdir(runtime) == []
