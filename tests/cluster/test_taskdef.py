"""Task definition validation: every rule has a bad input with its exact message."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from kiln.cluster.errors import ClientException, InvalidParameterException
from kiln.cluster.taskdef import (
    container_device_request,
    task_device_requests,
    validate_task_definition,
)

C0 = "containerDefinitions[0]"
RR0 = f"{C0}.resourceRequirements[0]"
DEV0 = f"{C0}.linuxParameters.devices[0]"


def base() -> dict[str, Any]:
    return {
        "family": "train",
        "containerDefinitions": [
            {"name": "main", "command": ["python", "train.py"], "memory": 512}
        ],
    }


def container(**fields: Any) -> dict[str, Any]:
    return {"name": "main", "command": ["python", "train.py"], "memory": 512, **fields}


def with_containers(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"family": "train", "containerDefinitions": list(containers)}


def neuron() -> list[dict[str, str]]:
    return [{"type": "NeuronDevice", "value": "ALL"}]


def devices(*paths: str, **extra: Any) -> dict[str, Any]:
    return {"devices": [{"hostPath": path, **extra} for path in paths]}


def edit(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    request = base()
    change(request)
    return request


# (id, request, exception type, exact message)
BAD: list[tuple[str, Any, type[Exception], str]] = [
    (
        "not-an-object",
        ["family"],
        ClientException,
        "request: expected a JSON object, got list; send the RegisterTaskDefinition body",
    ),
    (
        "missing-family",
        edit(lambda r: r.pop("family")),
        ClientException,
        (
            "request: missing required field 'family'; RegisterTaskDefinition needs 'family' and"
            " 'containerDefinitions'"
        ),
    ),
    (
        "missing-containers",
        edit(lambda r: r.pop("containerDefinitions")),
        ClientException,
        (
            "request: missing required field 'containerDefinitions'; RegisterTaskDefinition needs"
            " 'family' and 'containerDefinitions'"
        ),
    ),
    (
        "unknown-top-level-field-close-match",
        edit(lambda r: r.update(placementConstraint=[])),
        ClientException,
        (
            "request: unknown field 'placementConstraint' in RegisterTaskDefinitionRequest;"
            " did you mean 'placementConstraints'?"
        ),
    ),
    (
        "unknown-top-level-field-case",
        edit(lambda r: r.update(NetworkMode="host")),
        ClientException,
        (
            "request: unknown field 'NetworkMode' in RegisterTaskDefinitionRequest;"
            " did you mean 'networkMode'?"
        ),
    ),
    (
        "unknown-container-field",
        with_containers(container(memorys=5)),
        ClientException,
        f"{C0}: unknown field 'memorys' in ContainerDefinition; did you mean 'memory'?",
    ),
    (
        "unknown-device-field-lists-valid-fields",
        with_containers(container(linuxParameters={"devices": [{"path": "/dev/neuron0"}]})),
        ClientException,
        (
            f"{DEV0}: unknown field 'path' in Device; valid fields are: hostPath, containerPath,"
            " permissions"
        ),
    ),
    (
        "unknown-requirement-field",
        with_containers(container(resourceRequirements=[{"type": "GPU", "count": "1"}])),
        ClientException,
        (
            f"{RR0}: unknown field 'count' in ResourceRequirement; valid fields are: value, type,"
            " sharingStrategy"
        ),
    ),
    (
        "wrong-type-container-cpu",
        with_containers(container(cpu="1024")),
        ClientException,
        f"{C0}.cpu: expected an integer, got string '1024'",
    ),
    (
        "wrong-type-essential",
        with_containers(container(essential="yes")),
        ClientException,
        f"{C0}.essential: expected true or false, got string 'yes'",
    ),
    (
        "wrong-type-command",
        with_containers(container(command="python train.py")),
        ClientException,
        f"{C0}.command: expected a list, got string 'python train.py'",
    ),
    (
        "bad-network-mode",
        edit(lambda r: r.update(networkMode="bridged")),
        ClientException,
        "networkMode: invalid value 'bridged'; valid values are: bridge, host, awsvpc, none",
    ),
    (
        "bad-family",
        edit(lambda r: r.update(family="my family!")),
        ClientException,
        (
            "family: invalid family 'my family!'; use up to 255 letters (uppercase and lowercase),"
            " numbers, hyphens and underscores"
        ),
    ),
    (
        "task-cpu-not-a-size",
        edit(lambda r: r.update(cpu="lots")),
        ClientException,
        "cpu: invalid value 'lots'; give CPU units such as '1024' or '1 vCPU'",
    ),
    (
        "task-memory-zero",
        edit(lambda r: r.update(memory="0")),
        ClientException,
        "memory: invalid value '0'; give a positive whole number of MiB such as '2048' or '2 GB'",
    ),
    (
        "no-containers",
        with_containers(),
        ClientException,
        "containerDefinitions: at least one container definition is required",
    ),
    (
        "too-many-containers",
        with_containers(*[container(name=f"c{i}") for i in range(11)]),
        ClientException,
        (
            "containerDefinitions: at most 10 containers are allowed per task definition (got 11);"
            " split the task"
        ),
    ),
    (
        "container-without-name",
        with_containers({"command": ["true"], "memory": 64}),
        ClientException,
        f"{C0}: missing required field 'name'; every container needs a unique name",
    ),
    (
        "bad-container-name",
        with_containers(container(name="main/1")),
        ClientException,
        (
            f"{C0}.name: invalid container name 'main/1'; use up to 255 letters (uppercase and"
            " lowercase), numbers, hyphens and underscores"
        ),
    ),
    (
        "duplicate-container-name",
        with_containers(container(), container()),
        ClientException,
        (
            "containerDefinitions[1].name: duplicate container name 'main' (also used by"
            " containerDefinitions[0]); give every container a unique name"
        ),
    ),
    (
        "nothing-to-run",
        with_containers({"name": "main", "memory": 64}),
        ClientException,
        (
            f"{C0}: a container needs a 'command' (run as a process on the instance) or an 'image';"
            " add a command such as ['python', 'train.py']"
        ),
    ),
    (
        "no-essential-container",
        with_containers(container(essential=False)),
        ClientException,
        (
            "containerDefinitions: at least one container must be essential; set 'essential': true"
            " on one of them"
        ),
    ),
    (
        "negative-cpu",
        with_containers(container(cpu=-1)),
        ClientException,
        f"{C0}.cpu: must not be negative (got -1); give CPU units, 1024 per vCPU",
    ),
    (
        "zero-memory",
        with_containers(container(memory=0)),
        ClientException,
        f"{C0}.memory: must be a positive number of MiB (got 0)",
    ),
    (
        "no-memory-anywhere",
        with_containers({"name": "main", "command": ["true"]}),
        ClientException,
        (
            f"{C0}: at least one of 'memory' or 'memoryReservation' must be specified (or set the"
            " task-level 'memory')"
        ),
    ),
    (
        "reservation-above-limit",
        with_containers(container(memory=512, memoryReservation=1024)),
        ClientException,
        (
            f"{C0}.memoryReservation: must not exceed memory (got memoryReservation=1024,"
            " memory=512); lower memoryReservation or raise memory"
        ),
    ),
    (
        "environment-without-name",
        with_containers(container(environment=[{"value": "1"}])),
        ClientException,
        (
            f"{C0}.environment[0]: missing required field 'name'; give each variable a name and a"
            " value"
        ),
    ),
    (
        "requirement-without-type",
        with_containers(container(resourceRequirements=[{"value": "1"}])),
        ClientException,
        f"{RR0}: missing required field 'type' in ResourceRequirement",
    ),
    (
        "requirement-unknown-type",
        with_containers(container(resourceRequirements=[{"type": "Neuron", "value": "ALL"}])),
        ClientException,
        (
            f"{RR0}.type: invalid value 'Neuron'; valid values are: GPU, InferenceAccelerator,"
            " NeuronDevice"
        ),
    ),
    (
        "gpu-not-a-number",
        with_containers(container(resourceRequirements=[{"type": "GPU", "value": "two"}])),
        ClientException,
        (
            f"{RR0}: GPU value must be a positive integer (got 'two'); set it to the number of"
            " physical GPUs the container needs, e.g. '1'"
        ),
    ),
    (
        "gpu-zero",
        with_containers(container(resourceRequirements=[{"type": "GPU", "value": "0"}])),
        ClientException,
        (
            f"{RR0}: GPU value must be a positive integer (got '0'); set it to the number of"
            " physical GPUs the container needs, e.g. '1'"
        ),
    ),
    (
        "gpu-without-value",
        with_containers(container(resourceRequirements=[{"type": "GPU"}])),
        ClientException,
        (
            f"{RR0}: GPU value must be a positive integer (got None); set it to the number of"
            " physical GPUs the container needs, e.g. '1'"
        ),
    ),
    (
        "neuron-value-not-all",
        with_containers(container(resourceRequirements=[{"type": "NeuronDevice", "value": "2"}])),
        ClientException,
        (
            f"{RR0}: NeuronDevice value must be 'ALL' (got '2'); managed Neuron allocation gives the"
            " container every device of its instance"
        ),
    ),
    (
        "duplicate-requirement-type",
        with_containers(
            container(
                resourceRequirements=[{"type": "GPU", "value": "1"}, {"type": "GPU", "value": "1"}]
            )
        ),
        ClientException,
        (
            f"{C0}.resourceRequirements[1]: duplicate GPU requirement; give each resource type once"
            " per container"
        ),
    ),
    (
        "inference-accelerator",
        with_containers(
            container(resourceRequirements=[{"type": "InferenceAccelerator", "value": "dev1"}])
        ),
        ClientException,
        (
            f"{RR0}: InferenceAccelerator (Elastic Inference) is not supported; use {{'type':"
            " 'NeuronDevice', 'value': 'ALL'} on an Inferentia instance"
        ),
    ),
    (
        "gpu-sharing",
        with_containers(
            container(
                resourceRequirements=[
                    {
                        "type": "GPU",
                        "value": "1",
                        "sharingStrategy": {"nvidiaMps": {"memory": 1024}},
                    }
                ]
            )
        ),
        ClientException,
        (
            f"{RR0}.sharingStrategy: GPU sharing is not supported; remove sharingStrategy to get"
            " whole GPUs"
        ),
    ),
    (
        "two-neuron-containers",
        with_containers(
            container(name="a", resourceRequirements=neuron()),
            container(name="b", resourceRequirements=neuron()),
        ),
        ClientException,
        (
            "containerDefinitions[1].resourceRequirements[0]: only one container per task may request"
            " NeuronDevice (already requested by container 'a'); keep the requirement on one"
            " container"
        ),
    ),
    (
        "neuron-and-gpu",
        with_containers(
            container(name="a", resourceRequirements=neuron()),
            container(name="b", resourceRequirements=[{"type": "GPU", "value": "1"}]),
        ),
        ClientException,
        (
            "containerDefinitions: the task requests both NeuronDevice (container 'a') and GPU"
            " (container 'b'); no instance type has both, request one kind of accelerator"
        ),
    ),
    (
        "neuron-managed-and-manual-same-container",
        with_containers(
            container(resourceRequirements=neuron(), linuxParameters=devices("/dev/neuron3"))
        ),
        ClientException,
        (
            f"{DEV0}: '/dev/neuron3' is mapped manually but container 'main' requests NeuronDevice;"
            " use either resourceRequirements NeuronDevice 'ALL' or linuxParameters.devices for"
            " Neuron devices, not both"
        ),
    ),
    (
        "neuron-managed-and-manual-other-container",
        with_containers(
            container(name="a", resourceRequirements=neuron()),
            container(name="b", linuxParameters=devices("/dev/fuse", "/dev/neuron0")),
        ),
        ClientException,
        (
            "containerDefinitions[1].linuxParameters.devices[1]: '/dev/neuron0' is mapped manually"
            " but container 'a' requests NeuronDevice; use either resourceRequirements NeuronDevice"
            " 'ALL' or linuxParameters.devices for Neuron devices, not both"
        ),
    ),
    (
        "gpu-managed-and-manual",
        with_containers(
            container(
                resourceRequirements=[{"type": "GPU", "value": "1"}],
                linuxParameters=devices("/dev/nvidia0"),
            )
        ),
        ClientException,
        (
            f"{DEV0}: '/dev/nvidia0' is mapped manually but container 'main' requests GPUs; use"
            " either resourceRequirements GPU or linuxParameters.devices, not both"
        ),
    ),
    (
        "device-without-host-path",
        with_containers(container(linuxParameters={"devices": [{"containerPath": "/dev/x"}]})),
        ClientException,
        f"{DEV0}: missing required field 'hostPath' in Device",
    ),
    (
        "relative-host-path",
        with_containers(container(linuxParameters=devices("neuron0"))),
        ClientException,
        f"{DEV0}.hostPath: must be an absolute path (got 'neuron0'), e.g. '/dev/neuron0'",
    ),
    (
        "relative-container-path",
        with_containers(container(linuxParameters=devices("/dev/neuron0", containerPath="n0"))),
        ClientException,
        f"{DEV0}.containerPath: must be an absolute path (got 'n0'); omit it to use the host path",
    ),
    (
        "duplicate-host-path",
        with_containers(container(linuxParameters=devices("/dev/neuron0", "/dev/neuron0"))),
        ClientException,
        (
            f"{C0}.linuxParameters.devices[1].hostPath: '/dev/neuron0' is already mapped by"
            f" {C0}.linuxParameters.devices[0]; map each host device once"
        ),
    ),
    (
        "permission-not-allowed",
        with_containers(
            container(linuxParameters=devices("/dev/neuron0", permissions=["read", "execute"]))
        ),
        ClientException,
        f"{DEV0}.permissions[1]: invalid value 'execute'; valid values are: read, write, mknod",
    ),
    (
        "permission-twice",
        with_containers(
            container(linuxParameters=devices("/dev/neuron0", permissions=["read", "read"]))
        ),
        ClientException,
        f"{DEV0}.permissions: lists a permission twice; give each at most once",
    ),
    (
        "permissions-empty",
        with_containers(container(linuxParameters=devices("/dev/neuron0", permissions=[]))),
        ClientException,
        f"{DEV0}.permissions: must not be empty; omit it to get read, write and mknod",
    ),
    (
        "too-many-constraints",
        edit(
            lambda r: r.update(
                placementConstraints=[
                    {"type": "memberOf", "expression": "attribute:ecs.os-type == linux"}
                ]
                * 11
            )
        ),
        InvalidParameterException,
        (
            "placementConstraints: at most 10 constraints are allowed per task (got 11); remove some"
            " or merge memberOf expressions with 'and'"
        ),
    ),
    (
        "distinct-instance-in-task-definition",
        edit(lambda r: r.update(placementConstraints=[{"type": "distinctInstance"}])),
        InvalidParameterException,
        (
            "placementConstraints[0]: distinctInstance is not allowed in a task definition; pass it"
            " to RunTask or CreateService instead, or use memberOf"
        ),
    ),
    (
        "constraint-expression-does-not-parse",
        edit(
            lambda r: r.update(
                placementConstraints=[{"type": "memberOf", "expression": "instanceType == x"}]
            )
        ),
        InvalidParameterException,
        (
            "placementConstraints[0]: invalid memberOf expression at position 1: unknown subject"
            " 'instanceType'; use one of agentConnected, agentVersion, attribute:<name>,"
            " ec2InstanceId, registeredAt, runningTasksCount, task:group (expression:"
            " 'instanceType == x')"
        ),
    ),
    (
        "mps-memory-below-model-minimum",
        with_containers(
            container(
                resourceRequirements=[
                    {"type": "GPU", "value": "1", "sharingStrategy": {"nvidiaMps": {"memory": 0}}}
                ]
            )
        ),
        ClientException,
        f"{RR0}.sharingStrategy.nvidiaMps.memory: must be at least 1 (got 0)",
    ),
    (
        "too-many-tags",
        edit(lambda r: r.update(tags=[{"key": f"k{i}", "value": "v"} for i in range(51)])),
        ClientException,
        "tags: must have at most 50 items (got 51)",
    ),
]


@pytest.mark.parametrize(
    ("request_body", "error", "message"),
    [pytest.param(request, error, message, id=name) for name, request, error, message in BAD],
)
def test_rejects_with_exact_message(
    request_body: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as caught:
        validate_task_definition(copy.deepcopy(request_body))
    assert type(caught.value) is error
    assert caught.value.message == message


def test_bad_cases_have_unique_ids() -> None:
    names = [name for name, *_ in BAD]
    assert len(names) == len(set(names))


def test_normalizes_and_fills_defaults() -> None:
    request = {
        "family": "llama-pretrain",
        "cpu": "4 vCPU",
        "memory": "8 GB",
        "requiresCompatibilities": ["EC2"],
        "networkMode": "host",
        "containerDefinitions": [
            {
                "name": "trainer",
                "command": ["torchrun", "train.py"],
                "environment": [{"name": "NEURON_CC_FLAGS", "value": "-O1"}],
                "resourceRequirements": neuron(),
                "linuxParameters": devices("/dev/fuse"),
            },
            {"name": "sidecar", "image": "busybox", "essential": False},
        ],
        "placementConstraints": [
            {"type": "memberOf", "expression": "attribute:ecs.instance-type =~ trn1.*"}
        ],
        "tags": [{"key": "team", "value": "ml"}],
    }
    original = copy.deepcopy(request)
    task = validate_task_definition(request)
    assert request == original, "the input must not be modified"
    assert task["cpu"] == "4096"
    assert task["memory"] == "8192"
    trainer, sidecar = task["containerDefinitions"]
    assert trainer["essential"] is True
    assert sidecar["essential"] is False
    assert sidecar["environment"] == [] and sidecar["resourceRequirements"] == []
    assert trainer["linuxParameters"]["devices"] == [
        {
            "hostPath": "/dev/fuse",
            "containerPath": "/dev/fuse",
            "permissions": ["read", "write", "mknod"],
        }
    ]
    assert task["placementConstraints"] == original["placementConstraints"]
    assert task["volumes"] == []


@pytest.mark.parametrize(
    ("cpu", "memory", "want"),
    [
        ("1024", "2048", ("1024", "2048")),
        (512, 1024, ("512", "1024")),
        ("0.5 vCPU", "1GB", ("512", "1024")),
    ],
)
def test_task_size_forms(cpu: Any, memory: Any, want: tuple[str, str]) -> None:
    task = validate_task_definition({**base(), "cpu": cpu, "memory": memory})
    assert (task["cpu"], task["memory"]) == want


def test_task_memory_replaces_container_memory() -> None:
    task = validate_task_definition(
        {"family": "f", "memory": "1024", "containerDefinitions": [{"name": "a", "command": ["x"]}]}
    )
    assert task["containerDefinitions"][0]["essential"] is True


def test_manual_neuron_devices_without_managed_allocation_are_fine() -> None:
    task = validate_task_definition(
        with_containers(
            container(
                name="a",
                linuxParameters=devices(
                    "/dev/neuron0", "/dev/neuron1", permissions=["read", "write"]
                ),
            ),
            container(name="b", linuxParameters=devices("/dev/neuron2")),
        )
    )
    a, b = task["containerDefinitions"]
    assert a["linuxParameters"]["devices"][1]["permissions"] == ["read", "write"]
    assert container_device_request(a) == {
        "gpu": 0,
        "neuron_all": False,
        "devices": ["/dev/neuron0", "/dev/neuron1"],
    }
    assert container_device_request(b)["devices"] == ["/dev/neuron2"]


@pytest.mark.parametrize(
    ("fields", "want"),
    [
        ({}, {"gpu": 0, "neuron_all": False, "devices": []}),
        ({"resourceRequirements": neuron()}, {"gpu": 0, "neuron_all": True, "devices": []}),
        (
            {"resourceRequirements": [{"type": "GPU", "value": "4"}]},
            {"gpu": 4, "neuron_all": False, "devices": []},
        ),
        (
            {"linuxParameters": devices("/dev/neuron3", "/dev/fuse")},
            {"gpu": 0, "neuron_all": False, "devices": ["/dev/neuron3", "/dev/fuse"]},
        ),
    ],
)
def test_container_device_request(fields: dict[str, Any], want: dict[str, Any]) -> None:
    assert container_device_request(container(**fields)) == want


def test_task_device_requests_in_container_order() -> None:
    task = validate_task_definition(
        with_containers(
            container(name="a", resourceRequirements=[{"type": "GPU", "value": "2"}]),
            container(name="b", resourceRequirements=[{"type": "GPU", "value": "1"}]),
        )
    )
    assert [r["gpu"] for r in task_device_requests(task)] == [2, 1]


def test_json_nulls_count_as_absent() -> None:
    task = validate_task_definition(
        {
            "family": "f",
            "placementConstraints": None,
            "containerDefinitions": [
                container(
                    essential=None,
                    environment=None,
                    linuxParameters={
                        "devices": [
                            {"hostPath": "/dev/neuron0", "containerPath": None, "permissions": None}
                        ]
                    },
                )
            ],
        }
    )
    main = task["containerDefinitions"][0]
    assert main["essential"] is True and main["environment"] == []
    assert main["linuxParameters"]["devices"][0] == {
        "hostPath": "/dev/neuron0",
        "containerPath": "/dev/neuron0",
        "permissions": ["read", "write", "mknod"],
    }
    assert task["placementConstraints"] == []


def test_without_service_model_malformed_input_is_a_client_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kiln.cluster import _ecs_model

    monkeypatch.setattr(_ecs_model, "SHAPES", {})
    monkeypatch.setattr(_ecs_model, "AVAILABLE", False)
    good = validate_task_definition(with_containers(container(resourceRequirements=neuron())))
    assert good["containerDefinitions"][0]["essential"] is True
    with pytest.raises(ClientException) as caught:
        validate_task_definition(with_containers(container(resourceRequirements=[{"value": "1"}])))
    assert caught.value.message == (
        "request: malformed task definition (KeyError: 'type'); install botocore for"
        " field-by-field validation"
    )
