"""Every placement strategy and field, multi-copy placement at each resource limit, and the
accounting findings of issue 15 (negative/huge amounts, named devices placed only where they
exist and reserved exactly).  Pure placement checks end with ``_consistent``; service-level ones
with the store invariants (conftest)."""

from __future__ import annotations

import random

import pytest
from cluster_testlib import add_instance, container, register
from test_placement import cand, needs

from kiln.cluster import placement
from kiln.cluster.errors import InvalidParameterException
from kiln.cluster.service import ClusterService
from kiln.cluster.store import Store


def _consistent(before: dict[str, tuple[int, int]], cands, placed, need) -> None:
    """Placement's own bookkeeping: remaining == before - what was placed, >= 0; no device twice."""
    for c in cands:
        mine = [p for p in placed if p.candidate is c]
        cpu0, mem0 = before[c.arn]
        assert c.remaining_cpu == cpu0 - need.cpu * len(mine) >= 0
        assert c.remaining_memory == mem0 - need.memory * len(mine) >= 0
        ids = [d["device_id"] for p in mine for per in p.devices for d in per]
        assert len(ids) == len(set(ids))
        assert not {d["device_id"] for d in c.free_devices} & set(ids)


def _place(cands, need, count, seed=0):
    before = {c.arn: (c.remaining_cpu, c.remaining_memory) for c in cands}
    placed, failures = placement.place(cands, need, count, random.Random(seed))
    _consistent(before, cands, placed, need)
    return placed, failures


@pytest.mark.parametrize(
    ("kw", "need_kw", "fits", "reason"),
    [
        ({"remaining_cpu": 3000}, {"cpu": 1000}, 3, "RESOURCE:CPU"),
        ({"remaining_memory": 32768}, {"memory": 10000}, 3, "RESOURCE:MEMORY"),
        ({"remaining_memory": 40000}, {"memory": 20000}, 2, "RESOURCE:MEMORY"),
        ({"gpu": 8}, {"gpu": 2}, 4, "RESOURCE:GPU"),
        ({"neuron": 4}, {"neuron_all": True}, 1, "RESOURCE:NEURON"),
        ({"neuron": 4}, {"devices": ["/dev/neuron2"]}, 1, "RESOURCE:DEVICE"),
    ],
)
def test_multi_copy_placement_stops_exactly_at_each_limit(kw, need_kw, fits, reason):
    base = {"remaining_cpu": 100_000, "remaining_memory": 100_000}
    c = cand("a", **{**base, **kw})
    need = needs(**{"cpu": 0, "memory": 0, **need_kw})
    placed, failures = _place([c], need, 10)
    assert len(placed) == fits
    assert failures == [{"arn": "a", "reason": reason}]


def test_memory_is_consumed_by_each_copy():
    c = cand("a", remaining_cpu=100_000, remaining_memory=32 * 1024)
    placed, failures = _place([c], needs(cpu=10, memory=20_000), 2)
    assert len(placed) == 1 and failures == [{"arn": "a", "reason": "RESOURCE:MEMORY"}]
    assert c.remaining_memory == 32 * 1024 - 20_000


def test_binpack_on_memory_prefers_least_remaining_memory():
    cs = [
        cand("roomy", remaining_memory=60_000, remaining_cpu=1_000),
        cand("tight", remaining_memory=3_000, remaining_cpu=90_000),
    ]
    strat = [{"type": "binpack", "field": "memory"}]
    placed, _ = _place(cs, needs(cpu=10, memory=1_000, strategies=strat), 4)
    assert [p.candidate.arn for p in placed] == ["tight", "tight", "tight", "roomy"]


def test_binpack_on_cpu_ignores_memory():
    cs = [
        cand("cpu-tight", remaining_cpu=2_000, remaining_memory=90_000),
        cand("mem-tight", remaining_cpu=90_000, remaining_memory=2_000),
    ]
    strat = [{"type": "binpack", "field": "cpu"}]
    placed, _ = _place(cs, needs(cpu=1_000, memory=10, strategies=strat), 3)
    assert [p.candidate.arn for p in placed] == ["cpu-tight", "cpu-tight", "mem-tight"]


def test_spread_on_an_attribute_balances_its_values():
    cs = [
        cand("a1", attributes={"zone": "a"}),
        cand("a2", attributes={"zone": "a"}),
        cand("b1", attributes={"zone": "b"}),
    ]
    strat = [{"type": "spread", "field": "attribute:zone"}]
    placed, _ = _place(cs, needs(cpu=10, memory=10, strategies=strat), 4, seed=3)
    zones = [p.candidate.attributes["zone"] for p in placed]
    assert sorted(zones) == ["a", "a", "b", "b"]
    assert zones[0] != zones[1] and zones[2] != zones[3]  # each round takes the emptier zone


def test_spread_then_binpack_uses_binpack_as_tie_breaker():
    cs = [
        cand("big", remaining_memory=50_000, attributes={"zone": "a"}),
        cand("small", remaining_memory=5_000, attributes={"zone": "a"}),
    ]
    strat = [{"type": "spread", "field": "attribute:zone"}, {"type": "binpack", "field": "memory"}]
    placed, _ = _place(cs, needs(memory=1_000, strategies=strat), 1)
    assert placed[0].candidate.arn == "small"


def test_spread_on_host_and_empty_field_balance_instances():
    for field in ("host", "instanceId"):
        cs = [cand("a"), cand("b"), cand("c")]
        strat = [{"type": "spread", "field": field}]
        placed, _ = _place(cs, needs(cpu=10, memory=10, strategies=strat), 3, seed=5)
        assert sorted(p.candidate.arn for p in placed) == ["a", "b", "c"]


def test_random_strategy_uses_every_instance_and_is_seeded():
    runs = []
    for seed in (0, 0, 1):
        cs = [cand(n) for n in "abcd"]
        placed, _ = _place(cs, needs(cpu=10, memory=10, strategies=[{"type": "random"}]), 3, seed)
        runs.append([p.candidate.arn for p in placed])
    assert runs[0] == runs[1]  # the same seed, the same choice
    seen = set()
    for seed in range(20):
        cs = [cand(n) for n in "abcd"]
        placed, _ = _place(cs, needs(strategies=[{"type": "random"}]), 1, seed)
        seen.add(placed[0].candidate.arn)
    assert seen == set("abcd")


def test_named_devices_only_where_they_exist():
    gpu_only = cand("g", "p4d.24xlarge", gpu=8, remaining_cpu=100_000, remaining_memory=100_000)
    need = needs(cpu=1, memory=1, devices=["/dev/neuron0", "/dev/neuron1"])
    placed, failures = _place([gpu_only], need, 3)
    assert placed == [] and failures == [{"arn": "g", "reason": "ATTRIBUTE"}]
    one = cand("inf", "inf2.xlarge", neuron=1)
    placed, failures = _place([one], need, 1)
    assert placed == [] and failures == [{"arn": "inf", "reason": "ATTRIBUTE"}]
    two = cand("two", neuron=2)
    placed, _ = _place([two], need, 1)
    assert sorted(d["device_id"] for d in placed[0].devices[0]) == ["neuron0", "neuron1"]


def test_nvidia_path_maps_to_the_gpu_of_that_index():
    c = cand("g", "p4d.24xlarge", gpu=2, remaining_cpu=10_000, remaining_memory=10_000)
    placed, failures = _place([c], needs(cpu=1, memory=1, devices=["/dev/nvidia1"]), 2)
    assert [p.devices[0][0]["device_id"] for p in placed] == ["gpu1"]
    assert failures == [{"arn": "g", "reason": "RESOURCE:DEVICE"}]
    _, failures = _place([c], needs(cpu=1, memory=1, devices=["/dev/nvidia7"]), 1)
    assert failures == [{"arn": "g", "reason": "ATTRIBUTE"}]


def test_untracked_host_device_does_not_block_placement():
    c = cand("a", neuron=1)
    placed, _ = _place([c], needs(cpu=1, memory=1, devices=["/dev/fuse"]), 2)
    assert len(placed) == 2 and all(p.devices == [[]] for p in placed)


def test_failure_reasons_follow_the_service_order():
    c = cand("a", status="DRAINING", agent_connected=False, remaining_cpu=0)
    assert placement.check(c, needs())[1] == "INACTIVE"
    c.status = "ACTIVE"
    assert placement.check(c, needs())[1] == "AGENT"
    c.agent_connected = True
    assert placement.check(c, needs())[1] == "RESOURCE:CPU"
    c.remaining_cpu = 4096
    assert placement.check(c, needs(memory=10**6))[1] == "RESOURCE:MEMORY"
    assert placement.check(c, needs(cpu=4096, memory=8192))[1] == ""


# -- the same limits through the service and its store -------------------------------------------


@pytest.fixture
def svc(tmp_path):
    s = ClusterService(Store(str(tmp_path / "c.db")), seed=0)
    s.create_cluster({})
    return s


def test_service_places_two_20000_mib_copies_on_two_instances_not_one(svc):
    a = add_instance(svc, "trn1.2xlarge")  # 32 GiB
    register(svc, "big", container(memory=20_000, cpu=10))
    out = svc.run_task({"taskDefinition": "big", "count": 2})
    assert len(out["tasks"]) == 1 and out["failures"][0]["reason"] == "RESOURCE:MEMORY"
    doc = svc.describe_container_instances({"containerInstances": [a]})["containerInstances"][0]
    rem = {r["name"]: r for r in doc["remainingResources"]}
    assert rem["MEMORY"]["integerValue"] == 32 * 1024 - 20_000


@pytest.mark.parametrize("value", ["-100000", "3 foo", "1e3", "", "99999999999"])
def test_bad_overrides_are_refused(svc, value):
    add_instance(svc, "trn1.2xlarge")
    register(svc, "t", container())
    for field in ("cpu", "memory"):
        if value == "":
            continue
        with pytest.raises(InvalidParameterException):
            svc.run_task({"taskDefinition": "t", "overrides": {field: value}})
    assert svc.list_tasks({})["taskArns"] == []


@pytest.mark.parametrize(
    "resources",
    [
        [{"name": "CPU", "type": "INTEGER", "integerValue": -1024}],
        [{"name": "MEMORY", "type": "INTEGER", "integerValue": -1}],
        [{"name": "MEMORY", "type": "LONG", "longValue": 2**63}],
        [{"name": "CPU", "type": "DOUBLE", "doubleValue": 1.5}],
    ],
)
def test_bad_instance_resources_are_refused(svc, resources):
    total = [
        {"name": "CPU", "type": "INTEGER", "integerValue": 4096},
        {"name": "MEMORY", "type": "INTEGER", "integerValue": 8192},
    ]
    given = {r["name"] for r in resources}
    body = {"totalResources": resources + [r for r in total if r["name"] not in given]}
    with pytest.raises(InvalidParameterException):
        svc.register_container_instance(body)


def test_neuron_paths_on_gpu_instance_are_not_placed(svc):
    add_instance(svc, "p4d.24xlarge")
    devs = [{"hostPath": "/dev/neuron0"}, {"hostPath": "/dev/neuron1"}]
    register(svc, "manual", container(linuxParameters={"devices": devs}))
    out = svc.run_task({"taskDefinition": "manual", "count": 3})
    assert out["tasks"] == [] and out["failures"][0]["reason"] == "ATTRIBUTE"


def test_inf2_xlarge_reserves_exactly_what_is_mapped(svc):
    inf = add_instance(svc, "inf2.xlarge")  # one Neuron device
    register(svc, "one", container(linuxParameters={"devices": [{"hostPath": "/dev/neuron0"}]}))
    both = [{"hostPath": "/dev/neuron0"}, {"hostPath": "/dev/neuron1"}]
    register(svc, "two", container(linuxParameters={"devices": both}))
    assert svc.run_task({"taskDefinition": "two"})["tasks"] == []
    [t] = svc.run_task({"taskDefinition": "one"})["tasks"]
    assert t["containers"][0]["neuronDeviceIds"] == ["0"]
    rows = svc.store.query("SELECT device_id, task_arn FROM devices WHERE instance_arn = ?", (inf,))
    assert [(r["device_id"], r["task_arn"]) for r in rows] == [("neuron0", t["taskArn"])]


def test_invariant_violation_rolls_the_transition_back(svc, monkeypatch):
    add_instance(svc, "trn1.2xlarge")
    register(svc, "t", container(memory=1024))
    monkeypatch.setattr(placement, "_consume", lambda *a: None)  # a bookkeeping bug
    monkeypatch.setattr(
        placement, "check", lambda c, n: ([[]], "")
    )  # and a check that lets everything through
    from kiln.cluster.invariants import InvariantError

    with pytest.raises(InvariantError):
        svc.run_task({"taskDefinition": "t", "count": 10, "overrides": {"memory": "30000"}})
    assert svc.list_tasks({})["taskArns"] == []


# -- what the cluster query language sees of an instance (memberOf during placement) -------------


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("ec2InstanceId == i-b", "b"),
        ("agentVersion == kiln-2.0", "b"),
        ("runningTasksCount >= 3", "b"),
        ("registeredAt > 2020-01-01T00:00:00Z", "b"),
        ("task:group == family:other", "b"),
        ("agentConnected == true and attribute:ecs.instance-type == p4d.24xlarge", "b"),
    ],
)
def test_member_of_sees_every_subject(expression, expected):
    cs = [
        cand("a", running_tasks_count=0),
        cand(
            "b",
            "p4d.24xlarge",
            agent_version="kiln-2.0",
            running_tasks_count=3,
            registered_at=1.7e9,
            groups={"family:other": 1},
        ),
    ]
    con = [{"type": "memberOf", "expression": expression}]
    placed, _ = _place(cs, needs(cpu=1, memory=1, constraints=con), 1)
    assert [p.candidate.arn for p in placed] == [expected]


def test_each_copy_counts_as_a_running_task_and_a_group_member():
    con = [{"type": "memberOf", "expression": "runningTasksCount < 1"}]
    cs = [cand("a"), cand("b")]
    placed, _ = _place(cs, needs(cpu=1, memory=1, constraints=con), 2)
    assert sorted(p.candidate.arn for p in placed) == ["a", "b"]
    assert [c.running_tasks_count for c in cs] == [1, 1]
    for seed in range(10):  # the emptier instance of the group wins, every time
        cs = [cand("a", groups={"family:t": 2}), cand("b")]
        spread = [{"type": "spread", "field": "instanceId"}]
        placed, _ = _place(cs, needs(cpu=1, memory=1, strategies=spread), 2, seed)
        assert [p.candidate.arn for p in placed] == ["b", "b"]
        assert cs[1].groups == {"family:t": 2}


def test_spread_without_field_balances_instances():
    for seed in range(5):
        cs = [cand("a", groups={"family:t": 1}), cand("b")]
        placed, _ = _place(cs, needs(cpu=1, memory=1, strategies=[{"type": "spread"}]), 1, seed)
        assert placed[0].candidate.arn == "b"


def test_ties_are_broken_at_random_without_strategies():
    seen = set()
    for seed in range(20):
        placed, _ = _place([cand(n) for n in "abcd"], needs(cpu=1, memory=1), 1, seed)
        seen.add(placed[0].candidate.arn)
    assert seen == set("abcd")


def test_no_failures_when_every_copy_is_placed():
    cs = [cand("full", remaining_cpu=0), cand("ok")]
    placed, failures = _place(cs, needs(), 1)
    assert [p.candidate.arn for p in placed] == ["ok"] and failures == []
    placed, failures = _place([cand("ok")], needs(), 1)
    assert failures == []


def test_device_kinds_are_not_mixed_up():
    mixed = cand("m", neuron=2, gpu=1, remaining_cpu=10_000, remaining_memory=10_000)
    placed, _ = _place([mixed], needs(cpu=1, memory=1, neuron_all=True), 1)
    assert sorted(d["device_id"] for d in placed[0].devices[0]) == ["neuron0", "neuron1"]
    mixed = cand("m", neuron=2, gpu=1, remaining_cpu=10_000, remaining_memory=10_000)
    _, failures = _place([mixed], needs(cpu=1, memory=1, gpu=2), 1)
    assert failures == [{"arn": "m", "reason": "RESOURCE:GPU"}]


def test_every_mapped_path_is_reserved_in_order():
    c = cand("a", neuron=2)
    placed, _ = _place([c], needs(cpu=1, memory=1, devices=["/dev/fuse", "/dev/neuron1"]), 1)
    assert [d["device_id"] for d in placed[0].devices[0]] == ["neuron1"]
    g = cand("g", "p4d.24xlarge", gpu=2, remaining_cpu=10_000, remaining_memory=10_000)
    need = needs(cpu=1, memory=1, gpu=1, devices=["/dev/nvidia0", "/dev/nvidia1"])
    placed, _ = _place([g], need, 1)
    assert sorted(d["device_id"] for d in placed[0].devices[0]) == ["gpu0", "gpu1"]


def test_neuron_path_maps_by_index_when_the_device_has_no_path():
    c = cand("a", neuron=2)
    for d in c.all_devices:
        d["path"] = None
    placed, _ = _place([c], needs(cpu=1, memory=1, devices=["/dev/neuron1"]), 1)
    assert [d["device_id"] for d in placed[0].devices[0]] == ["neuron1"]


def test_failures_only_when_a_copy_is_left_unplaced():
    binpack = [{"type": "binpack", "field": "cpu"}]  # "full" is tried first and fails
    cs = [cand("full", remaining_cpu=0), cand("ok")]
    placed, failures = _place(cs, needs(strategies=binpack), 1)
    assert [p.candidate.arn for p in placed] == ["ok"] and failures == []


def test_running_tasks_count_grows_from_its_current_value():
    con = [{"type": "memberOf", "expression": "runningTasksCount < 2"}]
    cs = [cand("a", running_tasks_count=1), cand("b", running_tasks_count=5)]
    placed, failures = _place(cs, needs(cpu=1, memory=1, constraints=con), 2)
    assert [p.candidate.arn for p in placed] == ["a"] and cs[0].running_tasks_count == 2
    assert {f["reason"] for f in failures} == {placement.MEMBER_OF_FAILED}
