"""SDPA without dropout as an op that draws no random numbers, where a checkpoint recomputes it.

ATen's CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``) is tagged
``nondeterministic_seeded`` for its dropout, whatever ``dropout_p`` is.  In an activation
checkpoint's region (``torch.utils.checkpoint``, ``transformers``' gradient checkpointing) the
partitioner recomputes it in backward and, for a random op, wraps both calls in
``run_and_save_rng_state`` / ``run_with_rng_state`` to replay the forward's random numbers.  Kiln
does not lower those wrappers, so the whole forward and backward graph of a checkpointed model
with SDPA attention (GPT-2, BERT, ViT) ran on ATen, op by op (a counted ``graph:`` fallback).

With ``dropout_p == 0`` the kernel draws nothing: before the partition, such a call in a
checkpointed region becomes ``kiln::sdpa_cpu_no_dropout`` (the same kernel, untagged), and the
compile frontend lowers it back to ATen's op (``fx._AS``).

Needs: AOTAutograd's joint graph, before partitioning.  Guarantees: only calls whose dropout
probability is the number 0 and that the checkpoint policy recomputes are changed; values as
before (the same ATen kernel); counted as ``sdpa_rng_wrappers_avoided``.
"""

from __future__ import annotations

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from kiln import metrics

ATEN_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "sdpa_cpu_no_dropout(Tensor query, Tensor key, Tensor value, bool is_causal=False, *, "
    "Tensor? attn_mask=None, float? scale=None) -> (Tensor, Tensor)"
)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return ATEN_SDPA(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)


_LIB.impl("sdpa_cpu_no_dropout", _sdpa, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::sdpa_cpu_no_dropout", _sdpa, lib=_LIB)
OP = torch.ops.kiln.sdpa_cpu_no_dropout.default
_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _dropout_p(node: torch.fx.Node) -> object:
    if len(node.args) > 3:
        return node.args[3]
    return node.kwargs.get("dropout_p", 0.0)


def untag_draw_free_sdpa(graph: torch.fx.Graph) -> int:
    """Swap checkpointed SDPA calls with ``dropout_p == 0`` for :data:`OP`; returns how many."""
    found = 0
    for node in graph.find_nodes(op="call_function", target=ATEN_SDPA):
        p = _dropout_p(node)
        if isinstance(p, bool) or not isinstance(p, (int, float)) or p != 0:
            continue
        if node.meta.get("recompute") not in _RECOMPUTED:
            continue
        q, k, v = node.args[:3]
        causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
        kwargs = {n: node.kwargs[n] for n in ("attn_mask", "scale") if n in node.kwargs}
        node.target = OP
        node.args = (q, k, v, causal)
        node.kwargs = kwargs
        found += 1
    if found:
        metrics.incr("sdpa_rng_wrappers_avoided", found)
    return found


def as_aten(args: tuple, kwargs: dict) -> tuple[object, tuple, dict]:
    """``kiln::sdpa_cpu_no_dropout`` -> ATen's kernel with ``dropout_p=0.0`` (for ``fx._AS``)."""
    q, k, v, *rest = args
    causal = rest[0] if rest else kwargs.get("is_causal", False)
    kw = {n: kwargs[n] for n in ("attn_mask", "scale") if n in kwargs}
    return ATEN_SDPA, (q, k, v, 0.0, causal), kw
