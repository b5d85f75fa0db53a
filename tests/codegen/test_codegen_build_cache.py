"""The kernel build cache: hits, corrupted entries, parallel units, size independence."""

from __future__ import annotations

import sys

import pytest
import torch
from kiln_codegen_testlib import op, t

from kiln import metrics
from kiln.codegen.cpp import build
from kiln.codegen.cpp import fuse_claimed as fuse  # the C++ backend's fusion (its claims)
from kiln.config import config
from kiln.ir.graph import GraphBuilder, In

cbuild = sys.modules["kiln.codegen.cpp.build"]

_SRC = 'extern "C" int kiln_test_%s(int x) { return x * %d; }\n'


@pytest.fixture(autouse=True)
def _no_build_in_flight():
    """Earlier tests' background builds count in the same metrics: let them end first."""
    assert cbuild.wait_idle(600)


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


_PRELUDE = "// test prelude\n"


def _kernels(*specs: tuple[str, int]) -> dict:
    return {f"kiln_test_{n}": (_SRC % (n, m), (f"kiln_test_{n}",)) for n, m in specs}


def test_kernel_built_in_one_unit_is_loaded_from_it_by_the_next(tmp_path, monkeypatch):
    """A kernel already built (in any unit) is not compiled again: a later set of kernels loads
    it from that unit and compiles only its new kernels, in this process and, through the on-disk
    index, in a new one; an index entry that names a missing or corrupted unit is rebuilt."""
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    builds = metrics.get("kernel_builds")
    first = cbuild.build_kernels(_kernels(("ka", 2), ("kb", 3)), _PRELUDE, 8)
    assert metrics.get("kernel_builds") == builds + 1  # one unit for both
    assert first["kiln_test_ka"] is first["kiln_test_kb"]
    reused = metrics.get("kernels_reused")
    second = cbuild.build_kernels(_kernels(("ka", 2), ("kc", 5)), _PRELUDE, 8)
    assert metrics.get("kernel_builds") == builds + 2  # only kc compiled
    assert metrics.get("kernels_reused") == reused + 1
    assert second["kiln_test_ka"] is first["kiln_test_ka"]
    assert not hasattr(second["kiln_test_kc"], "kiln_test_ka")  # the new unit holds kc alone
    assert second["kiln_test_ka"].kiln_test_ka(4) == 8
    assert second["kiln_test_kc"].kiln_test_kc(4) == 20
    # a new process (empty in-memory tables): every kernel found through the index
    cbuild.forget_loaded()
    third = cbuild.build_kernels(_kernels(("kc", 5), ("kb", 3), ("ka", 2)), _PRELUDE, 8)
    assert metrics.get("kernel_builds") == builds + 2
    assert [third[f"kiln_test_{n}"][f"kiln_test_{n}"](1) for n in ("ka", "kb", "kc")] == [2, 3, 5]
    # the same source after another prelude is another kernel
    cbuild.build_kernels(_kernels(("ka", 2)), "// other prelude\n", 8)
    assert metrics.get("kernel_builds") == builds + 3
    # an index entry naming a unit that is gone, or garbage: built again, the entry replaced
    index = tmp_path / "kernels" / "index"
    key_b = cbuild.kernel_key(_PRELUDE, _SRC % ("kb", 3))
    (index / key_b).write_text("0" * 32)
    key_c = cbuild.kernel_key(_PRELUDE, _SRC % ("kc", 5))
    (index / key_c).write_text("not a key\n")
    cbuild.forget_loaded()
    again = cbuild.build_kernels(_kernels(("kb", 3), ("kc", 5)), _PRELUDE, 8)
    assert metrics.get("kernel_builds") == builds + 4
    assert (
        again["kiln_test_kb"].kiln_test_kb(2) == 6 and again["kiln_test_kc"].kiln_test_kc(2) == 10
    )
    assert (index / key_b).read_text() == (index / key_c).read_text() != "0" * 32


def test_many_new_kernels_split_into_two_units(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    builds = metrics.get("kernel_builds")
    libs = cbuild.build_kernels(_kernels(*[(f"s{i}", i) for i in range(5)]), _PRELUDE, 2)
    assert metrics.get("kernel_builds") == builds + 2
    assert len({id(lib) for lib in libs.values()}) == 2
    assert [libs[f"kiln_test_s{i}"][f"kiln_test_s{i}"](3) for i in range(5)] == [0, 3, 6, 9, 12]


def test_long_kernel_source_splits_into_units_of_about_equal_size(tmp_path, monkeypatch):
    """Few kernels but much source: two units, the longest kernel alone in one (g++ time grows
    with the source), the short ones together; every kernel callable from its unit."""
    monkeypatch.setattr(config, "cache_dir", str(tmp_path))
    pad = "// " + "x" * 4000 + "\n"
    kernels = _kernels(("l0", 2), ("l1", 3), ("l2", 4))
    src, syms = kernels["kiln_test_l0"]
    kernels["kiln_test_l0"] = (pad * 3 + src, syms)  # ~12,000 characters
    kernels["kiln_test_l1"] = (pad + kernels["kiln_test_l1"][0], ("kiln_test_l1",))
    builds = metrics.get("kernel_builds")
    libs = cbuild.build_kernels(kernels, _PRELUDE, 8, 10_000)
    assert metrics.get("kernel_builds") == builds + 2
    assert libs["kiln_test_l1"] is libs["kiln_test_l2"] is not libs["kiln_test_l0"]
    assert [libs[f"kiln_test_l{i}"][f"kiln_test_l{i}"](5) for i in range(3)] == [10, 15, 20]
    cbuild.forget_loaded()
    again = cbuild.build_kernels(kernels, _PRELUDE, 8)  # no size rule: found in the index
    assert metrics.get("kernel_builds") == builds + 2
    assert again["kiln_test_l0"].kiln_test_l0(1) == 2
