"""A function Dynamo captures whole (``fullgraph=True``), compiled by Kiln ahead of time with
PyTorch's ``aot_compile`` and saved, loads in a new process without Dynamo or AOTAutograd: no
frame traced, no AOTAutograd cache lookup, no Kiln graph compiled (Kiln's disk cache serves its
kernels).  Forward and backward give the first process's numbers bit for bit, and eager's within
fused-kernel rounding.  Changed inputs fail the saved guards (never a wrong program), and graphs
lowered by another Kiln are refused with the fix named.  (A whole training step with
``loss.backward()`` and ``opt.step()`` breaks the graph, so it cannot be saved this way; see the
README's compile-cache paragraph.)
"""

import textwrap

import pytest
from _subprocess import run_json

SCRIPT = textwrap.dedent(
    """
    import copy, json, sys, torch, kiln
    from torch._dynamo.utils import compilation_time_metrics, counters
    from kiln.frontends.compile import aot_cache

    def loss_fn(model, x):
        return model(x).square().mean()

    def run(f, m, x):
        m.zero_grad()
        loss = f(m, x)
        loss.backward()
        return [loss.item()] + [p.grad.flatten().tolist() for p in m.parameters()]

    def refused(call):
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the message is the result
            return f"{type(e).__name__}: {e}"
        return "ran"

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    path = sys.argv[2]
    out = {}
    if sys.argv[1] == "save":
        out["eager"] = run(loss_fn, copy.deepcopy(m), x)  # no grads on m when saved
        f = torch.compile(loss_fn, backend="kiln", fullgraph=True).aot_compile(((m, x), {}))
        f.save_compiled_function(path)
    else:
        with open(path, "rb") as fh:
            f = torch.compiler.load_compiled_function(fh)
    out["compiled"] = run(f, m, x)
    out["frames"] = sum(counters["frames"].values())
    out["traced_s"] = sum(compilation_time_metrics.get("bytecode_tracing", []))
    out["aot"] = dict(counters["aot_autograd"])
    out["kiln"] = {k: kiln.metrics.get(k) for k in ("graphs_compiled", "aot_cache_hits")}
    if sys.argv[1] == "load":
        out["batch5"] = refused(lambda: f(m, torch.randn(5, 8)))
        out["float64"] = refused(lambda: f(m.double(), x.double()))
        aot_cache.cache_key_tag = lambda: "kiln-another-version"
        with open(path, "rb") as fh:
            out["stale"] = refused(lambda: torch.compiler.load_compiled_function(fh))
    print(json.dumps(out))
    """
)


def _run(tmp_path, which):
    return run_json(
        SCRIPT, which, str(tmp_path / "loss_fn.kiln"), KILN_CACHE_DIR=str(tmp_path / "cache")
    )


def test_saved_function_loads_without_dynamo_and_refuses_other_inputs(tmp_path):
    saved = _run(tmp_path, "save")
    assert saved["kiln"]["graphs_compiled"] >= 2  # forward and backward
    # fused kernels round differently from eager: within the bench's tolerance
    for got, want in zip(saved["compiled"], saved["eager"]):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7)

    loaded = _run(tmp_path, "load")
    assert loaded["frames"] == 0 and loaded["traced_s"] == 0  # Dynamo traced nothing
    assert loaded["aot"] == {}  # no AOTAutograd trace, no cache lookup
    assert loaded["kiln"] == {"graphs_compiled": 0, "aot_cache_hits": 2}
    assert loaded["compiled"] == saved["compiled"]  # the same program, bit for bit

    for change in ("batch5", "float64"):
        assert loaded[change].startswith("RuntimeError: GuardManager check failed"), loaded[change]
    assert loaded["stale"].startswith("StaleKilnGraph: Kiln: this compiled function holds graphs")
    assert "compile it again" in loaded["stale"]
