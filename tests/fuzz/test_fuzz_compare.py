"""The fuzzer's comparison (``fuzz_harness.compare``) on made-up results: a broadcast input's
gradient whose terms cancel is held to the terms' magnitudes, and no looser than that; the
gradient of the expanded view itself is compared element by element; where eager's error on the
drawn inputs is luck, Kiln's is held to eager's median error at nearby inputs, and no looser
(a made-up case and the layer-norm chain the lazy-sizes run flagged, compiled by Kiln)."""

from __future__ import annotations

import torch
from fuzz_harness import Data, Result, _typical, compare, make_function, near_references, run
from fuzz_programs import Input, Program

import kiln  # noqa: F401 - registers the "kiln" torch.compile backend

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


def _lucky(kiln_value: float, near_errors: list[float]) -> tuple:
    """One element whose float64 value is 1.0: eager's float32 result happened to be exact,
    while at nearby inputs its error is ``near_errors`` (one per draw)."""
    r = T([1.0], dtype=torch.float64)
    got, eager, ref = (
        Result([T([kiln_value])], [], []),
        Result([T([1.0])], [], []),
        Result([r], [], []),
    )
    near = [(Result([T([1.0 + d])], [], []), Result([r], [], [])) for d in near_errors]
    return got, eager, ref, lambda: near


def test_eager_s_lucky_draw_is_measured_against_its_typical_error_nearby() -> None:
    # eager exact here, 2e-5 off at 16 nearby inputs: Kiln 5e-5 off passes (within 4x)
    got, eager, ref, near = _lucky(1.0 + 5e-5, [2e-5, -2e-5] * 8)
    assert compare("lazy", got, eager, ref) != []
    assert compare("lazy", got, eager, ref, near) == []


def test_an_error_beyond_eager_s_typical_error_still_fails() -> None:
    got, eager, ref, near = _lucky(1.0 + 2e-4, [2e-5, -2e-5] * 8)
    bad = compare("lazy", got, eager, ref, near)
    assert len(bad) == 1 and "eager nearby, median 2e-05" in bad[0], bad


def test_one_wild_draw_does_not_widen_the_band() -> None:
    # a draw that crossed a branch (error 1.0): the median ignores it
    got, eager, ref, near = _lucky(1.0 + 1e-4, [1e-6] * 15 + [1.0])
    assert compare("compile", got, eager, ref, near) != []
    # lucky zeros in fewer than half of the draws do not narrow it either
    got, eager, ref, near = _lucky(1.0 + 5e-5, [0.0] * 7 + [2e-5] * 9)
    assert compare("compile", got, eager, ref, near) == []


def _ln_chain_case() -> tuple:
    """A layer norm of a layer norm over one row of 2 (eps 1e-3), the shape of the programs the
    lazy-sizes fuzz run flagged: the input gradient is rstd2 * h * (1 - xhat^2) with xhat^2 ~
    0.996, so half an ulp of the saved float rstd moves it by ~1e-5 relative.  At this row (one of
    20,000 random ones) eager's float32 gradient is 2.4e-7 off float64, luck: its median error at
    nearby inputs is 7x that (Kiln's, 3.9e-6, is 16x eager's here, 2.2x eager's typical)."""
    prog = Program(
        [Input("x0", (1, 2), "grad")],
        ["v1 = F.layer_norm(x0, (2,), eps=1e-3)", "v2 = F.layer_norm(v1, (2,), eps=1e-3)"],
        ["v2"],
    )
    data = Data(
        [T([[-0.5619535446166992, -0.5259777903556824]])],
        [T([[1.7500964403152466, -0.14863435924053192]])],
    )
    return prog, make_function(prog), data


def test_a_layer_norm_chain_s_lucky_eager_gradient() -> None:
    prog, fn, data = _ln_chain_case()
    e32, e64 = run(prog, fn, data), run(prog, fn, data, torch.float64)
    near = near_references(prog, fn, data)
    lucky = float((e32.grads[0].double() - e64.grads[0]).abs().max())
    typical = float(_typical(near, "grads", 0).max())
    assert typical > 4 * lucky, (lucky, typical)  # 2.4e-7 vs 1.8e-6
    # Kiln's compiled gradient: within 4x of eager's typical error (not of its lucky one)
    torch._dynamo.reset()
    got = run(prog, torch.compile(fn, backend="kiln", fullgraph=True), data)
    assert compare("compile", got, e32, e64, near) == []
    # and a gradient 10x eager's typical error off float64 is still a mismatch
    off = e64.grads[0] + 10 * typical * torch.sign(e64.grads[0])
    got.grads = [off.float()]
    bad = compare("compile", got, e32, e64, near)
    assert len(bad) == 1 and bad[0].startswith("compile: grads[0]"), bad
