"""The one function Kiln's step path calls into observe (:func:`kiln.metrics.on_step`).

Installed when ``kiln`` is imported.  Per step, with everything at its default, it costs two
config reads and the publisher's rate-limit check; TensorBoard and the profiler are imported only
when switched on.  The profiler's step mark comes first, right after Kiln took the step's end
time, so ``ProfilerStep#N`` ranges and Kiln's step times cover the same interval; the rest runs in
a ``kiln::observe`` range of the next step.
"""

from __future__ import annotations

from kiln import metrics
from kiln.config import config
from kiln.observe import ranges  # noqa: F401 - registers the executor's profiled runner
from kiln.observe.publish import Publisher

_publisher: Publisher | None = None
_tensorboard = False
_profiling = False


def on_step() -> None:
    global _publisher, _tensorboard
    if _profiling:
        from kiln.observe import profile

        profile.on_step()
    with metrics.span("kiln::observe"):
        if config.publish:
            if _publisher is None or _publisher.directory != config.runtime_dir:
                _publisher = Publisher(config.runtime_dir)
            _publisher.tick()
        if config.tensorboard_dir or _tensorboard:
            from kiln.observe import tensorboard

            _tensorboard = True
            tensorboard.on_step()


def install() -> None:
    """Register the step hook; start a profile session if ``KILN_PROFILE`` asks for one."""
    global _profiling
    metrics.on_step(on_step)
    if config.profile and not _profiling:
        from kiln.observe import profile

        _profiling = True
        profile.start_from_config()
