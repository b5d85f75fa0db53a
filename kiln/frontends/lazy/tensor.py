"""Lazy tensors: every ATen op on them is recorded into the pending graph, not run.

A :class:`LazyTensor` is a wrapper subclass on the ``kiln`` device with no storage of its own.  It
holds a :class:`~kiln.frontends.lazy.trace.Storage` (the value it shares with its views), the chain
of view ops from that storage's base to itself, and a meta tensor with its exact geometry, which is
how shapes, dtypes and strides are inferred (by running each op on the meta device).

How each op is handled (``_dispatch``):
  view ops          no node: the result shares the storage, its chain grows by one link
  in-place ops      the functional variant is recorded, and the result written back through the
                    view chain (so every alias sees it, as in eager)
  Kiln ops          one node; float arguments lifted into scalar inputs (a new lr is no new graph)
  other ops         torch's decomposition if it has one, else an opaque node (counted)
  data-dependent    (``nonzero``, ``.item()``, ops without a meta kernel) sync, run eagerly, counted
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import core_aten_decompositions
from torch.utils._pytree import tree_flatten, tree_map

from kiln import metrics
from kiln.config import config
from kiln.frontends.lazy import (
    accelerator_dtypes,
    batch_norm,
    cpu_kernels,
    packed_sequences,
    recipes,
    rnn_cells,
)
from kiln.frontends.lazy import device_module as _devmod
from kiln.frontends.lazy import trace as T
from kiln.frontends.lazy.foreach import record_split, split_of
from kiln.frontends.lazy.memory import track, update_peak
from kiln.frontends.lazy.shapes import _map, infer_typed
from kiln.frontends.lazy.views import Link, inverse, split_links
from kiln.ir.graph import Node
from kiln.ir.ops import OPS, Category, functional_variant
from kiln.lowering.aten import Ref, lower_call, op_name, template
from kiln.lowering.decompositions import DECOMPOSITIONS as REDUCED_FLOAT_DECOMPOSITIONS

aten = torch.ops.aten
DEVICE = torch.device("kiln", 0)
_CPU = torch.device("cpu")
# torch's decompositions, as a plain dict: ``core_aten_decompositions()`` is a lazily filled
# table whose ``get`` is dict's own and finds nothing until the table is read another way (the
# lazy device used ``.get`` and so decomposed no op at all: ``select_backward`` and the like ran
# through ATen); ``items()`` fills it.
_DECOMPS: dict[Any, Any] = dict(core_aten_decompositions().items())
# Kiln's, looked up first
_OWN_DECOMPS: dict[Any, Any] = {
    **rnn_cells.DECOMPOSITIONS,
    **batch_norm.DECOMPOSITIONS,  # the running statistics native_batch_norm writes
    **accelerator_dtypes.DECOMPOSITIONS,
    **packed_sequences.DECOMPOSITIONS,
    # where torch's differ from ATen's kernels in bf16 / fp16; ops Kiln has a record for are
    # recorded whole and run by ATen (or a Kiln formula), never decomposed
    **{op: f for op, f in REDUCED_FLOAT_DECOMPOSITIONS.items() if not op_name(op)[1]},
}


def _index_put_checked(
    self: torch.Tensor,
    indices: Any,
    values: torch.Tensor,
    accumulate: bool = False,
    unsafe: bool = False,
) -> torch.Tensor:
    """``_index_put_impl_`` -- what advanced indexing's backward (``w[idx]``'s gradient, an
    accumulating write into zeros) calls -- as ``index_put_``: the same write (``unsafe`` only
    lets ATen skip its index bounds checks, which the recorded ``index_put`` keeps), recorded like
    any in-place op instead of running on ATen (a counted fallback until 2026-12-05: Swin's
    relative position bias table, Whisper's decoder positions)."""
    return aten.index_put_.default(self, indices, values, accumulate)


# In-place ops recorded as another in-place op with other arguments (the in-place path records
# an op's functional variant with the op's own arguments), by both recorders
REDIRECTS: dict[Any, Callable[..., Any]] = {aten._index_put_impl_.default: _index_put_checked}


def _wait_at_once(x: torch.Tensor) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor.default(x)


if torch.distributed.is_available():
    # Functional collectives (funcol.all_reduce, ...) wrap their result in an AsyncCollectiveTensor
    # that waits when first used (``_wrap_tensor_autograd``); while tracing they wait at once
    # instead.  A lazy step is a trace: record the wait (the wrapper, replayed, would hand the
    # graph's next kernel a tensor without storage).
    import torch.distributed._functional_collectives  # (defines the wrapper op)

    _OWN_DECOMPS[torch.ops._c10d_functional._wrap_tensor_autograd.default] = _wait_at_once

# Ops whose float arguments describe the op itself (not a value that changes per step): kept in
# the graph so passes can see them (pow(x, 2.0) -> x*x).
_STRUCTURAL_FLOATS = {
    "pow",
    "native_dropout",
    "leaky_relu",
    "elu",
    "hardtanh",
    "softplus",
    "threshold",
    "rrelu",
    "celu",
    "gelu",
    "clamp",
    "clamp_min",
    "clamp_max",
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_fused_rms_norm",
    "full",
    "fill",
    "scalar_tensor",
    "arange",
    "linspace",
    "bernoulli",
    "uniform",
    "normal_functional",
    "masked_fill",
    "nan_to_num",
}
# Ops that take CPU index tensors next to device tensors, as in eager PyTorch (x_cuda[cpu_idx]).
# Ops that take CPU tensors with dimensions next to kiln tensors (any other mix raises eager's
# mixed-device error), for both recorders: indices (as CUDA takes CPU index tensors) and
# ``_pack_padded_sequence``, whose ``lengths`` must be a CPU tensor on every device
# (packed_sequences.py).  (Copies between the devices are handled before this check.)
CPU_OPERANDS_OK = frozenset(
    {
        "index",
        "index_put",
        "index_put_",
        "_index_put_impl_",
        "_unsafe_index",
        "_pack_padded_sequence",
    }
)


class LazyTensor(torch.Tensor):
    _st: T.Storage
    _chain: tuple[Link, ...]
    _meta: torch.Tensor
    _g: recipes.Geo | None  # interned geometry of _meta, set on first use (recipes.signature)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, meta: torch.Tensor, st: T.Storage, chain: tuple = ()) -> LazyTensor:  # noqa: PYI034
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=DEVICE,
            requires_grad=False,
        )
        r._st = st
        r._chain = chain
        r._meta = meta
        r._g = None
        return r

    # ``param.data = t`` (weight initialisation, ``vector_to_parameters``, EMA copies): PyTorch
    # copies the tensor metadata (sizes, strides, dtype) but knows nothing of a kiln tensor's own
    # state, so the parameter kept its old value under the new metadata (silently).  Here the
    # lazy state comes along; autograd identity and version counter stay, as in eager.
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if not isinstance(new, LazyTensor):  # RuntimeError, as eager's device mismatch
            raise RuntimeError(  # noqa: TRY004
                f"kiln: `.data =` on a kiln tensor takes a kiln tensor, got one on {new.device}; "
                "move it first (`t.to('kiln')`)"
            )
        torch._C.TensorBase.data.__set__(self, new)  # metadata checks, as eager's
        self._st, self._chain, self._meta, self._g = new._st, new._chain, new._meta, new._g

    # Libraries that serialize state dicts (safetensors, transformers' save_pretrained) find
    # shared tensors by their storage and data pointers; a kiln tensor answers with those of the
    # host buffer it holds (pending work runs first).
    def untyped_storage(self) -> torch.UntypedStorage:
        return materialize(self, "storage").untyped_storage()

    def data_ptr(self) -> int:
        return materialize(self, "storage").data_ptr()

    def __reduce_ex__(self, protocol: int) -> tuple:
        """Pickled (``torch.save``) as the CPU tensor it holds: see lazy/serialization.py."""
        from kiln.frontends.lazy.serialization import reduce_lazy

        return reduce_lazy(self, materialize(self, "save"), protocol)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        v = materialize(self, "print")
        body = repr(v)
        return body[:-1] + f", device='{DEVICE}')" if body.endswith(")") else body

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        with T._lock:
            try:
                out = _dispatch(func, args, kwargs or {})
            except Exception as e:
                if torch._C._current_graph_task_id() == -1:
                    raise
                return _BackwardError(func, e)
            if config.eager:
                T.sync("eager")
                metrics.incr("eager_ops")
            return out


class _BackwardError:
    """Returned instead of raising when recording an op fails inside a backward pass.

    PyTorch runs the backward of kiln tensors on its autograd worker thread, where a Python
    exception leaving ``__torch_dispatch__`` is still pending when PyTorch's Python device guard
    restores its stream; the guard then calls into Python and the process aborts
    (std::terminate).  PyTorch cannot convert this object to a tensor and raises a C++ error with
    its repr -- the original error, which ``backward()`` then raises as a RuntimeError.  The
    original exception is kept in ``last_backward_error``."""

    def __init__(self, func: Any, exc: Exception) -> None:
        global last_backward_error
        last_backward_error = exc
        self.text = (
            f"[kiln] the backward pass failed on the kiln device in {func}: "
            f"{type(exc).__name__}: {exc}"
        )
        metrics.incr("backward_errors")

    def __repr__(self) -> str:
        return self.text


last_backward_error: Exception | None = None


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    """Record one op on lazy tensors (what ``__torch_dispatch__`` does), for kiln kernels."""
    return LazyTensor.__torch_dispatch__(func, (), args, kwargs)


def new_data(value: torch.Tensor) -> LazyTensor:
    """A lazy tensor that holds concrete data (its own storage)."""
    value = value.detach()
    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    st = T.Storage(meta, value)
    track(st)
    return LazyTensor(meta, st)


def _new_pending(meta: torch.Tensor, node: int) -> LazyTensor:
    st = T.Storage(meta)
    T.current().set_pending(st, node)
    return LazyTensor(meta, st)


# ---------------------------------------------------------------------------------------------
# reading and writing values


# View ops that return their input unchanged (same geometry, same value): a link of one of these
# records no node.  A ``Parameter`` made from a kiln tensor is ``data.detach()`` (torch.nn's path for
# tensor subclasses), so every read of a parameter would otherwise record a ``detach`` node, and a
# detach between two in-place updates of one parameter (AdamW's weight decay, then its update)
# split the optimizer's kernel in two with the parameter's intermediate value in memory.
# ``detach`` and ``alias`` of a lazy tensor share its storage and chain (no link at all); the
# checks in ``read`` and ``_write`` cover links made another way (``detach_``).
_IDENTITY_VIEWS = {aten.detach.default, aten.alias.default, aten.lift_fresh.default}
_IDENTITY_IDS = frozenset(id(f) for f in _IDENTITY_VIEWS)  # OpOverload hashes in Python: use ids


def read(x: LazyTensor) -> int:
    """Node id of ``x``'s current value in the trace (replaying its view chain)."""
    tr = T.current()
    node = tr.import_storage(x._st)
    chain = x._chain
    if not chain:
        return node
    meta = x._st.meta
    last = len(chain) - 1
    for k, link in enumerate(chain):
        if id(link[0]) in _IDENTITY_IDS:
            continue  # meta unchanged: an identity view has its input's geometry
        li = recipes.link_info(link)
        if li is not None:  # made by a view recipe: its node template is known
            if li.fallback is not None:
                metrics.fallback(li.fallback)
            node = tr.add_call((li.token, (node,)), li.op, (node,), li.args, li.kwargs, li.types)
            meta = li.meta
            continue
        func, args, kw = link
        # the chain's last link yields x itself: its meta is known, no need to re-run the view
        out_meta = x._meta if k == last else func(meta, *args, **dict(kw))
        n = lower_call(func, (Ref(node), *args), dict(kw), _ref_only, T.out_types(out_meta))
        node = tr.add(n)
        meta = out_meta
    return node


def _ref_only(x: Any) -> Ref | None:
    return x if isinstance(x, Ref) else None


def _write(x: LazyTensor, value_node: int) -> None:
    """Make ``value_node`` the new value of ``x``, through its view chain."""
    tr = T.current()
    chain = x._chain
    # metas along the chain: metas[k] is the value that link k is applied to
    metas = [x._st.meta]
    for link in chain:
        li = recipes.link_info(link)
        if li is not None:
            metas.append(li.meta)
        else:
            func, args, kw = link
            metas.append(func(metas[-1], *args, **dict(kw)))
    new = value_node
    for k in range(len(chain) - 1, -1, -1):
        if id(chain[k][0]) in _IDENTITY_IDS:
            continue  # writing through an identity view writes its parent with the same value
        parent = LazyTensor(metas[k], x._st, chain[:k])
        new = inverse(chain[k], metas[k], _record_nodes, Ref(read(parent)), Ref(new)).id
    tr.set_pending(x._st, new)


def _record_nodes(func: Any, *args: Any, **kwargs: Any) -> Ref:
    """Record a functional op whose tensor arguments are already graph values (Refs)."""
    meta_args = tree_map(lambda a: _meta_of_ref(a), args)
    out_meta = func(*meta_args, **kwargs)
    n = lower_call(func, args, kwargs, _ref_only, T.out_types(out_meta))
    return Ref(T.current().add(n))


def _meta_of_ref(a: Any) -> Any:
    if isinstance(a, Ref):
        t = T.current().b.nodes[a.id].types[0]
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    return a


def materialize(x: LazyTensor, reason: str) -> torch.Tensor:
    """Concrete CPU value of ``x`` (aliasing its storage's data), running pending work first."""
    with T._lock:
        st = x._st
        if st.pending and st.gen == T.current().gen:
            T.sync(reason)
        v = st.data
        for func, args, kw in x._chain:
            v = func(v, *args, **dict(kw))
        return v


# ---------------------------------------------------------------------------------------------
# dispatch


def _to_meta(a: Any) -> Any:
    if isinstance(a, LazyTensor):
        return a._meta
    if isinstance(a, torch.Tensor):
        return a.to("meta")
    if isinstance(a, torch.device) and a.type == "kiln":
        return torch.device("meta")
    return a


def _cpu_device(a: Any) -> Any:
    if isinstance(a, torch.device) and a.type == "kiln":
        return _CPU
    return a


def host_scalars(func: Any, args: tuple, kwargs: dict) -> Any:
    """A foreach op's ``scalars`` tensor (``_foreach_addcdiv_.Tensor``'s step sizes): a CPU
    tensor next to device tensors on every device (CUDA's too), read on the host.  None where
    ``func`` has none.  Both recorders take it."""
    i = _facts(func).host_scalars
    if i < 0:
        return None
    return args[i] if i < len(args) else kwargs.get("scalars")


def _check_devices(func: Any, args: Any, kwargs: dict) -> None:
    host = host_scalars(func, args, kwargs)
    for a in (*args, *kwargs.values()):
        if a is host and host is not None:
            continue
        if isinstance(a, (list, tuple)):
            for x in a:
                _check_one(func, x)
        else:
            _check_one(func, a)


def _check_one(func: Any, a: Any) -> None:
    if isinstance(a, torch.Tensor) and a.layout != torch.strided:
        raise RuntimeError(
            f"{a.layout} tensors are not supported on the kiln device (when checking arguments "
            f"for {func}): it records dense, strided tensors only; run this op on the CPU"
        )
    # a CPU tensor next to kiln tensors is an error, as for cuda/cpu, except 0-dim ones (scalars)
    if isinstance(a, torch.Tensor) and not isinstance(a, LazyTensor) and a.dim() > 0:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, "
            f"{DEVICE} and {a.device}! (when checking arguments for {func}); move the "
            f"{a.device} tensor with .to(kiln.device()) or the kiln tensor with .cpu()"
        )


def _mutated_args(func: Any) -> list[int]:
    return [
        i
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def _functional(func: Any) -> Any | None:
    key = f"{func._schema.name.split('::')[1]}.{func._overloadname}"
    target = functional_variant(key)  # set in the op's record when the name alone does not say
    named = target is not None
    if target is None:
        name = func._schema.name.split("::")[1]
        if not name.endswith("_"):
            return None
        target = f"{name[:-1]}.{func._overloadname}"
    name, _, overload = target.partition(".")
    packet = getattr(aten, name, None)
    if packet is None:
        return None
    if named:
        return getattr(packet, overload) if overload in packet.overloads() else None
    # The overload with the same arguments: the same name is not enough (pow_.Scalar takes
    # (Tensor self, Scalar exponent), pow.Scalar takes (Scalar self, Tensor exponent)).
    want = _arg_sig(func)
    for ov in sorted(packet.overloads(), key=lambda o: o != overload):
        if _arg_sig(getattr(packet, ov)) == want:
            return getattr(packet, ov)
    return None


def _arg_sig(func: Any) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in func._schema.arguments]


class _Facts:
    """What ``_dispatch`` needs to know about one ATen overload, worked out once."""

    __slots__ = (
        "composite",
        "decomp",
        "fast_view",
        "func",
        "functional",
        "host_scalars",
        "identity",
        "inplace_view",
        "lift",
        "mutated",
        "name",
        "plain",
        "split",
        "view",
    )

    def __init__(self, func: Any) -> None:
        self.func = func
        self.name = func._schema.name.split("::")[1]
        self.composite = self.name not in OPS and _is_composite_implicit(func)
        self.view = func.is_view
        # the position of a foreach op's ``scalars`` tensor (``_foreach_addcdiv_.Tensor``'s step
        # sizes), a CPU tensor on every device, as CUDA takes it; -1: none
        self.host_scalars = next(
            (
                i
                for i, a in enumerate(func._schema.arguments)
                if self.name.startswith("_foreach_")
                and a.name == "scalars"
                and str(a.type) == "Tensor"
            ),
            -1,
        )
        self.identity = func in _IDENTITY_VIEWS  # detach / alias: a new tensor, same value
        self.inplace_view = (
            torch.Tag.inplace_view in func.tags and func is not aten.set_.source_Tensor
        )
        self.mutated = _mutated_args(func)
        self.functional = _functional(func) if self.mutated else None
        own = _OWN_DECOMPS.get(func)
        self.decomp = own or (_DECOMPS.get(func) if self.name not in OPS else None)
        self.lift = self.name not in _STRUCTURAL_FLOATS  # Python floats become scalar inputs
        # a functional foreach op recorded as per-tensor ops (see foreach.py)
        self.split = split_of(func) if not self.mutated else None
        # a view op whose recipe ``_dispatch`` may replay before any other check (its only
        # tensor argument is a lazy tensor, so there is no device to check)
        self.fast_view = (
            self.view
            and not self.composite
            and not self.identity
            and func not in _BIT_VIEWS
            and func is not aten.as_strided.default
        )
        # recorded as one node by _record, with no special case before it: may use a recipe
        self.plain = not (
            self.composite
            or self.view
            or self.inplace_view
            or self.mutated
            or self.decomp is not None
            or func in _BIT_VIEWS
            or func in _SPECIAL
            or self.split is not None
        )


_FACTS: dict[int, _Facts] = {}


def _facts(func: Any) -> _Facts:
    # keyed by id: an OpOverload hashes in Python; overloads live as long as the process
    f = _FACTS.get(id(func))
    if f is None or f.func is not func:
        f = _FACTS[id(func)] = _Facts(func)
    return f


def _normal_view_in_inference(args: tuple) -> bool:
    """Whether a view op's input is a normal (not an inference) tensor under inference_mode.

    As ATen's views, such a view is a normal tensor (autograd's view tracking gives it its base's
    version counter, which an inference tensor cannot take), so it is made with inference_mode
    off.  Asked by view ops only: the check stays off every other op's path."""
    return (
        torch.is_inference_mode_enabled()
        and bool(args)
        and isinstance(args[0], torch.Tensor)
        and not args[0].is_inference()
    )


def _view_outside_inference(func: Any, args: tuple, kwargs: dict) -> Any:
    with torch.inference_mode(False):
        return _dispatch(func, args, kwargs)


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    f = _facts(func)
    if f.plain:  # fast path: a recipe for this call signature (see recipes.py)
        leaves: list = []
        key = recipes.signature(f, args, kwargs, f.lift, leaves)
        if key is not None:
            r = recipes._recipes.get(key)
            if r is not None:
                return _replay(r, leaves)
    elif f.fast_view:  # the same for views: a view recipe, whose one leaf is the viewed tensor
        if _normal_view_in_inference(args):
            return _view_outside_inference(func, args, kwargs)
        leaves = []
        key = recipes.signature(f, args, kwargs, False, leaves)
        if key is not None and len(leaves) == 1 and leaves[0] is args[0]:
            r = recipes._recipes.get(key)
            if r is not None:
                x = args[0]
                if r.single:
                    return _view_of(x, *r.outs[0])
                return [_view_of(x, m, g, ln) for m, g, ln in r.outs]
    name = f.name
    dev = kwargs.get("device")
    kind = torch.device(dev).type if dev is not None else None
    if kind == DEVICE.type:
        _devmod._index(dev)  # "kiln:1": an error naming the one device, not a tensor on kiln:0
    if kind == "cpu":
        # a CPU result (``.cpu()``, ``zeros_like(x, device="cpu")``): made from the values.  (A
        # ``_to_copy`` to the kiln device -- ``type_as`` inside a decomposition -- is recorded.)
        def conc(a: Any) -> Any:
            return materialize(a, "to_cpu") if isinstance(a, LazyTensor) else a

        return func(*tree_map(conc, args), **kwargs)
    if func is aten.copy_.default or func is aten.copy.default:
        if func is aten.copy_.default and _upload(args[0], args[1]):
            return args[0]
        if func is aten.copy_.default and not isinstance(args[0], LazyTensor):
            # into a host tensor (C++ callers such as DistributedDataParallel's parameter
            # checks): run the pending work, then an ordinary host copy
            args[0].copy_(materialize(args[1], "to_cpu"), *args[2:], **kwargs)
            return args[0]
    elif name not in CPU_OPERANDS_OK:
        _check_devices(func, args, kwargs)
    if func in FILLS:
        out = _fill(func, args, kwargs)
        if out is not None:
            return out
    if f.composite:
        # Reached from inside a decomposition (aten.to.dtype_layout from type_as): decompose it as
        # autograd would have.  (Recorded whole, to.dtype_layout was taken for a view -- its
        # schema may alias -- and replayed with device=kiln inside the graph.)
        out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
    if func in _BIT_VIEWS:
        # conj / neg bits: a lazy tensor's dispatcher flags do not carry them, so ops would see
        # an unresolved conjugate in the meta only; compute the value instead (a copy, not a view)
        return _dispatch(_BIT_VIEWS[func], args, kwargs)
    if f.view:
        if _normal_view_in_inference(args):
            return _view_outside_inference(func, args, kwargs)
        if f.identity and len(args) == 1 and not kwargs and type(args[0]) is LazyTensor:
            return _alias_of(args[0])
        if func is not aten.as_strided.default:  # (as_strided checks its storage's size)
            leaves = []
            key = recipes.signature(f, args, kwargs, False, leaves)
            if key is not None and len(leaves) == 1 and leaves[0] is args[0]:
                r = recipes.lookup(key) or _remember_view(func, args, kwargs, key)
                x = args[0]
                if r.single:
                    return _view_of(x, *r.outs[0])
                return [_view_of(x, m, g, ln) for m, g, ln in r.outs]
        return _view(func, args, kwargs)
    if f.inplace_view:
        return _inplace_view(func, args, kwargs)
    if f.mutated:
        redirect = REDIRECTS.get(func)
        if redirect is not None:
            return redirect(*args, **kwargs)
        fn = f.functional
        if fn is None or "out" in kwargs or func._overloadname.endswith("out"):
            return _eager(func, args, kwargs, f"op:{name}")
        return _inplace(func, fn, args, kwargs, f.mutated)
    if f.decomp is not None:
        out = f.decomp(*args, **kwargs)
        if out is not NotImplemented:
            return out
    return _record(func, args, kwargs)


_BIT_VIEWS = {
    aten._conj.default: aten.conj_physical.default,
    aten._neg_view.default: aten.neg.default,
}
# ``zeros_like(x)`` / ``ones_like`` / ``full_like`` of a tensor holding data (no value pending in
# this step) are made as data at once, not recorded.  An optimizer's first step creates its state
# so (AdamW's ``exp_avg = zeros_like(param)``): as graph nodes they made that step's graph differ
# from every later one (which reads the state as inputs and writes it back in place), one graph
# more to compile -- with ten sequence lengths, three instead of two.  Of a pending value (an
# activation) they stay nodes, fused into their readers.
FILLS = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}
# handled before _record by _dispatch
_SPECIAL = {aten._to_copy.default, aten.copy_.default, aten.copy.default, *FILLS}


def fill_value(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The CPU value of a :data:`FILLS` call on a kiln tensor (its geometry, dtype and memory
    format as the call asks), or None where the call is recorded instead: another device or a
    layout other than strided asked for, pinned memory."""
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type != DEVICE.type:
        return None
    if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory"):
        return None
    x = args[0]
    like = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)  # geometry only, never read
    return func(like, *args[1:], **{k: v for k, v in kwargs.items() if k != "device"})


def _fill(func: Any, args: tuple, kwargs: dict) -> LazyTensor | None:
    """A :data:`FILLS` call made as data (:func:`fill_value`) when its tensor holds data."""
    x = args[0]
    if type(x) is not LazyTensor:
        return None
    with T._lock:
        st = x._st
        if st.data is None or (st.pending and st.gen == T.current().gen):
            return None
    v = fill_value(func, args, kwargs)
    if v is None:
        return None
    out = new_data(v)
    update_peak()
    return out


def _is_composite_implicit(func: Any) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _upload(dst: Any, src: Any) -> bool:
    """``dst.copy_(cpu_tensor)`` over a whole storage (what ``.to(dev)`` does): the storage takes
    the data directly, with no graph node, so per-step data is a graph input, not a graph."""
    if not isinstance(dst, LazyTensor) or isinstance(src, LazyTensor):
        return False
    if not isinstance(src, torch.Tensor) or dst._chain or src.dtype != dst.dtype:
        return False
    if tuple(src.shape) != tuple(dst._st.meta.shape):
        return False
    meta = dst._st.meta
    data = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
    data.copy_(src)
    st = dst._st
    st.data, st.pending, st.node, st.gen = data, False, None, -1
    track(st)
    update_peak()
    return True


def _view(func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    out_meta = func(*_map(_to_meta, args), **{k: _map(_to_meta, v) for k, v in kwargs.items()})
    if func is aten.as_strided.default:
        _check_in_storage(out_meta, x._st.meta)
    if isinstance(out_meta, (list, tuple)):
        links = split_links(func, args, kwargs, list(out_meta))
        return [LazyTensor(m, x._st, x._chain + (ln,)) for m, ln in zip(out_meta, links)]
    link = (func, tuple(args[1:]), tuple(kwargs.items()))
    return LazyTensor(out_meta, x._st, x._chain + (link,))


def _remember_view(func: Any, args: tuple, kwargs: dict, key: tuple) -> recipes.ViewRecipe:
    outs = _view(func, args, kwargs)
    single = isinstance(outs, LazyTensor)
    items = []
    for v in [outs] if single else outs:
        link = v._chain[-1]
        lfunc, largs, lkw = link
        targs, tkwargs, inputs = template((Ref(0), *largs), dict(lkw), _ref_only)
        op, real = op_name(lfunc)
        node = Node(op, inputs, targs, tkwargs, T.out_types(v._meta))
        fallback = None if real else lfunc._schema.name.split("::")[-1]
        items.append((v._meta, link, node, fallback))
    return recipes.remember_view(key, items, single)


def _wrapper(geo: recipes.Geo) -> LazyTensor:
    """An empty lazy tensor with the geometry ``geo`` (its storage, chain and meta set by the
    caller)."""
    return torch.Tensor._make_wrapper_subclass(
        LazyTensor,
        geo.shape,
        strides=geo.stride,
        storage_offset=geo.offset,
        dtype=geo.dtype,
        device=DEVICE,
        requires_grad=False,
    )


def _view_of(x: LazyTensor, meta: torch.Tensor, geo: recipes.Geo, link: tuple) -> LazyTensor:
    r = _wrapper(geo)
    r._st = x._st
    r._chain = x._chain + (link,)
    r._meta = meta
    r._g = geo
    return r


def _geo(x: LazyTensor) -> recipes.Geo:
    g = x._g
    if g is None:
        g = x._g = recipes.geo_of(x._meta)
    return g


def _alias_of(x: LazyTensor) -> LazyTensor:
    """A new lazy tensor with ``x``'s storage, chain and geometry (``detach``, ``alias``)."""
    g = _geo(x)
    r = _wrapper(g)
    r._st = x._st
    r._chain = x._chain
    r._meta = x._meta
    r._g = g
    return r


def _check_in_storage(view: torch.Tensor, base: torch.Tensor) -> None:
    """``as_strided`` may address any element of its storage, and its meta kernel checks nothing:
    raise eager's error now (a view past the end would fail only when the step runs)."""
    if view.numel() == 0:
        return
    last = view.storage_offset() + sum((n - 1) * st for n, st in zip(view.shape, view.stride()))
    need = (last + 1) * view.element_size()
    have = base.untyped_storage().nbytes()
    if need > have:
        raise RuntimeError(
            f"setStorage: sizes {list(view.shape)}, strides {list(view.stride())}, storage offset "
            f"{view.storage_offset()}, and itemsize {view.element_size()} requiring a storage "
            f"size of {need} are out of bounds for storage of size {have}"
        )


def _with_defaults(func: Any, fn: Any, args: tuple, kwargs: dict) -> dict:
    """``kwargs`` plus the in-place op's defaults that its functional variant lacks
    (``bernoulli_.float`` defaults ``p`` to 0.5, ``bernoulli.p`` requires it)."""
    fn_args = {a.name: a for a in fn._schema.arguments}
    out = dict(kwargs)
    for i, a in enumerate(func._schema.arguments):
        if i < len(args) or a.name in out or not a.has_default_value():
            continue
        target = fn_args.get(a.name)
        if target is not None and not target.has_default_value():
            out[a.name] = a.default_value
    return out


def _inplace_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """In-place view ops (``unsqueeze_``, ``t_``, ``squeeze_``, ...) change only the geometry of
    the tensor: it becomes the view its out-of-place op returns (same storage, one more link)."""
    fn = _functional(func)
    if fn is None or not fn.is_view:
        return _eager(func, args, kwargs, f"op:{func._schema.name.split('::')[1]}")
    x = args[0]
    v = _view(fn, args, kwargs)
    x._chain, x._meta, x._g = v._chain, v._meta, None
    with torch.utils._mode_utils.no_dispatch():  # the wrapper's own sizes and strides
        func(*args, **kwargs)
    return x


# PyTorch's names of the dtypes in its casting errors
_SCALAR_TYPE_NAMES = {
    torch.float64: "Double",
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.int64: "Long",
    torch.int32: "Int",
    torch.int16: "Short",
    torch.int8: "Char",
    torch.uint8: "Byte",
    torch.bool: "Bool",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}


def check_inplace_cast(result: torch.dtype, target: torch.dtype) -> None:
    """Eager's error for an in-place op whose result the written tensor's dtype cannot hold
    (``int_tensor.add_(0.5)``): the write is never made with a silent cast."""
    if result != target and not torch.can_cast(result, target):
        raise RuntimeError(
            f"result type {_SCALAR_TYPE_NAMES.get(result, result)} can't be cast to the desired "
            f"output type {_SCALAR_TYPE_NAMES.get(target, target)}"
        )


def _inplace(func: Any, fn: Any, args: tuple, kwargs: dict, mutated: list[int]) -> Any:
    out = _record(fn, args, _with_defaults(func, fn, args, kwargs))
    # a functional form returns a value per mutated argument, a list for a list argument
    # (``_fused_adamw`` returns five lists): flattened in order, as the targets are
    outs: list = []
    for o in out if isinstance(out, (list, tuple)) else [out]:
        outs.extend(o if isinstance(o, (list, tuple)) else [o])
    targets: list[LazyTensor] = []
    for i in mutated:
        a = args[i] if i < len(args) else kwargs[func._schema.arguments[i].name]
        targets.extend(a if isinstance(a, (list, tuple)) else [a])
    if len(targets) != len(outs):
        raise RuntimeError(
            f"Kiln internal error: {func} mutates {len(targets)} tensors, "
            f"its functional form returns {len(outs)}"
        )
    for t, v in zip(targets, outs):
        vn = read(v)
        vg, tg = _geo(v), _geo(t)  # interned geometries: no torch.Size built per check
        if vg.dtype != tg.dtype or vg.shape != tg.shape:
            check_inplace_cast(vg.dtype, tg.dtype)
            vn = _record_nodes(aten._to_copy.default, Ref(vn), dtype=t.dtype).id
            if v.shape != t.shape:
                vn = _record_nodes(aten.expand.default, Ref(vn), list(t.shape)).id
        _write(t, vn)
    return args[0] if func._schema.returns and len(targets) == 1 else None


def _replay(r: recipes.Recipe, leaves: list) -> Any:
    """Record one call from its recipe: its inputs are the current values of ``leaves``."""
    tr = T._trace
    gen = tr.gen
    ins = []
    for a in leaves:
        if type(a) is float:
            ins.append(tr.scalar(a))
            continue
        st = a._st
        if not a._chain and st.gen == gen and st.node is not None:
            ins.append(st.node)
        else:
            ins.append(read(a))
    inputs = tuple(ins)
    if r.fallback is not None:
        metrics.fallback(r.fallback)
    nid = tr.add_call((r.token, inputs), r.op, inputs, r.args, r.kwargs, r.types)
    if r.single:
        return _pending(tr, r.meta, r.geo, nid)
    return tuple(_pending(tr, m, g, tr.getitem(nid, k)) for k, (m, g) in enumerate(r.outs))


def _pending(tr: T.Trace, meta: torch.Tensor, geo: recipes.Geo, node: int) -> LazyTensor:
    st = T.Storage.computed(meta, tr, node)
    r = _wrapper(geo)
    r._st = st
    r._chain = ()
    r._meta = meta
    r._g = geo
    return r


def _record(func: Any, args: tuple, kwargs: dict) -> Any:
    tr = T.current()
    f = _facts(func)
    if f.split is not None:
        outs = record_split(f.split, args, kwargs, _dispatch)
        if outs is not None:
            return outs
    leaves: list = []
    key = recipes.signature(f, args, kwargs, f.lift, leaves)
    if key is not None:
        r = recipes.lookup(key)
        if r is not None:
            return _replay(r, leaves)
    try:
        out_meta, out_types = infer_typed(func, args, kwargs, _to_meta)
    except Exception:  # noqa: BLE001 - data-dependent shape or no meta kernel: run it for real
        return _eager(func, args, kwargs, f"op:{func._schema.name.split('::')[1]}")
    if not _has_tensor_out(out_meta):
        if (
            func._schema.returns
            and all(
                str(r.type) in ("int", "bool", "float", "Scalar", "SymInt")
                for r in func._schema.returns
            )
            and not any(isinstance(a, LazyTensor) for a in tree_flatten(args)[0])
        ):
            return out_meta
        return _eager(func, args, kwargs, f"op:{func._schema.name.split('::')[1]}")
    lift = f.lift

    def ref_of(a: Any) -> Ref | None:
        if isinstance(a, LazyTensor):
            return Ref(read(a))
        if isinstance(a, torch.Tensor):
            return Ref(tr.import_tensor(a))
        if lift and type(a) is float:
            return Ref(tr.scalar(a))
        return None

    kw = {k: _cpu_device(v) for k, v in kwargs.items()}
    node = lower_call(func, args, kw, ref_of, out_types)
    random = node.category is Category.RANDOM
    if random:
        if tr.replay is not None:
            replayed = _replay_random(tr, func, node, args, out_meta)
            if replayed is not None:
                return replayed
        tr.seed()
    nid = tr.add(node)
    if key is not None and not random:
        fallback = None if op_name(func)[1] else func._schema.name.split("::")[-1]
        recipes.remember(key, node, fallback, out_meta, len(leaves))
    if isinstance(out_meta, torch.Tensor):
        out: Any = _new_pending(out_meta, nid)
    else:
        outs = []
        for k, m in enumerate(out_meta):
            if isinstance(m, torch.Tensor):
                outs.append(_new_pending(m, tr.getitem(nid, k)))
            else:
                outs.append(m)
        out = type(out_meta)(outs) if isinstance(out_meta, tuple) else outs
    if random:
        tr.randoms.append((node.with_(inputs=()), node.inputs, out))
    return out


# Random ops whose result depends on the shapes and dtypes of their tensor arguments, not on their
# values (``uniform(x, a, b)``, ``bernoulli(x, p=0.5)``): a replayed draw is the recorded one.
_VALUE_FREE_RANDOM = {
    "rand",
    "randn",
    "rand_like",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "uniform",
    "normal_functional",
    "exponential",
    "geometric",
    "cauchy",
    "log_normal",
    "random",
}


def _replay_random(tr: T.Trace, func: Any, node: Any, args: tuple, out_meta: Any) -> Any:
    """The next random op after ``torch.kiln.set_rng_state`` rewound the RNG: reuse the draw of
    the random op recorded at that point of the trace (as eager's generator would repeat it)."""
    k = tr.replay
    assert k is not None
    prev, prev_inputs, prev_out = tr.randoms[k]
    tr.replay = k + 1 if k + 1 < len(tr.randoms) else None
    if prev != node.with_(inputs=()):
        tr.replay = None  # the program took another path than the one it rewound to
        return None
    name = func._schema.name.split("::")[1]
    overload = func._overloadname
    if (
        prev_inputs == node.inputs
        or name in _VALUE_FREE_RANDOM
        or (name == "bernoulli" and overload == "p")
    ):
        return _alias_outputs(prev_out)
    if name == "native_dropout":
        # same mask; the output recomputed from this input: input * mask * (1 / (1 - p))
        mask = _alias_outputs(prev_out[1])
        p = args[1]
        scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
        x = args[0]
        return (x * mask * scale, mask)
    raise NotImplementedError(
        f"Kiln lazy device: {func} was replayed after torch.kiln.set_rng_state (activation "
        "checkpointing recomputes its forward this way) with different input values than the "
        "first time; its draw depends on them, so Kiln cannot repeat it.  Checkpoint a region "
        "without this op, or run it with use_reentrant=False and preserve_rng_state=False."
    )


def _alias_outputs(out: Any) -> Any:
    """New lazy tensors with the pending values of ``out`` (same graph nodes)."""
    if isinstance(out, LazyTensor):
        return _new_pending(out._meta, read(out))
    return type(out)(_alias_outputs(o) for o in out)


def _has_tensor_out(out: Any) -> bool:
    if isinstance(out, torch.Tensor):
        return True
    if isinstance(out, (list, tuple)):
        return any(isinstance(o, torch.Tensor) for o in out)
    return False


def refuse_nested(func: Any, out: Any) -> None:
    """Raise a clear error if an op run on CPU values returned a nested tensor, which the kiln
    device cannot hold (it has no strides to record; both recorders call this)."""
    if any(isinstance(o, torch.Tensor) and o.is_nested for o in tree_flatten(out)[0]):
        raise NotImplementedError(
            f"{func._schema.name} returned a nested tensor, which the kiln device does not "
            "support. nn.TransformerEncoder builds one in its inference fast path (eval mode, "
            "no grad, a src_key_padding_mask): run it with "
            "torch.backends.mha.set_fastpath_enabled(False), or build it with "
            "enable_nested_tensor=False (the same values at unpadded positions; padded positions "
            "are computed instead of zero, as under torch.compile)."
        )


def _eager(func: Any, args: tuple, kwargs: dict, reason: str) -> Any:
    """Run one op eagerly on materialized values (a forced sync), writing mutations back."""
    metrics.fallback(func._schema.name.split("::")[1])

    def conc(a: Any) -> Any:
        if isinstance(a, LazyTensor):
            return materialize(a, reason)
        return _cpu_device(a)

    # materialize pending work once, then take values (views alias storage data, so in-place
    # eager ops write straight into the storages).  An op that writes its arguments runs only
    # after *all* recorded work: ops recorded earlier may read the old value of what it writes.
    if _mutated_args(func) or any(
        isinstance(a, LazyTensor) and a._st.pending for a in tree_flatten((args, kwargs))[0]
    ):
        T.sync(reason)
    cargs = tree_map(conc, args)
    ckwargs = tree_map(conc, kwargs)
    out = cpu_kernels.call(func, cargs, ckwargs)
    mutated_ids = set()
    for i in _mutated_args(func):
        a = args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)
        for t in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(t, LazyTensor):
                mutated_ids.add(id(t))

    refuse_nested(func, out)

    def wrap(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            for a in tree_flatten(cargs)[0]:
                if o is a:  # in-place op returned its (mutated) argument
                    idx = tree_flatten(cargs)[0].index(a)
                    return tree_flatten(args)[0][idx]
            return new_data(o)
        return o

    return tree_map(wrap, out)


def factory(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Ops that make a kiln tensor from nothing (``torch.zeros(..., device=dev)``)."""
    if _devmod.unusable is not None or _devmod.pending_probe is not None:
        _devmod.check_usable()
    if kwargs.get("device") is not None:
        _devmod._index(kwargs["device"])  # "kiln:1": an error naming the one device
    with T._lock:
        out = _record(func, args, kwargs)
        if config.eager:
            T.sync("eager")
        return out


recipes.lazy_type = LazyTensor
