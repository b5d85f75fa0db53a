"""Placement decisions and failure reasons (pure functions over Candidate snapshots)."""

from __future__ import annotations

import random

from kiln.cluster import placement
from kiln.cluster.placement import Candidate, TaskNeeds


def _devices(kind: str, n: int, cores: int = 2) -> list[dict]:
    return [
        {
            "device_id": f"{kind}{i}",
            "kind": kind,
            "idx": i,
            "cores": cores,
            "task_arn": None,
            "path": f"/dev/neuron{i}" if kind == "neuron" else None,
        }
        for i in range(n)
    ]


def cand(arn: str, itype: str = "trn1.32xlarge", neuron: int = 0, gpu: int = 0, **kw) -> Candidate:
    devs = _devices("neuron", neuron) + _devices("gpu", gpu)
    base = {
        "arn": arn,
        "ec2_instance_id": "i-" + arn,
        "status": "ACTIVE",
        "agent_connected": True,
        "agent_version": "kiln-1.0",
        "attributes": {"ecs.instance-type": itype},
        "registered_at": 0.0,
        "remaining_cpu": 4096,
        "remaining_memory": 8192,
        "free_devices": list(devs),
        "all_devices": devs,
    }
    base.update(kw)
    return Candidate(**base)


def needs(cpu=1024, memory=1024, gpu=0, neuron_all=False, devices=(), **kw) -> TaskNeeds:
    req = {"gpu": gpu, "neuron_all": neuron_all, "devices": list(devices)}
    return TaskNeeds(cpu=cpu, memory=memory, group="family:t", containers=[req], **kw)


def test_neuron_all_takes_every_device_and_second_fails():
    c = cand("a", neuron=16)
    placed, failures = placement.place([c], needs(neuron_all=True), 2, random.Random(0))
    assert len(placed) == 1
    assert [d["idx"] for d in placed[0].devices[0]] == list(range(16))
    assert failures == [{"arn": "a", "reason": "RESOURCE:NEURON"}]


def test_neuron_on_instance_without_neuron_is_attribute_failure():
    _, failures = placement.place([cand("g", "p4d.24xlarge", gpu=8)], needs(neuron_all=True), 1)
    assert failures == [{"arn": "g", "reason": "ATTRIBUTE"}]


def test_gpu_exact_and_exclusive():
    c = cand("g", "p4d.24xlarge", gpu=8, remaining_cpu=100000, remaining_memory=100000)
    placed, failures = placement.place([c], needs(gpu=3), 3, random.Random(0))
    assert len(placed) == 2 and failures == [{"arn": "g", "reason": "RESOURCE:GPU"}]
    ids = [d["device_id"] for p in placed for d in p.devices[0]]
    assert len(ids) == 6 and len(set(ids)) == 6


def test_cpu_memory_agent_and_inactive_reasons():
    cs = [
        cand("cpu", remaining_cpu=512),
        cand("mem", remaining_memory=10),
        cand("agent", agent_connected=False),
        cand("drain", status="DRAINING"),
    ]
    _, failures = placement.place(cs, needs(), 1)
    assert {f["arn"]: f["reason"] for f in failures} == {
        "cpu": "RESOURCE:CPU",
        "mem": "RESOURCE:MEMORY",
        "agent": "AGENT",
        "drain": "INACTIVE",
    }


def test_member_of_constraint():
    cs = [cand("trn", neuron=16), cand("inf", "inf2.48xlarge", neuron=12)]
    con = [{"type": "memberOf", "expression": "attribute:ecs.instance-type =~ trn1.*"}]
    placed, _ = placement.place(cs, needs(constraints=con), 1)
    assert placed[0].candidate.arn == "trn"
    con = [{"type": "memberOf", "expression": "attribute:ecs.instance-type == p5.48xlarge"}]
    placed, failures = placement.place(cs, needs(constraints=con), 1)
    assert not placed
    assert {f["reason"] for f in failures} == {placement.MEMBER_OF_FAILED}


def test_distinct_instance():
    cs = [cand("a"), cand("b")]
    placed, failures = placement.place(cs, needs(constraints=[{"type": "distinctInstance"}]), 3)
    assert sorted(p.candidate.arn for p in placed) == ["a", "b"]
    assert {f["reason"] for f in failures} == {placement.DISTINCT_FAILED}


def test_binpack_and_spread():
    cs = [cand("roomy", remaining_cpu=8192), cand("tight", remaining_cpu=2048)]
    placed, _ = placement.place(cs, needs(strategies=[{"type": "binpack", "field": "cpu"}]), 2)
    assert [p.candidate.arn for p in placed] == ["tight", "tight"]
    cs = [cand("a"), cand("b")]
    spread = [{"type": "spread", "field": "instanceId"}]
    placed, _ = placement.place(cs, needs(strategies=spread), 2, random.Random(1))
    assert sorted(p.candidate.arn for p in placed) == ["a", "b"]


def test_linux_parameters_device_is_exclusive():
    c = cand("a", neuron=2)
    placed, failures = placement.place([c], needs(devices=["/dev/neuron1"]), 2)
    assert len(placed) == 1 and placed[0].devices[0][0]["device_id"] == "neuron1"
    assert failures == [{"arn": "a", "reason": "RESOURCE:DEVICE"}]
    # NeuronDevice ALL now cannot have every device
    _, failures = placement.place([c], needs(neuron_all=True), 1)
    assert failures[0]["reason"] == "RESOURCE:NEURON"
