"""The kiln device as PyTorch's accelerator: ``torch.accelerator.is_available()`` only once the
device is in use (an importing program keeps the CPU, lazy/device_module.py ``in_use``), and
then ``torch.accelerator``'s memory API and ``torch.UntypedStorage(device="kiln")`` through the
device's c10 allocator (lazy/allocator.h).  Each case runs in a fresh process: availability
depends on what the process did before, and the storage case used to kill the process."""

from __future__ import annotations

import json
import textwrap

from _process_testlib import run_clean


def _run(code: str) -> dict:
    # (the recorder this run tests kept: conftest.py sets KILN_LAZY_RECORDER)
    out = run_clean("-c", textwrap.dedent(code), keep=("KILN_LAZY_RECORDER",))
    return json.loads(out.strip().splitlines()[-1])


def test_the_accelerator_is_available_only_once_the_device_is_used():
    r = _run(
        """
        import json, torch, kiln
        out = {"type": torch.accelerator.current_accelerator().type,
               "before": [torch.accelerator.is_available(), torch.kiln.is_available()]}
        x = torch.ones(3).to("kiln")  # the first use: a move, no kiln.device() call
        out["after"] = [torch.accelerator.is_available(), torch.kiln.is_available()]
        print(json.dumps(out))
        """
    )
    assert r == {"type": "kiln", "before": [False, False], "after": [True, True]}


def test_the_accelerator_memory_api_reports_the_devices_tensors():
    r = _run(
        """
        import json, torch, kiln
        dev = kiln.device()
        torch.accelerator.reset_peak_memory_stats()
        x = torch.randn(1000, device=dev)
        y = (x * 2).sum()
        kiln.mark_step()
        out = {"acc": torch.accelerator.memory_allocated(), "kiln": torch.kiln.memory_allocated(),
               "peak": torch.accelerator.max_memory_allocated(),
               "stats": torch.accelerator.memory_stats()["allocated_bytes.all.current"]}
        torch.accelerator.empty_cache()  # (accelerate's free_memory calls it)
        del x, y
        out["freed"] = torch.accelerator.memory_allocated()
        torch.accelerator.reset_peak_memory_stats()
        out["reset_peak"] = torch.accelerator.max_memory_allocated()
        print(json.dumps(out))
        """
    )
    assert r["acc"] == r["kiln"] == r["stats"] >= 4000  # x's buffer, y's 4 bytes
    assert r["peak"] >= r["acc"]
    assert r["freed"] == 0
    assert r["reset_peak"] == 0


def test_a_storage_on_the_kiln_device_is_made_not_a_crash():
    r = _run(
        """
        import json, torch, kiln
        kiln.device()
        s = torch.UntypedStorage(8, device="kiln")
        try:
            s.cpu()
            err = None
        except RuntimeError as e:  # a kiln storage's ops: an error, never a crash
            err = type(e).__name__
        print(json.dumps({"device": str(s.device), "nbytes": s.nbytes(), "err": err}))
        """
    )
    assert r["device"] == "kiln:0" and r["nbytes"] == 8
    assert r["err"] in (None, "RuntimeError")
