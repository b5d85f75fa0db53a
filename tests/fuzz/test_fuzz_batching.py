"""The batched fuzz run's bookkeeping (``check_cases`` / ``_bisect``), with a stand-in for the
compile/lazy run: a failing batch is narrowed to the programs at fault, a failure seen only in
the whole batch is counted as ``batch_only``, and a batch whose graph went to ATen is re-checked
in parts.  (The real batch path runs in the long fuzz run; this keeps the logic tested in CI in
milliseconds.)"""

from __future__ import annotations

import test_fuzz as tf
from fuzz_programs import Program


def _cases(n: int) -> list[tf.Case]:
    return [tf.Case(Program(), i, None, None, None, None) for i in range(n)]  # type: ignore[arg-type]


def _stats(monkeypatch) -> dict:
    stats = {k: 0 for k in tf.STATS}
    monkeypatch.setattr(tf, "STATS", stats)
    monkeypatch.setattr(tf, "LOG", "")
    monkeypatch.setattr(tf, "MODES", ["compile", "lazy"])
    return stats


def test_a_failing_batch_is_narrowed_to_its_program(monkeypatch) -> None:
    stats = _stats(monkeypatch)
    runs: list[int] = []

    def fake(mode, part):
        runs.append(len(part))
        return [[f"{mode}: off"] if c.data_seed == 5 else [] for c in part], False

    monkeypatch.setattr(tf, "_check_mode", fake)
    bad = tf.check_cases(_cases(8))
    assert bad == [[], [], [], [], [], ["compile: off", "lazy: off"], [], []]
    assert stats["mismatches"] == 1 and stats["batch_reruns"] == 2 and stats["batch_only"] == 0
    assert stats["programs"] == 8
    # per mode: the batch, then halves down to the program (8, 4+4, 2+2, 1+1), not 8 singles
    assert sorted(runs) == sorted([8, 4, 4, 2, 2, 1, 1] * 2)


def test_a_failure_only_in_the_whole_batch_is_counted_as_batch_only(monkeypatch) -> None:
    stats = _stats(monkeypatch)

    def fake(mode, part):
        return [["off"] if len(part) == 6 else [] for _ in part], False

    monkeypatch.setattr(tf, "_check_mode", fake)
    assert tf.check_cases(_cases(6)) == [[]] * 6
    assert stats["batch_only"] == 2 and stats["mismatches"] == 0


def test_a_batch_left_to_aten_is_checked_in_parts(monkeypatch) -> None:
    stats = _stats(monkeypatch)
    checked_alone: list[int] = []

    def fake(mode, part):
        if len(part) == 1:
            checked_alone.append(part[0].data_seed)
            return [["off"] if part[0].data_seed == 2 else []], False
        return [[] for _ in part], True  # the whole graph went to ATen: nothing was checked

    monkeypatch.setattr(tf, "_check_mode", fake)
    bad = tf.check_cases(_cases(4))
    assert bad == [[], [], ["off", "off"], []]
    assert sorted(checked_alone) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert stats["batch_only"] == 0
