"""The ``torch.compile`` backend.

    import kiln, torch
    step = torch.compile(step, backend="kiln")     # or: step = kiln.compile(step)

Dynamo captures the Python code, AOTAutograd splits it into forward and backward ATen graphs with
the min-cut partitioner Inductor uses (the backward recomputes cheap pointwise values instead of
the forward saving them; ``KILN_RECOMPUTE=0`` saves them all), torch's core decompositions reduce
the op set, and each graph is lowered to Kiln IR, optimized and compiled through the shared caches.
AOTAutograd's own cache holds the lowered graphs (:mod:`kiln.frontends.compile.aot_cache`), so a
new process with the same cache runs neither AOTAutograd's tracing nor Kiln's passes again.
A graph that needs no autograd (the optimizer step, compiled on its own; a model under
``no_grad``) skips AOTAutograd: it is recorded once on fake tensors
(:mod:`kiln.frontends.compile.inference`; ``KILN_DISABLE_PASSES=direct_inference`` hands it to
AOTAutograd as before), and Kiln's own cache keeps its kernels.
A graph Kiln cannot take at all runs as the ATen graph Dynamo gave it, counted in the metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from functorch.compile import make_boxed_func
from torch._decomp import core_aten_decompositions
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._subclasses.fake_tensor import unset_fake_temporarily

from kiln import metrics
from kiln.config import config
from kiln.frontends.compile import compile_time
from kiln.frontends.compile.aot_cache import (
    KilnOutputCode,
    OutSpec,
    aot_cache_settings,
    cache_key_tag,
    make_runner,
    note_graph,
    signature,
    takes_python_scalars,
)
from kiln.frontends.compile.attention import attention_to_sdpa
from kiln.frontends.compile.autograd_parts import detached_across_parts
from kiln.frontends.compile.dropout import drop_zero_dropout
from kiln.frontends.compile.frame_gc import cyclic_gc_paused
from kiln.frontends.compile.frame_gc import install as _pause_gc_in_frame_compiles
from kiln.frontends.compile.fx import UnsupportedGraph, fx_to_kiln
from kiln.frontends.compile.gqa import sdpa_gqa
from kiln.frontends.compile.inference import INFERENCE_FOLDER, Declined, Recorded, try_compile
from kiln.frontends.compile.known_breaks import install as _compile_known_breaks_at_once
from kiln.frontends.compile.log_only import install as _skip_log_only_work
from kiln.frontends.compile.logger_calls import install as _move_logging_calls
from kiln.frontends.compile.optimizer_forms import install as _optimizer_forms
from kiln.frontends.compile.optimizer_trace import install as _quiet_optimizer_trace
from kiln.frontends.compile.options import compile_options
from kiln.frontends.compile.partition import (
    min_cut_keeping_mutated_reads,
    saving_all_but_checkpointed,
)
from kiln.frontends.compile.short_attention import sdpa_to_chain
from kiln.frontends.compile.strided_matmul import strided_matmuls
from kiln.ir.graph import Graph
from kiln.ir.ops import keep_whole_ops
from kiln.lowering.decompositions import DECOMPOSITIONS
from kiln.lowering.foreach import FOREACH_DECOMPOSITIONS
from kiln.runtime.cache import DiskCache
from kiln.runtime.compiler import compile_graph
from kiln.runtime.steps import call_site, stack_trace_frames


def _site(gm: torch.fx.GraphModule) -> str:
    """The user's line the graph comes from (its first node with a stack trace)."""
    for n in gm.graph.nodes:
        st = n.meta.get("stack_trace")
        site = call_site("compile", stack_trace_frames(st)) if st else None
        if site is not None:
            return site
    return f"compile:{gm.__class__.__name__}"


def _no_donated_buffers() -> None:
    """Tell AOTAutograd that Kiln's backward donates none of the saved tensors' buffers.

    AOTAutograd lists saved tensors a backward may overwrite ("donated buffers", an Inductor
    memory reuse) and then refuses ``backward(retain_graph=True)`` for a backward compiled before
    its first run, as Kiln compiles it (one cache entry holds both): ``l1.backward(retain_graph=
    True); l2.backward()`` through a compiled step raised, where Inductor, which compiles the
    backward at that first run, drops the list.  Kiln's kernels never write into saved tensors,
    so the list is empty."""
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None and ctx.fw_metadata is not None:
        ctx.fw_metadata.bw_donated_idxs = []


def _kiln_compiler(
    gm: torch.fx.GraphModule, example_inputs: list, kind: str = "forward"
) -> KilnOutputCode:
    """``kind``: which of AOTAutograd's graphs this is (``forward``, ``backward``, ``inference``).
    Each kind is its own recompile site: an eval loop under ``no_grad`` (an inference graph)
    after training (forward and backward graphs) is not a recompile of the training graphs."""
    _no_donated_buffers()
    # a different graph with the same input signature at one site is not a recompile
    site, sig = _site(gm) + f"#{kind}#{len(example_inputs)}", signature(example_inputs)
    note_graph(site, sig)
    try:
        with metrics.fallbacks_counted() as fell:  # the lowering's: a cache hit counts them again
            g, out_spec = fx_to_kiln(gm)
    except UnsupportedGraph as e:
        metrics.fallback(f"graph:{e}")
        return KilnOutputCode.fallback(make_boxed_func(gm.forward), str(e))
    # AOTAutograd may call us inside an active FakeTensorMode; Kiln compiles (constant folding,
    # kernel checks) on real tensors.
    with unset_fake_temporarily():
        exe = compile_graph(g)
    return KilnOutputCode(g, out_spec, make_runner(exe, out_spec), site, sig, fell=fell)


def _direct_lower(gm: Recorded) -> tuple[Graph, OutSpec]:
    """The recorded ATen graph -> Kiln's graph and output spec (a graph Kiln cannot take is
    declined: AOTAutograd and the ATen fallback take it as before)."""
    try:
        return fx_to_kiln(gm)  # type: ignore[arg-type] - it reads only gm.graph
    except UnsupportedGraph as e:
        raise Declined(f"Kiln cannot take it: {e}") from e


def _direct_builder(
    gm: torch.fx.GraphModule,
) -> Callable[[tuple[Graph, OutSpec], list], Callable[[list], list]]:
    """Kiln's compile of a graph recorded from ``gm`` without AOTAutograd (see
    :mod:`kiln.frontends.compile.inference`), through the shared caches."""

    def build(lowered: tuple[Graph, OutSpec], inputs: list) -> Callable[[list], list]:
        g, out_spec = lowered
        note_graph(_site(gm) + f"#inference#{len(inputs)}", signature(inputs))
        return make_runner(compile_graph(g), out_spec)

    return build


# Ops kept whole (their records say ``keep_whole``, kiln/ir/ops.py says why): not decomposed.
_KEEP = tuple(
    getattr(pkt, o)
    for pkt in (getattr(torch.ops.aten, n) for n in keep_whole_ops())
    for o in pkt.overloads()
)
# torch's table, Kiln's own entries (kiln/lowering/decompositions.py) in place of some, and
# foreach ops as their per-element ops (kiln/lowering/foreach.py)
_DECOMPS = {
    k: v
    for k, v in {
        **core_aten_decompositions(),
        **DECOMPOSITIONS,
        **FOREACH_DECOMPOSITIONS,
    }.items()
    if k not in _KEEP
}


def _aot_backend(options: dict[str, Any]) -> Callable:
    """AOTAutograd around Kiln's compiler, made afresh for each Dynamo graph: AOTAutograd wraps
    the backward compiler of a SerializableAOTDispatchCompiler in place on every call, so one
    shared instance would nest a wrapper per compiled graph (RecursionError after a few hundred).
    ``options`` (torch.compile's, see :mod:`kiln.frontends.compile.options`) are in force for
    each of its compiles, also a backward AOTAutograd compiles at its first run."""

    def compiler(kind: str) -> SerializableAOTDispatchCompiler:
        def kiln_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> KilnOutputCode:
            with config.scoped(**options):
                return _kiln_compiler(gm, example_inputs, kind)

        return SerializableAOTDispatchCompiler(KilnOutputCode, kiln_compiler)

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        decompositions=_DECOMPS,
        # what the forward saves for backward: Inductor's choice (recompute cheap pointwise work,
        # save less) or AOTAutograd's default (save every value backward reads)
        partition_fn=min_cut_keeping_mutated_reads
        if config.recompute
        else saving_all_but_checkpointed,
        # in-place updates of inputs (the optimizer's parameters and state) stay in the graph as
        # copy_ nodes -> Kiln ``writeback`` nodes, so kernels can write the new values in place
        keep_inference_input_mutations=True,
    )


# Calls that only switch autocast state: Dynamo keeps a ``with torch.autocast(...)`` block as
# these two, also in a graph where nothing else is left (a graph break inside the block).
_AUTOCAST_SWITCHES = (
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
)


def _computes_nothing(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` calls nothing but autocast switches (no tensor op, no module, no method)."""
    return all(
        n.op in ("placeholder", "output", "get_attr")
        or (n.op == "call_function" and n.target in _AUTOCAST_SWITCHES)
        for n in gm.graph.nodes
    )


# the lazy device's type (kiln.frontends.lazy.tensor.DEVICE; the frontends do not import each other)
_LAZY_DEVICE = "kiln"


def kiln_backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    """Dynamo's graph -> graph-level rewrites (``dropout`` with p=0 -> its input, see
    :mod:`kiln.frontends.compile.dropout`; hand-written attention -> SDPA, see
    :mod:`kiln.frontends.compile.attention`; SDPA over short keys -> the chain, see
    :mod:`kiln.frontends.compile.short_attention`; repeated k/v heads -> grouped-query SDPA, see
    :mod:`kiln.frontends.compile.gqa`) -> AOTAutograd, with AOTAutograd's cache on for Kiln
    (see :mod:`kiln.frontends.compile.aot_cache`): a new process skips AOTAutograd and Kiln's
    passes.  The rewrites run first, so the cache key is that of the rewritten graph.  The cyclic
    garbage collector pauses for the call (:func:`frame_gc.cyclic_gc_paused`).  torch.compile's
    ``options`` are Kiln config keys in force for this graph's compiles, its ``mode`` is
    Inductor's (see :mod:`kiln.frontends.compile.options`).  The first call stops Dynamo's
    optimizer tracing from importing Inductor for CPU tensors
    (:mod:`kiln.frontends.compile.optimizer_trace`), and skips work Dynamo does only for logs
    and metrics no one records (:mod:`kiln.frontends.compile.log_only`).  The compile time it and
    Dynamo take goes to Kiln's metrics (:mod:`kiln.frontends.compile.compile_time`)."""
    _install_trace_wrappers()
    compile_time.frame_began()
    with compile_time.backend_call():
        return _kiln_backend(gm, example_inputs, **kwargs)


def _kiln_backend(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Callable:
    options = compile_options(kwargs)
    if any(isinstance(x, torch.Tensor) and x.device.type == _LAZY_DEVICE for x in example_inputs):
        # a step on the kiln device (the model moved there): the device records what the graph
        # runs and compiles it at mark_step, as torch.compile's XLA backend leaves XLA tensors to
        # the XLA device (AOTAutograd cannot trace them: its fake tensors do not take them)
        metrics.incr("lazy_device_graphs")
        return gm.forward
    # paused already where Dynamo's frame compile is (frame_gc), not where a caller runs the
    # backend itself
    with cyclic_gc_paused(), config.scoped(**options):
        if "dropout" not in config.disabled_passes:
            drop_zero_dropout(gm)
        if "attention" not in config.disabled_passes:
            attention_to_sdpa(gm)
        if "gqa" not in config.disabled_passes:
            sdpa_gqa(gm)
        if "short_attention" not in config.disabled_passes:
            sdpa_to_chain(gm)
        if "strided_matmul" not in config.disabled_passes:
            strided_matmuls(gm)
        if torch.is_grad_enabled() and detached_across_parts(gm):
            # outputs of separate autograd graphs (a GAN step): AOTAutograd would make them one
            # node, whose backward the first loss.backward() frees (autograd_parts.py)
            metrics.fallback("graph:separate autograd graphs")
            return gm.forward
        if _computes_nothing(gm):
            # runs as the Python Dynamo wrote (its autocast switches, its outputs): AOTAutograd's
            # wrappers and an empty Kiln graph cost ~0.1 ms a call and do nothing here (GPT-2's
            # step ran two such graphs a step: the autocast block around its loss, split by the
            # loss's graph break)
            metrics.incr("trivial_graphs")
            return gm.forward
        # a graph whose text is the same for every value of a Python number it takes is compiled
        # without the caches keyed on that text (takes_python_scalars: a stale value otherwise)
        cache = config.disk_cache and not takes_python_scalars(gm)
        if config.disk_cache and not cache:
            metrics.incr("cache_skipped_python_scalars")
        if "direct_inference" not in config.disabled_passes:
            direct = try_compile(
                gm,
                example_inputs,
                _DECOMPS,
                _direct_lower,
                _direct_builder(gm),
                DiskCache(config.cache_dir, INFERENCE_FOLDER) if cache else None,
                cache_key_tag(),
            )
            if direct is not None:
                return direct
        with aot_cache_settings(cache):
            return _aot_backend(options)(gm, example_inputs, **kwargs)


def _install_trace_wrappers() -> None:
    """Dynamo-side wrappers: two skip work whose result goes unused and change no trace; for
    Kiln's frames only, one makes a library's logging call after the graph instead of breaking it
    (``logger_calls.py``), one compiles ``loss.backward()``'s graph break without re-tracing the
    frame (``known_breaks.py``), one pauses the cyclic collector while a frame compiles
    (``frame_gc.py``), one traces torch's per-tensor optimizer loops as list ops
    (``optimizer_forms.py``)."""
    _quiet_optimizer_trace()
    _skip_log_only_work()
    _move_logging_calls(_is_kiln_backend)
    _compile_known_breaks_at_once(_is_kiln_backend)
    _pause_gc_in_frame_compiles(_is_kiln_backend)
    _optimizer_forms(_is_kiln_backend)


def _is_kiln_backend(compiler_fn: Any) -> bool:
    """Whether Dynamo's compiler for a frame is Kiln's backend, through the wrappers
    ``torch.compile`` puts around it (``WrapBackendDebug``, ``_TorchCompileWrapper``)."""
    for _ in range(8):
        if compiler_fn is kiln_backend:
            return True
        compiler_fn = (
            getattr(compiler_fn, "_torchdynamo_orig_backend", None)
            or getattr(compiler_fn, "compiler_fn", None)
            or getattr(compiler_fn, "__wrapped__", None)
        )
        if compiler_fn is None:
            return False
    return False


class _OnLookup:
    """Kiln's name in Dynamo's backend registry until ``torch.compile(backend="kiln")`` first
    looks it up.  The registry holds an entry point per name it has not loaded yet
    (``torch._dynamo.backends.registry._BACKENDS``) and calls its ``load()`` at that lookup, which
    ``torch.compile`` makes when it is called, before Dynamo traces anything.  Loading installs
    the trace wrappers (:func:`_install_trace_wrappers`) and returns the backend, which the
    registry then keeps.  So the frames Dynamo traces before Kiln's backend first runs (the
    model's forward) get them too, and a process that imports Kiln but never names its backend
    keeps torch as it is.  ``import kiln`` puts this object in the registry; the package's
    entry point (``pyproject.toml``, for processes that did not import Kiln, and the one the
    registry reads when it scans entry points) names its ``backend`` attribute, which loads the
    same way."""

    name = "kiln"
    group = "torch_dynamo_backends"
    value = f"{__name__}:registry_entry.backend"

    @property
    def backend(self) -> Callable:
        _install_trace_wrappers()
        return kiln_backend

    def load(self) -> Callable:
        return self.backend


registry_entry = _OnLookup()


def _register() -> None:
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS

    if "kiln" not in _BACKENDS and "kiln" not in _COMPILER_FNS:
        _BACKENDS["kiln"] = registry_entry  # type: ignore[assignment]


def compile(model_or_fn: Any = None, **kwargs: Any) -> Any:
    """``kiln.compile(f)`` = ``torch.compile(f, backend="kiln")``; keyword arguments pass through."""
    if model_or_fn is None:
        return lambda f: compile(f, **kwargs)
    _install_trace_wrappers()
    return torch.compile(model_or_fn, backend="kiln", **kwargs)
