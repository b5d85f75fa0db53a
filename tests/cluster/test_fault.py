"""Issue 15 fault test (short CI version of ``fault_load.py``)."""

from __future__ import annotations

from fault_load import run


def test_kill_9_of_server_agent_and_tasks_under_load(tmp_path):
    figures = run(seconds=10, seed=1, workers=3, work_root=str(tmp_path))
    print(figures)
    assert figures["devices_held_by_stopped_tasks"] == 0
    assert figures["processes_of_stopped_tasks_alive"] == 0
    assert figures["double_assignments"] == 0
    assert sum(figures["faults"].values()) >= 2
    assert figures["calls"] > 0
