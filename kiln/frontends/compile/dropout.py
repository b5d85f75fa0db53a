"""``dropout(x, p=0)`` -> ``x``, on the graph Dynamo captured.

Models keep their dropout layers with ``p=0.0`` (nanoGPT's default config, most ``transformers``
configs' attention and hidden dropout at fine-tuning or pre-training time), so a training step's
graph calls ``F.dropout(x, 0.0, True)``.  Eager PyTorch returns ``x`` itself for ``p == 0`` (ATen's
``_dropout_impl``: no copy, no mask), but AOTAutograd's decomposition of ``aten.dropout`` makes it
``x.clone()``.  Where the copy is read only by other ops Kiln's ``simplify`` drops it, but where
its value is saved for backward (the attention probabilities before ``p @ v``) the forward then
saves both ``x`` and its copy: on the tiny GPT 1 MB more peak tensor memory than eager's step
(16.5 vs 15.5 MB).  With the call gone the graph is what eager runs.

Matched: ``torch.nn.functional.dropout`` / ``torch.dropout`` calls (``nn.Dropout`` is inlined by
Dynamo into the former) whose probability is the Python number 0 (any ``training``/``inplace``:
each returns its input, the same tensor object), also inside the subgraphs of higher-order ops
(``torch.utils.checkpoint``'s body).

Needs: a Dynamo FX graph.  Guarantees: eager's values and aliasing (the same tensor flows on);
off with ``KILN_DISABLE_PASSES=dropout``; each call removed counted as ``dropout_p0_removed``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from kiln.frontends.compile.rewrite_done import finish

_DROPOUT = (F.dropout, torch.dropout)


def _p(n: torch.fx.Node) -> Any:
    """The node's dropout probability argument (``F.dropout``'s default 0.5), as written."""
    if len(n.args) > 1:
        return n.args[1]
    return n.kwargs.get("p", 0.5)


def _is_dropout(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target in _DROPOUT


def _drop_in(gm: torch.fx.GraphModule) -> int:
    g = gm.graph
    found = 0
    for n in list(g.nodes):
        if not _is_dropout(n) or not n.args:
            continue
        p = _p(n)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or p != 0:
            continue
        x = n.args[0]
        if not isinstance(x, torch.fx.Node):
            continue
        n.replace_all_uses_with(x)
        g.erase_node(n)
        found += 1
    return finish(gm, found, "dropout_p0_removed")


def drop_zero_dropout(gm: torch.fx.GraphModule) -> int:
    """Replace every ``dropout`` with probability 0 by its input, in the graph and in the
    subgraphs its higher-order ops call (an activation checkpoint's body: left there, the random
    op made AOTAutograd save and replay RNG states, ``run_and_save_rng_state``, which Kiln does
    not lower, so the whole graph ran on ATen); returns how many."""
    return sum(_drop_in(m) for _, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule))
