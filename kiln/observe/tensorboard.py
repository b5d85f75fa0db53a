"""Kiln's metrics in TensorBoard, one point per training step.

    import kiln
    tb = kiln.tensorboard("runs/exp1")       # or KILN_TENSORBOARD_DIR=runs/exp1
    tb.writer.add_scalar("loss", loss.item(), step)   # your own scalars, same writer
    ...
    tb.close()                                # also done at exit

Written with ``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package: ``pip
install 'kiln[observe]'``).  Tags, each at global step = Kiln's step count (compile mode's
last step is written when the run ends):

    kiln/step_time_ms        wall time of the step, from the previous step's end; for step 1 from
                             its first compile (compile mode; none on the lazy device)
    kiln/compile_time_ms     time the step waited for compiles: Kiln's compiles and cache loads,
                             torch.compile's frame compiles around them (Dynamo, AOTAutograd),
                             kernel builds (kiln.metrics.compile_wait_s)
    kiln/execute_time_ms     time running compiled graphs in the step
    kiln/steps_per_s         throughput (1 / step time); kiln/samples_per_s with samples_per_step
    kiln/graphs_compiled, kiln/cache_hits_memory, kiln/cache_hits_disk, kiln/fallbacks,
    kiln/forced_syncs, kiln/recompiles   running totals
"""

from __future__ import annotations

import atexit
from typing import Any

from kiln import metrics
from kiln.config import config

_TOTALS = (
    "graphs_compiled",
    "cache_hits_memory",
    "cache_hits_disk",
    "fallbacks",
    "forced_syncs",
    "recompiles",
)


class TensorBoardMissing(ImportError):
    pass


def _summary_writer(logdir: str) -> Any:
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise TensorBoardMissing(
            "Kiln's TensorBoard logging needs the 'tensorboard' package: "
            "pip install 'kiln[observe]' (or pip install tensorboard); "
            f"or unset KILN_TENSORBOARD_DIR. ({exc})"
        ) from None
    return SummaryWriter(logdir)


class KilnTensorBoard:
    """Writes Kiln's metrics after each step into ``writer`` (a SummaryWriter)."""

    def __init__(self, logdir: str, writer: Any = None, samples_per_step: int | None = None):
        self.logdir = logdir
        self.owns_writer = writer is None
        self.writer = writer if writer is not None else _summary_writer(logdir)
        self.samples_per_step = samples_per_step
        self._prev: dict[str, Any] = metrics.snapshot()

    def log_step(self) -> None:
        snap = metrics.snapshot()
        step = snap.get("steps", 0)
        prev, self._prev = self._prev, snap
        w = self.writer
        step_s = snap["last_step_s"]  # None where the step's start is not known
        if step_s:
            w.add_scalar("kiln/step_time_ms", step_s * 1e3, step)
            w.add_scalar("kiln/steps_per_s", 1.0 / step_s, step)
            if self.samples_per_step:
                w.add_scalar("kiln/samples_per_s", self.samples_per_step / step_s, step)
        compile_s = metrics.compile_wait_s(snap) - metrics.compile_wait_s(prev)
        w.add_scalar("kiln/compile_time_ms", compile_s * 1e3, step)
        w.add_scalar("kiln/execute_time_ms", (snap["execute_s"] - prev["execute_s"]) * 1e3, step)
        for name in _TOTALS:
            w.add_scalar(f"kiln/{name}", snap.get(name, 0), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self.owns_writer:
            self.writer.close()
        else:
            self.writer.flush()


_active: KilnTensorBoard | None = None


def tensorboard(
    logdir: str | None = None, *, writer: Any = None, samples_per_step: int | None = None
) -> KilnTensorBoard | None:
    """Write Kiln's metrics per step to TensorBoard: into ``logdir`` (a new SummaryWriter), or
    into your own ``writer``.  ``kiln.tensorboard(None)`` stops.  Returns the logger; its
    ``writer`` is the SummaryWriter, for your own scalars beside Kiln's."""
    global _active
    if writer is not None and logdir is None:
        logdir = str(writer.log_dir)
    if _active is not None:
        _active.close()
        _active = None
    if not logdir:
        config.update(tensorboard_dir="")
        return None
    logger = KilnTensorBoard(logdir, writer, samples_per_step)  # raises if tensorboard is missing
    config.update(tensorboard_dir=logdir)
    _active = logger
    return logger


def on_step() -> None:
    """Step hook: log to the active logger; KILN_TENSORBOARD_DIR (or a changed
    ``config.tensorboard_dir``) opens one, an emptied one closes it."""
    want = config.tensorboard_dir
    if _active is None or _active.logdir != want:
        if not want and _active is None:
            return
        tensorboard(want or None)
    if _active is not None:
        _active.log_step()


@atexit.register
def _close() -> None:
    metrics.run_ending()  # compile mode's last step, still open, is written first
    if _active is not None:
        _active.close()
