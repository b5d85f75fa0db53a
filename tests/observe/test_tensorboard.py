"""``kiln.tensorboard(logdir)`` writes Kiln's metrics per step; TensorBoard's own reader finds the
expected tags at the expected steps, beside the user's scalars in the same writer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import kiln
from kiln.observe.tensorboard import TensorBoardMissing

TAGS = {
    "kiln/step_time_ms",
    "kiln/steps_per_s",
    "kiln/samples_per_s",
    "kiln/compile_time_ms",
    "kiln/execute_time_ms",
    "kiln/graphs_compiled",
    "kiln/cache_hits_memory",
    "kiln/cache_hits_disk",
    "kiln/fallbacks",
    "kiln/forced_syncs",
    "kiln/recompiles",
}


def _train(steps: int, tb: kiln.observe.tensorboard.KilnTensorBoard) -> None:
    dev = kiln.device()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = torch.randn(4, 8).to(dev), torch.randn(4, 1).to(dev)
    for step in range(1, steps + 1):
        loss = ((m(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        kiln.mark_step()
        tb.writer.add_scalar("user/loss", loss.item(), step)


def test_event_file_has_kiln_tags_per_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    kiln.metrics.reset()
    tb = kiln.tensorboard(str(tmp_path), samples_per_step=4)
    try:
        assert kiln.config.tensorboard_dir == str(tmp_path)
        _train(5, tb)
    finally:
        kiln.tensorboard(None)
    assert kiln.config.tensorboard_dir == ""
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert TAGS | {"user/loss"} <= set(acc.Tags()["scalars"])
    steps = [e.step for e in acc.Scalars("kiln/compile_time_ms")]
    assert steps == [1, 2, 3, 4, 5]  # one point per step (mark_step), every step
    assert [e.step for e in acc.Scalars("kiln/step_time_ms")] == [2, 3, 4, 5]  # none for step 1
    assert len(acc.Scalars("user/loss")) == 5
    assert acc.Scalars("kiln/graphs_compiled")[-1].value >= 1
    assert sum(e.value for e in acc.Scalars("kiln/compile_time_ms")) > 0
    assert all(e.value > 0 for e in acc.Scalars("kiln/step_time_ms"))
    per_s = [e.value for e in acc.Scalars("kiln/samples_per_s")]
    ms = [e.value for e in acc.Scalars("kiln/step_time_ms")]
    assert per_s == pytest.approx([4 / (t / 1e3) for t in ms], rel=1e-4)


def test_missing_tensorboard_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(TensorBoardMissing, match=r"pip install 'kiln\[observe\]'"):
        kiln.tensorboard(str(tmp_path))
    assert kiln.config.tensorboard_dir == ""  # nothing half switched on


def test_config_field_switches_logging(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    kiln.metrics.reset()
    kiln.config.update(tensorboard_dir=str(tmp_path))  # what KILN_TENSORBOARD_DIR sets
    try:
        for _ in range(3):
            kiln.metrics.step_done()
    finally:
        kiln.config.update(tensorboard_dir="")
        kiln.metrics.step_done()  # the hook sees the switch turned off: closes the writer
    acc = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("kiln/step_time_ms")] == [2, 3]
    assert [e.step for e in acc.Scalars("kiln/fallbacks")] == [1, 2, 3]
