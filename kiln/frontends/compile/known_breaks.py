"""Graph breaks Dynamo knows at once, compiled without tracing the frame a second time.

When Dynamo (torch 2.13) cannot trace a call, it does not compile the graph it has so far: it
marks the instruction in its speculation log and traces the whole frame again from its first
instruction, and only at that instruction, the second time, compiles the partial graph and the
frame's resume function (``break_graph_if_unsupported`` -> ``fail_and_restart_analysis``).  The
restart is how Dynamo undoes whatever a failed attempt changed (a half-inlined function's
nodes, guards, side effects, grad mode).  A training step pays it on every frame that ends in
such a call: ``loss.backward()`` (Dynamo does not trace it) re-traces the whole forward, and
the optimizer's ``torch._dynamo.graph_break()`` calls re-trace the optimizer's frames.

One call fails before it changes anything: ``Tensor.backward()`` (Dynamo's ``method_backward``
raises on its first line unless ``trace_autograd_ops`` is on), met directly in the frame being
traced (not inside a function Dynamo was inlining).  For it, :func:`install` compiles the partial
graph right away, in the first pass, with the stack (and, before Python 3.13, the call's keyword names) put back as they were before
the call: what the
second pass would have reached, without tracing everything before it again (the forward, in a
training step).  An explicit ``torch._dynamo.graph_break()`` is not one: calling it adds a guard
on the function the second pass does not add.  Only when all of this holds, else Dynamo restarts
as before:

- the frame is compiled by Kiln's backend (``is_ours`` on its compiler), the instruction is
  ``CALL`` in the frame's own translator (``InstructionTranslator``'s dispatch table; inlined
  calls have their own translator class and table);
- the failure was ``Tensor.backward()``'s, and its stack names only this frame;
- the attempt left the graph's nodes, the guards, the graph inputs, the fake tensors tracked,
  the registered modules, the shape guards and the side effects as they were (counted before and
  after).

The graph, its guards and the resume function are then built by Dynamo's own
``handle_graph_break``, as in the second pass.  Installed with the other trace wrappers
(``backend._install_trace_wrappers``), only over torch 2.13's own ``CALL``;
``graph_break_retraces_skipped`` counts the passes saved.
"""

from __future__ import annotations

import dis
import functools
from collections.abc import Callable
from typing import Any

from kiln import metrics
from kiln.frontends.compile.torch_wrap import release_checked

# what Dynamo's Unsupported says first for the failures that change nothing before raising
_KNOWN = ("Unsupported Tensor.backward() call",)


def _state(tx: Any) -> tuple[int, ...]:
    """Counts of what a failed call attempt could have added to the trace."""
    out = tx.output
    se = out.side_effects
    return (
        len(out.graph.nodes),
        len(out.guards),
        len(out.input_source_to_var),
        len(out.tracked_fakes),
        len(out.nn_modules),
        len(out.shape_env.guards) if out.shape_env is not None else 0,
        len(se.id_to_variable),
        sum(len(v) for v in se.store_attr_mutations.values()),
        len(se.keepalive),
    )


def _closure_value(fn: Callable[..., Any], name: str) -> Any:
    cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
    cell = cells.get(name)
    return None if cell is None else cell.cell_contents


def _wrap(
    original: Callable[..., Any],
    handle_graph_break: Callable[..., Any],
    is_ours: Callable[[Any], bool],
) -> Callable[..., Any]:
    from torch._dynamo import exc

    @functools.wraps(original)
    def CALL(self: Any, inst: Any) -> Any:
        if not is_ours(self.output.compiler_fn):
            return original(self, inst)
        log = self.speculation_log
        stack, before, index = list(self.stack), _state(self), log.index
        kw_names = getattr(self, "kw_names", None)  # a failed call clears it (3.11, 3.12)
        try:
            return original(self, inst)
        except exc.SpeculationRestartAnalysis:
            entry = log.entries[index] if index < len(log.entries) else None
            reason = entry.reason if entry is not None else None
            if (
                entry is None
                or entry.inst is not inst
                or reason is None
                or not str(reason.reason).startswith(_KNOWN)
                or len(reason.user_stack) != 1
                or _state(self) != before
            ):
                raise
            self.stack[:] = stack
            if kw_names is not None:
                self.kw_names = kw_names
            self.current_instruction_push = True  # as CALL's own wrapper sets it
            metrics.incr("graph_break_retraces_skipped")
            return handle_graph_break(self, inst, reason)

    CALL.__kiln_wrapped__ = original  # type: ignore[attr-defined]
    return CALL


def install(is_ours: Callable[[Any], bool]) -> bool:
    """Put the wrapper in the frame translator's dispatch table for ``CALL`` (once per process;
    Dynamo looks opcodes up there, per class); whether it is in place."""
    if not release_checked():  # as torch_wrap.wrap_once, for a dispatch table's entry
        return False
    from torch._dynamo import symbolic_convert as sc

    base = getattr(sc, "InstructionTranslatorBase", None)
    root = getattr(sc, "InstructionTranslator", None)
    table = getattr(root, "dispatch_table", None)
    op = dis.opmap.get("CALL")
    if base is None or not isinstance(table, list) or op is None:
        return False
    current = table[op]
    if hasattr(current, "__kiln_wrapped__"):
        return True
    handle = _closure_value(current, "handle_graph_break") if current is not None else None
    if current is not base.__dict__.get("CALL") or not callable(handle):
        return False  # not torch's own handler: leave it
    table[op] = _wrap(current, handle, is_ours)
    return True
