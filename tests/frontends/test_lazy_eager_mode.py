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
