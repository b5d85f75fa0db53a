"""What Kiln's compile backend hands AOTAutograd: an ``OutputCode`` that PyTorch's AOTAutograd
cache can store and load, so that a new process skips AOTAutograd and Kiln's passes.

AOTAutograd caches a compiled graph when the compiler is a ``SerializableAOTDispatchCompiler``
returning an ``OutputCode`` and the cache is *bundled* (the ``OutputCode`` is pickled into the
entry instead of being looked up in Inductor's FX graph cache).  A :class:`KilnOutputCode` keeps
the Kiln graph that lowering produced (before optimization) and the output spec; loaded from the
cache, it compiles that graph through :func:`kiln.runtime.compiler.compile_graph`, whose own key
(graph hash, Kiln code, backend, passes) finds the optimized graph and the built kernels on disk.

The AOTAutograd key covers the Dynamo graph, the inputs' metadata, torch's version and configs;
:func:`cache_key_tag` adds Kiln's version and the source of the compiler and of this frontend
(lowering and decompositions change the graph an entry holds).  An entry whose payload does not
match its SHA-256 is reported with a warning and compiled again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._inductor.codecache as _inductor_codecache
from torch._functorch._aot_autograd.autograd_cache import (
    AOTAutogradCache,
    BypassAOTAutogradCache,
    FXGraphCacheMiss,
)
from torch._inductor.codecache import sha256_hash
from torch._inductor.output_code import OutputCode

from kiln import metrics
from kiln.config import config
from kiln.frontends.compile import torch_key
from kiln.frontends.compile.alias_check import first_run
from kiln.ir.graph import Graph
from kiln.runtime import steps
from kiln.runtime.cache import code_fingerprint, kiln_version
from kiln.runtime.compiler import Executable, compile_graph
from kiln.runtime.steps import Recompiles, Signature

OutSpec = list[tuple[str, Any]]


class StaleKilnGraph(FXGraphCacheMiss):
    """A compiled function holds Kiln graphs that another Kiln (version or frontend code) lowered.
    AOTAutograd's cache never serves one (the tag is in its key); a function saved with
    ``aot_compile(...).save_compiled_function`` and loaded by a newer Kiln raises this."""


@functools.lru_cache(maxsize=1)
def cache_key_tag() -> str:
    """Kiln's part of the AOTAutograd cache key: its version, the compiler's code and this
    frontend's code (fx -> Kiln lowering, decompositions, this file)."""
    h = hashlib.sha256(f"{kiln_version()}|{code_fingerprint()}".encode())
    for f in sorted(Path(__file__).resolve().parent.glob("*.py")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return "kiln-" + h.hexdigest()[:16]


# Dynamo keeps ``with torch.autocast(...)`` (enabled or not) as calls to these two functions in
# the graph, their arguments graph constants (part of the key).  AOTAutograd's cache refuses
# functions it does not know; these two only switch autocast state.
_AUTOCAST_FNS = {
    f"torch.amp.autocast_mode.{n}": torch.__version__ for n in ("_enter_autocast", "_exit_autocast")
}


def _no_backend_registration() -> None:
    """Stands in for Inductor's ``init_backend_registration`` in AOTAutograd's cache key (see
    :func:`_key_without_inductor_codegen`)."""


@contextlib.contextmanager
def _key_without_inductor_codegen() -> Iterator[None]:
    """AOTAutograd's cache key (``FxGraphHashDetails``) first registers Inductor's code generators
    for every device (``init_backend_registration``: imports of its C++, Triton, Halide, MPS...
    code generators, ~0.5 s of CPU once per process, the largest part of a warm start's cache hit
    besides Dynamo) to hash the custom passes and codegen configs of those backends.  Those
    only change what Inductor generates; a Kiln graph never goes through Inductor's code
    generation, so for Kiln's own calls the key leaves them out: no registration, and both
    tables empty (so the key is the same whether Inductor registered its backends in this
    process or not).  Module attributes of ``torch._inductor.codecache`` swapped for the length
    of a Kiln backend call, which runs under Dynamo's compile lock; restored after it."""
    names = ("init_backend_registration", "custom_backend_passes", "custom_backend_codegen_configs")
    saved = {n: getattr(_inductor_codecache, n) for n in names}
    stand_ins = dict(zip(names, (_no_backend_registration, {}, {})))
    for n in names:
        setattr(_inductor_codecache, n, stand_ins[n])
    try:
        yield
    finally:
        for n in names:
            setattr(_inductor_codecache, n, saved[n])


def _has_view_replay(entry: Any) -> bool:
    meta = getattr(entry, "runtime_metadata", None)
    infos = getattr(meta, "output_info", None) or ()
    return any(getattr(i, "view_meta_sequence", None) is not None for i in infos)


@contextlib.contextmanager
def _no_entries_with_view_replay() -> Iterator[None]:
    """An output that is a view of an intermediate or of an input is rebuilt from its base at run
    time by replaying the view ops recorded during tracing (C++ ``ViewMeta`` objects).  torch
    2.13 pickles them into the cache entry: pickling them can crash the process (SIGSEGV in
    ``AOTAutogradCache._pickle_entry``) and a loaded entry replays garbage sizes
    (``RuntimeError: invalid shape dimension -8837...``; Inductor's warm start does the same).
    For Kiln's calls such an entry is not saved (counted as ``aot_cache_skipped_view_replay``):
    the graph compiles again in the next process.  ``AOTAutogradCache.save`` swapped for the
    length of a Kiln backend call (under Dynamo's compile lock), restored after it."""
    original = AOTAutogradCache.__dict__["save"]

    def save(key: str, entry: Any, remote: bool) -> None:
        if _has_view_replay(entry):
            metrics.incr("aot_cache_skipped_view_replay")
            return None
        return original.__func__(key, entry, remote)

    AOTAutogradCache.save = staticmethod(save)  # type: ignore[method-assign]
    try:
        yield
    finally:
        AOTAutogradCache.save = original  # type: ignore[method-assign]


def takes_python_scalars(gm: torch.fx.GraphModule) -> bool:
    """Whether Dynamo passes a Python number to ``gm`` as a 0-dim tensor: a float argument that
    changed between calls (``specialize_float=False``, torch.compile's default), read back with
    ``.item()`` inside the graph.

    Such a graph must not be cached by its text (torch 2.13, pytorch/pytorch#197889): where the
    number reaches an op's scalar argument (``add(y, alpha=-lr)``, ``clamp(max=s)``,
    ``rms_norm(eps=...)``), tracing bakes in the value of the compiling call and guards on it,
    but the guard is over a symbol the cache does not keep, and the graph's text is the same for
    every value.  The next value fails the guard, recompiles, hits the first entry and computes
    silently with the old number (Inductor too).  Kiln compiles such graphs without a cache."""
    for node in gm.graph.find_nodes(op="placeholder"):
        arg = node.meta.get("grapharg")
        if arg is not None and arg.pass_arg_as_tensor and not arg.is_tensor:
            return True
    return False


@contextlib.contextmanager
def aot_cache_settings(cache: bool = True) -> Iterator[None]:
    """For the duration of one Kiln backend call: AOTAutograd's cache on (bundled entries, Kiln's
    tag in the key, ``config.disk_cache`` decides), under ``<config.cache_dir>/torch``, the backward
    compiled with the forward (one entry holds both), and a key that does not import Inductor's
    code generators (:func:`_key_without_inductor_codegen`), and no entry saved for a graph whose
    outputs are rebuilt by view replay (:func:`_no_entries_with_view_replay`).  Inductor and
    other backends are untouched.  ``cache=False``: the cache off for this call
    (:func:`takes_python_scalars`).  torch's source key, part of AOTAutograd's, comes from Kiln's
    memo where torch's files are unchanged (:mod:`kiln.frontends.compile.torch_key`)."""
    if cache:
        torch_key.prime()
    # the partitioner is not part of AOTAutograd's key (entries hold partitioned graphs)
    tag = cache_key_tag() + ("|recompute" if config.recompute else "")
    user_tag = torch.compiler.config.cache_key_tag
    old_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # AOTAutograd finds its folder through this variable at each lookup and save
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(config.cache_dir).resolve() / "torch")
    try:
        with (
            torch._functorch.config.patch(
                enable_autograd_cache=config.disk_cache and cache,
                bundled_autograd_cache=True,
                force_non_lazy_backward_lowering=True,
            ),
            torch.compiler.config.patch(cache_key_tag=f"{user_tag}|{tag}" if user_tag else tag),
            torch._inductor.config.patch(
                unsafe_marked_cacheable_functions={
                    **torch._inductor.config.unsafe_marked_cacheable_functions,
                    **_AUTOCAST_FNS,
                }
            ),
            _key_without_inductor_codegen(),
            _no_entries_with_view_replay(),
        ):
            yield
    finally:
        if old_dir is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old_dir


_recompiles = Recompiles()


def signature(example_inputs: Sequence[Any]) -> Signature:
    """A compiled graph's input signature (symbolic sizes as text, so that it pickles)."""
    return Signature(
        tuple(
            (tuple(d if isinstance(d, int) else str(d) for d in x.shape), x.dtype)
            if isinstance(x, torch.Tensor)
            else type(x).__name__
            for x in example_inputs
        )
    )


def note_graph(site: str, sig: Signature) -> None:
    """A graph was compiled or loaded at ``site``: a changed signature there is a recompile."""
    _recompiles.seen(site, sig)


def make_runner(exe: Executable, out_spec: OutSpec) -> Callable[[list], list]:
    """The boxed function AOTAutograd calls: step accounting, the graph, outputs in AOT order."""
    kinds = [k for k, _ in out_spec]
    idx = [v for _, v in out_spec]
    runs: list = []  # identifies this graph's runs to kiln.runtime.steps
    first: list = [True]  # AOTAutograd's first call may run under its aliasing check (alias_check)

    def execute(args: list) -> list:
        return exe(args, steal=True)  # AOTAutograd hands the list over (boxed convention)

    def run(args: list) -> list:
        steps.graph_run(runs)  # step boundaries and KILN_MAX_STEPS (kiln.runtime.steps)
        t0 = time.perf_counter()
        if first:
            first.clear()
            outs = first_run(exe.graph, execute, args)
        else:
            outs = execute(args)
        args.clear()
        metrics.executed(time.perf_counter() - t0)
        return [outs[v] if k == "out" else v for k, v in zip(kinds, idx)]

    run._boxed_call = True  # type: ignore[attr-defined]
    run.kiln_executable = exe  # type: ignore[attr-defined]
    return run


class KilnOutputCode(OutputCode):
    """A compiled graph for AOTAutograd: Kiln's executable, or (``fallback``) the ATen graph when
    Kiln could not take it; only the former is cached."""

    def __init__(
        self,
        graph: Graph | None,
        out_spec: OutSpec,
        run: Callable[[list], list],
        site: str = "",
        sig: Signature | None = None,
        fallback_reason: str = "",
        fell: dict[str, int] | None = None,
    ) -> None:
        """``fell``: the ATen fallbacks lowering ``graph`` counted, per op (counted again when
        the entry is loaded, as a cold compile counts them)."""
        super().__init__()
        self._boxed_call = True
        self._run: Callable[[list], list] | None = run
        self._fallback_reason = fallback_reason
        self._payload = b""
        self._digest = ""
        self._kiln_tag = cache_key_tag()  # which Kiln lowered the graph
        if graph is not None:
            self._payload = pickle.dumps(
                (graph, out_spec, site, sig, dict(fell or {})), protocol=pickle.HIGHEST_PROTOCOL
            )
            self._digest = hashlib.sha256(self._payload).hexdigest()

    @classmethod
    def fallback(cls, run: Callable[[list], list], reason: str) -> KilnOutputCode:
        """The ATen graph, run as it is (Kiln could not take it): never cached."""
        return cls(None, [], run, fallback_reason=reason)

    def __call__(self, inputs: Sequence[Any]) -> Any:
        assert self._run is not None, "KilnOutputCode called before post_compile"
        return self._run(inputs)  # type: ignore[arg-type]

    def prepare_for_serialization(self) -> None:
        if not self._payload:
            raise BypassAOTAutogradCache(f"Kiln ran this graph as ATen ({self._fallback_reason})")
        self._run = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_run"] = None
        return state

    def post_compile(
        self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any
    ) -> None:
        """Loaded from the cache: check the payload, then build (Kiln's caches: no passes, no g++)."""
        if self._run is not None:
            return
        if hashlib.sha256(self._payload).hexdigest() != self._digest:
            dropped = _drop_corrupt_entries()
            warnings.warn(
                "Kiln: corrupt entry in the compile cache (AOTAutograd's) (payload checksum mismatch); "
                f"removed {len(dropped)} damaged file(s) {dropped}, compiling this graph again"
            )
            metrics.incr("aot_cache_corrupt")
            # a miss, not a bypass: AOTAutograd compiles and saves a fresh entry
            raise FXGraphCacheMiss("corrupt Kiln payload")
        if getattr(self, "_kiln_tag", None) != cache_key_tag():
            metrics.incr("aot_cache_stale")
            raise StaleKilnGraph(
                f"Kiln: this compiled function holds graphs lowered by another Kiln "
                f"({getattr(self, '_kiln_tag', 'unknown')}; this one is {cache_key_tag()}): "
                "compile it again with this Kiln (torch.compile(..., backend='kiln')) and save "
                "it anew"
            )
        graph, out_spec, site, sig, fell = pickle.loads(self._payload)
        if site and sig is not None:
            note_graph(site, sig)
        metrics.fallbacks_again(fell)  # the ops the lowering left to ATen, counted as cold
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            exe = compile_graph(graph)
        metrics.incr("aot_cache_hits")
        self._run = make_runner(exe, out_spec)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


def _drop_corrupt_entries() -> list[str]:
    """Remove AOTAutograd cache files whose content no longer hashes to their name (AOTAutograd
    names each entry file by the SHA-256 of its content)."""
    root = Path(AOTAutogradCache._get_tmp_dir())
    dropped = []
    for f in root.glob("*/*"):
        if f.name.startswith(".") or not f.is_file():
            continue
        try:
            if sha256_hash(f.read_bytes()) != f.name:
                f.unlink()
                dropped.append(str(f))
        except FileNotFoundError:  # removed by another process meanwhile
            continue
    return dropped
