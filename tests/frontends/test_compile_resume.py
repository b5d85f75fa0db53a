"""Checkpoint and resume with the whole training step compiled (``backend="kiln"``).

Train n steps, save model + AdamW + LR scheduler + RNG state with ``torch.save``, go on n more
steps; a new process loads the checkpoint and runs the same n steps: its losses equal the
uninterrupted run's (within 1e-6 relative).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch

_LIB = textwrap.dedent(
    """
    import json, sys, torch, kiln

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                torch.nn.Linear(16, 3))
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

        @torch.compile(backend="kiln")
        def step(x):
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return m, opt, sched, step

    def steps(step, sched, n):
        losses = []
        for _ in range(n):
            losses.append(step(torch.randn(8, 6)).item())
            sched.step()
        return losses
    """
)
_MAIN = textwrap.dedent(
    """
    path, n = sys.argv[1], int(sys.argv[2])
    m, opt, sched, step = build()
    ck = torch.load(path)
    m.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
    sched.load_state_dict(ck["sched"]); torch.set_rng_state(ck["rng"])
    print(json.dumps(steps(step, sched, n)))
    """
)


def test_resume_in_a_new_process_matches_the_uninterrupted_run(tmp_path) -> None:
    path, n = str(tmp_path / "ck.pt"), 3
    lib: dict = {}
    exec(_LIB, lib)
    m, opt, sched, step = lib["build"]()
    full = lib["steps"](step, sched, n)
    torch.save(
        {
            "model": m.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "rng": torch.get_rng_state(),
        },
        path,
    )
    full += lib["steps"](step, sched, n)
    script = tmp_path / "resume.py"
    script.write_text(_LIB + _MAIN)
    r = subprocess.run(
        [sys.executable, str(script), path, str(n)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(full) == 2 * n and len(resumed) == n
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(full[n:]), rtol=1e-6, atol=0)
    assert full[n:] != full[:n]  # the losses move: the comparison is not of constants
