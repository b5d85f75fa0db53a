"""A library's logging call inside a compiled frame made beside the graph, not a graph break.

In torch 2.13 Dynamo stops the graph at any ``logging.Logger`` method it meets while tracing
(``LoggingLoggerVariable.call_method``: "logging.Logger method not supported for non-export
cases"), unless the method is in ``torch._dynamo.config.ignore_logging_functions``, which drops
the call altogether.  Libraries log on their default paths: ``transformers``' GPT-2 (its config
names no ``loss_type``) calls ``logger.warning_once(...)`` in its ``loss_function`` property on
every forward.  That one call split GPT-2's training step into two forward graphs, and since a
graph break inside an inlined call makes Dynamo restart each enclosing frame's analysis from its
start, its forward was traced about eight times in the first step.  Measured on the bench step
(1 thread, empty caches, 2026-12-03): first step 4.67 -> 3.33 s, steady step 9.36 -> 8.76 ms,
five Kiln graphs -> three.

For frames compiled with Kiln's backend, :func:`install` moves such a call out of the graph's
way when its arguments hold no tensor (constants and string formats of them; a tensor could
change before a moved call read it, so such a call keeps Dynamo's graph break).  Where it goes:

- called before any of the graph's operations (only its inputs so far): into the code Dynamo runs
  before the graph (``pregraph_bytecode``), so it is made before anything the graph computes, as
  in eager -- also when an operation of the graph then raises (an index out of range);
- called after some: made right after the graph runs, as Dynamo makes ``print`` under
  ``config.reorderable_logging_functions``.  If an operation after the call raises at run time
  (a data-dependent error), the graph raises before the call is made and the message is not
  logged; eager would have logged it before raising.

Either way it is made with the same arguments on the logger the frame holds then, so the level,
the handlers and a ``*_once`` method's memory of what it logged act as in eager.  Also different
from eager: its place among the frame's other side effects (the limit Dynamo documents for
reordered prints), the caller the record names (``funcName``/``lineno``: the compiled frame's,
not the library function's), and under ``fullgraph=True`` such a call no longer raises
(``aot_eager`` raises: Dynamo counts it as a graph break).  It applies only where that is sound,
else Dynamo's graph break stays:

- the method is one that logs and returns None (:data:`_LOGGING_METHODS`), called with
  positional arguments only, each a constant or a string format Dynamo can rebuild
  (``DebuggingVariable.can_reorder_logs``), no tensor among them; a method in
  ``ignore_logging_functions`` is left to Dynamo, which drops it as asked;
- the logger was reached through a source the frame can load it from again;
- the frame is compiled by Kiln's backend (``is_ours`` on the output graph's compiler):
  ``backend="inductor"`` and every other backend keep torch's behaviour;
- not under ``config.nested_graph_breaks`` (torch 2.13 does not emit these calls there) nor
  export (where Dynamo drops logging calls itself).

The calls made after the graph are kept on the frame's root translator: a call recorded on an
inlined function's translator is never made in torch 2.13 (its list is not the one the graph's
epilogue reads).
Installed with the other trace wrappers (``backend._install_trace_wrappers``), only over torch
2.13's own ``call_method``; ``logging_calls_moved`` counts the calls moved.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kiln import metrics
from kiln.frontends.compile.torch_wrap import defined_in, release_checked, wrap_once

# logging.Logger methods that log and return None; the *_once ones are transformers' own
# (transformers.utils.logging sets them on logging.Logger)
_LOGGING_METHODS = frozenset(
    {
        "debug",
        "info",
        "warning",
        "warn",
        "error",
        "critical",
        "log",
        "warning_once",
        "info_once",
        "warning_advice",
    }
)


def _holds_tensor(vt: Any) -> bool:
    """Whether a tensor is among the call's arguments, also inside a string format Dynamo builds
    (an f-string over a tensor) -- its value could change before a moved call reads it."""
    from torch._dynamo.variables import TensorVariable
    from torch._dynamo.variables.misc import StringFormatVariable

    if isinstance(vt, TensorVariable):
        return True
    if isinstance(vt, StringFormatVariable):
        return any(_holds_tensor(a) for a in (*vt.sym_args, *vt.sym_kwargs.values()))
    return False


def _movable(self: Any, tx: Any, name: str, args: list, kwargs: dict, is_ours: Any) -> bool:
    from torch._dynamo import config
    from torch._dynamo.variables.misc import DebuggingVariable

    if kwargs or name not in _LOGGING_METHODS or self.source is None:
        return False
    if tx.export or config.nested_graph_breaks or not is_ours(tx.output.compiler_fn):
        return False
    method = getattr(self.value, name, None)
    if not callable(method):
        return False
    ignored = config.ignore_logging_functions
    if method in ignored or getattr(method, "__func__", None) in ignored:
        return False  # Dynamo drops it, as its user asked
    if any(_holds_tensor(a) for a in args):
        return False
    return DebuggingVariable.can_reorder_logs(method, args, kwargs)


def _before_any_op(tx: Any) -> bool:
    """Whether the frame's graph has no operation yet (only its inputs): a call made before the
    graph then comes before everything the graph computes, as in eager."""
    return all(n.op in ("placeholder", "get_attr") for n in tx.output.graph.nodes)


def _emit_before_graph(tx: Any, fn: Any, args: list) -> None:
    from torch._dynamo.bytecode_transformation import create_call_function, create_instruction
    from torch._dynamo.codegen import PyCodegen

    root = tx.output.root_tx
    cg = PyCodegen(root)
    cg.add_push_null(lambda: cg(fn))
    for arg in args:
        cg(arg)
    cg.extend_output(create_call_function(len(args), False))
    cg.extend_output([create_instruction("POP_TOP")])
    tx.output.pregraph_bytecode.extend(cg.get_instructions())


def _wrap(original: Callable[..., Any], is_ours: Callable[[Any], bool]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call_method(self: Any, tx: Any, name: str, args: list, kwargs: dict) -> Any:
        if not _movable(self, tx, name, args, kwargs, is_ours):
            return original(self, tx, name, args, kwargs)
        from torch._dynamo.source import AttrSource
        from torch._dynamo.variables import ConstantVariable
        from torch._dynamo.variables.misc import DebuggingVariable

        fn = DebuggingVariable(getattr(self.value, name), source=AttrSource(self.source, name))
        if _before_any_op(tx):
            _emit_before_graph(tx, fn, list(args))
        else:
            tx.output.root_tx.debug_locals.append((fn, list(args)))
        metrics.incr("logging_calls_moved")
        return ConstantVariable.create(None)

    return call_method


def install(is_ours: Callable[[Any], bool]) -> bool:
    """Wrap ``LoggingLoggerVariable.call_method`` (once per process); whether it is in place."""
    if not release_checked():
        return False
    from torch._dynamo.variables import misc

    cls = getattr(misc, "LoggingLoggerVariable", None)
    if cls is None:
        return False
    return wrap_once(cls, "call_method", lambda fn: _wrap(fn, is_ours), defined_in(misc.__name__))
