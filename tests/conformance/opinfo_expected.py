"""Known OpInfo failures of Kiln, each with its reason, and the ops compared by shape/dtype only.

``EXPECTED`` maps ``(op id, mode, check)`` to the reason; ``mode`` is "lazy", "compile" or "*",
``check`` is "fwd", "grad" or "*".  A wrong result is always listed here with its max abs diff:
it must never pass silently.  Remove an entry as soon as Kiln is fixed
(``bench/opinfo_report.py`` lists entries that pass).
"""

from __future__ import annotations

# Random ops: Kiln's lazy device seeds each step's random ops from its own per-step seed, so the
# values cannot match eager's stream; only shapes and dtypes are compared.  Same for ops whose
# output is uninitialized memory.
RANDOM: frozenset[str] = frozenset(
    {
        "bernoulli",
        "multinomial",
        "normal",
        "normal.number_mean",
        "normal.in_place",
        "log_normal",
        "rand_like",
        "randn",
        "randn_like",
        "randint",
        "randint_like",
        "uniform",
        "cauchy",
        "exponential",
        "geometric",
        "nn.functional.dropout",
        "nn.functional.dropout2d",
        "nn.functional.dropout3d",
        "nn.functional.alpha_dropout",
        "nn.functional.feature_alpha_dropout.with_train",
        "nn.functional.rrelu",
        "empty",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "empty_strided",
        "empty_permuted",
    }
)

# Wrapped in OpInfo's wrapper_set_seed but deterministic: compared by value.
NOT_RANDOM: frozenset[str] = frozenset(
    {
        "item",
        "nn.functional.feature_alpha_dropout.without_train",
    }
)

# Ops Kiln claims (a computing Kiln op) whose passing run executed no Kiln graph, and why that is
# right.  Anything else that runs no Kiln graph fails (test_opinfo.check_op).
_FILL_AS_DATA = (
    "its samples' input holds data: the lazy device makes a fill of such a tensor as data at "
    "once, no graph (an optimizer's state; kiln/frontends/lazy/tensor.py FILLS); values still "
    "compared, and a fill of a pending value is recorded (tests/frontends/test_lazy_recording.py)"
)
# (op, mode), mode "*" for both
NO_GRAPH: dict[tuple[str, str], str] = {
    ("contiguous", "*"): "its samples are contiguous already: contiguous() returns its input",
    ("zeros_like", "lazy"): _FILL_AS_DATA,
    ("ones_like", "lazy"): _FILL_AS_DATA,
    ("full_like", "lazy"): _FILL_AS_DATA,
}

_DATA_DEPENDENT = (
    "boolean-mask indexing has a data-dependent output shape: the lazy device runs it eagerly "
    "by design (a sync, counted as a fallback; kiln/frontends/lazy/tensor.py _record)"
)

# ATen ops that Kiln claims but that may run through ATen in this op's run, and why; the values
# are still compared (unlike EXPECTED, which excuses any failure of the op).  Keys as in EXPECTED.
ALLOWED_FALLBACKS: dict[tuple[str, str, str], dict[str, str]] = {
    ("__getitem__", "lazy", "*"): {"index": _DATA_DEPENDENT},
    ("index_put", "lazy", "grad"): {"index": _DATA_DEPENDENT + " (index_put's backward indexes)"},
}

_SPARSE = "sparse tensors are not supported on the lazy device"

EXPECTED: dict[tuple[str, str, str], str] = {
    # --- lazy: ops Kiln claims that ran through ATen (lazy engineer; measured in the full sweep)
    ("logspace", "lazy", "fwd"): "claimed op fell back: logspace ran through ATen",
    ("_native_batch_norm_legit", "lazy", "*"): "claimed op fell back: _native_batch_norm_legit "
    "ran through ATen (and no Kiln graph ran)",
    ("nn.functional.linear_cross_entropy.chunked_none", "lazy", "grad"): "claimed ops fell back: "
    "addmm, amax, div, mm, mul ran through ATen in the gradient",
    # --- lazy: errors
    ("tensor_split", "lazy", "*"): (
        "tensor_split needs its indices tensor on the CPU ('expected tensor_indices_or_sections "
        "to be on cpu, but it's on kiln:0'), while the lazy device rejects CPU tensors of rank > 0 "
        "next to kiln tensors"
    ),
    ("sparse.sampled_addmm", "lazy", "*"): _SPARSE,
    ("sparse.mm.reduce", "lazy", "*"): _SPARSE,
    ("to_sparse", "lazy", "*"): _SPARSE + " ('to(options) doesn't support converting to a "
    "different layout')",
    # --- compile
    ("index_put", "compile", "*"): (
        "no Kiln graph ran: with requires_grad, AOTAutograd cannot trace the boolean-mask samples "
        "(DynamicOutputShapeException: aten.nonzero, a data-dependent shape), and Dynamo runs the "
        "whole frame eagerly ('Backend compiler exception ... Adding a graph break')"
    ),
}


# Failures that take the whole test process down (a C++ abort): never run, always xfail.
CRASHES: dict[tuple[str, str, str], str] = {
    # (fft.hfft's lazy backward aborted the process until the lazy device resolved conjugate
    # views: it passes now.  The sweep runs in worker processes, so a new abort fails its op.)
}


def _lookup(table: dict, op: str, mode: str, check: str) -> str | None:
    for key in ((op, mode, check), (op, mode, "*"), (op, "*", check), (op, "*", "*")):
        if key in table:
            return table[key]
    return None


def allowed_fallbacks(op: str, mode: str, check: str) -> dict[str, str]:
    return _lookup(ALLOWED_FALLBACKS, op, mode, check) or {}


def expected_failure(op: str, mode: str, check: str) -> str | None:
    return _lookup(EXPECTED, op, mode, check) or _lookup(CRASHES, op, mode, check)


def crashes(op: str, mode: str, check: str) -> str | None:
    return _lookup(CRASHES, op, mode, check)
