"""Fuzz: botocore-shaped random requests (valid and invalid, built from the service model)
against the HTTP server for a fixed budget.  Every response is 2xx, or 4xx with an ECS error
name; never 5xx; the store invariants hold after every call."""

from __future__ import annotations

import http.client
import json
import random
import threading

import pytest
from cluster_testlib import add_instance, check_invariants, container, gpus, neuron_all, register

from kiln.cluster import _ecs_model
from kiln.cluster.server import ClusterHTTPServer
from kiln.cluster.service import ACTIONS, ClusterService
from kiln.cluster.store import Store

TARGET = "AmazonEC2ContainerServiceV20141113."
BUDGET = 600  # requests per CI run (about 10 s here)
ECS_ERRORS = {
    "ClientException",
    "InvalidParameterException",
    "ClusterNotFoundException",
    "AccessDeniedException",
    "UnknownOperationException",
    "ServiceNotFoundException",
    "ServiceNotActiveException",
    "ResourceNotFoundException",
    "ThrottlingException",
}


class Gen:
    """Random values for model shapes: mostly well-formed, sometimes wrong in one place."""

    def __init__(self, rng: random.Random, pool: list[str]) -> None:
        self.rng = rng
        self.pool = pool  # names and ARNs that exist, so valid paths are reached too

    def value(self, shape_name: str, depth: int = 0) -> object:
        shape = _ecs_model.SHAPES[shape_name]
        kind = shape["type"]
        if self.rng.random() < 0.03:
            return self.wrong(kind)
        if kind == "structure":
            members = shape.get("members", {})
            required = set(shape.get("required", []))
            out = {}
            for name, m in members.items():
                if name in required or (depth < 3 and self.rng.random() < 0.3):
                    out[name] = self.value(m["shape"], depth + 1)
            if self.rng.random() < 0.03:
                out["notAField"] = 1
            return out
        if kind == "list":
            n = self.rng.choice([0, 1, 1, 2, 3]) if depth < 4 else 0
            return [self.value(shape["member"]["shape"], depth + 1) for _ in range(n)]
        if kind == "map":
            return {
                str(self.value(shape["key"]["shape"], depth + 1)): self.value(
                    shape["value"]["shape"], depth + 1
                )
                for _ in range(self.rng.choice([0, 1, 2]))
            }
        if kind == "string":
            if shape.get("enum"):
                return self.rng.choice(shape["enum"] + ["NOT_AN_ENUM"])
            return self.string()
        if kind in ("integer", "long"):
            return self.rng.choice([0, 1, 2, 5, 10, 11, 100, -1, -(2**40), 2**31, 2**63])
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind in ("double", "float"):
            return self.rng.choice([0.0, 1.5, -3.25, 1e308])
        return self.rng.choice([0, 1.7e9, "2020-01-01T00:00:00Z"])  # timestamp, blob

    def string(self) -> str:
        r = self.rng.random()
        if r < 0.5 and self.pool:
            return self.rng.choice(self.pool)
        return self.rng.choice(
            [
                "",
                "x",
                "default",
                "attribute:ecs.instance-type == trn1.32xlarge",
                "agentConnected == true and (runningTasksCount < 3 or not(task:group exists))",
                "attribute:a =~ '(a|aa)+'",
                "(" * 40 + "agentConnected == true" + ")" * 40,
                "é" * 5,
                "a\u0000b",
                "z" * 3000,
                '{"offset": -5}',
                "arn:aws:ecs:us-east-1:000000000000:task/other/abc",
                "1 vCPU",
                "-100000",
                "3 foo",
            ]
        )

    def wrong(self, kind: str) -> object:
        options: list[object] = [None, 7, "text", [], {}, True, [["nested"]], {"a": {"b": {}}}]
        return self.rng.choice([o for o in options if _kind_of(o) != kind])


def _kind_of(value: object) -> str:
    return {dict: "structure", list: "list", str: "string", bool: "boolean", int: "integer"}.get(
        type(value), ""
    )


@pytest.fixture
def served(tmp_path):
    svc = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    svc.create_cluster({})
    pool = [add_instance(svc, t) for t in ("trn1.32xlarge", "p4d.24xlarge", "inf2.xlarge")]
    pool += [
        register(svc, "neuron", neuron_all()),
        register(svc, "gpu", gpus(2)),
        register(svc, "plain", container()),
        register(
            svc, "mapped", container(linuxParameters={"devices": [{"hostPath": "/dev/neuron0"}]})
        ),
    ]
    pool += ["neuron", "gpu", "plain", "mapped", "default", "neuron:1"]
    pool += [t["taskArn"] for t in svc.run_task({"taskDefinition": "gpu", "count": 2})["tasks"]]
    srv = ClusterHTTPServer("127.0.0.1", 0, svc)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield srv, svc, pool
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


def test_random_model_shaped_requests_never_5xx(served):
    srv, svc, pool = served
    rng = random.Random(1234)
    gen = Gen(rng, pool)
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=30)
    actions = sorted(ACTIONS)
    statuses: dict[int, int] = {}
    for i in range(BUDGET):
        action = rng.choice(actions) if rng.random() < 0.97 else "NoSuchAction"
        shape = _ecs_model.input_shape(action)
        body = gen.value(shape) if shape else {}
        if rng.random() < 0.02:
            body = rng.choice([[], "x", 5, None])
        data = json.dumps(body).encode()
        conn.request("POST", "/", data, {"X-Amz-Target": TARGET + action})
        resp = conn.getresponse()
        raw = resp.read()
        statuses[resp.status] = statuses.get(resp.status, 0) + 1
        doc = json.loads(raw)
        assert resp.status < 500, (i, action, body, doc)
        if resp.status >= 400:
            assert doc["__type"] in ECS_ERRORS, (action, body, doc)
        if resp.status == 200:
            for t in doc.get("tasks") or []:
                pool.append(t["taskArn"])
        if resp.headers.get("Connection") == "close":
            conn.close()
            conn = http.client.HTTPConnection(host, port, timeout=30)
        check_invariants(svc.store)
    conn.close()
    print("statuses", statuses)
    assert statuses.get(200, 0) > BUDGET // 10  # the valid paths were reached, too
