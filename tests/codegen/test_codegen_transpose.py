"""Kiln's transposing-copy kernel (kiln/codegen/cpp/transpose.py) against ATen's ``t_copy``: the
values are moved, never computed, so every element must be ATen's, over full 32 x 32 tiles,
partial tiles at both edges, single rows and columns, zero-size and non-contiguous inputs, on
both executors (outputs NaN-poisoned on the Python one, so a skipped element fails)."""

from __future__ import annotations

import pytest
import torch
from kiln_codegen_testlib import poison_outputs

import kiln
from kiln.codegen.cpp import build
from kiln.ir.graph import GraphBuilder, In, Node, TensorType
from kiln.ir.kernel import OutKind

SHAPES = [(64, 96), (1024, 256), (33, 65), (1, 1), (1, 300), (300, 1), (7, 1024), (1000, 250)]


def _graph(shape: tuple):
    b = GraphBuilder()
    x = b.input(TensorType(shape, torch.float32))
    out = b.add(
        Node("t_copy.default", (x,), (In(0),), (), (TensorType(shape[::-1], torch.float32),))
    )
    return b.build([out])


def test_output_kind_swaps_the_last_two_dims():
    assert OutKind.TRANS.shape((5, 7)) == (7, 5)
    assert OutKind.TRANS.shape((2, 5, 7)) == (2, 7, 5)


@pytest.mark.parametrize("launcher", [True, False])
def test_transposing_copy_is_atens(monkeypatch, launcher):
    saved = kiln.config.launcher
    kiln.config.update(launcher=launcher)
    try:
        if not launcher:
            poison_outputs(monkeypatch)
        run, info = build(_graph((64, 96)))
        assert [k["kind"] for k in info["kernels"]] == ["transpose"]
        for shape in SHAPES + [(0, 40), (40, 0), (0, 0)]:
            x = torch.randn(shape)
            (got,) = run([x])
            assert got.is_contiguous() and got.shape == (shape[1], shape[0])
            assert torch.equal(got, x.t()), shape
        # non-contiguous inputs: the kernel reads a contiguous copy
        for x in (torch.randn(96, 200)[:, 5:105], torch.randn(80, 64).t()):
            (got,) = run([x])
            assert torch.equal(got, x.t())
    finally:
        kiln.config.update(launcher=saved)


def test_other_dtypes_stay_on_aten():
    b = GraphBuilder()
    x = b.input(TensorType((8, 4), torch.float64))
    out = b.add(Node("t_copy.default", (x,), (In(0),), (), (TensorType((4, 8), torch.float64),)))
    run, info = build(b.build([out]))
    assert info["kernels"] == []
    xv = torch.randn(8, 4, dtype=torch.float64)
    assert torch.equal(run([xv])[0], xv.t())


@pytest.mark.parametrize("isa", ["native", "no-avx512", "no-avx"])
def test_each_instruction_set_path(tmp_path, isa):
    """The kernel's three paths (16 x 16 AVX-512 blocks, 8 x 8 AVX blocks, element by element),
    each compiled on its own (the backend builds only this machine's) and checked against ATen."""
    import ctypes
    import shutil
    import subprocess

    from kiln.codegen.cpp.transpose import emit_t_copy

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    g = _graph((64, 96))
    src, _ = emit_t_copy("kiln_t", g.nodes[1], [g.nodes[0].types[0]])
    (tmp_path / "t.cpp").write_text("#include <cstdint>\n" + src)
    flags = {"native": [], "no-avx512": ["-mno-avx512f"], "no-avx": ["-mno-avx"]}[isa]
    so = tmp_path / "t.so"
    cmd = ["g++", "-O2", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC"]
    subprocess.run([*cmd, str(tmp_path / "t.cpp"), "-o", str(so)], check=True)
    fn = ctypes.CDLL(str(so)).kiln_t
    for shape in [(64, 96), (1000, 250), (33, 65), (1, 300), (0, 7)]:
        x = torch.randn(shape)
        y = torch.full((shape[1], shape[0]), float("nan"))
        ptrs = (ctypes.c_void_p * 2)(x.data_ptr(), y.data_ptr())
        fn(ptrs, (ctypes.c_int64 * 2)(*shape), (ctypes.c_double * 1)(0.0))
        assert torch.equal(y, x.t()), (isa, shape)
