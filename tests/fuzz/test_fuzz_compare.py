"""The fuzzer's comparison (``fuzz_harness.compare``) on made-up results: a broadcast input's
gradient whose terms cancel is held to the terms' magnitudes, and no looser than that; the
gradient of the expanded view itself is compared element by element."""

from __future__ import annotations

import torch
from fuzz_harness import Result, compare

T = torch.tensor


def _results(kiln_sum: float, view_kiln: list[float] | None = None) -> tuple[Result, ...]:
    """One expanded input (5 positions folded into 1 element) whose view-gradient terms of
    ~300 sum to 0: eager's float32 sum happened to be exactly 0, float64 gives 1e-13."""
    view64 = T([364.0, -206.0, 263.0, -127.5, -293.5], dtype=torch.float64)
    view32 = view64.float()
    kv = view32 if view_kiln is None else T(view_kiln)
    got = Result([], [T([kiln_sum])], [], [kv])
    eager = Result([], [T([0.0])], [], [view32])
    ref = Result([], [T([1e-13], dtype=torch.float64)], [], [view64])
    return got, eager, ref


def test_a_cancelling_sum_is_held_to_its_terms_rounding() -> None:
    # Kiln's sum 3e-5 off float64 (the terms' float32 rounding): passes on the folded band
    assert compare("lazy", *_results(3.05e-5)) == []
    # without the view gradients (no band) the same result fails against eager's lucky 0
    got, eager, ref = _results(3.05e-5)
    for r in (got, eager, ref):
        r.vgrads = [None]
    assert compare("lazy", got, eager, ref)


def test_a_wrong_sum_still_fails() -> None:
    # 1e-5 of the summed magnitudes (1254) is 0.0125: an error of 0.05 is a mismatch
    bad = compare("lazy", *_results(0.05))
    assert len(bad) == 1 and bad[0].startswith("lazy: grads[0]"), bad


def test_the_view_gradient_is_compared_element_by_element() -> None:
    bad = compare("compile", *_results(0.0, [364.0, -206.0, 263.0, -127.0, -293.5]))
    assert len(bad) == 1 and bad[0].startswith("compile: vgrads[0] 1/5 elements off"), bad
