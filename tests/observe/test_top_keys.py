"""``kiln top``'s views and keys, on this test process's own record."""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from kiln.observe.publish import Publisher
from kiln.observe.top import SORTS, Top, short_command


def _text(top: Top) -> str:
    console = Console(width=200, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(top.frame())
    return console.export_text()


def test_views_sort_and_quit(tmp_path: Path) -> None:
    pub = Publisher(str(tmp_path))
    pub.write()
    try:
        top = Top(str(tmp_path))
        frame = _text(top)
        assert "1 Kiln process" in frame and "view processes, sort cpu" in frame
        assert any(line.startswith(f"{os.getpid()} ") for line in frame.splitlines())
        assert top.key("g") and "GRAPH" in _text(top) and "STEPS/s" not in _text(top)
        assert top.key("d")
        devices = _text(top)
        assert "no accelerators found" in devices or "DEVICE" in devices
        assert top.key("a") and top.view == "all"
        for expected in [*SORTS[1:], SORTS[0]]:
            assert top.key("s") and top.sort == expected
        assert top.key("\t") and top.view == "processes"
        assert not top.key("q")
    finally:
        pub.remove()


def test_short_command() -> None:
    argv = ["/venv/bin/python", "/home/me/train.py", "--out", "/tmp/x", "-c"]
    assert short_command(argv) == "python train.py --out x -c"
