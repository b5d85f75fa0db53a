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
RANDOM: frozenset[str] = frozenset({
    "bernoulli", "multinomial", "normal", "normal.number_mean", "normal.in_place", "log_normal",
    "rand_like", "randn", "randn_like", "randint", "randint_like", "uniform", "cauchy",
    "exponential", "geometric",
    "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
    "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
    "nn.functional.rrelu",
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted",
})

# Wrapped in OpInfo's wrapper_set_seed but deterministic: compared by value.
NOT_RANDOM: frozenset[str] = frozenset({"item", "nn.functional.feature_alpha_dropout.without_train"})

EXPECTED: dict[tuple[str, str, str], str] = {
}


# Failures that take the whole test process down (a C++ abort): never run, always xfail.
CRASHES: dict[tuple[str, str, str], str] = {
}


def _lookup(table: dict, op: str, mode: str, check: str) -> str | None:
    for key in ((op, mode, check), (op, mode, "*"), (op, "*", check), (op, "*", "*")):
        if key in table:
            return table[key]
    return None


def expected_failure(op: str, mode: str, check: str) -> str | None:
    return _lookup(EXPECTED, op, mode, check) or _lookup(CRASHES, op, mode, check)


def crashes(op: str, mode: str, check: str) -> str | None:
    return _lookup(CRASHES, op, mode, check)
