"""Kernels compiled in build threads: the backend returns before g++ ends, the first run waits;
a build takes its unit's lock when it starts and releases it when it ends, whatever the graph's
first run does (processes sharing one cache never wait for each other's first run)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from kiln import metrics
from kiln.codegen.cpp.build import BuildError, PendingUnit
from kiln.codegen.cpp.deferred import Deferred
from kiln.config import config

cbuild = sys.modules["kiln.codegen.cpp.build"]

_SRC = 'extern "C" int kiln_bg_%s(int x) { return x * %d; }\n'


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    assert cbuild.wait_idle(600)  # earlier tests' background builds count in the same metrics
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    cbuild.forget_loaded()
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()


def _landed(pending: PendingUnit, timeout: float = 120.0) -> None:
    """Poll (without waiting on the build) until the build thread is done."""
    t0 = time.monotonic()
    while pending.running:
        assert time.monotonic() - t0 < timeout, "the build never ended"
        time.sleep(0.02)


def test_unit_lands_and_a_warm_cache_starts_nothing(fresh_cache):
    src = _SRC % ("w", 4)
    builds = metrics.get("kernel_builds")
    (pending,) = cbuild.start_many([src])
    assert isinstance(pending, PendingUnit)  # started, the caller goes on
    lib = pending.wait()
    assert lib.kiln_bg_w(3) == 12
    assert metrics.get("kernel_builds") == builds + 1
    assert not list(fresh_cache.glob("kernels/.*"))  # no temporary file left
    cbuild.forget_loaded()
    (again,) = cbuild.start_many([src])
    assert not isinstance(again, PendingUnit)  # a hit: loaded at once, nothing started
    assert again.kiln_bg_w(2) == 8
    assert metrics.get("kernel_builds") == builds + 1


def test_build_lands_indexes_and_unlocks_without_being_waited_for(fresh_cache):
    """Nothing in this process waits for the build: it still lands, lists its kernels in the
    index and releases its lock, and another process sharing the cache loads it, no rebuild."""
    kernels = {f"kiln_bg_{n}": (_SRC % (n, m), (f"kiln_bg_{n}",)) for n, m in (("p", 3), ("q", 5))}
    pending = cbuild.start_kernels(kernels, "// prelude\n", 8)
    (unit,) = {u for u, _ in pending._libs.values()}
    _landed(unit)
    key = unit.key
    kdir = fresh_cache / "kernels"
    assert cbuild._valid(kdir / f"{key}.so")
    index = sorted(p.read_text() for p in (kdir / "index").iterdir())
    assert index == [key, key]
    other = textwrap.dedent(
        f"""
        import sys
        from filelock import FileLock
        import kiln.codegen.cpp
        from kiln import metrics
        build = sys.modules["kiln.codegen.cpp.build"]
        FileLock({str(kdir / f"{key}.lock")!r}, timeout=5).acquire()  # free: the build let it go
        kernels = {kernels!r}
        libs = build.build_kernels(kernels, "// prelude\\n", 8)
        assert libs["kiln_bg_q"].kiln_bg_q(2) == 10
        print(metrics.get("kernel_builds"), metrics.get("kernels_reused"))
        """
    )
    env = {**os.environ, "KILN_CACHE_DIR": str(fresh_cache)}
    out = subprocess.run(
        [sys.executable, "-c", other],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0", "2"]
    assert pending.wait()["kiln_bg_p"].kiln_bg_p(2) == 6


def test_a_kernel_in_flight_is_shared_not_built_twice(fresh_cache):
    kernels = {"kiln_bg_s": (_SRC % ("s", 7), ("kiln_bg_s",))}
    builds = metrics.get("kernel_builds")
    first = cbuild.start_kernels(kernels, "// prelude\n", 8)
    second = cbuild.start_kernels(kernels, "// prelude\n", 8)  # the first may still be building
    assert first.wait()["kiln_bg_s"] is second.wait()["kiln_bg_s"]
    assert metrics.get("kernel_builds") == builds + 1
    assert second.wait()["kiln_bg_s"].kiln_bg_s(3) == 21


def test_forked_child_builds_what_its_parent_had_in_flight(fresh_cache):
    (pending,) = cbuild.start_many([_SRC % ("fork", 6)])
    pid = os.fork()
    if pid == 0:  # the child: the build thread is not here; waiting builds it (or finds it)
        code = 1
        try:
            code = 0 if pending.wait().kiln_bg_fork(2) == 12 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pending.wait().kiln_bg_fork(3) == 18


def test_starting_gxx_opens_no_pipe_a_forked_child_could_keep(fresh_cache, monkeypatch):
    """subprocess starts a child through a pipe it reads to its end; a process forked by another
    thread meanwhile kept the write end, and the build thread waited for that child forever (the
    child was waiting for the build).  The build starts g++ without one."""

    def no_pipe(*args, **kwargs):
        raise AssertionError("a pipe was opened while starting g++")

    monkeypatch.setattr(os, "pipe", no_pipe)
    monkeypatch.setattr(os, "pipe2", no_pipe, raising=False)
    (pending,) = cbuild.start_many([_SRC % ("nopipe", 5)])
    assert pending.wait().kiln_bg_nopipe(3) == 15


def test_children_forked_as_builds_start_never_wait_forever(fresh_cache):
    """Fork at once after builds start (the window in which subprocess's pipe leaked into the
    child: 9 of 30 such forks hung before); every child and the parent get their kernels."""
    for i in range(4):
        (pending,) = cbuild.start_many([_SRC % (f"race{i}", 7)])
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = 0 if getattr(pending.wait(), f"kiln_bg_race{i}")(2) == 14 else 2
            finally:
                os._exit(code)
        t0 = time.monotonic()
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - t0 > 120:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail(f"fork {i}: the child still waited for its kernel after 120 s")
            time.sleep(0.02)
        assert os.waitstatus_to_exitcode(status) == 0
        assert getattr(pending.wait(), f"kiln_bg_race{i}")(3) == 21


def test_failed_gxx_raises_at_every_wait(fresh_cache):
    (pending,) = cbuild.start_many(['extern "C" int kiln_bg_bad( { return }\n'])
    for _ in range(2):
        with pytest.raises(BuildError, match="g\\+\\+ failed for kernel unit"):
            pending.wait()
    assert not list(fresh_cache.glob("kernels/*.so"))
    assert not list(fresh_cache.glob("kernels/.*"))
    lock = next(fresh_cache.glob("kernels/*.lock"))
    from filelock import FileLock

    FileLock(str(lock), timeout=5).acquire()  # released after the failure


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = torch.nn.functional.gelu(model[0](x)) * 1.5 + 0.25
    torch._dynamo.graph_break()  # two graphs: the second is traced while the first compiles
    return (torch.tanh(model[1](h)) ** 2).sum()


def test_graphs_compiled_while_dynamo_traces_equal_eager(fresh_cache, monkeypatch):
    made = []
    real_init = Deferred.__init__

    def spy(self, make):
        made.append(self)
        real_init(self, make)

    monkeypatch.setattr(Deferred, "__init__", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    ref = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    ref.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(7, 33).t().contiguous().t()  # non-contiguous
    compiled = torch.compile(_step, backend="kiln")
    for xs in (x, x[:1], x[:0]):  # odd, size-1 and empty batches
        loss = compiled(model, xs)
        loss.backward()
        want = _step(ref, xs)
        want.backward()
        torch.testing.assert_close(loss, want)
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
        opt.zero_grad()
        ref_opt.zero_grad()
    assert made  # graphs returned before their g++ finished


def test_gxx_failure_in_a_compiled_step_raises_a_build_error(fresh_cache, monkeypatch):
    monkeypatch.setattr(cbuild, "CXX", "false")
    monkeypatch.setattr(cbuild, "_toolchain_id", lambda: "false-compiler")
    compiled = torch.compile(lambda a: torch.sigmoid(a) * 3.0 + a, backend="kiln")
    with pytest.raises(BuildError, match="g\\+\\+ failed"):
        compiled(torch.randn(4, 5))
