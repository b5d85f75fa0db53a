"""Data-parallel training through ``kiln run`` (torchrun, gloo) on loopback: 2 workers, 2 nodes
x 2 workers, and a killed worker.  Each job trains the tiny transformer of dp_train.py for 20
steps and must match the single-process run on the same global batch."""

from __future__ import annotations

import subprocess
import time

import dp_train
import torch
from dist_testlib import (
    REL_TOL,
    SCRIPT,
    STEPS,
    compiled_once_per_job,
    free_port,
    job_env,
    kiln_run,
    load,
    max_rel_diff,
    run,
)

import kiln.distributed.checkpoint as kcheckpoint

_REF = {
    "fsdp": "compile",
    "compile": "compile",
    "compile_funcol": "compile",
    "lazy": "lazy",
    "lazy_pg": "lazy",
    "lazy_ddp": "lazy",
}


def _check_job(res: dict, reference: dict, modes: list[str], cache_dir) -> None:
    for mode in modes:
        ref = reference["losses"][_REF[mode]]
        got = res["losses"][mode]
        assert max_rel_diff(got, ref) < REL_TOL, (mode, got, ref)
        assert got[-1] < got[0] * 0.5  # it trained
    total, got, added = compiled_once_per_job(res, cache_dir)
    # every rank ran every graph of the job, and each was compiled by exactly one rank (the
    # others waited on the file lock and loaded it from the shared disk cache)
    assert got == [added] * len(got) and total == added > 0, (total, got, added)
    # each C++ kernel unit was built (g++) by one rank; the others found it in the cache
    m = [r["metrics"] for r in res["ranks"]]
    units = [x.get("kernel_builds", 0) + x.get("kernel_cache_hits", 0) for x in m]
    assert units == [units[0]] * len(units) and units[0] > 0, m
    assert sum(x.get("kernel_builds", 0) for x in m) == units[0], m


def test_two_workers_match_single_process(tmp_path, reference):
    out, ckpt = tmp_path / "dp.json", tmp_path / "ckpt"
    modes = ["compile", "compile_funcol", "lazy", "lazy_pg", "lazy_ddp"]
    cmd = kiln_run("--nproc-per-node", "2", SCRIPT, "--modes", ",".join(modes))
    cmd += ["--steps", str(STEPS), "--out", str(out), "--ckpt", str(ckpt)]
    p = run(cmd, job_env(tmp_path / "cache"), timeout=420)
    assert p.returncode == 0, p.stderr[-4000:]
    res = load(out)
    assert res["world"] == 2
    _check_job(res, reference, modes, tmp_path / "cache")
    # the collectives were nodes of Kiln graphs (run through ATen): the compiled all-reduce
    # function's graph, GradientSync's buckets, the kiln process group's recorded all-reduces
    fb = res["fallbacks"]
    n_params = len(list(dp_train.TinyGPT().parameters()))
    assert fb["compile_funcol"].get("all_reduce") == fb["compile_funcol"].get("wait_tensor")
    assert fb["compile_funcol"].get("all_reduce", 0) >= n_params, fb
    assert fb["lazy"].get("all_reduce", 0) > 0 and fb["lazy_pg"].get("all_reduce", 0) > 0, fb
    assert fb["lazy_ddp"].get("allreduce_", 0) >= STEPS, fb  # the reducer's bucket all-reduces
    lazy_ranks = [r["metrics"] for r in res["ranks"]]
    assert all(m.get("grad_buckets_issued", 0) >= 2 * STEPS for m in lazy_ranks)  # bucketed
    # each worker pinned to its own core(s), with as many threads
    cpus = [tuple(r["cpus"]) for r in res["ranks"]]
    assert all(len(c) == r["threads"] for c, r in zip(cpus, res["ranks"]))
    if len(set().union(*cpus)) >= 2:
        assert not set(cpus[0]) & set(cpus[1])

    # the 2-rank checkpoint reloads in one process (world size 1) to the single-process state
    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(7)
        m = dp_train.TinyGPT()
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    m2, o2 = fresh()
    kcheckpoint.load(ckpt, m2, o2)
    m1, o1 = fresh()
    kcheckpoint.load(reference["ckpt"], m1, o1)
    d = dp_train.D
    for (name, a), b in zip(m2.named_parameters(), m1.parameters()):
        if name == "block.qkv.bias":
            # the key bias has no effect (softmax ignores a per-row constant): its gradient is
            # rounding noise, which AdamW turns into +-lr steps; compare the query/value parts
            a, b = torch.cat([a[:d], a[2 * d :]]), torch.cat([b[:d], b[2 * d :]])
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    x, y = dp_train.batch()
    with torch.no_grad():
        assert abs(float(m2(x, y)) - float(m1(x, y))) <= REL_TOL * abs(float(m1(x, y)))
    s2, s1 = o2.state_dict()["state"], o1.state_dict()["state"]
    assert len(s2) == len(s1) == len(list(m1.parameters()))
    for k in s1:
        torch.testing.assert_close(s2[k]["exp_avg_sq"], s1[k]["exp_avg_sq"], rtol=1e-3, atol=1e-8)
        assert float(s2[k]["step"]) == STEPS


def test_two_workers_python_recorder_match_single_process(tmp_path, reference):
    """The kiln device's Python recorder (``KILN_LAZY_RECORDER=python``; the native one is the
    default, which test_two_workers_match_single_process runs) in both workers: GradientSync,
    the kiln process group and PyTorch's DistributedDataParallel train as the single process
    does."""
    out = tmp_path / "dp.json"
    modes = ["lazy", "lazy_pg", "lazy_ddp"]
    cmd = kiln_run("--nproc-per-node", "2", SCRIPT, "--modes", ",".join(modes))
    cmd += ["--steps", str(STEPS), "--out", str(out)]
    env = job_env(tmp_path / "cache")
    env["KILN_LAZY_RECORDER"] = "python"
    p = run(cmd, env, timeout=420)
    assert p.returncode == 0, p.stderr[-4000:]
    res = load(out)
    assert res["world"] == 2
    assert not any(r["native"] for r in res["ranks"]), res["ranks"]
    for mode in modes:
        got, ref = res["losses"][mode], reference["losses"]["lazy"]
        assert max_rel_diff(got, ref) < REL_TOL, (mode, got, ref)
        assert got[-1] < got[0] * 0.5  # it trained
    assert all(r["metrics"].get("grad_buckets_issued", 0) >= 2 * STEPS for r in res["ranks"])


def test_two_nodes_two_workers_c10d_rendezvous(tmp_path, reference):
    port = free_port()
    env = job_env(tmp_path / "cache")
    procs = []
    for node in range(2):
        cmd = kiln_run(
            "--nproc-per-node", "2", "--nnodes", "2", "--node-rank", str(node),
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t{port}",
            "--rdzv-timeout", "120", SCRIPT, "--modes", "compile,lazy",
            "--steps", str(STEPS), "--out", str(tmp_path / f"n{node}.json"),
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        errs = [p.communicate(timeout=480)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [e[-3000:] for e in errs]
    outs = [tmp_path / f"n{n}.json" for n in range(2)]
    res = load(next(o for o in outs if o.exists()))  # global rank 0 lives on one of the nodes
    assert res["world"] == 4
    _check_job(res, reference, ["compile", "lazy"], tmp_path / "cache")


def test_killed_worker_stops_the_job_with_a_clear_error(tmp_path):
    cmd = kiln_run("--nproc-per-node", "2", SCRIPT, "--modes", "lazy", "--steps", str(STEPS))
    cmd += ["--out", str(tmp_path / "x.json"), "--kill-rank", "1", "--kill-step", "2"]
    t0 = time.monotonic()
    p = run(cmd, job_env(tmp_path / "cache"), timeout=180)
    took = time.monotonic() - t0
    assert p.returncode == 1, p.stderr[-3000:]
    assert "kiln run: the job failed and was stopped" in p.stderr
    assert "rank 1" in p.stderr and "SIGKILL" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "x.json").exists()
    assert took < 120, took


def test_fsdp2_fully_shard_compiled_by_kiln(tmp_path, reference):
    out = tmp_path / "fsdp.json"
    cmd = kiln_run("--nproc-per-node", "2", SCRIPT, "--modes", "fsdp", "--steps", str(STEPS))
    p = run(cmd + ["--out", str(out)], job_env(tmp_path / "cache"), timeout=420)
    assert p.returncode == 0, p.stderr[-4000:]
    _check_job(load(out), reference, ["fsdp"], tmp_path / "cache")
