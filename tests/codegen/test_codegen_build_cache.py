"""The kernel build cache: hits, corrupted entries, parallel units, size independence."""

from __future__ import annotations

import sys

import torch
from kiln_codegen_testlib import op, t

from kiln import metrics
from kiln.codegen.cpp import build
from kiln.config import config
from kiln.ir.graph import GraphBuilder, In
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)

cbuild = sys.modules["kiln.codegen.cpp.build"]

_SRC = 'extern "C" int kiln_test_%s(int x) { return x * %d; }\n'


def test_second_build_is_a_cache_hit(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    src = _SRC % ("hit", 3)
    builds = metrics.get("kernel_builds")
    (lib,) = cbuild.build_many([src])
    assert lib.kiln_test_hit(5) == 15
    assert metrics.get("kernel_builds") == builds + 1
    cbuild.forget_loaded()
    hits = metrics.get("kernel_cache_hits")
    (lib2,) = cbuild.build_many([src])
    assert lib2.kiln_test_hit(2) == 6
    assert metrics.get("kernel_builds") == builds + 1
    assert metrics.get("kernel_cache_hits") == hits + 1


def test_corrupted_entry_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    src = _SRC % ("corrupt", 7)
    cbuild.build_many([src])
    so = tmp_path / "kernels" / f"{cbuild.cache_key(src)}.so"
    bad = so.with_name("bad.tmp")
    bad.write_bytes(b"not an ELF file")
    bad.replace(so)  # a new inode: the library this process mapped stays intact
    cbuild.forget_loaded()
    builds = metrics.get("kernel_builds")
    (lib,) = cbuild.build_many([src])
    assert metrics.get("kernel_builds") == builds + 1
    assert so.read_bytes()[:4] == b"\x7fELF"
    assert lib.kiln_test_corrupt(3) == 21


def test_units_build_in_parallel_and_independently(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    srcs = [_SRC % (f"par{i}", i + 1) for i in range(3)]
    libs = cbuild.build_many(srcs)
    assert [getattr(lib, f"kiln_test_par{i}")(10) for i, lib in enumerate(libs)] == [10, 20, 30]
    assert len({cbuild.cache_key(s) for s in srcs}) == 3


def test_one_compiled_graph_serves_many_sizes():
    b = GraphBuilder()
    x = b.input(t(("s0", 33)))
    y = b.input(t((33,)))
    a = op(b, "add.Tensor", (x, y), (In(0), In(1)), t(("s0", 33)))
    r = op(b, "relu.default", (a,), (In(0),), t(("s0", 33)))
    s = op(b, "sum.dim_IntList", (r,), (In(0), [-1]), t(("s0",)))
    run, info = build(fuse(b.build([r, s])))
    assert len(info["kernels"]) == 1
    for n in (1, 7, 1023):
        xv, yv = torch.randn(n, 33), torch.randn(33)
        out, red = run([xv, yv])
        torch.testing.assert_close(out, torch.relu(xv + yv))
        torch.testing.assert_close(red, torch.relu(xv + yv).sum(-1))
