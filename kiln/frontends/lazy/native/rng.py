"""Random ops on the native recorder as graph nodes (issue 10, stage 5).

Mirrors the Python recorder (``lazy/tensor.py``'s ``_record`` for ``Category.RANDOM`` nodes,
``trace.seed``, ``rng_mark`` / ``rng_rewind``, ``_replay_random``):

- A random op (``native_dropout``, ``bernoulli``, ``rand_like``, ``normal``, the functional
  variant of ``uniform_``, ...) is recorded as one node, made as any other Python-fallback node
  (``Handler.record``): no forced sync, no new graph per step.
- The first random op of a trace also records the step's **seed**: a 0-dim int64 CPU tensor
  drawn from the CPU generator as the Python recorder draws it at its cut
  (``torch.randint(0, 2**62, ())``), behind a marker node recorded after that op's node, which
  ``convert.py`` turns into the graph's ``scalar`` input with ``role="seed"`` placed just before
  the first random node, as the Python recorder places it (the compiled graph seeds its random
  ops from it: ``runtime.compiler._seeded``).  A new seed each step is a new input value, not a
  new graph, and ``torch.manual_seed`` makes a step reproducible.
- ``torch.kiln.get_rng_state`` marks the state with how many random ops this trace recorded
  (:meth:`RandomOps.mark`); ``set_rng_state`` with a state of the same trace makes the random
  ops that follow reuse the recorded draws (:meth:`RandomOps.rewind`), as activation
  checkpointing needs.  The recorded outputs stay referenced until the trace is cut (the Python
  recorder's ``Trace.randoms``), so they are outputs of the cut, as there; the cut lets them go
  (:meth:`RandomOps.cut`).

Needs: the recorder extension (``trace_gen``, ``record_node``, ``add_recipe``, ``alias_of``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kiln.frontends.lazy.native import convert
from kiln.frontends.lazy.tensor import _VALUE_FREE_RANDOM
from kiln.ir.graph import Node, TensorType
from kiln.ir.ops import Category
from kiln.lowering.aten import op_name

if TYPE_CHECKING:
    from kiln.frontends.lazy.native.fallback import Handler, _Op

_SEED_HASH = 0x6B696C6E5F736565  # the seed marker recipe's content hash ("kiln_see")


class RandomOps:
    """The random ops of the native recorder's current trace."""

    def __init__(self, mod: Any) -> None:
        self.mod = mod
        self.gen = -1  # the trace the lists below belong to
        self.seeded = False
        # per random op recorded in this trace: (recipe key, input identities, outputs)
        self.randoms: list[tuple[tuple, tuple, Any]] = []
        self.replay: int | None = None
        self.seed_rid: int | None = None

    def _current(self) -> int:
        gen = self.mod.trace_gen()
        if gen != self.gen:
            self.gen = gen
            self.seeded = False
            self.randoms = []
            self.replay = None
        return gen

    def cut(self) -> None:
        """The trace was cut: its recorded draws are no longer replayable (nor kept alive)."""
        self.gen = -1
        self.seeded = False
        self.randoms = []
        self.replay = None

    def record(self, h: Handler, op: _Op, args: tuple, kwargs: dict) -> Any:
        if not is_random_node(op.func):
            return h.record(op, args, kwargs)  # lowered as another kind of node: a plain one
        gen = self._current()
        key, inputs = h.signature(op, args, kwargs)
        ids = tuple(self._identity(a) for a in inputs)
        if self.replay is not None:
            out = self._replay(op, key, ids, args)
            if out is not None:
                return out
        n = self.mod.trace_len()
        out = h.record(op, args, kwargs, (key, inputs))
        if self.mod.trace_gen() == gen and self.mod.trace_len() > n:  # recorded as a node
            if not self.seeded:
                self._seed()
            self.randoms.append((key, ids, out))
        return out

    def _identity(self, a: Any) -> Any:
        """What tells one graph value of a call from another: a native tensor's storage node,
        trace and chain length with its geometry; a CPU tensor or a lifted float: itself."""
        if isinstance(a, torch.Tensor):
            if self.mod.is_native(a):
                return (*self.mod.tensor_info(a), self.mod.geo_of(a))
            return ("cpu", id(a))
        return ("float", id(a))

    def _seed(self) -> None:
        """The trace's seed, recorded behind its first random node (``convert.py`` moves the
        seed input before that node, where the Python recorder's ``trace.seed`` puts it)."""
        if self.seed_rid is None:
            rid = self.mod.add_recipe([([], [], 0, torch.int64)], _SEED_HASH)
            convert.register(rid, convert.SEED, (), (), (TensorType((), torch.int64),), None)
            self.seed_rid = rid
        value = torch.randint(0, 2**62, (), dtype=torch.int64)
        self.mod.record_node(self.seed_rid, [], [value])  # its output is dropped
        self.seeded = True

    def _replay(self, op: _Op, key: tuple, ids: tuple, args: tuple) -> Any:
        """The next random op after ``set_rng_state`` rewound the RNG to a point of this trace:
        the draw recorded there (as eager's generator would repeat it); None when the program
        took another path (the op is then recorded as a new draw)."""
        k = self.replay
        assert k is not None
        prev_key, prev_ids, prev_out = self.randoms[k]
        self.replay = k + 1 if k + 1 < len(self.randoms) else None
        if prev_key != key:
            self.replay = None
            return None
        func = op.func
        name = func._schema.name.split("::")[1]
        if (
            prev_ids == ids
            or name in _VALUE_FREE_RANDOM
            or (name == "bernoulli" and func._overloadname == "p")
        ):
            return self._alias(prev_out)
        if name == "native_dropout":
            # same mask; the output recomputed from this input: input * mask * (1 / (1 - p))
            mask = self._alias(prev_out[1])
            p = args[1]
            scale = 0.0 if p == 1 else 1.0 / (1.0 - p)
            return (args[0] * mask * scale, mask)
        raise NotImplementedError(
            f"Kiln lazy device (native recorder): {func} was replayed after "
            "torch.kiln.set_rng_state (activation checkpointing recomputes its forward this way) "
            "with different input values than the first time; its draw depends on them, so Kiln "
            "cannot repeat it.  Checkpoint a region without this op, or run it with "
            "use_reentrant=False and preserve_rng_state=False."
        )

    def _alias(self, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return self.mod.alias_of(out)
        return type(out)(self._alias(o) for o in out)

    # -- torch.kiln.get_rng_state / set_rng_state ----------------------------------------------

    def mark(self, state: torch.Tensor) -> None:
        """Tag a state handed out by ``get_rng_state`` with the point of this trace."""
        gen = self._current()
        state._kiln_native_rng_mark = (gen, len(self.randoms))  # type: ignore[attr-defined]

    def rewind(self, state: torch.Tensor) -> None:
        """``set_rng_state(state)``: a state of this trace replays the draws recorded after it;
        any other only rewinds the CPU generator (which seeds later steps)."""
        gen = self._current()
        m = getattr(state, "_kiln_native_rng_mark", None)
        if m is not None and m[0] == gen and m[1] < len(self.randoms):
            self.replay = m[1]
        else:
            self.replay = None


_RANDOM_NODE: dict[Any, bool] = {}


def is_random_node(func: Any) -> bool:
    """Whether ``func`` lowers to a ``Category.RANDOM`` node (what the Python recorder seeds)."""
    r = _RANDOM_NODE.get(func)
    if r is None:
        r = _RANDOM_NODE[func] = Node(op_name(func)[0]).category is Category.RANDOM
    return r


_shared: list[RandomOps] = []  # one per process: every handler installed records into it


def shared(mod: Any) -> RandomOps:
    """The process's random-op state for the recorder extension ``mod`` (a handler installed
    later, e.g. by a test, shares it)."""
    if not _shared or _shared[0].mod is not mod:
        _shared[:] = [RandomOps(mod)]
    return _shared[0]


def active() -> RandomOps | None:
    """The random-op state, once the recorder's handler exists (``torch.kiln``'s RNG calls)."""
    return _shared[0] if _shared else None
