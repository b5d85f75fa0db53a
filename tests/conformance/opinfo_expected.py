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
NO_GRAPH: dict[str, str] = {
    "contiguous": "its samples are contiguous already: contiguous() returns its input",
}

_SPARSE = "sparse tensors are not supported on the lazy device"

EXPECTED: dict[tuple[str, str, str], str] = {
    # --- lazy: wrong results
    ("linalg.eigvals", "lazy", "grad"): "wrong result: max abs diff 0.465 (complex eigenvalue "
    "gradient; likely the conj bit of lazy views)",
    # --- lazy: ops Kiln claims that ran through ATen (lazy engineer; measured in the full sweep)
    ("logspace", "lazy", "fwd"): "claimed op fell back: logspace ran through ATen",
    ("_native_batch_norm_legit", "lazy", "*"): "claimed op fell back: _native_batch_norm_legit "
    "ran through ATen (and no Kiln graph ran)",
    ("nn.functional.linear_cross_entropy.chunked_none", "lazy", "grad"): "claimed ops fell back: "
    "addmm, amax, div, mm, mul ran through ATen in the gradient",
    # --- compile: random ops Dynamo runs eagerly (no graph reaches Kiln)
    **{
        (op, "compile", "fwd"): "no Kiln graph ran: Dynamo runs the random op eagerly"
        for op in (
            "cauchy",
            "exponential",
            "geometric",
            "log_normal",
            "normal.in_place",
            "uniform",
            "randint_like",
            "multinomial",
        )
    },
    # --- lazy: errors
    ("tensor_split", "lazy", "*"): (
        "tensor_split needs its indices tensor on the CPU ('expected tensor_indices_or_sections "
        "to be on cpu, but it's on kiln:0'), while the lazy device rejects CPU tensors of rank > 0 "
        "next to kiln tensors"
    ),
    ("to", "lazy", "grad"): (
        "backward of a kiln->cpu copy: 'opt_ready_stream && opt_parent_stream INTERNAL ASSERT "
        "FAILED' (autograd engine.cpp:1096; streams of the Python device guard)"
    ),
    ("sparse.sampled_addmm", "lazy", "*"): _SPARSE,
    ("sparse.mm.reduce", "lazy", "*"): _SPARSE,
    ("to_sparse", "lazy", "fwd"): _SPARSE + " ('to(options) doesn't support converting to a "
    "different layout')",
}


# Failures that take the whole test process down (a C++ abort): never run, always xfail.
CRASHES: dict[tuple[str, str, str], str] = {
    ("fft.hfft", "lazy", "grad"): (
        "process abort: the backward calls view_as_real on a conjugated lazy tensor ('view_as_real "
        "doesn't work on unresolved conjugated tensors'); an exception raised inside "
        "__torch_dispatch__ during backward unwinds through torch's Python device guard "
        "(PythonDeviceGuard::exchangeStream in ~InlineStreamGuard) and std::terminate()s"
    ),
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
