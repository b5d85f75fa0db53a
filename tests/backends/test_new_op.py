"""Adding an op a backend can generate is one record plus one kernel template: ``sinc`` (an ATen
op Kiln has no record for) gets a record and a C++ formula, and is then lowered as a Kiln op,
fused with its neighbours and run by the generated kernel, matching eager."""

from __future__ import annotations

import pytest
import torch

from kiln.codegen.cpp.ops import register_formula, unregister_formula
from kiln.config import config
from kiln.ir import GraphBuilder, In, Node, TensorType
from kiln.ir.ops import Category, defop, undefop
from kiln.lowering.aten import op_name
from kiln.runtime.compiler import clear_memory_cache, compile_graph


@pytest.fixture
def sinc():
    saved = (config.backend, config.disk_cache)
    defop("sinc", Category.ELEMENTWISE)  # the record: ATen's sinc is the reference
    register_formula(  # the kernel template, as ATen's CPU kernel computes it
        "sinc.default",
        "(({x}) == ({t})0 ? ({t})1 : km::sin(({t})3.14159265358979323846 * ({x})) "
        "/ (({t})3.14159265358979323846 * ({x})))",
    )
    config.update(backend="cpp", disk_cache=False)
    clear_memory_cache()
    yield
    undefop("sinc")
    unregister_formula("sinc.default")
    config.update(backend=saved[0], disk_cache=saved[1])
    clear_memory_cache()


def _graph(shape):
    t = TensorType(shape, torch.float32)
    b = GraphBuilder()
    x = b.input(t)
    y = b.input(t)
    s = b.add(Node("sinc.default", (x,), (In(0),), (), (t,)))
    z = b.add(Node("mul.Tensor", (s, y), (In(0), In(1)), (), (t,)))
    return b.build([z])


def test_before_the_record_sinc_is_an_aten_fallback():
    assert op_name(torch.ops.aten.sinc.default) == ("opaque.aten::sinc.default", False)


@pytest.mark.parametrize("shape", [(0,), (7,), (64, 257)])
def test_a_new_pointwise_op_is_fused_and_run(sinc, shape):
    assert op_name(torch.ops.aten.sinc.default) == ("sinc.default", True)
    exe = compile_graph(_graph(shape))
    fused = [n for n in exe.graph.nodes if n.op == "fused"]
    assert len(fused) == 1 and len(exe.graph.nodes) == 3  # two inputs, one kernel
    assert exe.info["backend"] == "cpp" and len(exe.info["kernels"]) == 1
    x = torch.randn(shape) * 3
    if x.numel():
        x.view(-1)[0] = 0.0  # sinc(0) = 1
    y = torch.randn(shape)
    (out,) = exe([x, y])
    torch.testing.assert_close(out, torch.sinc(x) * y, rtol=1e-5, atol=1e-6)
