"""``kiln.cluster.resources``: what a RegisterContainerInstance request turns into (pure)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kiln.cluster import resources
from kiln.cluster.errors import InvalidParameterException


def _total(cpu=4096, memory=8192, **extra):
    out = [
        {"name": "CPU", "type": "INTEGER", "integerValue": cpu},
        {"name": "MEMORY", "type": "INTEGER", "integerValue": memory},
    ]
    out += [{"name": k, "type": "STRINGSET", "stringSetValue": v} for k, v in extra.items()]
    return out


def test_catalog_type_fills_cpu_memory_and_simulated_devices():
    spec = resources.instance_spec(
        {"attributes": [{"name": "ecs.instance-type", "value": "trn1.2xlarge"}]}
    )
    assert (spec.cpu, spec.memory) == (8 * 1024, 32 * 1024)
    assert spec.simulated and spec.instance_type == "trn1.2xlarge"
    assert [(d.kind, d.index, d.path) for d in spec.devices] == [("neuron", 0, "/dev/neuron0")]
    assert spec.devices[0].device_id == "neuron0" and spec.devices[0].cores == 2
    assert spec.attributes["ecs.instance-type"] == "trn1.2xlarge"
    assert spec.attributes["ecs.os-type"] == "linux"
    assert spec.attributes["ecs.availability-zone"] == "us-east-1a"
    assert spec.device_root is None and spec.agent_version == "kiln-1.0"
    assert spec.ec2_instance_id.startswith("i-") and len(spec.ec2_instance_id) == 19


def test_identity_document_gives_type_id_and_zone():
    doc = {"instanceType": "p4d.24xlarge", "instanceId": "i-abc", "availabilityZone": "eu-west-1b"}
    spec = resources.instance_spec({"instanceIdentityDocument": json.dumps(doc)})
    assert spec.ec2_instance_id == "i-abc" and spec.instance_type == "p4d.24xlarge"
    assert spec.attributes["ecs.availability-zone"] == "eu-west-1b"
    assert (spec.cpu, spec.memory) == (96 * 1024, 1179648)
    assert [d.device_id for d in spec.devices] == [f"gpu{i}" for i in range(8)]


def test_attribute_beats_identity_document_and_explicit_resources_beat_catalog():
    doc = {"instanceType": "p4d.24xlarge"}
    body = {
        "instanceIdentityDocument": json.dumps(doc),
        "attributes": [
            {"name": "ecs.instance-type", "value": "trn1.2xlarge"},
            {"name": "ecs.availability-zone", "value": "zone-z"},
            {"name": "rack", "value": None},
        ],
        "totalResources": _total(cpu=100, memory=200),
        "versionInfo": {"agentVersion": "9.9"},
    }
    spec = resources.instance_spec(body)
    assert spec.instance_type == "trn1.2xlarge" and (spec.cpu, spec.memory) == (100, 200)
    assert spec.attributes["ecs.availability-zone"] == "zone-z"
    assert spec.attributes["rack"] == "" and spec.agent_version == "9.9"


def test_without_type_cpu_and_memory_are_required():
    with pytest.raises(InvalidParameterException, match="totalResources CPU and MEMORY"):
        resources.instance_spec({})
    with pytest.raises(InvalidParameterException, match="totalResources CPU and MEMORY"):
        resources.instance_spec({"totalResources": _total()[:1]})
    spec = resources.instance_spec({"totalResources": _total()})
    assert spec.devices == [] and not spec.simulated and spec.instance_type is None


def test_gpu_ids_from_platform_devices_or_string_set():
    body = {
        "totalResources": _total(),
        "platformDevices": [{"id": "GPU-a", "type": "GPU"}, {"id": "x", "type": "OTHER"}],
    }
    spec = resources.instance_spec(body)
    assert [(d.kind, d.index, d.uuid) for d in spec.devices] == [("gpu", 0, "GPU-a")]
    assert not spec.simulated
    spec = resources.instance_spec({"totalResources": _total(GPU=["u0", "u1"])})
    assert [(d.device_id, d.uuid, d.path) for d in spec.devices] == [
        ("gpu0", "u0", None),
        ("gpu1", "u1", None),
    ]


def test_kiln_devices_and_their_checks():
    devs = [
        {
            "kind": "neuron",
            "index": 3,
            "path": "/dev/neuron3",
            "cores": 2,
            "memoryMib": 32,
            "name": "trn",
        },
        {"kind": "gpu", "uuid": "G", "memory_mib": 7},
    ]
    spec = resources.instance_spec(
        {"totalResources": _total(), "kilnDevices": devs, "kilnSimulated": False}
    )
    assert [d.device_id for d in spec.devices] == ["neuron3", "gpu1"]
    assert spec.devices[0].memory_mib == 32 and spec.devices[1].memory_mib == 7
    assert spec.devices[0].name == "trn" and spec.devices[1].name == ""
    assert spec.devices[1].uuid == "G" and not spec.simulated
    for bad in (
        [{"kind": "tpu"}],
        [{"index": -1}],
        [{"cores": "2"}],
        [{"index": True}],
        [{"path": 5}],
        ["neuron0"],
        [{"index": 0}, {"index": 0}],
    ):
        with pytest.raises(InvalidParameterException):
            resources.instance_spec({"totalResources": _total(), "kilnDevices": bad})
    with pytest.raises(InvalidParameterException):
        resources.instance_spec({"totalResources": _total(), "kilnDevices": {"kind": "gpu"}})


def test_simulated_flag_and_device_root():
    body = {
        "attributes": [
            {"name": "ecs.instance-type", "value": "trn1.2xlarge"},
            {"name": "kiln.device-root", "value": "/tmp/root"},
        ],
        "kilnSimulated": False,
    }
    spec = resources.instance_spec(body)
    assert not spec.simulated and spec.device_root == "/tmp/root"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"instanceIdentityDocument": "not json"}, "^instanceIdentityDocument is not JSON$"),
        (
            {"instanceIdentityDocument": "[1, 2]"},
            "^instanceIdentityDocument must be a JSON object of strings$",
        ),
        ({"instanceIdentityDocument": json.dumps({"instanceType": 5})}, "JSON object of strings"),
        ({"attributes": [{"value": "x"}]}, "^each attribute needs a name$"),
        ({"attributes": ["x"]}, "^each attribute needs a name$"),
        (
            {"totalResources": _total(cpu=-1)},
            r"^totalResources CPU: must be a whole number from 0 to 2147483647, got -1$",
        ),
        (
            {"totalResources": _total(memory=2**31)},
            r"^totalResources MEMORY: must be a whole number",
        ),
        ({"totalResources": _total(cpu=True)}, "^totalResources CPU: .* got True$"),
        (
            {"attributes": [{"name": "ecs.instance-type", "value": "nope.large"}]},
            "unknown instance type",
        ),
        (
            {},
            "^give totalResources CPU and MEMORY, or an ecs.instance-type attribute from the catalog$",
        ),
        (
            {"totalResources": _total(), "kilnDevices": {"kind": "gpu"}},
            "^kilnDevices: expected a list of device objects$",
        ),
        (
            {"totalResources": _total(), "kilnDevices": ["x"]},
            r"^kilnDevices\[0\]: expected an object$",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{}, {"kind": "tpu"}]},
            r"^kilnDevices\[1\]\.kind: must be one of \('neuron', 'gpu'\)$",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{"index": -1}]},
            r"^kilnDevices\[0\]\.index: ",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{"cores": "2"}]},
            r"^kilnDevices\[0\]\.cores: ",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{"memoryMib": -2}]},
            r"^kilnDevices\[0\]\.memoryMib: ",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{"path": 5}]},
            r"^kilnDevices\[0\]\.path: expected a string, got 5$",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{"name": 5}]},
            r"^kilnDevices\[0\]\.name: expected a string",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{"uuid": 5}]},
            r"^kilnDevices\[0\]\.uuid: expected a string",
        ),
        (
            {"totalResources": _total(), "kilnDevices": [{"index": 0}, {"index": 0}]},
            "^duplicate device indices in the registration$",
        ),
    ],
)
def test_bad_registrations_are_refused_with_the_field_named(body, message):
    with pytest.raises(InvalidParameterException, match=message):
        resources.instance_spec(body)


def test_kiln_device_defaults():
    spec = resources.instance_spec(
        {"totalResources": _total(), "kilnDevices": [{}, {"name": None}]}
    )
    a, b = spec.devices
    assert (a.kind, a.index, a.path, a.cores, a.memory_mib, a.name, a.uuid) == (
        "neuron",
        0,
        None,
        0,
        0,
        "",
        None,
    )
    assert (b.index, b.name) == (1, "")
    spec = resources.instance_spec({"totalResources": _total(), "kilnDevices": [{"memory_mib": 3}]})
    assert spec.devices[0].memory_mib == 3


def test_gpu_string_set_devices_have_no_cores_or_memory():
    spec = resources.instance_spec({"totalResources": _total(GPU=["u0"])})
    d = spec.devices[0]
    assert (d.kind, d.index, d.path, d.cores, d.memory_mib, d.name, d.uuid) == (
        "gpu",
        0,
        None,
        0,
        0,
        "gpu",
        "u0",
    )


def test_simulated_flag_is_false_unless_simulated_or_asked():
    assert resources.instance_spec({"totalResources": _total()}).simulated is False
    assert (
        resources.instance_spec({"totalResources": _total(), "kilnSimulated": True}).simulated
        is True
    )
    body = {
        "attributes": [{"name": "ecs.instance-type", "value": "trn1.2xlarge"}],
        "kilnSimulated": 0,
    }
    assert resources.instance_spec(body).simulated is False


def test_instance_type_from_document_is_recorded_as_attribute():
    doc = json.dumps({"instanceType": "trn1.2xlarge"})
    spec = resources.instance_spec({"instanceIdentityDocument": doc})
    assert spec.attributes["ecs.instance-type"] == "trn1.2xlarge"


def test_simulated_devices_keep_catalog_uuid(monkeypatch):
    from kiln.devices import discovery

    real = discovery.simulated_devices
    monkeypatch.setattr(
        discovery,
        "simulated_devices",
        lambda t: [dataclasses.replace(d, uuid=f"U{d.index}") for d in real(t)],
    )
    spec = resources.instance_spec(
        {"attributes": [{"name": "ecs.instance-type", "value": "trn1.2xlarge"}]}
    )
    assert spec.devices[0].uuid == "U0"


def test_generated_instance_ids_are_unique_and_shaped():
    ids = {resources.instance_spec({"totalResources": _total()}).ec2_instance_id for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 19 and i[2:].isalnum() for i in ids)


def test_amount_limits_are_inclusive():
    assert (
        resources.instance_spec({"totalResources": _total(cpu=0, memory=2**31 - 1)}).memory
        == 2**31 - 1
    )


def test_resource_value_prefers_integer_and_skips_nulls():
    rs = [{"name": "CPU", "integerValue": None, "longValue": 5}, {"name": "CPU", "integerValue": 9}]
    assert resources._resource_value(rs, "CPU") == 5
    assert resources._resource_value([], "CPU") is None
    assert resources._resource_value(None, "CPU") is None
    assert resources._resource_value([{"name": "X", "doubleValue": 1.5}], "X") == 1.5
    assert resources._resource_value([{"name": "X", "stringSetValue": ["a"]}], "X") == ["a"]
    assert resources._resource_value([{"name": "X"}], "X") is None


def test_resource_list_shape_and_public_ids():
    devices = [
        {"kind": "gpu", "idx": 1, "uuid": "GPU-1"},
        {"kind": "gpu", "idx": 0, "uuid": None},
        {"kind": "neuron", "idx": 4},
    ]
    out = resources.resource_list(2048, 4096, devices)
    assert out[:4] == [
        {"name": "CPU", "type": "INTEGER", "integerValue": 2048},
        {"name": "MEMORY", "type": "INTEGER", "integerValue": 4096},
        {"name": "PORTS", "type": "STRINGSET", "stringSetValue": []},
        {"name": "PORTS_UDP", "type": "STRINGSET", "stringSetValue": []},
    ]
    assert out[4] == {"name": "GPU", "type": "STRINGSET", "stringSetValue": ["GPU-1", "0"]}
    assert out[5] == {"name": "NEURON", "type": "STRINGSET", "stringSetValue": ["4"]}
    assert len(out) == 6
    assert resources.public_id({"kind": "neuron", "idx": 2, "uuid": "ignored"}) == "2"
