"""A picture of one profiled step: a PNG timeline of a Chrome trace (``kiln profile --png``).

One row per nesting depth on the step's thread, time left to right; Kiln's ranges in colour
(record blue, mark_step/sync grey, compile orange, graph green, kernels bright green, fallbacks
red), PyTorch's ``aten::`` ops light grey, everything else lavender.  Needs Pillow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLOURS = {
    "kiln::record": (91, 143, 214),
    "kiln::mark_step": (150, 150, 150),
    "kiln::sync": (120, 120, 120),
    "kiln::compile": (240, 150, 40),
    "kiln::graph": (60, 160, 80),
    "kiln::kernel": (120, 220, 90),
    "kiln::fallback": (220, 60, 60),
    "kiln::observe": (180, 130, 200),
    "kiln::settle_heap": (200, 200, 90),
}
ATEN = (215, 215, 215)
OTHER = (200, 190, 235)
ROW, WIDTH, MARGIN, MAX_ROWS = 22, 1400, 10, 10


def _colour(name: str) -> tuple[int, int, int]:
    head = name.split(" ", 1)[0]
    if head in COLOURS:
        return COLOURS[head]
    return ATEN if name.startswith("aten::") else OTHER


def _rows(events: list[dict]) -> list[tuple[int, dict]]:
    """(depth, event) by nesting: an event inside an open one goes one row below it."""
    out: list[tuple[int, dict]] = []
    ends: list[float] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while ends and ends[-1] <= e["ts"]:
            ends.pop()
        out.append((len(ends), e))
        ends.append(e["ts"] + e["dur"])
    return out


def render_step(trace: dict[str, Any], path: str | Path, step: str | None = None) -> str:
    """Draw ``step`` (a ``ProfilerStep#N`` name; default: the last one) into ``path``; returns
    the step drawn.  ValueError if the trace has no such step."""
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError as exc:
        raise ImportError(
            "a trace picture needs Pillow: pip install 'kiln[observe]' (or pip install pillow)"
        ) from exc
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("the trace has no ProfilerStep ranges (was it written by kiln profile?)")
    pick = (
        max(steps, key=lambda e: int(e["name"].split("#")[1]))
        if step is None
        else next((e for e in steps if e["name"] == step), None)
    )
    if pick is None:
        raise ValueError(f"no {step} in the trace; it has {', '.join(e['name'] for e in steps)}")
    a, b = pick["ts"], pick["ts"] + pick["dur"]
    inside = [  # clipped to the step: kiln::record starts at the previous step's cut
        {**e, "ts": max(e["ts"], a), "dur": min(e["ts"] + e["dur"], b) - max(e["ts"], a)}
        for e in events
        if e.get("tid") == pick.get("tid") and e["ts"] < b and e["ts"] + e["dur"] > a
    ]
    scale = (WIDTH - 2 * MARGIN) / max(b - a, 1.0)
    rows = [(d, e) for d, e in _rows(inside) if d < MAX_ROWS and e["dur"] * scale >= 1]
    depth = max((d for d, _ in rows), default=0) + 1
    img = Image.new("RGB", (WIDTH, 2 * MARGIN + (depth + 1) * ROW), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=12)
    for d, e in rows:
        x0 = MARGIN + (e["ts"] - a) * scale
        x1 = max(x0 + 1, MARGIN + (e["ts"] + e["dur"] - a) * scale)
        y0 = MARGIN + d * ROW
        draw.rectangle([x0, y0, x1, y0 + ROW - 3], fill=_colour(e["name"]), outline="white")
        label = f"{e['name']} {e['dur'] / 1e3:.1f} ms"
        if draw.textlength(label, font=font) < x1 - x0 - 4:
            draw.text((x0 + 2, y0 + 4), label, fill="black", font=font)
    x, y = MARGIN, MARGIN + depth * ROW + 4
    for name, colour in [*COLOURS.items(), ("aten::", ATEN), ("other", OTHER)]:
        draw.rectangle([x, y, x + 12, y + 12], fill=colour)
        draw.text((x + 16, y), name, fill="black", font=font)
        x += 24 + draw.textlength(name, font=font)
    img.save(path)
    return pick["name"]
