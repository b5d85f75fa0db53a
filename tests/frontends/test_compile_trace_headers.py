"""Dynamo's location headers without tokenizing source files unless a log prints them
(kiln/frontends/compile/trace_headers.py): a training step compiled with ``kiln.compile``
tokenizes no file and gives eager's numbers; with Dynamo's ``trace_call`` log on, the log's text
is the same as in a process without the wrapper."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import torch
from _subprocess import run_json
from torch._dynamo import funcname_cache, symbolic_convert

from kiln.frontends.compile import trace_headers

SCRIPT = textwrap.dedent(
    """
    import copy, json, sys
    import torch, kiln
    import torch._dynamo.funcname_cache as funcname_cache

    if sys.argv[2] == "log":
        torch._logging.set_logs(trace_call=True)
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

    if sys.argv[1] == "kiln":
        compiled = kiln.compile(step)
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
        "losses": losses,
        "params_close": all(
            torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.parameters(), ref.parameters())
        ),
    }))
    """
)


def test_a_training_step_compiled_with_kiln_tokenizes_no_source_file(tmp_path):
    out = run_json(SCRIPT, "kiln", "quiet", KILN_CACHE_DIR=str(tmp_path / "cache"))
    # torch tokenized torch/nn/modules/linear.py, activation.py, torch/optim/*.py ... before
    assert out["tokenized"] == []
    for got, want in out["losses"]:
        assert abs(got - want) <= 1e-5 * abs(want)
    assert out["params_close"]


def _trace_call_lines(backend: str, tmp_path) -> list[str]:
    """The ``TRACE FX call`` headers Dynamo logged for SCRIPT's step (stderr), paths dropped."""
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
    return [re.sub(r"^.*TRACE FX call", "TRACE FX call", ln) for ln in lines]


def test_with_the_log_on_its_headers_are_torchs(tmp_path):
    plain = _trace_call_lines("aot_eager", tmp_path)
    wrapped = _trace_call_lines("aot_eager+wrapper", tmp_path)
    # function names found by tokenizing, as torch writes them: "... in forward (Linear.forward)"
    assert any("(Linear.forward)" in ln for ln in plain), plain[:5]
    assert wrapped == plain


def test_the_name_is_torchs_only_while_a_log_would_print_it():
    calls = []

    def original(filename: str, lineno: int) -> str:
        calls.append((filename, lineno))
        return "f.g"

    log = logging.getLogger("kiln.test.trace_headers")
    wrapped = trace_headers._wrap(original, (log,))
    log.setLevel(logging.INFO)
    assert wrapped("x.py", 3) is None and calls == []
    log.setLevel(logging.DEBUG)
    try:
        assert wrapped("x.py", 3) == "f.g" and calls == [("x.py", 3)]
    finally:
        log.setLevel(logging.NOTSET)


def test_installed_once_and_only_over_torchs_function(monkeypatch):
    name = "get_funcname"
    assert trace_headers.install()
    installed = getattr(symbolic_convert, name)
    torchs = installed.__kiln_wrapped__
    assert torchs is funcname_cache.get_funcname
    assert trace_headers.install() and getattr(symbolic_convert, name) is installed  # not nested

    monkeypatch.setattr(symbolic_convert, name, torchs)
    monkeypatch.setattr(torch, "__version__", "2.99.0")  # a torch whose tracer was not read
    assert not trace_headers.install()
    assert getattr(symbolic_convert, name) is torchs

    monkeypatch.setattr(torch, "__version__", "2.13.0")

    def someone_elses(filename: str, lineno: int) -> str:
        return "theirs"

    monkeypatch.setattr(symbolic_convert, name, someone_elses)
    assert not trace_headers.install()
    assert getattr(symbolic_convert, name) is someone_elses
