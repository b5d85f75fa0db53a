"""The state record: written atomically at step boundaries (rate-limited), private, removed at
exit; stale and foreign records ignored; step boundaries of both frontends."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kiln import metrics
from kiln.config import ConfigError, from_env
from kiln.observe.publish import FORMAT, Publisher, PublishWarning, record_path
from kiln.observe.records import read_records
from kiln.runtime import steps


def test_record_written_atomically_and_removed(tmp_path: Path) -> None:
    d = tmp_path / "run"
    pub = Publisher(str(d), interval_s=3600)
    pub.tick()
    pub.tick()  # within the interval: no second write
    assert pub.writes == 1
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert sorted(os.listdir(d)) == [f"proc-{os.getpid()}.json"]  # no temporary file left
    rec = json.loads(record_path(d, os.getpid()).read_text())
    assert rec["format"] == FORMAT and rec["pid"] == os.getpid()
    assert rec["cpus"] == sorted(os.sched_getaffinity(0))
    assert rec["create_time"] == pytest.approx(psutil.Process().create_time())
    assert {"steps", "counters", "graphs", "step_s_median", "threads", "task"} <= set(rec)
    assert [r["pid"] for r in read_records(d)] == [os.getpid()]
    pub.write()  # an explicit write replaces the record in place
    assert pub.writes == 2 and len(os.listdir(d)) == 1
    pub.remove()
    assert os.listdir(d) == []


def test_unwritable_directory_warns_once_and_training_goes_on(tmp_path: Path) -> None:
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)  # writable by others: records could be forged there
    pub = Publisher(str(d))
    with pytest.warns(PublishWarning, match="KILN_RUNTIME_DIR"):
        pub.tick()
    assert pub.failed and os.listdir(d) == []
    pub._next = 0.0
    pub.tick()  # no second warning, no exception
    assert pub.writes == 0


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_and_foreign_records_are_ignored(tmp_path: Path, caplog) -> None:
    d = tmp_path
    live = Publisher(str(d))
    live.write()
    dead = record_path(d, _dead_pid())
    dead.write_text(json.dumps({"format": FORMAT, "pid": int(dead.stem[5:]), "create_time": 1.0}))
    reused = d / "proc-1.json"  # pid 1 lives, but started at another time than recorded
    reused.write_text(json.dumps({"format": FORMAT, "pid": 1, "create_time": 12345.0}))
    corrupt = d / "proc-999999.json"
    corrupt.write_text("{not json")
    recs = read_records(d)
    assert [r["pid"] for r in recs] == [os.getpid()]
    assert not dead.exists() and not reused.exists()  # stale: cleaned up
    assert corrupt.exists() and "unreadable" in caplog.text  # not ours to judge: left, logged
    live.remove()


def test_step_hooks_and_compile_mode_boundaries() -> None:
    calls: list[int] = []

    def hook() -> None:
        calls.append(metrics.get("steps"))

    metrics.reset()
    steps._ran.clear()  # (graphs an earlier test of this process ran)
    metrics.on_step(hook)
    try:
        fw, bw, opt = object(), object(), object()
        for _ in range(3):  # three iterations of forward, backward, optimizer graphs
            for g in (fw, bw, opt):
                steps.graph_run(g)
        # a step ends when its first graph runs again: 2 ends seen, the 3rd is still open
        assert calls == [1, 2]
        # each with a time: step 1's from its first graph (no frame compile noted a start)
        assert len(metrics.snapshot()["step_s"]) == 2
        metrics.run_ending()  # the run ends: the open step is the third
        assert calls == [1, 2, 3]
    finally:
        metrics.remove_step_hook(hook)
        steps._ran.clear()


def test_the_record_is_gone_when_compile_modes_last_step_ends_at_exit(tmp_path: Path) -> None:
    """At exit the record goes, and compile mode's last step, still open, ends (atexit functions
    run in either order): it ends first and writes nothing after the record is removed."""
    metrics.reset()
    steps._ran.clear()
    pub = Publisher(str(tmp_path / "run"), interval_s=0.0)
    metrics.on_step(pub.tick)
    try:
        steps.graph_run(object())  # a compile-mode step, open
        pub.write()
        assert pub.path.exists()
        pub.remove()  # at exit...
        metrics.run_ending()  # ...and the open step's end, where it comes after
        assert metrics.get("steps") == 1
        assert not pub.path.exists()
    finally:
        metrics.remove_step_hook(pub.tick)
        steps._ran.clear()


def test_config_fields() -> None:
    cfg = from_env({"KILN_PUBLISH": "0", "KILN_RUNTIME_DIR": "/x", "KILN_PROFILE_STEPS": "2"})
    assert (cfg.publish, cfg.runtime_dir, cfg.profile_steps) == (False, "/x", 2)
    with pytest.raises(ConfigError, match="profile_steps"):
        from_env({"KILN_PROFILE_STEPS": "0"})
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    expected = f"{xdg}/kiln" if xdg else f"/tmp/kiln-{os.getuid()}"
    assert from_env({}).runtime_dir == expected
