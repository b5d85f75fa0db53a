"""API actions as Python methods, and the concurrency property of placement."""

from __future__ import annotations

import multiprocessing
import random
import threading
import time

import pytest
from cluster_testlib import add_instance, check_invariants, container, gpus, neuron_all, register

from kiln.cluster.errors import ClientException, ClusterNotFoundException
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

ARN = "arn:aws:ecs:us-east-1:000000000000"


@pytest.fixture
def svc(tmp_path):
    s = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    s.create_cluster({})
    return s


def test_task_definition_revisions_and_arns(svc):
    assert register(svc, "train", neuron_all()) == f"{ARN}:task-definition/train:1"
    assert register(svc, "train", neuron_all()) == f"{ARN}:task-definition/train:2"
    assert (
        svc.describe_task_definition({"taskDefinition": "train"})["taskDefinition"]["revision"] == 2
    )
    svc.deregister_task_definition({"taskDefinition": "train:2"})
    assert (
        svc.describe_task_definition({"taskDefinition": "train"})["taskDefinition"]["revision"] == 1
    )
    assert svc.list_task_definitions({})["taskDefinitionArns"] == [f"{ARN}:task-definition/train:1"]
    with pytest.raises(ClientException):
        svc.describe_task_definition({"taskDefinition": "nope"})


def test_cluster_not_found(svc):
    with pytest.raises(ClusterNotFoundException):
        svc.run_task({"cluster": "missing", "taskDefinition": "x"})
    assert svc.describe_clusters({"clusters": ["missing"]})["failures"][0]["reason"] == "MISSING"


def test_register_simulated_trn1_resources(svc):
    arn = add_instance(svc, "trn1.32xlarge")
    assert arn.startswith(f"{ARN}:container-instance/default/")
    ci = svc.describe_container_instances({"containerInstances": [arn]})["containerInstances"][0]
    reg = {r["name"]: r for r in ci["registeredResources"]}
    assert reg["CPU"]["integerValue"] == 128 * 1024
    assert reg["MEMORY"]["integerValue"] == 512 * 1024
    assert reg["NEURON"]["stringSetValue"] == [str(i) for i in range(16)]
    attrs = {a["name"]: a["value"] for a in ci["attributes"]}
    assert attrs["ecs.instance-type"] == "trn1.32xlarge"
    assert ci["remainingResources"] == ci["registeredResources"]


def test_run_and_stop_frees_devices(svc):
    inst = add_instance(svc, "trn1.32xlarge")
    register(svc, "train", neuron_all())
    out = svc.run_task({"taskDefinition": "train"})
    task = out["tasks"][0]
    assert task["taskArn"].startswith(f"{ARN}:task/default/")
    assert task["containers"][0]["neuronDeviceIds"] == [str(i) for i in range(16)]
    again = svc.run_task({"taskDefinition": "train"})
    assert again["tasks"] == [] and again["failures"] == [
        {"arn": inst, "reason": "RESOURCE:NEURON"}
    ]
    stopped = svc.stop_task({"task": task["taskArn"]})["task"]
    assert stopped["lastStatus"] == "STOPPED"  # never claimed by an agent: stopped at once
    ci = svc.describe_container_instances({"containerInstances": [inst]})["containerInstances"][0]
    assert ci["remainingResources"] == ci["registeredResources"]
    assert len(svc.run_task({"taskDefinition": "train"})["tasks"]) == 1
    check_invariants(svc.store)


def test_gpu_ids_and_draining(svc):
    inst = add_instance(svc, "p4d.24xlarge")
    register(svc, "gpu2", gpus(2))
    t = svc.run_task({"taskDefinition": "gpu2", "count": 4})["tasks"]
    ids = [g for task in t for g in task["containers"][0]["gpuIds"]]
    assert len(ids) == 8 and len(set(ids)) == 8
    svc.update_container_instances_state({"containerInstances": [inst], "status": "DRAINING"})
    for task in t:
        svc.stop_task({"task": task["taskArn"]})
    out = svc.run_task({"taskDefinition": "gpu2"})
    assert out["tasks"] == [] and out["failures"][0]["reason"] == "INACTIVE"


def test_list_and_filter(svc):
    a = add_instance(svc, "trn1.32xlarge", attributes={"team": "x"})
    add_instance(svc, "inf2.48xlarge")
    out = svc.list_container_instances({"filter": "attribute:team == x"})
    assert out["containerInstanceArns"] == [a]
    register(svc, "c", container())
    t = svc.run_task({"taskDefinition": "c", "startedBy": "me"})["tasks"][0]
    assert svc.list_tasks({"startedBy": "me"})["taskArns"] == [t["taskArn"]]


# -- the concurrency property ----------------------------------------------------------------
FAMILIES = ["neuron", "gpu1", "gpu3", "dev0", "cpu"]


def _setup(svc: ClusterService) -> None:
    add_instance(svc, "trn1.32xlarge")
    add_instance(svc, "trn1.2xlarge")
    add_instance(svc, "p4d.24xlarge")
    register(svc, "neuron", neuron_all())
    register(svc, "gpu1", gpus(1, cpu=4096))
    register(svc, "gpu3", gpus(3, memory=4096))
    devices = {"devices": [{"hostPath": "/dev/neuron0"}]}
    register(svc, "dev0", container(linuxParameters=devices))
    register(svc, "cpu", container(cpu=30000, memory=30000))


def _worker(db: str, seed: int, ops: int) -> None:
    """Random RunTask/StopTask calls, checking the invariants after every call."""
    svc = ClusterService(Store(db), seed=seed)
    rng = random.Random(seed)
    mine: list[str] = []
    for _ in range(ops):
        if mine and rng.random() < 0.4:
            svc.stop_task({"task": mine.pop(rng.randrange(len(mine)))})
        else:
            out = svc.run_task({"taskDefinition": rng.choice(FAMILIES), "count": rng.randint(1, 3)})
            mine += [t["taskArn"] for t in out["tasks"]]
        check_invariants(svc.store)


def race(url: str, seed_base: int, n_procs: int, n_threads: int, calls: int) -> None:
    """``n_procs`` processes and ``n_threads`` threads run ``_worker`` against one store at
    once; every caller must finish cleanly (each checks the invariants after every call).

    The processes start from a fork server, not by forking this process: a test worker that ran
    other tests has threads of its own (compile-cache build threads, torch's pools), and a child
    forked while one of them held a lock can hang on it (a child was still running after 120 s
    in one CI run)."""
    ctx = multiprocessing.get_context("forkserver")
    procs = [ctx.Process(target=_worker, args=(url, seed_base + i, calls)) for i in range(n_procs)]
    for p in procs:
        p.start()
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            _worker(url, seed, calls)
        except BaseException as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    assert not errors, errors
    assert [p.exitcode for p in procs] == [0] * n_procs


def test_concurrent_run_task_never_overlaps(tmp_path):
    """Threads and processes race RunTask/StopTask; devices never overlap or overcommit."""
    db = str(tmp_path / "c.db")
    svc = ClusterService(Store(db), seed=0)
    svc.create_cluster({})
    _setup(svc)
    started = time.monotonic()
    race(db, seed_base=100, n_procs=4, n_threads=6, calls=40)
    stats = check_invariants(svc.store)
    total = svc.store.query("SELECT COUNT(*) AS n FROM tasks")[0]["n"]
    elapsed = time.monotonic() - started
    print(
        f"10 callers (6 threads + 4 processes, 40 calls each), {total} tasks placed, {elapsed:.1f}s, {stats}"
    )
    assert total > 20
    assert elapsed < 60
