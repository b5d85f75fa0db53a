"""Hand-written attention -> ``F.scaled_dot_product_attention``, on the graph Dynamo captured.

Models that spell attention out (nanoGPT, ``transformers``' "eager" attention) run
``matmul(softmax(matmul(q, k^T) * s [masked]), v)`` as separate ops: two batched GEMMs over
materialized head layouts, a (B, H, L, S) probability tensor saved for backward, and a four-GEMM
backward.  ATen's CPU flash-attention kernels (kept whole by Kiln, forward and backward) do the same
math blocked, with an online softmax, reading q/k/v through their strides and saving only the
log-sum-exp.  Measured on this machine (eager, 1 thread, CPU time, forward + backward, B=8 H=4
L=S=64 E=32, additive mask): 2.3 ms hand-written vs 1.8 ms SDPA.  Inductor matches the same patterns
(``torch/_inductor/fx_passes/fuse_attention.py``); this pass runs before AOTAutograd, so forward
and backward both use the fused kernels.

Only for long keys (``S >= MIN_KEYS``, 256): against the chain as *Kiln* compiles it (scale, mask
and softmax one fused kernel over the GEMM's output), the flash kernels lose on short ones.
Measured 2026-12-02 (causal bool mask, ``torch.compile(backend="kiln")``, forward + backward,
medians of 7; hand-written vs rewritten, ms, 2 threads / 1 thread): B=8 H=4 E=32 at L=S=64 0.74 vs
1.11 / 1.25 vs 1.28, L=S=128 2.9 vs 4.8 / 4.4 vs 4.5; B=8 H=4 E=64 L=S=128 5.0 vs 5.1 / 7.1 vs
8.3; B=4 H=8 E=64 L=S=192 7.8 vs 8.8 / 15.1 vs 15.4; from 256 on the rewrite is level or ahead
(B=4 H=8 E=64 L=S=256 13.3 vs 13.5 / 25.7 vs 25.1, B=8 H=4 E=32 L=S=256 8.7 vs 8.4 / 17.1 vs
14.0, L=S=384 and 1024 2-4% ahead) and it does not keep the (B, H, L, S) probabilities for
backward.  A symbolic key length is judged by its hint (Dynamo's first size); a chain kept for
short keys is counted as ``attention_kept_short``.  SDPA calls a model makes itself over short keys
go the other way (:mod:`kiln.frontends.compile.short_attention`, the same threshold).

Matched chain (every intermediate with exactly one user)::

    a = matmul(q, transpose(k, -2, -1))     # q (B,H,L,E), k (B,H,S,E), v (B,H,S,Ev), float32
    a = a * s  |  a / s                     # optional, s a Python number
    a = a.masked_fill(m, -inf)  |  a + bias # optional: bool m (True = masked); a bias: kept
    p = softmax(a, dim=-1)                  # dtype None or float32
    p = p.to(float32)                       # optional, a no-op cast
    p = dropout(p, 0.0, ...)                # optional, only p == 0
    y = matmul(p, v)

becomes ``y = scaled_dot_product_attention(q, k, v, attn_mask=~m, scale=s)`` (scale 1.0 when
the scores are not scaled).  A row whose scores are all ``-inf`` is NaN in eager (softmax of
nothing) and 0 in SDPA, so the rewrite adds eager's NaNs back, in the forward and in the same
gradients as eager: ``masked_fill``'s backward zeroes the masked scores, so only v's gradient turns
NaN, through ``y + sum(v, -2) * where(row all masked, nan, 0)`` (exactly ``y`` elsewhere, except
that with an infinite value in v it turns rows NaN where eager has inf: eager's result is not
finite there either).

A chain with an added float bias is matched but kept as written (counted as
``attention_kept_float_bias``).  ``transformers``' additive masks are ``where(keep, 0,
finfo.min)``: with left padding and a causal mask, the first rows mask every key with a finite
number, so ``score + finfo.min`` rounds every score of the row to ``finfo.min`` and eager's softmax
is uniform there.  SDPA's CPU kernel computes those rows' gradients differently: on a 256-key
case (B=1, H=2, E=16, 40 padded keys) the forward agreed to 2e-6 and q's gradient was 62 off
where eager's largest was 1.7 (found trying a tiny Llama with ``attn_implementation="eager"`` and
left padding as a new user would; its value-projection gradient was 1.78 off against 0.0076).
Whether a row is masked whole depends on the data, and a bias of moderate values (-1e4) still
drops the scores' low bits the two kernels round differently, so no float bias is rewritten.

Not matched (left as written): other dtypes than float32, autocast regions, dropout p > 0, a mask
or bias that requires grad, batch dims that broadcast between q/k/v, zero-size inputs, ranks other
than 4, masked_fill with a finite value.

Needs: a Dynamo FX graph with ``example_value`` metadata.  Guarantees: same values as eager up to
the GEMM summation order (observed <= 5e-7 absolute on unit-scale inputs, forward and gradients);
switched off with ``KILN_DISABLE_PASSES=attention``; each rewrite counted in
``kiln.metrics`` as ``attention_to_sdpa``.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

from kiln import metrics
from kiln.frontends.compile.rewrite_done import example_values, finish

_MATMUL = (torch.matmul, operator.matmul)
_MUL = (operator.mul, torch.mul)
_DIV = (operator.truediv, torch.div)
_ADD = (operator.add, torch.add)
_SOFTMAX = (F.softmax, torch.softmax)
MIN_KEYS = 256  # shortest key length rewritten (module docstring)


def _val(n: Any) -> Any:
    return n.meta.get("example_value") if isinstance(n, torch.fx.Node) else None


def _is(n: torch.fx.Node, fns: tuple, method: str) -> bool:
    if n.op == "call_function":
        return n.target in fns
    return n.op == "call_method" and n.target == method


def _only_user(n: torch.fx.Node) -> torch.fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _arg(n: torch.fx.Node, pos: int, name: str, default: Any = None) -> Any:
    if len(n.args) > pos:
        return n.args[pos]
    return n.kwargs.get(name, default)


def _last_two(n: torch.fx.Node, rank: int) -> bool:
    """``n`` is ``transpose(x, -2, -1)`` (any spelling of the last two dims)."""
    if not _is(n, (torch.transpose,), "transpose") or len(n.args) != 3 or n.kwargs:
        return False
    dims = {d % rank for d in n.args[1:] if isinstance(d, int)}
    return dims == {rank - 2, rank - 1}


def _f32_4d(v: Any) -> bool:
    return (
        isinstance(v, torch.Tensor)
        and v.dtype == torch.float32
        and v.dim() == 4
        and all(not isinstance(s, int) or s > 0 for s in v.shape)
    )


def _long_keys(s: Any) -> bool:
    """Key length ``s`` (an int or a SymInt judged by its hint) is at least ``MIN_KEYS``."""
    if isinstance(s, torch.SymInt):
        s = s.node.hint
    return isinstance(s, int) and s >= MIN_KEYS


class _Match:
    def __init__(self) -> None:
        self.q = self.k = self.v = None
        self.scale = 1.0
        self.keep: torch.fx.Node | None = None  # masked_fill's mask (True = masked)
        self.bias: torch.fx.Node | None = None
        self.chain: list[torch.fx.Node] = []  # matched nodes, first to last


def _match(mm: torch.fx.Node) -> _Match | None:
    """The attention chain starting at the scores matmul ``mm``, or None."""
    if not _is(mm, _MATMUL, "matmul") or len(mm.args) != 2 or mm.kwargs:
        return None
    q, kt = mm.args
    qv = _val(q)
    if not isinstance(kt, torch.fx.Node) or not _f32_4d(qv) or not _last_two(kt, 4):
        return None
    m = _Match()
    m.q, m.k = q, kt.args[0]
    kv = _val(m.k)
    if not _f32_4d(kv) or kv.shape[:2] != qv.shape[:2] or kv.shape[-1] != qv.shape[-1]:
        return None
    m.chain = [mm]
    cur = mm
    nxt = _only_user(cur)
    # optional scale
    if nxt is not None and (_is(nxt, _MUL, "mul") or _is(nxt, _DIV, "div")):
        if len(nxt.args) != 2 or nxt.kwargs:
            return None
        a, b = nxt.args
        div = _is(nxt, _DIV, "div")
        s = b if a is cur else (None if div else a)
        if not isinstance(s, (int, float)) or isinstance(s, bool) or not math.isfinite(s) or s == 0:
            return None
        m.scale = 1.0 / s if div else float(s)
        m.chain.append(nxt)
        cur, nxt = nxt, _only_user(nxt)
    if nxt is None:
        return None
    # optional mask
    if _is(nxt, (torch.masked_fill,), "masked_fill"):
        if len(nxt.args) != 3 or nxt.kwargs or nxt.args[0] is not cur:
            return None
        mask, value = nxt.args[1], nxt.args[2]
        mv = _val(mask)
        if not (isinstance(value, float) and value == -math.inf):
            return None
        if not isinstance(mv, torch.Tensor) or mv.dtype != torch.bool or mv.dim() > 4:
            return None
        m.keep = mask
        m.chain.append(nxt)
        cur, nxt = nxt, _only_user(nxt)
    elif _is(nxt, _ADD, "add"):
        if len(nxt.args) != 2 or nxt.kwargs:
            return None
        a, b = nxt.args
        bias = b if a is cur else a
        bv = _val(bias)
        if not (isinstance(bv, torch.Tensor) and bv.dtype == torch.float32 and bv.dim() <= 4):
            return None
        if bv.requires_grad:
            return None  # SDPA gives no gradient for attn_mask
        m.bias = bias
        m.chain.append(nxt)
        cur, nxt = nxt, _only_user(nxt)
    if nxt is None or not _is(nxt, _SOFTMAX, "softmax") or nxt.args[0] is not cur:
        return None
    dim = _arg(nxt, 1, "dim")
    dtype = _arg(nxt, 3, "dtype") if nxt.op == "call_function" else _arg(nxt, 2, "dtype")
    if dim not in (-1, 3) or dtype not in (None, torch.float32):
        return None
    m.chain.append(nxt)
    cur, nxt = nxt, _only_user(nxt)
    if nxt is not None and nxt.op == "call_method" and nxt.target == "to":
        rest = list(nxt.args[1:]) + list(nxt.kwargs.values())
        if nxt.args[0] is not cur or rest != [torch.float32]:
            return None
        m.chain.append(nxt)
        cur, nxt = nxt, _only_user(nxt)
    if nxt is not None and nxt.op == "call_function" and nxt.target is F.dropout:
        p = _arg(nxt, 1, "p", 0.5)
        if nxt.args[0] is not cur or not isinstance(p, (int, float)) or p != 0:
            return None
        if _arg(nxt, 3, "inplace", False):
            return None
        m.chain.append(nxt)
        cur, nxt = nxt, _only_user(nxt)
    if nxt is None or not _is(nxt, _MATMUL, "matmul") or len(nxt.args) != 2 or nxt.kwargs:
        return None
    if nxt.args[0] is not cur:
        return None
    m.v = nxt.args[1]
    vv = _val(m.v)
    if not _f32_4d(vv) or vv.shape[:2] != qv.shape[:2] or vv.shape[2] != kv.shape[2]:
        return None
    m.chain.append(nxt)
    return m


def _rewrite(g: torch.fx.Graph, m: _Match, new: list[torch.fx.Node]) -> None:
    """Insert the SDPA call (and NaN fix-up) before the chain's last matmul, collecting the new
    nodes in ``new``, then replace and erase the chain (nothing is erased before that point)."""
    last = m.chain[-1]

    fake_mode = getattr(_val(m.q), "fake_mode", None)

    def call(fn: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
        kwargs = kwargs or {}
        n = g.call_function(fn, args, kwargs)
        n.meta["stack_trace"] = last.meta.get("stack_trace")
        # Dynamo's metadata: AOTAutograd's cache needs it on every tensor a method is called on
        ex_args, ex_kwargs = torch.fx.node.map_arg((args, kwargs), _val)
        with example_values(fake_mode):
            n.meta["example_value"] = fn(*ex_args, **ex_kwargs)
        new.append(n)
        return n

    with g.inserting_before(last):
        mask = call(torch.logical_not, (m.keep,)) if m.keep is not None else None
        y = call(
            F.scaled_dot_product_attention,
            (m.q, m.k, m.v),
            {"attn_mask": mask, "dropout_p": 0.0, "is_causal": False, "scale": m.scale},
        )
        if m.keep is not None:
            # masked_fill's backward zeroes the masked scores' gradient: in eager a dead row
            # only makes v's gradient NaN (through p^T dy), never q's or k's.  NaN reaches y
            # and v's gradient through y + sum(v) * where(dead, nan, 0) (exactly y elsewhere).
            dead = call(torch.all, (m.keep,), {"dim": -1, "keepdim": True})
            nan0 = call(torch.where, (dead, math.nan, 0.0))
            vsum = call(torch.sum, (m.v,), {"dim": -2, "keepdim": True})
            y = call(operator.add, (y, call(operator.mul, (vsum, nan0))))
    last.replace_all_uses_with(y)
    for n in reversed(m.chain):
        g.erase_node(n)


def uses_autocast(g: torch.fx.Graph) -> bool:
    """``g`` enters an autocast region that is not switched off (autocast picks other dtypes per
    op: the attention rewrites leave such graphs as written)."""
    for n in g.nodes:
        enter = n.op == "call_function" and getattr(n.target, "__name__", "") == "_enter_autocast"
        if enter and _arg(n, 2, "enabled", True) is not False:
            return True
    return False


def attention_to_sdpa(gm: torch.fx.GraphModule) -> int:
    """Rewrite every matched attention chain of ``gm`` in place; returns how many."""
    g = gm.graph
    if uses_autocast(g):
        return 0
    found = 0
    erased: set[torch.fx.Node] = set()
    for n in list(g.nodes):
        if n in erased or n.op not in ("call_function", "call_method"):
            continue
        try:
            m = _match(n)
        except (TypeError, ValueError, IndexError):
            m = None  # an argument of an unexpected kind: not this pattern
        if m is None:
            continue
        if m.bias is not None:
            # a finite bias can mask a whole row, which SDPA's backward computes unlike eager's
            # softmax (module docstring)
            metrics.incr("attention_kept_float_bias")
            continue
        if not _long_keys(_val(m.k).shape[2]):
            metrics.incr("attention_kept_short")
            continue
        new: list[torch.fx.Node] = []
        try:
            _rewrite(g, m, new)
        except Exception as e:  # noqa: BLE001 - e.g. the fake-tensor metadata could not be made
            for x in reversed(new):  # only added so far: remove them, keep the chain as written
                if not x.users:
                    g.erase_node(x)
            metrics.fallback(f"attention_to_sdpa ({type(e).__name__}: {e})")
            continue
        erased.update(m.chain)
        found += 1
    return finish(gm, found, "attention_to_sdpa")
