"""DescribeTasks latency on loopback: `kiln cluster serve --no-agent` in a subprocess, one
keep-alive HTTP connection, 2000 calls of 10 task ids.  Run: python bench/cluster_latency.py"""

import http.client
import json
import os
import sys
import tempfile
import time

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "cluster")
)
from cluster_testlib import ServerProcess, add_instance, container, register

from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store

d = tempfile.mkdtemp()
db = d + "/c.db"
svc = ClusterService(Store(db), seed=0)
svc.create_cluster({})
add_instance(svc, "trn1.32xlarge")
register(svc, "t", container(cpu=10, memory=10))
arns = [t["taskArn"] for t in svc.run_task({"taskDefinition": "t", "count": 10})["tasks"]]
srv = ServerProcess(db, d + "/agent", "--no-agent")
host, port = srv.url.split("//")[1].split(":")
conn = http.client.HTTPConnection(host, int(port))
body = json.dumps({"tasks": arns}).encode()
h = {
    "X-Amz-Target": "AmazonEC2ContainerServiceV20141113.DescribeTasks",
    "Content-Type": "application/x-amz-json-1.1",
}
lat = []
for i in range(2000):
    t = time.perf_counter()
    conn.request("POST", "/", body, h)
    r = conn.getresponse()
    r.read()
    lat.append(time.perf_counter() - t)
    assert r.status == 200
lat.sort()
n = len(lat)
print(
    f"DescribeTasks x10 ids, keep-alive, {n} calls: p50 {lat[n // 2] * 1000:.2f} ms p99 {lat[int(n * 0.99)] * 1000:.2f} ms, {n / sum(lat):.0f} calls/s"
)
srv.terminate()
