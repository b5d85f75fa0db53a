"""Work Dynamo does only for logs and metrics, skipped while they are off
(kiln/frontends/compile/log_only.py): a training step compiled with ``kiln.compile`` tokenizes
no source file, times no guards, and gives eager's numbers; with Dynamo's ``trace_call`` log on,
the log's text is the same as in a process without the wrappers; with the ``guards`` log on, the
guard latency is measured."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from _subprocess import run_json
from torch._C._dynamo import guards as guards_c
from torch._dynamo import funcname_cache, guards, symbolic_convert

from kiln.frontends.compile import log_only

SCRIPT = textwrap.dedent(
    """
    import copy, json, sys
    import torch, kiln
    import torch._dynamo.funcname_cache as funcname_cache

    if sys.argv[2] == "log":
        torch._logging.set_logs(trace_call=True, guards=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ref = copy.deepcopy(model)
    make = lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)
    opt, ref_opt = make(model), make(ref)

    def step(m, o, x, y):
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    if sys.argv[1] == "kiln.compile":
        compiled = kiln.compile(step)
    elif sys.argv[1] == "kiln":
        compiled = torch.compile(step, backend="kiln")
    else:  # torch's backend; with "aot_eager+wrapper" in a process where Kiln installed it
        if sys.argv[1].endswith("+wrapper"):
            kiln.compile(lambda: None)
        compiled = torch.compile(step, backend="aot_eager")
    losses = []
    for i in range(3):
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
        losses.append((compiled(model, opt, x, y).item(), step(ref, ref_opt, x, y).item()))
    print(json.dumps({
        "tokenized": sorted(f.rsplit("/", 1)[-1] for f in funcname_cache.cache),
        # per frame compiled: the measured latency of its guards, 0 where not measured
        "guard_latency_us": [m.guard_latency_us for m in torch._dynamo.utils.get_compilation_metrics()],
        "losses": losses,
        "params_close": all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters())
        ),
    }))
    """
)


@pytest.mark.parametrize("api", ["kiln.compile", "kiln"])
def test_a_training_step_compiled_with_kiln_tokenizes_no_file_and_times_no_guards(tmp_path, api):
    # kiln.compile(step), torch.compile(step, backend="kiln"): the wrappers are in before Dynamo
    # traces the first frame
    out = run_json(SCRIPT, api, "quiet", KILN_CACHE_DIR=str(tmp_path / "cache"))
    # torch tokenized torch/nn/modules/linear.py, activation.py, torch/optim/*.py ... and timed
    # each frame's guards after flushing the caches
    assert out["tokenized"] == []
    assert len(out["guard_latency_us"]) >= 2 and not any(out["guard_latency_us"])
    for got, want in out["losses"]:
        assert abs(got - want) <= 1e-5 * abs(want)
    assert out["params_close"]


def _logged(backend: str, tmp_path) -> tuple[list[str], int]:
    """The ``TRACE FX call`` headers Dynamo logged for SCRIPT's step (stderr), paths dropped, and
    how many times the guards were timed."""
    p = subprocess.run(
        [sys.executable, "-c", SCRIPT, backend, "log"],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "KILN_CACHE_DIR": str(tmp_path / backend)},
    )
    assert p.returncode == 0, p.stderr[-4000:]
    lines = [ln for ln in p.stderr.splitlines() if "TRACE FX call" in ln]
    latency = json.loads(p.stdout.strip().splitlines()[-1])["guard_latency_us"]
    timed = sum(1 for us in latency if us)
    return [re.sub(r"^.*TRACE FX call", "TRACE FX call", ln) for ln in lines], timed


def test_with_the_logs_on_headers_are_torchs_and_guards_are_timed(tmp_path):
    plain, _ = _logged("aot_eager", tmp_path)
    wrapped, timed = _logged("aot_eager+wrapper", tmp_path)
    # function names found by tokenizing, as torch writes them: "... in forward (Linear.forward)"
    assert any("(Linear.forward)" in ln for ln in plain), plain[:5]
    assert wrapped == plain
    assert timed >= 2  # one per frame compiled, the guards log on


def test_torchs_answer_only_while_wanted():
    calls = []

    def original(*args: object) -> str:
        calls.append(args)
        return "f.g"

    wanted = [False]
    wrapped = log_only._wrap(original, lambda: wanted[0], None)
    assert wrapped("x.py", 3) is None and calls == []
    wanted[0] = True
    assert wrapped("x.py", 3) == "f.g" and calls == [("x.py", 3)]


def test_wanted_follows_the_loggers():
    log = logging.getLogger("kiln.test.log_only")
    log.setLevel(logging.INFO)
    try:
        assert not log_only._debug_on(log)
        log.setLevel(logging.DEBUG)
        assert log_only._debug_on(log)
    finally:
        log.setLevel(logging.NOTSET)
    trace = logging.getLogger("kiln.test.log_only.trace")
    assert not log_only._trace_on(trace)
    handler = logging.NullHandler()
    trace.addHandler(handler)
    try:
        assert log_only._trace_on(trace)
    finally:
        trace.removeHandler(handler)


def test_installed_once_and_only_over_torchs_functions(monkeypatch):
    names = [
        (symbolic_convert, "get_funcname", funcname_cache),
        (guards, "profile_guard_manager", guards_c),
    ]
    assert log_only.install()
    installed = [getattr(user, name) for user, name, _ in names]
    for (user, name, owner), w in zip(names, installed):
        assert w.__kiln_wrapped__ is getattr(owner, name)
    assert log_only.install()  # not nested
    assert [getattr(user, name) for user, name, _ in names] == installed

    for (user, name, owner), _ in zip(names, installed):
        monkeypatch.setattr(user, name, getattr(owner, name))
    monkeypatch.setattr(torch, "__version__", "2.99.0")  # a torch whose callers were not read
    assert not log_only.install()
    assert all(getattr(user, name) is getattr(owner, name) for user, name, owner in names)

    monkeypatch.setattr(torch, "__version__", "2.13.0")

    def someone_elses(*args: object) -> str:
        return "theirs"

    for user, name, _ in names:
        monkeypatch.setattr(user, name, someone_elses)
    assert not log_only.install()
    assert all(getattr(user, name) is someone_elses for user, name, _ in names)


LOOKUP = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch._dynamo import guards, symbolic_convert
    from torch._dynamo.backends.registry import list_backends

    def installed():
        return [hasattr(f, "__kiln_wrapped__")
                for f in (symbolic_convert.get_funcname, guards.profile_guard_manager)]

    steps = {"imported": None, "compile_other": None, "named": None}
    if sys.argv[1] != "entry_point":
        import kiln
    steps["imported"] = installed()
    if sys.argv[1] == "after_scan":  # the registry scanned the installed entry points first
        list_backends()
        torch.compile(lambda x: x * 2, backend="eager")(torch.ones(1))
    steps["compile_other"] = installed()
    f = torch.compile(lambda x: x + 1, backend="kiln")
    steps["named"] = installed()
    steps["value"] = f(torch.ones(2)).tolist()
    print(json.dumps(steps))
    """
)


@pytest.mark.parametrize("how", ["imported", "after_scan", "entry_point"])
def test_installed_when_torch_compile_names_kiln_not_at_import(how):
    # imported: import kiln, then torch.compile(backend="kiln"); after_scan: the registry read the
    # package's entry point first; entry_point: no import kiln at all
    out = run_json(LOOKUP, how)
    assert out["imported"] == [False, False]
    assert out["compile_other"] == [False, False]
    assert out["named"] == [True, True]  # at torch.compile, before anything is traced
    assert out["value"] == [2.0, 2.0]
