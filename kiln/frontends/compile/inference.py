"""A Dynamo graph that needs no autograd (an optimizer's ``step()``: grad mode off) to an ATen
graph without AOTAutograd.

AOTAutograd traces such a graph twice (once to collect what it mutates, once to capture it), each
time through functionalization, proxy and fake tensors, ~1.4 s of CPU for the optimizer step of a
2-layer BERT: the largest part of its cold compile after Dynamo's own tracing.  An optimizer step
is simple: pointwise ops and in-place updates of parameters and state, no autograd.  This
records it once on fake tensors, under one dispatch mode that

- applies Kiln's decompositions (the table AOTAutograd is given) as make_fx does;
- makes each in-place op (``mul_``, ``lerp_``, ``copy_``, ...) its functional op, the result
  being the storage's new value for every later read;
- writes each updated input back at the end (``copy_`` into the placeholder: a Kiln writeback);
- records views (and ``detach``) as values, noting which tensors share a storage: an in-place
  write to any of those is declined.

It claims a graph only when all of this holds (else AOTAutograd takes it, as before, and the
reason is counted as ``inference_graph_declined:<reason>``): grad mode off or no tensor requiring
grad, static shapes, plain CPU tensors with distinct storages, only torch functions / operators /
tensor methods / ATen ops called, no in-place write to a tensor sharing its storage, no random
op (attention with ``dropout_p`` 0 draws nothing: taken), no data-dependent value, no output
that is an input or a view of one (a call that only logs, ``torch._C._log_api_usage_once``, is
allowed).  (An inference graph --
a model under ``torch.no_grad()`` -- qualifies as well as an optimizer step.)  The recorded graph is what Kiln would have got from AOTAutograd up to the order of
its nodes; it goes through :func:`kiln.frontends.compile.fx.fx_to_kiln` and Kiln's compiler like
any other graph (Kiln's own cache keeps its kernels: a new process records again, ~0.1 s).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_map

from kiln import metrics

# the folder of KILN_CACHE_DIR holding lowered graphs without autograd (see try_compile)
INFERENCE_FOLDER = "inference"


class Declined(Exception):
    """The graph is not one this path takes (the message says why); AOTAutograd takes it."""


_OPERATORS = {getattr(operator, n) for n in dir(operator) if not n.startswith("_")}
# tensor methods with effects beyond computing values
_METHODS_REFUSED = {
    "backward",
    "register_hook",
    "retain_grad",
    "requires_grad_",
    "set_",
    "resize_",
    "resize_as_",
    "share_memory_",
    "record_stream",
    "untyped_storage",
    "storage",
    "data_ptr",
}


# modules whose functions change global state (grad mode, autocast, RNG, devices) or are not ops
_MODULES_REFUSED = (
    "torch._C",
    "torch.amp",
    "torch.autograd",
    "torch._dynamo",
    "torch._functorch",
    "torch._higher_order_ops",
    "torch.random",
    "torch.cuda",
    "torch.cpu",
    "torch.backends",
    "torch.distributed",
    "torch.utils",
)
# torch's builtin op namespaces (torch.nn.functional.linear is torch._C._nn.linear, ...)
_OP_MODULES = {
    "torch._C._nn",
    "torch._C._linalg",
    "torch._C._special",
    "torch._C._fft",
    "torch._C._VariableFunctions",
}
_NAMES_REFUSED = ("set_", "_set", "manual_seed", "seed", "use_", "_enter", "_exit")


# calls in torch._C that only log (Dynamo keeps them in the graph): no value, no state of ours
_LOG_ONLY = (torch._C._log_api_usage_once,)


def _callable_ok(node: torch.fx.Node) -> bool:
    t = node.target
    if node.op == "call_method":
        return isinstance(t, str) and t not in _METHODS_REFUSED and hasattr(torch.Tensor, t)
    if isinstance(t, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return True
    if t in _OPERATORS or t in _LOG_ONLY:
        return True
    # torch's functions (torch.mul, torch.nn.functional.gelu, torch.linalg.qr, ...), not those
    # that switch global state (autocast, grad mode, the RNG) -- recording runs them
    mod, name = getattr(t, "__module__", None) or "", getattr(t, "__name__", "")
    if name.startswith(_NAMES_REFUSED):
        return False
    if mod in _OP_MODULES or (
        type(t).__name__ == "builtin_function_or_method" and getattr(torch, name, None) is t
    ):
        return True
    return (mod == "torch" or mod.startswith("torch.")) and not mod.startswith(_MODULES_REFUSED)


def _draws_nothing(func: Any, args: tuple, kwargs: dict) -> bool:
    """A random-tagged op whose call draws no random number: attention with ``dropout_p`` 0
    (torch tags the SDPA kernels random for their dropout; Kiln lowers them as plain nodes)."""
    for k, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            p = args[k] if k < len(args) else kwargs.get("dropout_p", a.default_value)
            return isinstance(p, (int, float)) and not isinstance(p, bool) and p == 0
    return False


# how a tensor made from Python values enters a traced graph
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


# ops that answer a question about a tensor's metadata (static shapes: constants)
_QUERIES = {
    torch.ops.prim.device.default,
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
    torch.ops.aten.is_contiguous.default,
    torch.ops.aten.is_contiguous.memory_format,
}


def _functional_of(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``aten.mul_.Scalar`` -> ``aten.mul.Scalar`` (same overload, same arguments)."""
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_") or name.endswith("__"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    if packet is None:
        return None
    f = getattr(packet, op._overloadname, None)
    if f is None:
        return None
    want = [(a.name, str(a.type)) for a in op._schema.arguments]
    got = [(a.name, str(a.type)) for a in f._schema.arguments]
    return f if want == got and len(f._schema.returns) == 1 else None


def _is_inplace_on_self(op: torch._ops.OpOverload) -> bool:
    """``self`` written in place and returned (``Tensor(a!) self -> Tensor(a!)``), nothing else."""
    s = op._schema
    if not s.arguments or len(s.returns) != 1:
        return False
    a0, r = s.arguments[0].alias_info, s.returns[0].alias_info
    others = [a for a in s.arguments[1:] if a.alias_info is not None]
    return bool(a0 and a0.is_write and r and r.is_write and not others)


def _is_foreach_inplace(op: torch._ops.OpOverload) -> bool:
    """``Tensor(a!)[] self`` written in place, nothing returned (``_foreach_add_.Scalar``)."""
    s = op._schema
    if not s.arguments or s.returns:
        return False
    a0 = s.arguments[0].alias_info
    others = [a for a in s.arguments[1:] if a.alias_info is not None]
    return (
        bool(a0 and a0.is_write and str(s.arguments[0].type).startswith("List[Tensor]"))
        and not others
    )


def _out_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``aten.maximum.out`` -> ``aten.maximum.default`` when ``out`` is its only written argument
    and the rest are the functional op's arguments."""
    s = op._schema
    written = [a for a in s.arguments if a.alias_info is not None]
    if op._overloadname != "out" or [a.name for a in written] != ["out"] or len(s.returns) != 1:
        return None
    f = getattr(op._overloadpacket, "default", None)
    if f is None or len(f._schema.returns) != 1:
        return None
    want = [(a.name, str(a.type)) for a in s.arguments if a.name != "out"]
    got = [(a.name, str(a.type)) for a in f._schema.arguments]
    return f if want == got else None


def _is_view(op: torch._ops.OpOverload) -> bool:
    """A view op: its outputs alias ``self`` (``Tensor(a) self -> Tensor(a)``), nothing written."""
    s = op._schema
    if not s.arguments or not s.returns:
        return False
    a0 = s.arguments[0].alias_info
    if a0 is None or a0.is_write:
        return False
    if any(a.alias_info is not None for a in s.arguments[1:]):
        return False
    return all(r.alias_info is not None and not r.alias_info.is_write for r in s.returns)


def _is_view_or_mutation(op: torch._ops.OpOverload) -> bool:
    s = op._schema
    return any(a.alias_info is not None for a in s.arguments) or any(
        r.alias_info is not None for r in s.returns
    )


class _Recorder(TorchDispatchMode):
    """Records the ATen calls of one run on fake tensors as functional nodes of ``graph``."""

    def __init__(self, graph: torch.fx.Graph, decomps: dict) -> None:
        super().__init__()
        self.graph = graph
        self.decomps = decomps
        self.node: dict[int, torch.fx.Node] = {}  # id(fake tensor) -> the node of its value
        self.keep: list[torch.Tensor] = []  # every fake tensor named in `node` (ids stay unique)
        self.aliased: set[int] = set()  # tensors sharing a storage with another (views)
        self.root: dict[int, int] = {}  # id(a view) -> id(the tensor whose storage it shares)

    def name(self, t: torch.Tensor, n: torch.fx.Node) -> None:
        self.node[id(t)] = n
        self.keep.append(t)

    def share(self, base: torch.Tensor, views: list[torch.Tensor]) -> None:
        """``views`` share ``base``'s storage: an in-place write to any of them is declined."""
        root = self.root.get(id(base), id(base))
        self.aliased.add(id(base))
        for v in views:
            self.aliased.add(id(v))
            self.root[id(v)] = root
            self.keep.append(v)

    def update(self, t: torch.Tensor, new: torch.Tensor) -> None:
        """``t``'s storage now holds ``new`` (same shape; cast to ``t``'s dtype here)."""
        if id(t) in self.aliased:
            raise Declined("an in-place write to a tensor that shares its storage")
        if new.shape != t.shape:
            raise Declined("an in-place op changed its input's shape")
        if new.dtype != t.dtype:
            with self:
                new = torch.ops.aten._to_copy.default(new, dtype=t.dtype)
        self.name(t, self.arg(new))

    def arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            n = self.node.get(id(a))
            if n is None:
                raise Declined("an op reads a tensor the graph did not make (a constant)")
            return n
        return a

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags and not _draws_nothing(
            func, args, kwargs
        ):
            raise Declined(f"random op {func}")
        if func is torch.ops.aten.copy_.default:  # the destination takes the source's value
            func(*args, **kwargs)  # eager's checks
            self.update(args[0], args[1])
            return args[0]
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            out = func(*args, **kwargs)  # (grad mode is off: the same value, the same storage)
            self.name(out, self.arg(args[0]))
            self.share(args[0], [out])
            return out
        if _is_inplace_on_self(func) or _is_foreach_inplace(func):
            functional = _functional_of(func)
            if functional is None:
                raise Declined(f"in-place op {func} has no functional twin")
            func(*args, **kwargs)  # eager's checks (a cast eager refuses raises here)
            with self:
                new = functional(*args, **kwargs)
            if _is_foreach_inplace(func):
                for t, n in zip(args[0], new, strict=True):
                    self.update(t, n)
                return None
            self.update(args[0], new)
            return args[0]
        out_twin = _out_twin(func)
        if out_twin is not None:  # op(..., out=t): t takes the functional op's value
            dst = kwargs["out"]
            rest = {k: v for k, v in kwargs.items() if k != "out"}
            with self:
                new = out_twin(*args, **rest)
            if new.shape != dst.shape:  # (eager would resize `out`)
                raise Declined(f"{func} resizes its out= tensor")
            func(*args, **kwargs)  # eager's checks
            self.update(dst, new)
            return dst
        if func in _QUERIES:  # a tensor's metadata (its device, a size): a constant here
            return func(*args, **kwargs)
        if func in _LIFTS and id(args[0]) not in self.node:  # torch.tensor(...) in the graph
            return self.constant(args[0])
        if func in self.decomps:
            with self:
                out = self.decomps[func](*args, **kwargs)
            if out is not NotImplemented:
                return out
        # a CompositeImplicitAutograd op (``to``, ``reshape``...) as its parts, as make_fx does
        with self:
            out = func.decompose(*args, **kwargs)
        if out is not NotImplemented:
            return out
        if _is_view(func):  # a value like any other as long as nothing writes its storage
            out = self.add(func, args, kwargs)
            self.share(args[0], list(out) if isinstance(out, tuple | list) else [out])
            return out
        if _is_view_or_mutation(func):
            raise Declined(f"mutating op {func}")
        return self.add(func, args, kwargs)

    def constant(self, t: torch.Tensor) -> Any:
        """A tensor the graph makes from Python values (Dynamo keeps ``torch.tensor([...])``
        calls in the graph): recorded as the factory op that makes it again -- ``empty`` when it
        has no elements, ``full`` when every element is one value; declined otherwise."""
        if t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
            raise Declined("a tensor constant that is not a plain CPU tensor")
        opts = {"dtype": t.dtype, "layout": torch.strided, "device": t.device}
        if t.numel() == 0:
            return self.add(torch.ops.aten.empty.memory_format, (list(t.shape),), opts)
        with _disable_current_modes():  # a real tensor: read its values outside fake mode
            values = set(t.reshape(-1).tolist())
        if len(values) != 1 or t.is_complex():
            raise Declined("a tensor constant with several values")
        return self.add(torch.ops.aten.full.default, (list(t.shape), values.pop()), opts)

    def add(self, func: Any, args: Any, kwargs: dict) -> Any:
        """Run ``func`` on the fake tensors and record it as a node (its outputs named)."""
        out = func(*args, **kwargs)
        n = self.graph.call_function(func, tree_map(self.arg, args), tree_map(self.arg, kwargs))
        n.meta["val"] = out
        if isinstance(out, torch.Tensor):
            self.name(out, n)
        elif isinstance(out, tuple | list) and all(isinstance(o, torch.Tensor) for o in out):
            for i, o in enumerate(out):
                g = self.graph.call_function(operator.getitem, (n, i))
                g.meta["val"] = o
                self.name(o, g)
        else:
            raise Declined(f"{func} returned {type(out).__name__}")
        return out


def _check(gm: torch.fx.GraphModule, inputs: list[Any]) -> None:
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise Declined("grad mode is on")
    if len(tensors) != len(inputs):
        raise Declined("a non-tensor input")
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device.type != "cpu":
            raise Declined("an input that is not a plain CPU tensor")
        if t.layout != torch.strided or t.is_quantized:
            raise Declined("an input that is not a strided tensor")
    stores = {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes()}
    if len(stores) != sum(1 for t in tensors if t.untyped_storage().nbytes()):
        raise Declined("inputs sharing a storage")
    for node in gm.graph.nodes:
        ev = node.meta.get("example_value")
        if node.op == "placeholder" and (
            isinstance(ev, torch.SymInt | torch.SymFloat | torch.SymBool)
            or (isinstance(ev, torch.Tensor) and not all(isinstance(d, int) for d in ev.shape))
        ):
            # a symbolic size (a graph for many shapes): recorded on one shape it would be
            # specialized to it; AOTAutograd traces it symbolically
            raise Declined("dynamic shapes")
        if node.op in ("call_function", "call_method") and not _callable_ok(node):
            raise Declined(f"call to {node.target}")
        if node.op == "call_module":
            raise Declined("a module call")


class Recorded(NamedTuple):
    """The recorded ATen graph (what :func:`kiln.frontends.compile.fx.fx_to_kiln` reads of a
    ``GraphModule``; a real one would generate its Python code, ~0.15 s for an optimizer step)."""

    graph: torch.fx.Graph


def record(gm: torch.fx.GraphModule, example_inputs: list, decomps: dict) -> tuple:
    """Dynamo's graph -> (the ATen graph, whose placeholders are the graph's tensor attributes
    then its inputs; those attributes); raises :class:`Declined`."""
    consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    _check(gm, [*consts, *example_inputs])
    return _record_checked(gm, consts, example_inputs, decomps), consts


def _record_checked(
    gm: torch.fx.GraphModule, consts: list, example_inputs: list, decomps: dict
) -> Recorded:
    """:func:`record` of a graph :func:`_check` has passed (``consts``: its tensor attributes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    inputs = [*consts, *example_inputs]
    out_graph = torch.fx.Graph()
    rec = _Recorder(out_graph, decomps)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fakes = [mode.from_tensor(t, static_shapes=True) for t in inputs]
    holders = []
    for i, f in enumerate(fakes):
        p = out_graph.placeholder(f"arg{i}")
        p.meta["val"] = f
        rec.name(f, p)
        holders.append(p)
    env: dict[torch.fx.Node, Any] = dict(zip(attrs, fakes[: len(attrs)]))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise Declined("inputs and placeholders differ in number")
    env.update(zip(placeholders, fakes[len(attrs) :]))
    outs: Any = None
    try:
        with mode, rec:
            for node in gm.graph.nodes:
                if node.op in ("placeholder", "get_attr"):
                    continue
                args = torch.fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
                if node.op == "call_function":
                    env[node] = node.target(*args, **kwargs)
                elif node.op == "call_method":
                    env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
                elif node.op == "output":
                    outs = args[0]
    except Declined:
        raise
    except Exception as e:  # a data-dependent value, an op fake tensors cannot run
        raise Declined(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    flat = list(outs) if isinstance(outs, tuple | list) else [outs]
    result = []
    for o in flat:
        if isinstance(o, torch.Tensor):
            n = rec.node[id(o)]
            root = rec.root.get(id(o), id(o))
            if any(o is f or root == id(f) for f in fakes):
                raise Declined("an output that is an input or a view of one")
            result.append(n)
        elif o is None or isinstance(o, int | float | bool):
            result.append(o)
        else:
            raise Declined(f"an output of type {type(o).__name__}")
    # the updated inputs, written back at the end (their last value)
    for f, p in zip(fakes, holders):
        cur = rec.node[id(f)]
        if cur is not p:
            c = out_graph.call_function(torch.ops.aten.copy_.default, (p, cur))
            c.meta["val"] = f
    out_graph.output(tuple(result))
    return Recorded(out_graph)


def cache_key(gm: torch.fx.GraphModule, inputs: list, tag: str) -> str:
    """The disk-cache key of ``gm``'s lowered graph: Dynamo's code for it, every input's metadata
    (the graph's tensor attributes first), the global state recording reads, torch's version and
    ``tag`` (Kiln's version and the source of its compiler and of this frontend)."""
    h = hashlib.sha256(gm.code.encode())
    for t in inputs:
        meta = (tuple(t.shape), t.stride(), t.dtype, t.device.type, t.requires_grad)
        h.update(repr(meta).encode())
    state = (
        torch.__version__,
        tag,
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )
    h.update(repr(state).encode())
    return "inference-" + h.hexdigest()[:40]


def try_compile(
    gm: torch.fx.GraphModule,
    example_inputs: list,
    decomps: dict,
    lower: Callable[[Recorded], Any],
    build: Callable[[Any, list], Callable[[list], list]],
    cache: Any = None,
    tag: str = "",
) -> Callable | None:
    """Dynamo's callable for ``gm`` compiled without AOTAutograd, or None when this path does not
    take it: a graph that needs autograd (AOTAutograd's business, not counted) or one declined
    for another reason (counted, with the reason).

    ``lower`` makes the recorded ATen graph what ``build`` turns into a runner of the inputs
    (attributes first); ``cache`` (a :class:`kiln.runtime.cache.DiskCache`, optional) keeps what
    ``lower`` made under :func:`cache_key` with the ATen fallbacks its lowering counted, so a new
    process records nothing (a hit is counted as ``inference_graph_cache_hits``, and its
    fallbacks as the lowering counted them)."""
    consts = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
    if torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in [*consts, *example_inputs]
    ):
        return None
    try:
        inputs = [*consts, *example_inputs]
        _check(gm, inputs)
        key = cache_key(gm, inputs, tag) if cache is not None else ""
        entry = cache.load(key) if cache is not None else None
        if entry is None:
            recorded = _record_checked(gm, consts, example_inputs, decomps)
            with metrics.fallbacks_counted() as fell:
                lowered = lower(recorded)
            if cache is not None:
                cache.store(key, (lowered, fell))
        else:
            # the ops lowering left to ATen, counted again as a cold compile counts them
            lowered, fell = entry
            metrics.fallbacks_again(fell)
            metrics.incr("inference_graph_cache_hits")
        run = build(lowered, inputs)
    except Declined as e:
        metrics.incr(f"inference_graph_declined:{str(e)[:80]}")
        return None
    metrics.incr("inference_graphs")

    def call(*args: Any) -> Any:
        return run([*consts, *args])

    return call
