"""One OpInfo op in one Kiln mode, judged against eager: the rules of the sweep.

``op_outcomes(name, mode)`` gives both checks (``fwd``, ``grad``) of one op, every sample, as
:class:`opinfo_runner.Outcome`; it never raises.  The rules (test_opinfo's docstring has them in
full): a sample whose eager run raises is skipped; a Kiln error or a value different from eager
fails; random ops compare shapes and dtypes only; a pass fails when an ATen op Kiln claims fell
back, or when the op under test is one Kiln claims and no Kiln graph ran.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from opinfo_expected import NO_GRAPH, NOT_RANDOM, RANDOM, allowed_fallbacks, crashes
from opinfo_runner import (
    EagerFailed,
    Outcome,
    _Error,
    compare,
    kiln_results,
    max_samples,
    rounding_only,
    run_eager,
    samples,
    spread,
)
from torch.testing._internal.common_methods_invocations import op_db

from kiln.ir.ops import OPS as OPS_TABLE
from kiln.ir.ops import Category
from kiln.lowering.fallback import FALLBACK as FALLBACK_TABLE

MODES = ("lazy", "compile")
CHECKS = ("fwd", "grad")


def op_id(op: Any) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


OPS = {op_id(op): op for op in op_db}


def is_random(name: str) -> bool:
    """Random ops: listed, or an OpInfo that wraps its op in ``wrapper_set_seed``."""
    if name in NOT_RANDOM:
        return False
    fn = OPS[name].op
    code = getattr(fn, "__code__", None)
    return name in RANDOM or (code is not None and "wrapper_set_seed" in code.co_names)


def op_outcomes(name: str, mode: str) -> dict[str, Outcome]:
    """Both checks of one op in one mode, every sample; never raises."""
    op = OPS[name]
    out: dict[str, Outcome] = {}
    if not op.supports_autograd:
        out["grad"] = Outcome("skip", "op does not support autograd")
    for check in CHECKS:
        crash = crashes(name, mode, check)
        if crash is not None:
            out[check] = Outcome("fail", f"not run: {crash}")
    if "fwd" in out:  # nothing runs without the forward
        out.setdefault("grad", out["fwd"])
        return out
    want_grad = "grad" not in out
    # the samples' random values do not depend on what the process ran before (a worker's
    # earlier ops): a failure reproduces with the op alone
    torch.manual_seed(zlib.crc32(name.encode()))
    try:
        ss = spread(samples(op, None, requires_grad=op.supports_autograd), max_samples(mode))
    except Exception as e:  # noqa: BLE001 - reported as the op's skip reason
        skip = Outcome("skip", f"sample_inputs raised {type(e).__name__}: {e}")
        return {"fwd": skip, "grad": out.get("grad", skip)}
    # eager first (one run per sample gives its forward and gradients): the samples it runs are
    # the ones compared
    exp_fwd, exp_grad, eager_err = [], [], {"fwd": "", "grad": ""}
    for s in ss:
        try:
            fwd, g, grad_err = run_eager(op, s, want_grad)
        except EagerFailed as e:
            eager_err["fwd"] = eager_err["grad"] = f"eager raised: {e}"
            continue
        exp_fwd.append((s, fwd))
        if grad_err:
            eager_err["grad"] = grad_err
        exp_grad.append(g)
    if not exp_fwd:
        skip = Outcome("skip", eager_err["fwd"] or "no sample")
        return {"fwd": skip, "grad": out.get("grad", skip)}
    mask = [g is not None for g in exp_grad]
    got_fwd, got_grad, ph = kiln_results(mode, op, [s for s, _ in exp_fwd], mask)
    rnd = is_random(name)
    judged = [s for s, _ in exp_fwd]
    fwd = _judge(
        op,
        judged,
        "fwd",
        got_fwd,
        [e for _, e in exp_fwd],
        [True] * len(mask),
        rnd,
        eager_err["fwd"],
    )
    fwd.fallbacks, fwd.kiln_graphs = dict(ph.fwd), ph.fwd_graphs
    out["fwd"] = _claims(name, mode, "fwd", fwd)
    if want_grad:
        grad = _judge(op, judged, "grad", got_grad, exp_grad, mask, rnd, eager_err["grad"])
        grad.fallbacks, grad.kiln_graphs = dict(ph.all), ph.all_graphs
        out["grad"] = _claims(name, mode, "grad", grad)
    return out


def _judge(
    op: Any,
    ss: list,
    check: str,
    got: list,
    expected: list,
    mask: list[bool],
    rnd: bool,
    why_none: str,
) -> Outcome:
    """The first sample that differs from eager, or a pass (a skip when none was compared).

    A sample beyond ``assert_close``'s tolerance of eager passes only when a float64 run of it
    shows the difference is rounding: Kiln's error is at most ``ROUNDING_FACTOR`` times eager's
    (:func:`opinfo_runner.rounding_only`; e.g. a sum with cancellation added in another order);
    those samples are counted in the outcome's detail."""
    n = rounded = 0
    for i, (s, a, e, m) in enumerate(zip(ss, got, expected, mask)):
        if not m:
            continue
        n += 1
        problem = a.msg if isinstance(a, _Error) else compare(a, e, rnd)
        rounding = problem is not None and not isinstance(a, _Error) and not rnd
        if rounding and rounding_only(op, s, check, a, e):
            rounded += 1
            problem = None
        if problem is not None:
            return Outcome("fail", f"sample {i}: {problem}", samples=n)
    if n == 0:
        return Outcome("skip", why_none or "no sample ran in eager")
    detail = (
        f"{rounded} samples differ from eager by rounding only (float64-judged)" if rounded else ""
    )
    return Outcome("pass", detail, samples=n)


def _claims(name: str, mode: str, check: str, result: Outcome) -> Outcome:
    """A pass where Kiln did not compute what it claims is a failure (but for the fallbacks
    opinfo_expected.ALLOWED_FALLBACKS justifies)."""
    if result.status != "pass":
        return result
    allowed = allowed_fallbacks(name, mode, check)
    claimed = sorted(f for f in result.fallbacks if kiln_computes(f) and f not in allowed)
    if claimed:
        result.status = "fail"
        result.detail = f"ops Kiln claims fell back to ATen: {claimed}"
    elif (
        result.kiln_graphs == 0
        and kiln_computes(packet(name))
        and (name, mode) not in NO_GRAPH
        and (name, "*") not in NO_GRAPH
    ):
        result.status = "fail"
        result.detail = f"no Kiln graph ran (Kiln claims {packet(name)!r})"
    return result


def kiln_computes(pkt: str) -> bool:
    """Whether Kiln claims this ATen packet: lowered to a Kiln op that computes (not a view,
    not opaque, not in the fallback table): such an op must run in a Kiln graph."""
    od = OPS_TABLE.get(pkt)
    return (
        od is not None
        and pkt not in FALLBACK_TABLE
        and od.category not in (Category.OPAQUE, Category.META, Category.VIEW)
    )


def packet(name: str) -> str:
    """The ATen packet an OpInfo op id stands for (``nn.functional.relu`` -> ``relu``,
    ``linalg.vector_norm`` -> ``linalg_vector_norm``, variants dropped)."""
    base = OPS[name].name
    for prefix, repl in (("nn.functional.", ""), ("linalg.", "linalg_"), ("special.", "special_")):
        if base.startswith(prefix):
            base = repl + base[len(prefix) :]
    return base.replace(".", "_")
