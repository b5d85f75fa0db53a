"""A 2-instance data-parallel job through boto3's ECS client to ``kiln cluster serve`` on
127.0.0.1 (two simulated trn1.32xlarge instances): it trains to the single-process losses, each
task holds its own instance's devices, and stopping one task stops the job."""

from __future__ import annotations

import queue
import signal
import subprocess
import threading
import time

import pytest
from dist_testlib import PY, REL_TOL, SCRIPT, STEPS, free_port, load, max_rel_diff

from kiln.distributed.job import DataParallelJob, JobError, describe

boto3 = pytest.importorskip("boto3")

HANG = """
import os, time, pathlib, torch, torch.distributed as dist
import kiln.distributed as kd
kd.init_process_group(timeout_s=60)
pathlib.Path(os.environ["READY_DIR"], f"rank{dist.get_rank()}").touch()
t = torch.ones(4)
while True:
    dist.all_reduce(t)
    time.sleep(0.05)
"""


class Server:
    """``kiln cluster serve`` on 127.0.0.1, a free port; its tasks are stopped on close."""

    def __init__(self, tmp) -> None:
        cmd = [PY, "-m", "kiln.tools.cli", "cluster", "--store", str(tmp / "c.db"), "serve"]
        cmd += ["--port", "0", "--work-dir", str(tmp / "agent")]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True
        ).start()
        deadline, seen = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if self.proc.poll() is not None:
                    break
                continue
            seen.append(line)
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].strip()
                break
        else:
            self.close()
            raise AssertionError("server did not start:\n" + "".join(seen))
        self.ecs = boto3.client(
            "ecs",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
        )
        self.ecs.create_cluster(clusterName="default")
        self.instances = [
            self.ecs.register_container_instance(
                cluster="default",
                attributes=[{"name": "ecs.instance-type", "value": "trn1.32xlarge"}],
            )["containerInstance"]["containerInstanceArn"]
            for _ in range(2)
        ]

    def close(self) -> None:
        try:
            arns = self.ecs.list_tasks(cluster="default")["taskArns"]
            for a in arns:
                self.ecs.stop_task(cluster="default", task=a, reason="test teardown")
            end = time.monotonic() + 20
            while arns and time.monotonic() < end:
                if all(t["lastStatus"] == "STOPPED" for t in describe(self.ecs, arns)):
                    break
                time.sleep(0.3)
        finally:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()


@pytest.fixture
def server(tmp_path):
    s = Server(tmp_path)
    try:
        yield s
    finally:
        s.close()


def test_two_instance_job_trains_and_shows_devices(server, tmp_path, reference):
    out = tmp_path / "job.json"
    job = DataParallelJob(
        "dp",
        script=SCRIPT,
        nnodes=2,
        nproc_per_node=2,
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        devices="NeuronDevice:ALL",
        script_args=["--modes", "lazy", "--steps", str(STEPS), "--out", str(out)],
        environment={"KILN_CACHE_DIR": str(tmp_path / "cache")},
    )
    arns = job.submit(server.ecs)
    tasks = describe(server.ecs, arns)
    assert sorted(t["containerInstanceArn"] for t in tasks) == sorted(server.instances)
    for t in tasks:  # each task holds all 16 Neuron devices of its own instance
        assert t["containers"][0]["neuronDeviceIds"] == [str(i) for i in range(16)]
        assert t["group"] == job.group
    result = job.wait(server.ecs, arns, timeout=400)
    assert result["exitCodes"] == [0, 0], result["tasks"]
    res = load(out)
    assert res["world"] == 4
    assert max_rel_diff(res["losses"]["lazy"], reference["losses"]["lazy"]) < REL_TOL
    # each worker saw half of its task's 32 NeuronCores
    cores = sorted(r["NEURON_RT_VISIBLE_CORES"] for r in res["ranks"])
    assert cores == ["0-15", "0-15", "16-31", "16-31"]
    # three nodes on two instances: the third cannot be placed (distinctInstance); the two
    # already started are stopped and the error names the reason
    big = DataParallelJob("dp3", script=SCRIPT, nnodes=3, rdzv_endpoint=f"127.0.0.1:{free_port()}")
    before = set(server.ecs.list_tasks(cluster="default", desiredStatus="STOPPED")["taskArns"])
    with pytest.raises(JobError, match="node 2 of 3 could not be placed"):
        big.submit(server.ecs)
    after = set(server.ecs.list_tasks(cluster="default", desiredStatus="STOPPED")["taskArns"])
    assert len(after - before) == 2
    assert server.ecs.list_tasks(cluster="default")["taskArns"] == []


def test_stopping_one_task_stops_the_job(server, tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    ready = tmp_path / "ready"
    ready.mkdir()
    job = DataParallelJob(
        "hang",
        script=str(script),
        nnodes=2,
        nproc_per_node=1,
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        environment={"READY_DIR": str(ready)},
    )
    arns = job.submit(server.ecs)
    end = time.monotonic() + 180
    while len(list(ready.iterdir())) < 2:
        assert time.monotonic() < end, "workers never started"
        assert all(t["lastStatus"] != "STOPPED" for t in describe(server.ecs, arns))
        time.sleep(0.3)
    server.ecs.stop_task(cluster="default", task=arns[1], reason="operator stop")
    t0 = time.monotonic()
    result = job.wait(server.ecs, arns, timeout=90)
    assert time.monotonic() - t0 < 60
    assert [t["lastStatus"] for t in result["tasks"]] == ["STOPPED", "STOPPED"]
    assert result["tasks"][1]["stoppedReason"] == "operator stop"
