"""Reading the state records Kiln processes publish (:mod:`kiln.observe.publish`).

A record counts only while its process lives: the pid must exist and have started when the record
says (a pid reused by another program does not match).  Stale records are ignored and, when they
are ours to remove, removed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import psutil

from kiln.observe.publish import FORMAT

log = logging.getLogger(__name__)


def _alive(rec: dict[str, Any]) -> bool:
    try:
        started = psutil.Process(int(rec["pid"])).create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # another user's live process
    return abs(started - float(rec.get("create_time", started))) < 1.0


def read_records(directory: str | os.PathLike, clean: bool = True) -> list[dict[str, Any]]:
    """Records of the live Kiln processes in ``directory``, by pid.  Unreadable or foreign-format
    files are skipped (logged); stale ones are removed when ``clean``."""
    d = Path(directory)
    try:
        paths = sorted(d.glob("proc-*.json"))
    except OSError as exc:
        log.debug("cannot list %s: %s", d, exc)
        return []
    out = []
    for p in paths:
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue  # removed by its process just now
        except (OSError, ValueError) as exc:
            log.warning("skipping unreadable Kiln state record %s: %s", p, exc)
            continue
        if not isinstance(rec, dict) or rec.get("format") != FORMAT or "pid" not in rec:
            log.warning("skipping %s: not a Kiln state record of format %d", p, FORMAT)
            continue
        if not _alive(rec):
            if clean:
                try:
                    p.unlink()
                except OSError as exc:
                    log.debug("cannot remove stale record %s: %s", p, exc)
            continue
        out.append(rec)
    return sorted(out, key=lambda r: r["pid"])
