"""KILN_EAGER=1: the same API, every op runs at once (debug mode), same numbers as eager."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import copy, json, torch, kiln
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    lz = copy.deepcopy(ref).to(kiln.device())
    x = torch.randn(5, 6)
    a = ref(x).sum()
    b = lz(x.to(kiln.device())).sum()
    pending = b._st.pending  # in eager mode nothing is left pending after an op
    b.backward()
    print(json.dumps({"ref": a.item(), "kiln": b.item(), "pending": pending,
                      "eager_ops": kiln.metrics.get("eager_ops"),
                      "grad_close": torch.allclose(lz[0].weight.grad.cpu(),
                                                   torch.autograd.grad(a, ref[0].weight)[0])}))
    """
)


def test_eager_debug_mode_runs_every_op_at_once(tmp_path):
    env = {**os.environ, "KILN_EAGER": "1", "KILN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert abs(r["ref"] - r["kiln"]) <= 1e-5 * abs(r["ref"]) + 1e-6
    assert r["pending"] is False
    assert r["eager_ops"] > 5
    assert r["grad_close"] is True


STEADY = textwrap.dedent(
    """
    import copy, json, warnings, torch, kiln
    from kiln.metrics import RecompileWarning
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    lz = copy.deepcopy(ref).to(kiln.device())
    # fused AdamW: an in-place op writing five lists of tensors
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (ref, lz)]
    xs = [torch.randn(5, 6) for _ in range(6)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x in xs:
            for m, opt, dev in ((ref, opts[0], "cpu"), (lz, opts[1], kiln.device())):
                m(x.to(dev)).square().sum().backward()
                opt.step()
                opt.zero_grad()
            kiln.mark_step()
    diff = max((a - b.cpu()).abs().max().item() for a, b in zip(ref.parameters(), lz.parameters()))
    c = kiln.metrics.counters()
    print(json.dumps({"diff": diff, "steps": c["steps"], "mark_steps": c["mark_steps"],
                      "recompile_warnings": sum(w.category is RecompileWarning for w in caught)}))
    """
)


def test_a_steady_loop_counts_its_steps_and_warns_of_no_recompiles(tmp_path):
    """Each op is its own graph in the debug mode: not a recompile of the step (it warned, advising
    the mark_step the loop calls), and a mark_step with nothing pending still ends a step (the
    debug mode counted none); fused AdamW, which writes lists of tensors, runs too (it raised)."""
    env = {**os.environ, "KILN_EAGER": "1", "KILN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", STEADY],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["recompile_warnings"] == 0
    assert r["steps"] == r["mark_steps"] == 6
    assert r["diff"] <= 1e-6
