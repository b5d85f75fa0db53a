"""The ``torch.compile`` backend.

    import kiln, torch
    step = torch.compile(step, backend="kiln")     # or: step = kiln.compile(step)

Dynamo captures the Python code, AOTAutograd splits it into forward and backward ATen graphs (the
optimizer step, compiled on its own, is an inference graph), torch's core decompositions reduce the
op set, and each graph is lowered to Kiln IR, optimized and compiled through the shared caches.
A graph Kiln cannot take at all runs as the ATen graph Dynamo gave it, counted in the metrics.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from functorch.compile import make_boxed_func
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from kiln import metrics
from kiln.frontends.compile.fx import UnsupportedGraph, fx_to_kiln
from kiln.ir.ops import keep_whole_ops
from kiln.runtime import steps
from kiln.runtime.compiler import compile_graph
from kiln.runtime.steps import Recompiles, Signature, call_site, stack_trace_frames

_recompiles = Recompiles()


def _site(gm: torch.fx.GraphModule) -> str:
    """The user's line the graph comes from (its first node with a stack trace)."""
    for n in gm.graph.nodes:
        st = n.meta.get("stack_trace")
        site = call_site("compile", stack_trace_frames(st)) if st else None
        if site is not None:
            return site
    return f"compile:{gm.__class__.__name__}"


def _signature(example_inputs: list) -> Signature:
    return Signature(
        tuple(
            (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__
            for x in example_inputs
        )
    )


def _kiln_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    # a different graph with the same input signature at one site is not a recompile
    _recompiles.seen(_site(gm) + f"#{len(example_inputs)}", _signature(example_inputs))
    try:
        g, out_spec = fx_to_kiln(gm)
    except UnsupportedGraph as e:
        metrics.fallback(f"graph:{e}")
        return make_boxed_func(gm.forward)
    # AOTAutograd may call us inside an active FakeTensorMode; Kiln compiles (constant folding,
    # kernel checks) on real tensors.
    with unset_fake_temporarily():
        exe = compile_graph(g)
    kinds = [k for k, _ in out_spec]
    idx = [v for _, v in out_spec]

    runs: list = []  # identifies this graph's runs to kiln.runtime.steps

    def run(args: list) -> list:
        steps.graph_run(runs)  # step boundaries and KILN_MAX_STEPS (kiln.runtime.steps)
        t0 = time.perf_counter()
        outs = exe(args)
        args.clear()
        metrics.executed(time.perf_counter() - t0)
        return [outs[v] if k == "out" else v for k, v in zip(kinds, idx)]

    run._boxed_call = True  # type: ignore[attr-defined]
    run.kiln_executable = exe  # type: ignore[attr-defined]
    return run


# Ops kept whole (their records say ``keep_whole``, kiln/ir/ops.py says why): not decomposed.
_KEEP = tuple(getattr(torch.ops.aten, n).default for n in keep_whole_ops())
_DECOMPS = {k: v for k, v in core_aten_decompositions().items() if k not in _KEEP}

kiln_backend = aot_autograd(
    fw_compiler=_kiln_compiler,
    bw_compiler=_kiln_compiler,
    inference_compiler=_kiln_compiler,
    decompositions=_DECOMPS,
    # in-place updates of inputs (the optimizer's parameters and state) stay in the graph as
    # copy_ nodes -> Kiln ``writeback`` nodes, so kernels can write the new values in place
    keep_inference_input_mutations=True,
)


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "kiln" not in _BACKENDS:
        register_backend(name="kiln")(kiln_backend)


def compile(model_or_fn: Any = None, **kwargs: Any) -> Any:
    """``kiln.compile(f)`` = ``torch.compile(f, backend="kiln")``; keyword arguments pass through."""
    if model_or_fn is None:
        return lambda f: compile(f, **kwargs)
    return torch.compile(model_or_fn, backend="kiln", **kwargs)
