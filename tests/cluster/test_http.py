"""Issue 15 findings 5, 6 and 8 (HTTP side): model validation before any handler, the hardened
HTTP layer, and SigV4 verification with server-held credentials."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import boto3
import botocore.exceptions
import pytest
from cluster_testlib import add_instance, container, register

from kiln.cluster import server as server_mod
from kiln.cluster.server import ClusterHTTPServer
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

TARGET = "AmazonEC2ContainerServiceV20141113."
CREDS = {"AKIDKILNTEST": "right-secret"}


@pytest.fixture
def make_server(tmp_path):
    started = []

    def make(**kw):
        svc = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
        svc.create_cluster({})
        srv = ClusterHTTPServer("127.0.0.1", 0, svc, **kw)
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        started.append((srv, t))
        return srv

    yield make
    for srv, t in started:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)


def _client(url, key="x", secret="x"):
    return boto3.client(
        "ecs",
        endpoint_url=url,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    )


def _post(srv, action, body, headers=None, raw=None):
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    data = raw if raw is not None else json.dumps(body).encode()
    h = {"X-Amz-Target": TARGET + action, "Content-Type": "application/x-amz-json-1.1"}
    h.update(headers or {})
    conn.request("POST", "/", data, h)
    resp = conn.getresponse()
    doc = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, doc, resp.headers


# -- SigV4 ------------------------------------------------------------------------------------


def test_sigv4_right_secret_works_wrong_secret_and_unknown_key_are_refused(make_server):
    srv = make_server(credentials=CREDS)
    good = _client(srv.url, "AKIDKILNTEST", "right-secret")
    assert good.list_clusters()["clusterArns"][0].endswith(":cluster/default")
    bad = _client(srv.url, "AKIDKILNTEST", "wrong-secret")
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        bad.list_clusters()
    assert caught.value.response["Error"]["Code"] == "InvalidSignatureException"
    unknown = _client(srv.url, "AKIDNOBODY", "right-secret")
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        unknown.list_clusters()
    assert caught.value.response["Error"]["Code"] == "UnrecognizedClientException"
    status, doc, _ = _post(srv, "ListClusters", {})  # no Authorization at all
    assert status == 400 and doc["__type"] == "AccessDeniedException"


def test_sigv4_signature_covers_the_body(make_server):
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    srv = make_server(credentials=CREDS)
    body = json.dumps({"clusterName": "signed"}).encode()
    req = AWSRequest(
        method="POST",
        url=srv.url + "/",
        data=body,
        headers={"X-Amz-Target": TARGET + "CreateCluster"},
    )
    SigV4Auth(Credentials("AKIDKILNTEST", "right-secret"), "ecs", "us-east-1").add_auth(req)
    headers = dict(req.headers.items())
    status, doc, _ = _post(srv, "CreateCluster", None, headers=headers, raw=body)
    assert status == 200 and doc["cluster"]["clusterName"] == "signed"
    tampered = json.dumps({"clusterName": "evil"}).encode()
    status, doc, _ = _post(srv, "CreateCluster", None, headers=headers, raw=tampered)
    assert status == 403 and doc["__type"] == "InvalidSignatureException"


def test_auth_is_checked_before_the_body_is_read(make_server):
    srv = make_server(credentials=CREDS, read_timeout=30)
    with socket.create_connection(srv.server_address[:2], timeout=5) as s:
        s.sendall(
            b"POST / HTTP/1.1\r\nHost: x\r\nX-Amz-Target: " + TARGET.encode() + b"ListClusters"
            b"\r\nContent-Length: 900000\r\n\r\n"
        )  # the body never comes: the refusal must not wait for it
        reply = s.recv(4096)
    assert b"AccessDeniedException" in reply


def test_non_ascii_bearer_token_is_a_4xx(make_server):
    srv = make_server(token="s3cret")
    status, doc, _ = _post(srv, "ListClusters", {}, headers={"Authorization": "Bearer s\u00e9cret"})
    assert status == 400 and doc["__type"] == "AccessDeniedException"


# -- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("action", "body"),
    [
        ("ListTasks", {"cluster": 7}),
        ("RunTask", {"taskDefinition": "t", "overrides": "cpu=1"}),
        ("RunTask", {"taskDefinition": "t", "placementStrategy": ["binpack"]}),
        ("RunTask", {"taskDefinition": "t", "count": "3 foo"}),
        ("ListTasks", {"desiredStatus": "SLEEPING"}),
        ("DescribeTasks", {"tasks": [f"t{i}" for i in range(101)]}),
        ("DescribeTasks", {"tasks": "abc"}),
        ("StopTask", {}),
        ("CreateCluster", {"clusterName": "x", "surprise": 1}),
        ("ListClusters", {"maxResults": "ten"}),
        ("RegisterTaskDefinition", []),
    ],
)
def test_model_rejects_malformed_requests_with_400(make_server, action, body):
    srv = make_server()
    status, doc, _ = _post(srv, action, body)
    assert status == 400, doc
    assert doc["__type"] in ("ClientException", "InvalidParameterException")


@pytest.mark.parametrize(
    ("headers", "raw"),
    [
        ({"Content-Length": "abc"}, b"{}"),
        ({}, b"[" * 100_000 + b"]" * 100_000),
        ({}, b"\xff\xfe not json"),
    ],
)
def test_bad_framing_and_bodies_are_400(make_server, headers, raw):
    srv = make_server()
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=10)
    conn.putrequest("POST", "/")
    conn.putheader("X-Amz-Target", TARGET + "ListClusters")
    conn.putheader("Content-Length", headers.get("Content-Length", str(len(raw))))
    conn.endheaders(raw)
    resp = conn.getresponse()
    doc = json.loads(resp.read())
    assert resp.status == 400 and doc["__type"] == "ClientException"


def test_unknown_action_and_request_ids(make_server):
    srv = make_server()
    status, doc, _ = _post(srv, "LaunchRockets", {})
    assert status == 400 and doc["__type"] == "UnknownOperationException"
    ids = {_post(srv, "ListClusters", {})[2]["x-amzn-RequestId"] for _ in range(3)}
    assert len(ids) == 3 and "00000000-0000-0000-0000-000000000000" not in ids


def test_deep_query_expression_is_400(make_server):
    srv = make_server()
    expr = "(" * 500 + "agentConnected == true" + ")" * 500
    status, doc, _ = _post(srv, "ListContainerInstances", {"filter": expr})
    assert status == 400 and doc["__type"] == "InvalidParameterException"


# -- the HTTP layer ---------------------------------------------------------------------------


def test_tcp_nodelay_and_one_write_per_response(make_server, monkeypatch):
    seen = []
    original = server_mod._Handler.setup

    def recording_setup(self):
        original(self)
        seen.append(self.request.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    monkeypatch.setattr(server_mod._Handler, "setup", recording_setup)
    srv = make_server()
    assert _post(srv, "ListClusters", {})[0] == 200
    assert seen and all(seen)
    assert server_mod._Handler.wbufsize > 0  # headers and body leave in one write


def test_connection_cap_and_read_timeout(make_server):
    srv = make_server(max_connections=4, read_timeout=1.0)
    held = []
    for _ in range(4):  # half-sent requests hold every slot ...
        s = socket.create_connection(srv.server_address[:2], timeout=5)
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        held.append(s)
    time.sleep(0.2)
    with socket.create_connection(srv.server_address[:2], timeout=5) as extra:
        assert b"ThrottlingException" in extra.recv(4096)  # ... so the next is turned away
    threads = threading.active_count()
    assert threads < 20
    time.sleep(1.5)  # ... until the read timeout drops them
    for s in held:
        s.close()
    assert _post(srv, "ListClusters", {})[0] == 200


def test_store_errors_from_validation_never_500(make_server):
    srv = make_server()
    add_instance(srv.service, "trn1.2xlarge")
    register(srv.service, "t", container())
    status, doc, _ = _post(srv, "RunTask", {"taskDefinition": "t", "overrides": {"cpu": "-1"}})
    assert status == 400 and doc["__type"] == "InvalidParameterException"
