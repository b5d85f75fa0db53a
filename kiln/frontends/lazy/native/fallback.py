"""The native recorder's boxed fallback to Python: no op is lost (stage 2's hybrid core).

``recorder.cpp`` records the ops of its table in C++.  Every other op reaching a native tensor
(the PrivateUse2 fallback and the CompositeExplicitAutograd ops it blocks), and a table op with an
argument the C++ path does not record (a CPU tensor, a tensor list), comes here through the
handler :func:`install` gives the recorder: the C++ side hands over the call's arguments as
Python objects and takes back what this returns.  Each call is counted
(``metrics`` ``native_python_ops``, per op in :data:`counts`).  What happens to it mirrors the
Python recorder (``lazy/tensor.py``'s ``_dispatch``), reusing its per-op facts:

- ``_to_copy`` to the CPU, and any op with ``device="cpu"``: the step is run (a counted forced
  sync) and the op runs on the values, its result a CPU tensor.
- In-place views (``squeeze_``, ``t_``, ``transpose_``, ...): recorded as the out-of-place view,
  whose geometry, storage and view chain the tensor then takes (``become``).
- Ops that write their arguments (in-place, ``out=``), random ops, ops whose result is not a
  tensor (``.item()``), ops with no meta kernel or a data-dependent shape: run eagerly on the
  materialized CPU values after running everything pending (a forced sync, counted with the op
  as a fallback, as the Python recorder's ``_eager``); results become native tensors holding the
  CPU values, and an op's written argument keeps its identity (the write lands in its storage).
- Ops with a Kiln decomposition: decomposed (the parts come back to the recorder: table ops in
  C++, the rest here).
- Everything else is recorded as one node (several outputs: one ``getitem`` node each), built
  exactly as the Python recorder's ``lower_call`` builds it (an opaque node, counted as a
  fallback when Kiln has no rule for the op).  Its recipe -- node template, output types and
  geometries, from the meta kernel -- is made once per call signature and kept in C++
  (``add_recipe``) and here; later calls with the same signature only collect their inputs and
  append the node (``record_node``).

Needs: the recorder extension loaded (``native.load``), Kiln's lowering and the lazy device's op
facts.  Guarantees: the values are eager PyTorch's; every call is counted; an op that cannot be
recorded or run raises a Python exception (the process lives on).
"""

from __future__ import annotations

import functools
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from kiln import metrics
from kiln.config import config
from kiln.frontends.lazy import cpu_kernels
from kiln.frontends.lazy.foreach import record_split, split_of
from kiln.frontends.lazy.native import convert, outops, rng, viewwrite
from kiln.frontends.lazy.native.outops import cpu_device as _cpu_device
from kiln.frontends.lazy.native.outops import is_out as _is_out
from kiln.frontends.lazy.native.outops import writes_outputs as _writes_outputs
from kiln.frontends.lazy.native.outops import written as _written
from kiln.frontends.lazy.native.strided_views import as_strided_by_views
from kiln.frontends.lazy.shapes import infer_typed
from kiln.frontends.lazy.tensor import (
    _BIT_VIEWS,
    CPU_OPERANDS_OK,
    FILLS,
    REDIRECTS,
    _facts,
    _with_defaults,
    check_inplace_cast,
    fill_value,
    host_scalars,
    refuse_nested,
)
from kiln.ir.graph import In
from kiln.lowering.aten import Ref, op_name, template

aten = torch.ops.aten
_CPU = torch.device("cpu")
# A call signature whose op runs on values (Handler.record): remembered in place of a recipe
_RUN_EAGERLY: Any = object()
# Ops that read their tensors' values and make no tensor: run on values a forced read computes
# without cutting the step (Handler.eager, native.peek)
_READS_ONLY = {aten._local_scalar_dense.default, aten.equal.default}

counts: Counter[str] = Counter()  # Python-fallback calls per op (``aten::name.overload``)


@dataclass(frozen=True)
class _Recipe:
    rid: int
    getitems: list[int]  # per tensor output of a multi-output op; empty for one output
    shape: Any  # None: a single tensor; else the output tuple/list, _TENSOR at tensor slots
    as_list: bool


class _Op:
    """One ATen overload as the handler sees it, worked out once."""

    __slots__ = ("counter", "facts", "fill", "foreach", "func", "plain", "schema")

    def __init__(self, func: Any) -> None:
        self.func = func
        f = self.facts = _facts(func)
        self.counter = f"{func._schema.name}.{func._overloadname}"
        # per schema argument: (keyword-only, enum table or None, has a default, the default)
        self.schema = []
        for a in func._schema.arguments:
            # (the Python schema shows these enums as ``Optional[int]``: the name tells them)
            t = str(a.type)
            enum = (
                convert._MEMORY_FORMATS
                if "MemoryFormat" in t or a.name == "memory_format"
                else convert._LAYOUTS
                if "Layout" in t or a.name == "layout"
                else None
            )
            has = a.has_default_value()
            self.schema.append((a.kwarg_only, enum, has, a.default_value if has else None))
        # a functional foreach op, recorded as per-tensor ops with the native device on
        self.foreach = f.split
        # made as data when its tensor holds data (lazy/tensor.py's FILLS)
        self.fill = func in FILLS
        # recorded as one node with nothing special before it (``Handler.record``)
        self.plain = not (
            func is aten._to_copy.default
            or f.inplace_view
            or func in _RESHAPING
            or f.mutated
            or f.identity
            or func in _SPLIT_VIEWS
            or f.view
            or torch.Tag.nondeterministic_seeded in func.tags
            or f.composite
            or f.decomp is not None
        )

    def split(self, vals: list) -> tuple[tuple, dict]:
        """The call's (args, kwargs) as ``__torch_dispatch__`` would get them: trailing
        positional defaults and defaulted keyword-only arguments left out, enums as Python
        objects."""
        args: list = []
        kwargs: dict = {}
        names = None
        for i, (v, (kw_only, enum, has, d)) in enumerate(zip(vals, self.schema)):
            if enum is not None and type(v) is int:
                v = enum[v]
            if kw_only:
                if not (has and _same(v, d)):
                    if names is None:
                        names = self.func._schema.arguments
                    kwargs[names[i].name] = v
            else:
                args.append(v)
        n = len(args)
        while n > 0 and self.schema[n - 1][2] and _same(args[n - 1], self.schema[n - 1][3]):
            n -= 1
        return tuple(args[:n]), kwargs


@functools.cache
def _per_element_form(fn: Any) -> tuple[Any, Any] | None:
    """(split, per-tensor in-place overload) of a functional foreach overload ``fn``, worked out
    once per overload (:meth:`Handler.per_element` runs each step a clipping loop runs); None
    where it has none."""
    split = split_of(fn) if fn is not None else None
    if split is None:
        return None
    name = split.op._schema.name.split("::")[1]
    per = getattr(getattr(aten, name + "_", None), split.op._overloadname, None)
    return None if per is None else (split, per)


class Handler:
    """The callable the recorder calls for an op it hands to Python."""

    def __init__(
        self,
        mod: Any,
        mark_step: Callable[[str], Any],
        peek: Callable[[list, str], list | None] | None = None,
    ) -> None:
        self.mod = mod
        self.mark_step = mark_step
        # values of a few native tensors without cutting the step, or None (native.peek)
        self.peek = peek
        self.ops: dict[Any, _Op] = {}  # by (name, overload); random factories by overload
        self.recipes: dict[tuple, _Recipe] = {}
        self.rng = rng.shared(mod)

    def __call__(self, qual: str, overload: str, vals: list) -> Any:
        op = self.ops.get((qual, overload))
        if op is None:
            # (an op of another namespace than aten: ``c10d::allreduce_``, the functional
            # collectives ``_c10d_functional::all_reduce``, ...)
            ns, name = qual.split("::")
            packet = getattr(getattr(torch.ops, ns), name)
            op = self.ops[(qual, overload)] = _Op(getattr(packet, overload or "default"))
        counts[op.counter] += 1
        metrics.incr("native_python_ops")
        args, kwargs = op.split(vals)
        if op.func in _READS_ONLY and all(self.mod.is_native(a) for a in args if _is_tensor(a)):
            # a read of native tensors (``.item()``, ``bool(t)``: a transformers step's
            # ``bool(mask.all())``) is never recorded: run at once on the values, without the
            # signature and recipe lookup ``record`` makes first
            return self.eager(op.func, args, kwargs, f"op:{op.facts.name}")
        if op.fill and self.mod.has_value(args[0]):
            # made as data, not recorded (an optimizer's state: lazy/tensor.py's FILLS)
            v = fill_value(op.func, args, kwargs)
            if v is not None:
                return self.mod.from_cpu(v)
        if op.plain and "device" not in kwargs and (op.foreach is None or not _device_active()):
            return self.record(op, args, kwargs)
        return self.dispatch(op, args, kwargs)

    def factory(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A factory with ``device=kiln`` that Kiln lowers (``torch.zeros(3, device=dev)``,
        ``empty``, ``ones``, ``full``, ``arange``, ``linspace``, ``eye``, ...) or a random one
        (``randn``, ``rand``, ``randint``, ``randperm``): one graph node, as the Python recorder
        records it -- random ones seeded from the step's seed (stage 5's promise: the Python
        recorder's values under one seed), not drawn from the CPU generator at the call.  Asked
        by ``native.device.factory``."""
        op = self.ops.get(func)
        if op is None:
            op = self.ops[func] = _Op(func)
        return self.rng.record(self, op, args, kwargs)  # (a plain node unless it is random)

    def factory_replayer(self, func: Any, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
        """For a factory call just recorded by :meth:`factory` as one plain node with no graph
        input (``empty``/``empty_strided``: the first op of every ``batch.to(kiln)``), a function
        that records the same node again without working out its signature; None otherwise."""
        op = self.ops.get(func)
        if op is None or rng.is_random_node(func):
            return None
        key, inputs = self.signature(op, args, kwargs)
        r = self.recipes.get(key)
        if inputs or r is None or r is _RUN_EAGERLY or r.shape is not None:
            return None
        record_node, rid, getitems = self.mod.record_node, r.rid, r.getitems
        return lambda: record_node(rid, getitems, [])[0]

    # -- what to do with one call ----------------------------------------------------------------

    def dispatch(self, op: _Op, args: tuple, kwargs: dict) -> Any:
        func = op.func
        f = op.facts
        name = f.name
        if _is_cpu(kwargs.get("device")):
            # a CPU result (``.cpu()``, ``zeros_like(x, device="cpu")``): made from the values
            is_native = self.mod.is_native
            got = self.read([a for a in args if _is_tensor(a) and is_native(a)], "to_cpu")
            cargs = [got[id(a)] if _is_tensor(a) and is_native(a) else a for a in args]
            return func(*cargs, **kwargs)
        self.check_devices(func, args, kwargs)
        if f.inplace_view and func not in _RESHAPING:
            view = _out_of_place(func)
            if view is not None and self.mod.is_native(args[0]):
                # recorded as its out-of-place view (a table view: a chain link), then the
                # tensor itself takes that view's geometry, storage and chain
                self.mod.become(args[0], view(*args, **kwargs))
                return args[0]
        if (
            f.mutated
            and _writes_outputs(func, kwargs)
            and _device_active()
            and not f.inplace_view
            and func not in _RESHAPING
            and self.keeps_out_geometry(op, args, kwargs)
        ):
            # an out= op that does not resize its outputs: its functional op recorded and
            # copied into the outputs (no sync); else run on the values (everything pending
            # first), writing into the outputs' storages, as the Python device does
            out = outops.record_out(self, op, args, kwargs)
            if out is not _NOT_DONE:
                return out
            return self.eager(func, args, kwargs, f"op:{name}")
        if (
            (func in _RESHAPING or (f.mutated and _writes_outputs(func, kwargs)))
            and _device_active()
            and all(self.mod.is_native(t) for t in _written(op, args, kwargs))
        ):
            return outops.reshape_in_place(self, op, args, kwargs)
        if f.inplace_view or func in _RESHAPING or (f.mutated and _is_out(func, kwargs)):
            raise NotImplementedError(
                f"Kiln native recorder: {func} changes a tensor's shape or storage in place; "
                "not supported yet on tensors made by native.tensor() (stage 3: views and "
                "in-place ops). Fix: use the kiln device (kiln.config.lazy_recorder = 'native' "
                "and .to(kiln.device())), where it is supported, or make a new tensor "
                "(x.new_empty(size), x.reshape(size)) instead of resizing x"
            )
        if func is aten.copy_.default and self.mod.upload(args[0], args[1]):
            return args[0]  # a CPU value into a whole native storage: no node, no sync
        if f.identity and len(args) == 1 and not kwargs and self.mod.is_native(args[0]):
            return self.mod.alias_of(args[0])  # detach / alias: no node, same storage
        bit = _BIT_VIEWS.get(func)
        if bit is not None and _device_active():
            # conj / neg bits: a native tensor's dispatcher flags do not carry them; compute the
            # value instead (a copy, not a view), as the Python device does
            return bit(*args, **kwargs)
        split = _SPLIT_VIEWS.get(func)
        if split is not None:  # one view per piece: table views (chain links), aliasing kept
            return split(*args, **kwargs)
        redirect = REDIRECTS.get(func) if f.mutated else None
        if redirect is not None and _device_active():
            return redirect(*args, **kwargs)
        if (
            f.mutated
            and f.functional is not None
            and _device_active()
            and not _is_out(func, kwargs)
        ):
            out = self.inplace(op, args, kwargs)
            if out is not _NOT_DONE:
                return out
        if op.foreach is not None and _device_active():
            # a functional foreach op: per-tensor ops (lazy/foreach.py), as on the Python device
            out = record_split(op.foreach, args, kwargs, _call)
            if out is not None:
                return out
        if func is aten.as_strided.default and _device_active() and self.mod.is_native(args[0]):
            out = as_strided_by_views(self.mod, *args, **kwargs)
            if out is not None:
                return out
        if f.mutated or f.view:
            # written arguments and views outside the table (they alias the value's memory) run
            # on the values
            return self.eager(func, args, kwargs, f"op:{name}")
        if f.composite:
            out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if f.decomp is not None:
            out = f.decomp(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if torch.Tag.nondeterministic_seeded in func.tags:
            return self.rng.record(self, op, args, kwargs)
        return self.record(op, args, kwargs)

    def keeps_out_geometry(self, op: _Op, args: tuple, kwargs: dict) -> bool:
        """Whether an out= op leaves every written tensor's geometry as it is (native tensors;
        asked of the meta kernel): then running it on the values writes into the storages'
        buffers (a view's value is a view of its storage's buffer) and every tensor on them
        stays right."""
        func = op.func
        targets = _written(op, args, kwargs)
        is_native = self.mod.is_native
        if not targets or not all(isinstance(t, torch.Tensor) and is_native(t) for t in targets):
            return False
        ids = {id(t): k for k, t in enumerate(targets)}
        metas = [_meta_like(t) for t in targets]

        def conv(a: Any) -> Any:
            k = ids.get(id(a))
            return metas[k] if k is not None else self.to_meta(a)

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the resize warning: answered below)
                func(*tree_map(conv, args), **tree_map(conv, kwargs))
        except Exception:  # noqa: BLE001 - no meta kernel: not known to keep the geometry
            return False
        return all(m.shape == t.shape and m.stride() == t.stride() for m, t in zip(metas, targets))

    def inplace(self, op: _Op, args: tuple, kwargs: dict) -> Any:
        """Stage 3: an in-place op (``add_``, ``copy_``, ``_foreach_mul_``, ...) recorded as its
        functional variant, each written tensor's storage then taking the result as its new
        pending value (``write_back``: no sync; ops recorded before read the old value).  One
        written view is written back through its chain (``viewwrite``).  ``_NOT_DONE`` when a
        written tensor is neither (several views, a storage shared with a view made on the
        values, a link with no inverse) or the result's geometry is not the target's: the caller
        runs the op on the values instead."""
        func = op.func
        targets = _written(op, args, kwargs)
        writable = self.mod.writable
        if not targets or not all(isinstance(t, torch.Tensor) for t in targets):
            return _NOT_DONE
        through = None  # a written view: its base and chain
        if not all(writable(t) for t in targets):
            if len(targets) > 1:
                return self.per_element(op, args, kwargs)
            if not self.mod.is_native(targets[0]):
                return _NOT_DONE
            through = viewwrite.chain_of(self.mod, targets[0])
            if through is None:
                return _NOT_DONE
        fn = op.facts.functional
        out = fn(*args, **_with_defaults(func, fn, args, kwargs))
        outs = list(out) if isinstance(out, (list, tuple)) else [out]
        if len(outs) != len(targets):
            return _NOT_DONE  # (the recorded node is dead: the cut prunes it)
        vals = []
        for t, v in zip(targets, outs):
            if not isinstance(v, torch.Tensor):
                return _NOT_DONE
            if v.dtype != t.dtype:
                check_inplace_cast(v.dtype, t.dtype)
                v = v.to(t.dtype)
            if through is not None and v.shape == t.shape:
                if not viewwrite.write_through(self.mod, through[0], through[1], v):
                    return _NOT_DONE
                metrics.incr("native_inplace_writes")
                return args[0] if func._schema.returns else None
            if self.mod.geo_of(v) != self.mod.geo_of(t):
                return _NOT_DONE
            vals.append(v)
        for t, v in zip(targets, vals):
            self.mod.write_back(t, v)
        metrics.incr("native_inplace_writes")
        return args[0] if func._schema.returns and len(targets) == 1 else None

    def per_element(self, op: _Op, args: tuple, kwargs: dict) -> Any:
        """An in-place foreach op some of whose written tensors are views (gradients autograd
        left as views of a transpose or a reduction; ``clip_grad_norm_``'s ``_foreach_mul_``
        writes them): the per-tensor in-place op once per element, in order -- what ATen's CPU
        foreach kernels do -- each recorded as a single in-place write (through its view, no
        sync).  ``_NOT_DONE`` when the op has no per-tensor in-place form."""
        form = _per_element_form(op.facts.functional)
        calls = form[0].calls(args, kwargs) if form is not None else None
        if calls is None:
            return _NOT_DONE
        per = form[1]
        for pos, kw in calls:
            per(*pos, **kw)
        metrics.incr("native_foreach_per_element")
        return None

    def signature(self, op: _Op, args: tuple, kwargs: dict) -> tuple[tuple, list]:
        """The call's recipe key (the op, the default dtype, each argument's signature part) and
        its graph values in template order."""
        func = op.func
        lift = op.facts.lift
        inputs: list = []
        key_parts: list = []
        host = host_scalars(func, args, kwargs) if op.facts.host_scalars >= 0 else None
        for a in args:
            key_parts.append(self.walk(func, a, lift, inputs, host))
        for k, v in kwargs.items():
            key_parts.append((k, self.walk(func, v, lift, inputs, host)))
        return (op, torch.get_default_dtype(), tuple(key_parts)), inputs

    def record(self, op: _Op, args: tuple, kwargs: dict, sig: tuple | None = None) -> Any:
        """Record the call as one node (``sig``: its :meth:`signature`, when known)."""
        func = op.func
        lift = op.facts.lift
        key, inputs = sig if sig is not None else self.signature(op, args, kwargs)
        r = self.recipes.get(key)
        if r is None:
            r = self.make_recipe(func, args, kwargs, lift)
            # (None: no tensor result, no meta kernel or a data-dependent shape -- the same for
            # every call with this signature, so the meta run is not repeated per call)
            self.recipes[key] = _RUN_EAGERLY if r is None else r
        if r is None or r is _RUN_EAGERLY:
            return self.eager(func, args, kwargs, f"op:{op.facts.name}")
        outs = self.mod.record_node(r.rid, r.getitems, inputs)
        if r.shape is None:
            return outs[0]
        it = iter(outs)
        res = [next(it) if s is _TENSOR else s for s in r.shape]
        return res if r.as_list else tuple(res)

    def walk(self, func: Any, x: Any, lift: bool, inputs: list, host: Any = None) -> Any:
        """The signature part of one argument; graph values appended to ``inputs`` in the order
        ``lowering.aten.template`` numbers them.  ``host``: the call's foreach ``scalars``
        tensor, a CPU tensor it takes (:func:`host_scalars`)."""
        if isinstance(x, torch.Tensor):
            inputs.append(x)
            g = self.mod.geo_of(x)
            if g >= 0:
                return ("n", g)
            if x.device.type != "cpu":
                self.check_devices(func, (x,), {})
            elif _device_active() and x is not host:
                check_cpu_operand(func, x)
            return ("c", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)
        if lift and type(x) is float:
            inputs.append(x)
            return ("f",)
        if isinstance(x, (list, tuple)):
            return (type(x), tuple(self.walk(func, y, lift, inputs, host) for y in x))
        return (type(x), x)

    def make_recipe(self, func: Any, args: tuple, kwargs: dict, lift: bool) -> _Recipe | None:
        try:
            out_meta, out_types = infer_typed(func, args, kwargs, self.to_meta)
        except Exception:  # noqa: BLE001 - no meta kernel or a data-dependent shape: run it
            return None
        if isinstance(out_meta, torch.Tensor):
            metas = [out_meta]
        elif isinstance(out_meta, (list, tuple)):
            metas = list(out_meta)
        else:
            return None  # no tensor result (a check on values): eager
        if not any(isinstance(m, torch.Tensor) for m in metas):
            return None  # a number, a bool: computed from values (eager)
        count = [0]

        def ref_of(a: Any) -> Ref | None:
            if isinstance(a, torch.Tensor) or (lift and type(a) is float):
                count[0] += 1
                return Ref(count[0] - 1)
            return None

        kw = {k: _cpu_device(v) for k, v in kwargs.items()}
        targs, tkwargs, _ = template(args, kw, ref_of)
        name, real = op_name(func)
        qual = func._schema.name.split("::")[1]
        fallback = None if real else qual
        types = tuple(out_types) if isinstance(out_types, (tuple, list)) else (out_types,)
        geos = [_geo(m) for m in metas if isinstance(m, torch.Tensor)]
        h = hash((name, repr(targs), repr(tkwargs), repr(types))) & (2**64 - 1)
        if isinstance(out_meta, torch.Tensor):
            rid = self.mod.add_recipe(geos, h)
            convert.register(rid, name, targs, tkwargs, types, fallback)
            return _Recipe(rid, [], None, False)
        rid = self.mod.add_recipe(geos, h)
        convert.register(rid, name, targs, tkwargs, types, fallback)
        getitems = []
        for k, m in enumerate(metas):
            if isinstance(m, torch.Tensor):
                g = self.mod.add_recipe([_geo(m)], hash(("getitem", h, k)) & (2**64 - 1))
                convert.register(g, "getitem", (In(0), k), (), (types[k],), None)
                getitems.append(g)
        shape = tuple(_TENSOR if isinstance(m, torch.Tensor) else m for m in metas)
        return _Recipe(rid, getitems, shape, isinstance(out_meta, list))

    # -- running for real ------------------------------------------------------------------------

    def sync(self, reason: str) -> None:
        if self.mod.trace_len() > 0:
            metrics.forced_sync(reason)
            self.mark_step(reason)

    def read(self, xs: list, reason: str) -> dict[int, torch.Tensor]:
        """The values of the native tensors ``xs`` (by ``id``) for a read: computed on their own
        when that is cheap, the step staying one graph (``native.peek``); else after everything
        pending runs (a forced sync, ``reason``)."""
        if self.peek is not None and xs:
            values = self.peek(xs, reason)
            if values is not None:
                return {id(x): v for x, v in zip(xs, values)}
        self.sync(reason)
        return {id(x): self.mod.value(x) for x in xs}

    def eager(self, func: Any, args: tuple, kwargs: dict, reason: str) -> Any:
        """Run one op on materialized CPU values after everything pending (as the Python
        recorder's ``_eager``): written arguments keep their identity, new results become native
        tensors."""
        metrics.fallback(func._schema.name.split("::")[1])
        is_native = self.mod.is_native
        got: dict[int, torch.Tensor] = {}
        if func in _READS_ONLY:  # a read (``.item()``, ``bool(t)``, ``equal``)
            flat, spec = tree_flatten((args, kwargs))
            got = self.read([a for a in flat if _is_tensor(a) and is_native(a)], reason)
            # its result is a number or a bool: nothing to wrap, no argument written
            cargs, ckwargs = tree_unflatten([got.get(id(a), a) for a in flat], spec)
            return func(*cargs, **ckwargs)
        self.sync(reason)

        def conc(a: Any) -> Any:
            if isinstance(a, torch.Tensor) and is_native(a):
                v = got.get(id(a))
                return self.mod.value(a) if v is None else v
            return _cpu_device(a)

        cargs = tree_map(conc, args)
        ckwargs = tree_map(conc, kwargs)
        out = cpu_kernels.call(func, cargs, ckwargs)
        refuse_nested(func, out)
        flat_c = tree_flatten((cargs, ckwargs))[0]
        flat_a = tree_flatten((args, kwargs))[0]
        buffers = {_buffer(c) for c in flat_c if isinstance(c, torch.Tensor)} - {0}

        def wrap(o: Any) -> Any:
            if not isinstance(o, torch.Tensor):
                return o
            for a, c in zip(flat_a, flat_c):
                if o is c:  # a written argument returned: the caller's tensor
                    return a
            # a view of a value (as_strided, ...) shares its buffer: it and the tensors whose
            # buffer it views are marked, so that writes to either run on the values and land in
            # that buffer, seen by both (never write_back / upload).  (Below autograd here,
            # o._is_view() does not say: compare buffers.)
            b = _buffer(o)
            if b == 0 or b not in buffers:
                return self.mod.from_cpu(o.detach())
            for a, c in zip(flat_a, flat_c):
                if isinstance(c, torch.Tensor) and _buffer(c) == b and is_native(a):
                    self.mod.lend(a)
            return self.mod.from_cpu(o.detach(), True)

        return tree_map(wrap, out)

    # -- helpers ---------------------------------------------------------------------------------

    def to_meta(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            if self.mod.is_native(a):
                return _meta_like(a)
            return a.to("meta")
        if isinstance(a, torch.device) and a.type == "kiln":
            return torch.device("meta")
        return a

    def check_devices(self, func: Any, args: tuple, kwargs: dict) -> None:
        """A tensor on another device than the CPU or a native tensor: eager's mixed-device
        error, naming both."""
        flat = [*args, *kwargs.values()]
        flat += [y for a in flat if isinstance(a, (list, tuple)) for y in a]
        strict = func is not None and _device_active()  # the kiln device's rules for CPU operands
        host = host_scalars(func, args, kwargs) if strict else None
        for a in flat:
            if strict and isinstance(a, torch.Tensor) and a.device == _CPU and a is not host:
                check_cpu_operand(func, a)
            if isinstance(a, torch.Tensor) and not self.mod.is_native(a) and a.device != _CPU:
                raise RuntimeError(
                    f"Kiln native recorder: {func} got a native kiln tensor and a tensor on "
                    f"{a.device} (of type {type(a).__name__}); expected all tensors on one "
                    "device (a CPU tensor is taken as a graph input)"
                )


def _device_active() -> bool:
    """The native recorder is the kiln device's (``config.lazy_recorder``): its rules apply."""
    return config.lazy_recorder == "native"


# CPU operands the native recorder takes: CPU_OPERANDS_OK (both recorders' list) and the copies
# between the devices, which the Python recorder handles before its device check (``_dispatch``)
_TAKES_CPU = CPU_OPERANDS_OK | {"copy_", "copy"}


def check_cpu_operand(func: Any, a: torch.Tensor) -> None:
    """A CPU tensor with dimensions next to native kiln tensors, with the native recorder as the
    kiln device's: eager's mixed-device error (the Python device's ``tensor._check_one``), except
    for 0-dim tensors, copies and the ops in ``CPU_OPERANDS_OK``.  (Without the switch, native
    tensors made by ``native.tensor`` take any CPU tensor as a graph input.)"""
    name = func._schema.name.split("::")[1]
    if a.dim() == 0 or name in _TAKES_CPU:
        return
    raise RuntimeError(
        "Expected all tensors to be on the same device, but found at least two devices, "
        f"kiln:0 and {a.device}! (when checking arguments for {func}); move the "
        f"{a.device} tensor with .to(kiln.device()) or the kiln tensor with .cpu()"
    )


_NOT_DONE = outops.NOT_DONE
_TENSOR = object()  # a tensor output's slot in a recipe's output shape (others: their value)


def _call(op: Any, args: tuple, kwargs: dict) -> Any:
    return op(*args, **kwargs)


def _split_tensor(x: torch.Tensor, size: int, dim: int = 0) -> list[torch.Tensor]:
    n = x.shape[dim]
    if n == 0:
        return [x.narrow(dim, 0, 0)]
    return [x.narrow(dim, i, min(size, n - i)) for i in range(0, n, size)]


def _split_with_sizes(x: torch.Tensor, sizes: list[int], dim: int = 0) -> list[torch.Tensor]:
    out, start = [], 0
    for k in sizes:
        out.append(x.narrow(dim, start, k))
        start += k
    return out


def _unbind(x: torch.Tensor, dim: int = 0) -> tuple[torch.Tensor, ...]:
    return tuple(x.select(dim, i) for i in range(x.shape[dim]))


_SPLIT_VIEWS: dict[Any, Callable[..., Any]] = {
    aten.split.Tensor: _split_tensor,
    aten.split_with_sizes.default: _split_with_sizes,
    aten.unbind.int: _unbind,
}
_RESHAPING = {aten.resize_.default, aten.set_.source_Tensor, aten.set_.default}


def _out_of_place(func: Any) -> Any | None:
    """``aten.squeeze_.dim`` -> ``aten.squeeze.dim`` (None where there is no such overload)."""
    name = func._schema.name.split("::")[1]
    if not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    same = getattr(packet, func._overloadname, None)
    if same is not None:
        return same
    want = [(a.name, str(a.type)) for a in func._schema.arguments[1:]]
    for ov in packet.overloads():  # transpose_.default -> transpose.int: the same arguments
        cand = getattr(packet, ov)
        if [(a.name, str(a.type)) for a in cand._schema.arguments[1:]] == want:
            return cand
    return None


def _same(v: Any, d: Any) -> bool:
    """``v`` is the schema default ``d`` (as the IValue comparison PyTorch uses)."""
    if d is None or v is None:
        return d is None and v is None
    if isinstance(v, torch.Tensor) or isinstance(d, torch.Tensor):
        return False
    try:
        return bool(type(v) is type(d) and v == d)
    except Exception:  # noqa: BLE001
        return False


def _buffer(t: torch.Tensor) -> int:
    """The address of ``t``'s buffer (0: none, or not a strided tensor)."""
    if t.layout != torch.strided or not torch._C._has_storage(t):
        return 0
    return t.untyped_storage().data_ptr()


def _geo(m: torch.Tensor) -> tuple:
    return (list(m.shape), list(m.stride()), m.storage_offset(), m.dtype)


def _meta_like(x: torch.Tensor) -> torch.Tensor:
    size, stride, off = tuple(x.shape), x.stride(), x.storage_offset()
    need = 0 if 0 in size else off + 1 + sum((s - 1) * st for s, st in zip(size, stride))
    base = torch.empty(max(need, off), dtype=x.dtype, device="meta")
    return base.as_strided(size, stride, off)


def _is_tensor(a: Any) -> bool:
    return isinstance(a, torch.Tensor)


def _is_cpu(d: Any) -> bool:
    return d is not None and torch.device(d).type == "cpu"


def python_ops() -> dict[str, int]:
    """Python-fallback calls per op since the process started."""
    return dict(counts)
