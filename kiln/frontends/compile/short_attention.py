"""``scaled_dot_product_attention`` over short keys -> the attention chain, on Dynamo's graph.

``transformers`` models (GPT-2, BERT, Llama: their default "sdpa" attention) call
``F.scaled_dot_product_attention`` themselves.  On this CPU ATen runs it as its flash kernels,
forward and backward, blocked with an online softmax; for short keys the plain chain as *Kiln*
compiles it is faster (two batched GEMMs around one fused scale/mask/softmax kernel, and the
backward's pointwise work fused as well).  Measured 2026-12-02 on the same chain, written out
(causal, ``torch.compile(backend="kiln")``, forward + backward, 2 threads): B=8 H=4 E=32 at
L=S=64 0.74 ms as the chain vs 1.11 ms as SDPA, L=S=128 2.9 vs 4.8; from 256 keys on SDPA is level
or ahead and keeps no (B, H, L, S) probabilities for backward (see
:mod:`kiln.frontends.compile.attention`, which rewrites the other way from ``MIN_KEYS`` on: the
two passes share that threshold, so no chain is rewritten back and forth).

The call becomes ``torch.ops.kiln.attention_chain`` (defined here), an op whose only kernel is
``CompositeImplicitAutograd``: AOTAutograd traces through it, so forward and backward are the
chain's ATen ops, and AOTAutograd's cache accepts the op (the key holds this file's text)::

    s = (q @ k^T) * scale                       # scale: the call's, else 1/sqrt(E)
    s = s.masked_fill(~causal | ~bool_mask, -inf)
    p = softmax(s, -1);  y = p @ v

Both products are ``kiln::matmul_strided`` (:mod:`kiln.ir.matmul_strided`): q/k/v are read through
their strides and y comes out laid out as (B, L, H, E), so no head is copied forward or backward
(under grouped-query heads ``torch.matmul``, see ``_attention_chain``).

SDPA's semantics are kept where they differ from a naive chain: the causal mask is aligned top
left (query i sees keys 0..i, as SDPA's ``is_causal``); under ``enable_gqa`` query head h reads
k/v head ``h // n`` (each k/v head's n query heads are stacked into one taller query, so k and v
are read without being repeated); a row whose every score is masked
is 0 with zero gradients (SDPA's result; a plain softmax gives NaN): with a mask, the scores of
such rows are replaced by zeros before the softmax and the row of ``y`` is multiplied by 0 --
exact elsewhere (``* 1``); ``is_causal`` masks no row.

A float (additive) mask stays SDPA (``sdpa_kept:float mask``): a row whose every value is a large
finite negative number (``transformers``' ``finfo.min`` masks under left padding and a causal
mask) rounds every score of the row to that number; the chain's softmax is then uniform there, as
a hand-written eager chain's is, and SDPA's kernel computes those rows' gradients otherwise (a
16-key case with four such rows: the forward the same, q's gradient 11.9 off where eager's
largest was 12.7).  Whether a row is masked whole depends on the data, so no float mask is taken.

Matched: calls with float32 rank-4 q/k/v (no zero-size dim; k and v with the same heads, q with a
whole multiple of them under ``enable_gqa``), ``dropout_p`` 0, a key length below ``MIN_KEYS``
(a symbolic one judged by its hint), no mask or a bool mask of rank <= 4, not both a mask and
``is_causal`` (SDPA refuses that), and outside autocast.  Left as
SDPA: everything else, counted as ``sdpa_kept`` with the reason; a call whose chain cannot be
built on Dynamo's fake tensors stays SDPA too, counted as a fallback naming the error.

Needs: a Dynamo FX graph with ``example_value`` metadata.  Guarantees: SDPA's values up to the
GEMMs' summation order and where the scale is applied (observed <= 1e-6 absolute on unit-scale
inputs, forward and gradients); the node's metadata recomputed for the new op; off with
``KILN_DISABLE_PASSES=short_attention``; each rewritten call counted as ``sdpa_to_chain``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from kiln import metrics
from kiln.config import config
from kiln.frontends.compile.attention import _f32_4d, _long_keys, _val, uses_autocast
from kiln.frontends.compile.rewrite_done import example_values, finish
from kiln.ir import matmul_strided

_SDPA = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "attention_chain(Tensor q, Tensor k, Tensor v, Tensor? mask, bool causal, float scale) -> Tensor"
)


def _attention_chain(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    """SDPA as the chain (module docstring); ``mask`` a bool mask or None."""
    b, h, length, e = q.shape
    groups = h // k.size(1)
    # The products read q/k/v through their strides (no head copies) and y comes out dense as
    # (B, L, H, E), the layout the model's transpose(1, 2) back reads (kiln.ir.matmul_strided).
    # Not under grouped-query heads: the taller query below is a view where q is dense (a Kiln
    # kernel's output) and its result (B, KV, groups * L, E) has no layout that is (B, L, H, E)
    # too; splitting the heads instead (k and v with a stride-0 groups dim) measured 1-2% slower
    # on the Llama workload (the k/v gradients then need a sum over the groups)
    strided = groups == 1 and "strided_matmul" not in config.disabled_passes
    if groups != 1:
        # grouped-query attention: query head h reads k/v head h // groups, so each k/v head's
        # query heads become one taller query (rows r = g * L + i): k and v are read as they are
        q = q.reshape(b, k.size(1), groups * length, e)
    kt = k.transpose(-2, -1)
    scores = (matmul_strided.OP(q, kt) if strided else torch.matmul(q, kt)) * scale
    if causal:
        rows = torch.arange(q.size(-2), device=q.device) % length
        cols = torch.arange(k.size(-2), device=q.device)
        scores = scores.masked_fill(rows[:, None] < cols[None, :], -math.inf)
    elif mask is not None:
        if groups != 1:
            mask = _grouped_mask(mask, k.size(1), groups, length)
        scores = scores.masked_fill(~mask, -math.inf)  # a bool mask (float masks stay SDPA)
    dead = None
    if mask is not None:  # a bool mask may mask a whole row
        dead = (~mask).all(dim=-1, keepdim=True)
        scores = torch.where(dead, 0.0, scores)  # no -inf row into the softmax: no NaN
    p = torch.softmax(scores, dim=-1)
    y = matmul_strided.OP(p, v, [0, 2, 1, 3]) if strided else torch.matmul(p, v)
    if dead is not None:
        y = y * (~dead).to(y.dtype)  # SDPA: 0 for a row with nothing to attend to
    return y.reshape(b, h, length, v.size(-1)) if groups != 1 else y


def _grouped_mask(mask: torch.Tensor, kv: int, groups: int, length: int) -> torch.Tensor:
    """A mask broadcastable to (B, H, L, S) -> one broadcastable to (B, KV, groups * L, S)."""
    while mask.dim() < 4:
        mask = mask[None]
    mb, mh, rows, s = mask.shape
    if mh == 1 and rows == 1:
        return mask  # the same for every head and row
    mask = mask.expand(mb, mh, length, s)
    if mh == 1:  # the same for every head: repeated for each group's rows
        mask = mask[:, :, None].expand(mb, 1, groups, length, s)
        return mask.reshape(mb, 1, groups * length, s)
    return mask.reshape(mb, kv, groups * length, s)


_LIB.impl("attention_chain", _attention_chain, "CompositeImplicitAutograd")
_CHAIN = torch.ops.kiln.attention_chain.default


def _call(n: torch.fx.Node) -> dict[str, Any] | None:
    """The call's arguments by name (defaults filled in), or None for an unexpected spelling."""
    if len(n.args) > len(_PARAMS) or any(k not in _PARAMS for k in n.kwargs):
        return None
    a = dict(_DEFAULTS, enable_gqa=False)
    a.update(zip(_PARAMS, n.args))
    a.update(n.kwargs)
    return a if all(p in a for p in _PARAMS[:3]) else None


def _why_kept(a: dict[str, Any]) -> str | None:
    """None when the call is taken, else the reason it stays SDPA."""
    q, k, v, mask = (_val(a[p]) for p in ("query", "key", "value", "attn_mask"))
    if not (_f32_4d(q) and _f32_4d(k) and _f32_4d(v)):
        return "not float32 rank 4"
    if a["dropout_p"] != 0 or not isinstance(a["dropout_p"], (int, float)):
        return "dropout"
    if not isinstance(a["is_causal"], bool) or not isinstance(a["enable_gqa"], bool):
        return "symbolic flag"
    if a["scale"] is not None and not isinstance(a["scale"], (int, float)):
        return "symbolic scale"
    if a["scale"] is None and not isinstance(q.shape[-1], int):
        return "symbolic head dim"  # the default scale 1/sqrt(E) needs E
    if _long_keys(k.shape[2]):
        return "long keys"
    if k.shape[:2] != v.shape[:2] or k.shape[2] != v.shape[2] or q.shape[0] != k.shape[0]:
        return "shapes"
    if q.shape[-1] != k.shape[-1] or not all(isinstance(s, int) for s in (q.shape[1], k.shape[1])):
        return "shapes"
    if q.shape[1] != k.shape[1] and not (a["enable_gqa"] and q.shape[1] % k.shape[1] == 0):
        return "shapes"
    if a["attn_mask"] is not None:
        if a["is_causal"]:
            return "mask and is_causal"
        if not isinstance(mask, torch.Tensor) or mask.dim() > 4 or mask.requires_grad:
            return "mask"
        if mask.dtype == torch.float32:
            return "float mask"  # a row of large finite values: SDPA's own gradients (above)
        if mask.dtype != torch.bool:
            return "mask dtype"
    return None


def sdpa_to_chain(gm: torch.fx.GraphModule) -> int:
    """Rewrite every matched SDPA call of ``gm`` in place; returns how many."""
    g = gm.graph
    if uses_autocast(g):
        return 0
    found = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in _SDPA:
            continue
        a = _call(n)
        why = "arguments" if a is None else _why_kept(a)
        if why is not None:
            metrics.incr(f"sdpa_kept:{why}")
            continue
        q = _val(a["query"])
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(q.shape[-1])
        mask = a["attn_mask"]
        args = (a["query"], a["key"], a["value"], mask, a["is_causal"], float(scale))
        fake_mode = getattr(q, "fake_mode", None)
        ex = torch.fx.node.map_arg(args, _val)
        try:
            with example_values(fake_mode):
                example = _CHAIN(*ex)
        except Exception as e:  # noqa: BLE001 - the call stays SDPA, which raises its own error
            metrics.fallback(f"sdpa_to_chain ({type(e).__name__}: {e})")
            continue
        n.target, n.args, n.kwargs = _CHAIN, args, {}
        n.meta["example_value"] = example
        found += 1
    return finish(gm, found, "sdpa_to_chain")


__all__ = ["sdpa_to_chain"]
