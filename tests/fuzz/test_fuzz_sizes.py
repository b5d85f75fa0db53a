"""The fuzzer's ``lazy-sizes`` check: a program rebuilt at other sizes keeps its form, the check
makes the lazy device compile shape-generic graphs and reuse them, and it reports a generic graph
that errs or computes a wrong value (planted here)."""

from __future__ import annotations

from typing import Any

import pytest
import test_fuzz as tf
from fuzz_programs import Program, drawn_sizes, programs, resized, size_plan
from hypothesis import HealthCheck, given, seed, settings

from kiln.frontends.lazy import dynamic


def _draw_programs(n: int, at: int) -> list[Program]:
    """``n`` fixed programs (hypothesis seed ``at``) that have a size >= 2 to move."""
    got: list[Program] = []

    @seed(at)
    @settings(max_examples=20 * n, database=None, suppress_health_check=list(HealthCheck))
    @given(programs())
    def draw(p: Program) -> None:
        if len(got) < n and any(s >= 2 for s in drawn_sizes(p)):
            got.append(p)

    draw()
    assert len(got) == n
    return got


def _cases(progs: list[Program]) -> list[tf.Case]:
    cases = []
    for i, p in enumerate(progs):
        c = tf._prepare(p, i, size_plan(p, i))
        if c is not None:
            cases.append(c)
    assert len(cases) >= len(progs) // 2
    return cases


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> dict:
    s = {k: 0 for k in tf.STATS}
    monkeypatch.setattr(tf, "STATS", s)
    monkeypatch.setattr(tf, "LOG", "")
    monkeypatch.setattr(tf, "MODES", ["lazy-sizes"])
    dynamic.clear()
    return s


def test_resized_moves_tied_sizes_together() -> None:
    progs, rebuilt = _draw_programs(30, 7), 0
    for p in progs:
        assert resized(p, {}).source == p.source  # no size moved: the very program
        moved = {s: s + 3 for s in drawn_sizes(p) if s >= 2}
        q = resized(p, moved)
        if q is None:  # a choice drawn only at some sizes (e.g. GQA needs an even head count)
            continue
        rebuilt += 1
        assert len(q.inputs) == len(p.inputs) and q.lines != []
        assert any(a.shape != b.shape for a, b in zip(p.inputs, q.inputs))
        for a, b in zip(p.inputs, q.inputs):
            assert len(a.shape) == len(b.shape)
        # the rebuilt program is one eager runs at its new sizes whenever it ran the old one
        if tf._prepare(p, 0, []) is not None:
            assert tf._prepare(q, 0, []) is not None, (p.describe(), q.describe())
    assert rebuilt >= len(progs) * 3 // 4


def test_size_plans_move_every_size_and_are_reproducible() -> None:
    for i, p in enumerate(_draw_programs(20, 11)):
        plan = size_plan(p, i)
        assert plan == size_plan(p, i) and 2 <= len(plan) <= 3
        big = [s for s in drawn_sizes(p) if s >= 2]
        for m in (plan[0], plan[-1]):
            assert [a for a, _ in m] == big and all(b >= 2 and b != a for a, b in m)


def test_sizes_compile_and_reuse_a_generic_graph(stats: dict) -> None:
    cases = _cases(_draw_programs(6, 3))
    bad = tf.check_cases(cases)
    assert bad == [[] for _ in cases]
    assert stats["sizes_runs"] >= len(cases)
    assert stats["generic_graphs"] > 0 and stats["generic_reuses"] > 0, stats


def _generic_graphs() -> list[Any]:
    return [g for fam in dynamic._families.values() for _, g in fam.generics]


def test_sizes_report_a_generic_graph_that_raises(stats: dict, monkeypatch) -> None:
    real = dynamic.choose

    def planted(g: Any) -> tuple[Any, list[int]]:
        gen, values = real(g)
        if values:
            raise RuntimeError("planted: the generic graph failed")
        return gen, values

    monkeypatch.setattr(dynamic, "choose", planted)
    cases = _cases(_draw_programs(6, 5))
    bad = tf.check_cases(cases)
    found = [m for b in bad for m in b if "planted" in m]
    assert any(m.startswith("lazy-sizes[") for m in found), bad
    assert stats["mismatches"] > 0


def test_sizes_report_a_generic_graph_with_a_wrong_value(stats: dict, monkeypatch) -> None:
    def planted(compile_graph: Any) -> Any:
        def compile_(g: Any) -> Any:
            exe = compile_graph(g)
            if not any(g is x for x in _generic_graphs()):
                return exe

            def run(values: list) -> list:
                out = list(exe(values))
                k = next(i for i, t in enumerate(out) if t.is_floating_point() and t.numel())
                out[k] = out[k] * 1.5 + 1.0  # a wrong value, from the generic graph only
                return out

            return run

        return compile_

    # both recorders compile a cut through lazy.dynamic.compiled
    monkeypatch.setattr(dynamic, "compile_graph", planted(dynamic.compile_graph))
    cases = _cases(_draw_programs(6, 13))
    bad = tf.check_cases(cases)
    assert any(m.startswith("lazy-sizes[") for b in bad for m in b), bad
    assert stats["mismatches"] > 0
