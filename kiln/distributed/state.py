"""What the launcher told this worker (set by :mod:`kiln.distributed.worker`)."""

from __future__ import annotations

# backend: the process-group backend ``kiln run --backend`` chose ("auto" when not launched by
# it); cpus: this worker's cores, as a list string ("0-1").
LAUNCH: dict[str, str] = {"backend": "auto", "cpus": ""}
