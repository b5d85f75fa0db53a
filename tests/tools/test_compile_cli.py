"""``kiln precompile`` fills the cache so the next run compiles nothing; ``kiln explain`` reports
fusion and fallbacks."""

import json
import os
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from kiln.config import config
from kiln.tools.cli import main as kiln_main

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, kiln
    dev = kiln.device()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2)).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    x = torch.randn(4, 8)
    for step in range(5):
        loss = m(x.to(dev)).square().mean()
        loss.backward()
        opt.step(); opt.zero_grad()
        kiln.mark_step()
        if step == 0:
            torch.nonzero(loss.detach().reshape(1) > 0)  # a data-dependent op: falls back
    print(json.dumps({k: kiln.metrics.get(k) for k in ("graphs_compiled", "cache_hits_disk")}))
    """
)


def _kiln(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "kiln.tools.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_precompile_then_zero_compiles(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    pre = _kiln("precompile", "--steps", "3", "--", sys.executable, str(script), env=env)
    assert pre.returncode == 0, pre.stderr
    assert "stopping after 3 steps" in pre.stderr
    assert "kiln precompile:" in pre.stdout and "new graphs" in pre.stdout
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["graphs_compiled"] == 0
    assert counts["cache_hits_disk"] >= 2


def test_explain_lists_passes_and_kernels_with_source(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    out = _kiln("explain", "--steps", "2", "--source", "--", sys.executable, str(script), env=env)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "graphs explained" in text
    if config.backend == "cpp":  # its fusion pass and generated kernels (the interpreter has none)
        assert "kernel kiln_" in text and "fuses" in text
        assert 'extern "C" void kiln_' in text  # --source prints the generated C++
        assert "pass fuse" in text
    assert f"({config.backend}" in text  # each graph names the backend that built it
    # every GEMM's epilogue choice: the Linear's bias inside addmm, its weight read by stride
    assert "gemm %" in text and "fused bias (ATen addmm/baddbmm)" in text
    assert "[ATen (MKL sgemm for float32)]" in text  # too small for oneDNN (gemm_library)
    assert "read by stride" in text
    # the run: its steps, and the forced sync of the data-dependent op, which no graph shows
    run = text[text.index("run (pid") :]
    assert "2 steps" in run
    assert "forced syncs" in run and "nonzero" in run


def test_precompile_without_a_command_says_how_to_give_one():
    # in this process (click's runner: no second torch import); the exit status and message
    # are click's usage error, the same as on the command line
    out = CliRunner().invoke(kiln_main, ["precompile"])
    assert out.exit_code == 2, out.output
    assert "give the command to run after --, e.g. -- python train.py" in out.stderr


COMPILE_SCRIPT = textwrap.dedent(
    """
    import json, torch, kiln
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    @kiln.compile
    def step(x):
        loss = m(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    x = torch.randn(4, 8)
    for _ in range(4):
        step(x)
    print(json.dumps({"graphs_compiled": kiln.metrics.get("graphs_compiled"),
                      "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
                      "direct_hits": kiln.metrics.get("inference_graph_cache_hits")}))
    """
)


def test_precompile_fills_the_compile_mode_cache(tmp_path):
    """Compile mode: after ``kiln precompile`` a new process runs neither AOTAutograd's tracing
    nor Kiln's passes (AOTAutograd's entries and Kiln's graphs are in KILN_CACHE_DIR)."""
    script = tmp_path / "train.py"
    script.write_text(COMPILE_SCRIPT)
    env = {**os.environ, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    pre = _kiln("precompile", "--steps", "2", "--", sys.executable, str(script), env=env)
    assert pre.returncode == 0, pre.stderr
    assert "new AOTAutograd entries" in pre.stdout and "(0 in all)" not in pre.stdout
    assert "new graphs without autograd (1 in all)" in pre.stdout
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr
    counts = json.loads(run.stdout.strip().splitlines()[-1])
    assert counts["graphs_compiled"] == 0
    # forward/backward from AOTAutograd's entries, the optimizer step from Kiln's own
    assert counts["aot_hits"] >= 1 and counts["direct_hits"] >= 1
