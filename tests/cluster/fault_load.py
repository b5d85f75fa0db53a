"""Load with faults: boto3 clients call a ``kiln cluster serve --no-agent`` server while its
agent (a separate ``kiln cluster agent``), the server and task processes are killed with
SIGKILL at random points and restarted.  Afterwards every task is stopped and the run checks:
no device held by a stopped task, no process of a stopped task alive, no device given twice.

    python tests/cluster/fault_load.py --seconds 60      # the long run; prints the figures

``tests/cluster/test_fault.py`` runs a short one in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import boto3
import botocore.config
import botocore.exceptions
from cluster_testlib import (
    PY,
    ServerProcess,
    add_instance,
    check_invariants,
    container,
    gpus,
    kill_task_processes,
    neuron_all,
    register,
    wait_for,
)

from kiln.cluster import procs
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

LONG = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
    " start_new_session=True)\n"
    "time.sleep(300)\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Cluster:
    """The server and agent processes, restartable."""

    def __init__(self, db: str, work: str, port: int) -> None:
        self.db, self.work, self.port = db, work, port
        self.server: ServerProcess | None = None
        self.agent: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.restarts: list[threading.Thread] = []

    def start_server(self) -> None:
        self.server = ServerProcess(self.db, self.work, "--port", str(self.port), "--no-agent")

    def start_agent(self) -> None:
        cmd = [PY, "-m", "kiln.tools.cli", "cluster", "--store", self.db, "agent"]
        self.agent = subprocess.Popen(
            [*cmd, "--work-dir", self.work],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def kill_server(self) -> bool:
        """SIGKILL the server and restart it in the background; False if it is restarting."""
        with self.lock:
            if self.server is None:
                return False
            self.server.kill()
            self.server = None
        thread = threading.Thread(target=self.start_server)
        thread.start()
        self.restarts.append(thread)
        return True

    def kill_agent(self) -> None:
        assert self.agent is not None
        self.agent.kill()
        self.agent.wait(timeout=10)
        self.start_agent()

    def settle(self) -> None:
        """Wait for background restarts; start the server here if one of them failed."""
        for thread in self.restarts:
            thread.join()
        if self.server is None or self.server.proc.poll() is not None:
            self.start_server()

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.agent.kill()


def run(seconds: float, seed: int = 0, workers: int = 4, work_root: str | None = None) -> dict:
    root = work_root or tempfile.mkdtemp(prefix="kiln-fault-")
    db, work = os.path.join(root, "c.db"), os.path.join(root, "agent")
    svc = ClusterService(Store(db), seed=seed)
    svc.create_cluster({})
    for itype in ("trn1.32xlarge", "p4d.24xlarge", "trn1.2xlarge", "trn1.2xlarge"):
        add_instance(svc, itype)
    quick = [PY, "-c", "import time; time.sleep(0.3)"]
    register(svc, "quick", gpus(1, command=quick, stopTimeout=2))
    register(svc, "long", neuron_all(command=[PY, "-c", LONG], stopTimeout=2))
    register(svc, "mid", gpus(2, command=[PY, "-c", "import time; time.sleep(2)"], stopTimeout=2))
    register(svc, "small", container(command=quick, cpu=256, memory=256, stopTimeout=2))
    cluster = _Cluster(db, work, _free_port())
    cluster.start_server()
    cluster.start_agent()
    url = f"http://127.0.0.1:{cluster.port}"
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    latencies: dict[str, list[float]] = {}
    counts = {"errors": 0, "calls": 0, "faults_server": 0, "faults_agent": 0, "faults_task": 0}
    arns: list[str] = []
    lock = threading.Lock()

    def worker(wseed: int) -> None:
        wrng = random.Random(wseed)
        config = botocore.config.Config(
            retries={"max_attempts": 1}, connect_timeout=2, read_timeout=15
        )
        client = boto3.client(
            "ecs",
            endpoint_url=url,
            region_name="us-east-1",
            aws_access_key_id="x",
            aws_secret_access_key="x",
            config=config,
        )
        while time.monotonic() < deadline:
            r = wrng.random()
            began = time.perf_counter()
            try:
                if r < 0.25:
                    action = "RunTask"
                    family = wrng.choice(["quick", "long", "mid", "small"])
                    out = client.run_task(taskDefinition=family, count=wrng.choice([1, 1, 2]))
                    with lock:
                        arns.extend(t["taskArn"] for t in out["tasks"])
                elif r < 0.7:
                    action = "DescribeTasks"
                    with lock:
                        some = wrng.sample(arns, min(len(arns), 10)) if arns else ["none"]
                    client.describe_tasks(tasks=some)
                elif r < 0.85:
                    action = "ListTasks"
                    client.list_tasks()
                else:
                    action = "StopTask"
                    with lock:
                        victim = wrng.choice(arns) if arns else None
                    if victim is None:
                        continue
                    client.stop_task(task=victim)
            except (
                botocore.exceptions.EndpointConnectionError,
                botocore.exceptions.ConnectionClosedError,
                botocore.exceptions.ReadTimeoutError,
            ):
                with lock:
                    counts["errors"] += 1
                time.sleep(0.05)
                continue
            except botocore.exceptions.ClientError as e:
                code = e.response["Error"]["Code"]
                if e.response["ResponseMetadata"]["HTTPStatusCode"] >= 500:
                    raise AssertionError(f"{action} answered 5xx: {code}") from e
            elapsed = time.perf_counter() - began
            with lock:
                counts["calls"] += 1
                latencies.setdefault(action, []).append(elapsed)

    def faults() -> None:
        while time.monotonic() < deadline - 1:
            time.sleep(rng.uniform(0.5, 2.0))
            choice = rng.random()
            if choice < 0.3:
                if cluster.kill_server():
                    counts["faults_server"] += 1
            elif choice < 0.6:
                cluster.kill_agent()
                counts["faults_agent"] += 1
            else:
                rows = svc.store.query("SELECT containers FROM tasks WHERE last_status = 'RUNNING'")
                pids = [c["pid"] for r in rows for c in json.loads(r["containers"]) if c.get("pid")]
                if pids:
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        counts["faults_task"] += 1
                    except ProcessLookupError:
                        pass

    threads = [threading.Thread(target=worker, args=(seed * 100 + i,)) for i in range(workers)]
    threads.append(threading.Thread(target=faults))
    started = time.monotonic()
    failure: list[BaseException] = []

    def guarded(t: threading.Thread) -> None:
        try:
            t.run()
        except (AssertionError, OSError, botocore.exceptions.BotoCoreError) as e:
            failure.append(e)

    runners = [threading.Thread(target=guarded, args=(t,)) for t in threads]
    try:
        for t in runners:
            t.start()
        for t in runners:
            t.join()
        elapsed = time.monotonic() - started
        if failure:
            raise failure[0]
        cluster.settle()
        # settle: stop everything, wait for the agent to report every task stopped
        for r in svc.store.query("SELECT arn FROM tasks WHERE desired_status != 'STOPPED'"):
            svc.stop_task({"task": r["arn"]})
        wait_for(
            lambda: not svc.store.query("SELECT arn FROM tasks WHERE last_status != 'STOPPED'"),
            timeout=90,
            every=0.2,
        )

        def stray() -> list[Any]:
            stopped = {r["arn"] for r in svc.store.query("SELECT arn FROM tasks")}
            return [p for a, ps in procs.marked_processes().items() if a in stopped for p in ps]

        try:  # the agent's orphan sweep runs every few seconds
            wait_for(lambda: not stray(), timeout=20, every=0.5)
        except AssertionError:
            pass
        held = svc.store.query(
            "SELECT COUNT(*) AS n FROM devices d JOIN tasks t ON d.task_arn = t.arn"
            " WHERE t.last_status = 'STOPPED'"
        )[0]["n"]
        stats = check_invariants(svc.store)  # raises on a device given twice
        describe = [x * 1000 for x in latencies.get("DescribeTasks", [])]
        return {
            "seconds": round(elapsed, 1),
            "calls": counts["calls"],
            "throughput_calls_per_s": round(counts["calls"] / elapsed, 1),
            "connection_errors_during_restarts": counts["errors"],
            "describe_tasks_p50_ms": round(_percentile(describe, 0.5), 2),
            "describe_tasks_p99_ms": round(_percentile(describe, 0.99), 2),
            "p50_ms": {a: round(_percentile(v, 0.5) * 1000, 2) for a, v in latencies.items()},
            "p99_ms": {a: round(_percentile(v, 0.99) * 1000, 2) for a, v in latencies.items()},
            "tasks": len(svc.store.query("SELECT arn FROM tasks")),
            "faults": {k: v for k, v in counts.items() if k.startswith("faults")},
            "devices_held_by_stopped_tasks": held,
            "processes_of_stopped_tasks_alive": len(stray()),
            "double_assignments": 0 if stats["held"] == 0 else stats["held"],
        }
    finally:
        cluster.stop()
        kill_task_processes(svc.store)
        ours = {r["arn"] for r in svc.store.query("SELECT arn FROM tasks")}
        for arn, ps in procs.marked_processes().items():  # nothing of ours outlives the run
            if arn in ours:  # tasks of other servers on this machine are not ours to kill
                procs.signal_all(ps, [], signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    args = parser.parse_args()
    print(json.dumps(run(args.seconds, args.seed, args.workers), indent=2))


if __name__ == "__main__":
    main()
