"""Validation and normalization of RegisterTaskDefinition requests (container service JSON shape).

Field names, types and enums come from the service model that botocore ships (loaded at import
time), so an unknown field is rejected by name exactly where the real API would not know it.
On top of the model, Kiln checks the rules that matter for accelerator scheduling:

* ``resourceRequirements``: GPU value is a positive integer; NeuronDevice value is ``ALL``
  (managed allocation: the container gets every Neuron device of its instance); at most one
  container per task requests NeuronDevice; a type appears at most once per container.
* ``linuxParameters.devices`` (manual allocation): ``hostPath`` absolute, ``permissions`` within
  read/write/mknod (default all three), no duplicates; a task may not mix managed NeuronDevice
  allocation with manually mapped ``/dev/neuronN`` devices (nor GPU requirements with
  ``/dev/nvidiaN``).
* ``placementConstraints``: ``memberOf`` only, at most 10 (see ``kiln.cluster.query``).

Every error names the offending field by its path, e.g. ``containerDefinitions[0].cpu``.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from kiln.cluster import _ecs_model
from kiln.cluster.errors import ClientException, InvalidParameterException
from kiln.cluster.query import validate_constraints

MAX_CONTAINERS = 10
PERMISSIONS = ("read", "write", "mknod")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,255}")
_NEURON_PATH = re.compile(r"/dev/neuron\d+")
_NVIDIA_PATH = re.compile(r"/dev/nvidia\d+")
_CPU = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*(vcpu)?\s*")
_MEMORY = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*(gb|mib|mb)?\s*")


def _fail(where: str, problem: str) -> ClientException:
    return ClientException(f"{where}: {problem}")


def _default(obj: dict, key: str, value: Any) -> Any:
    """Like dict.setdefault, but a JSON null counts as absent."""
    if obj.get(key) is None:
        obj[key] = value
    return obj[key]


def validate_task_definition(request: dict) -> dict:
    """Validate a RegisterTaskDefinition body; return a normalized deep copy.

    Defaults filled in: ``essential`` (True) on every container, device ``containerPath`` (the
    host path) and ``permissions`` (read, write, mknod); task-level ``cpu``/``memory`` become
    plain unit strings ("1 vCPU" -> "1024", "2 GB" -> "2048"); missing lists become [].
    Raises ClientException, or InvalidParameterException for placement constraints.
    """
    if not _ecs_model.AVAILABLE:
        # Without botocore's model the field types are unchecked; report malformed input as a
        # client error instead of crashing on it.
        try:
            return _validate(request)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ClientException(
                f"request: malformed task definition ({type(exc).__name__}: {exc}); install"
                " botocore for field-by-field validation"
            ) from exc
    return _validate(request)


def _validate(request: Any) -> dict:
    if not isinstance(request, dict):
        raise ClientException(
            f"request: expected a JSON object, got {type(request).__name__}; send the"
            " RegisterTaskDefinition body"
        )
    task = copy.deepcopy(request)
    for field in ("family", "containerDefinitions"):
        if task.get(field) is None:
            raise ClientException(
                f"request: missing required field {field!r}; RegisterTaskDefinition needs"
                " 'family' and 'containerDefinitions'"
            )
    _normalize_task_size(task)
    _ecs_model.check_shape(
        task, "RegisterTaskDefinitionRequest", "request", skip={"placementConstraints"}
    )
    _check_family(task["family"])
    containers = task["containerDefinitions"]
    if not containers:
        raise _fail("containerDefinitions", "at least one container definition is required")
    if len(containers) > MAX_CONTAINERS:
        raise _fail(
            "containerDefinitions",
            f"at most {MAX_CONTAINERS} containers are allowed per task definition (got"
            f" {len(containers)}); split the task",
        )
    seen: dict[str, int] = {}
    for index, container in enumerate(containers):
        where = f"containerDefinitions[{index}]"
        _check_container(where, container, task_memory=task.get("memory"))
        name = container["name"]
        if name in seen:
            raise _fail(
                f"{where}.name",
                f"duplicate container name {name!r} (also used by containerDefinitions"
                f"[{seen[name]}]); give every container a unique name",
            )
        seen[name] = index
    if not any(container["essential"] for container in containers):
        raise _fail(
            "containerDefinitions",
            "at least one container must be essential; set 'essential': true on one of them",
        )
    _check_accelerator_consistency(containers)
    _check_dependencies(containers)
    constraints = _default(task, "placementConstraints", [])
    validate_constraints(constraints, for_task_definition=True)
    for field in ("requiresCompatibilities", "tags", "volumes"):
        _default(task, field, [])
    other = [v for v in task["requiresCompatibilities"] if v != "EC2"]
    if other:
        raise _fail(
            "requiresCompatibilities",
            f"{other} is not supported: Kiln runs tasks on registered container instances"
            " (launch type EC2); use ['EC2'] or leave it out",
        )
    return task


def _normalize_task_size(task: dict) -> None:
    """Turn task-level cpu/memory ("1 vCPU", "2 GB", 1024) into unit strings ("1024")."""
    units = {"cpu": (_CPU, "vcpu", "CPU units such as '1024' or '1 vCPU'")}
    units["memory"] = (_MEMORY, "gb", "MiB such as '2048' or '2 GB'")
    for field, (pattern, big_unit, example) in units.items():
        value = task.get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            raise _fail(field, f"expected a string in {example}, got {value!r}")
        match = pattern.fullmatch(str(value))
        if not match:
            raise _fail(field, f"invalid value {value!r}; give {example}")
        amount = float(match.group(1))
        if (match.group(2) or "").lower() == big_unit:
            amount *= 1024
        if amount <= 0 or amount != int(amount):
            raise _fail(
                field, f"invalid value {value!r}; give a positive whole number of {example}"
            )
        task[field] = str(int(amount))


def _check_family(family: str) -> None:
    if not _NAME.fullmatch(family):
        raise _fail(
            "family",
            f"invalid family {family!r}; use up to 255 letters (uppercase and lowercase),"
            " numbers, hyphens and underscores",
        )


def _check_container(where: str, container: dict, task_memory: str | None) -> None:
    name = container.get("name")
    if name is None:
        raise _fail(where, "missing required field 'name'; every container needs a unique name")
    if not _NAME.fullmatch(name):
        raise _fail(
            f"{where}.name",
            f"invalid container name {name!r}; use up to 255 letters (uppercase and lowercase),"
            " numbers, hyphens and underscores",
        )
    if not container.get("command") and not container.get("image"):
        raise _fail(
            where,
            "a container needs a 'command' (run as a process on the instance) or an 'image';"
            " add a command such as ['python', 'train.py']",
        )
    _default(container, "essential", True)
    for field in ("environment", "resourceRequirements"):
        _default(container, field, [])
    _check_sizes(where, container, task_memory)
    for index, variable in enumerate(container["environment"]):
        if not variable.get("name"):
            raise _fail(
                f"{where}.environment[{index}]",
                "missing required field 'name'; give each variable a name and a value",
            )
    _check_resource_requirements(where, container["resourceRequirements"])
    _check_launchable(where, container)
    linux = container.get("linuxParameters")
    if linux is not None:
        _check_devices(f"{where}.linuxParameters", linux)


def _check_launchable(where: str, container: dict) -> None:
    """Refuse what the agent could never start: bad variable names, NUL bytes, bad timeouts."""
    for index, variable in enumerate(container["environment"]):
        name = variable["name"]
        if "=" in name or "\0" in name:
            raise _fail(
                f"{where}.environment[{index}].name",
                f"invalid variable name {name!r}: it must not contain '=' or a NUL byte",
            )
        if "\0" in (variable.get("value") or ""):
            raise _fail(f"{where}.environment[{index}].value", "must not contain a NUL byte")
    for field in ("command", "entryPoint"):
        for index, arg in enumerate(container.get(field) or []):
            if "\0" in arg:
                raise _fail(f"{where}.{field}[{index}]", "must not contain a NUL byte")
    for field in ("user", "workingDirectory"):
        if "\0" in (container.get(field) or ""):
            raise _fail(f"{where}.{field}", "must not contain a NUL byte")
    timeout = container.get("stopTimeout")
    if timeout is not None and not 2 <= timeout <= 120:
        raise _fail(f"{where}.stopTimeout", f"must be 2 to 120 seconds (got {timeout})")
    for index, secret in enumerate(container.get("secrets") or []):
        if "=" in secret["name"] or "\0" in secret["name"]:
            raise _fail(f"{where}.secrets[{index}].name", "must not contain '=' or a NUL byte")


def _check_dependencies(containers: list[dict]) -> None:
    """``dependsOn`` names containers of the task, without cycles; HEALTHY needs health checks."""
    names = {c["name"] for c in containers}
    graph: dict[str, list[str]] = {}
    for index, container in enumerate(containers):
        deps = container.get("dependsOn") or []
        for position, dep in enumerate(deps):
            path = f"containerDefinitions[{index}].dependsOn[{position}]"
            if dep["containerName"] not in names or dep["containerName"] == container["name"]:
                raise _fail(path, f"{dep['containerName']!r} is not another container of the task")
            if dep["condition"] == "HEALTHY":
                raise _fail(path, "HEALTHY needs health checks, which Kiln does not run; use START")
        graph[container["name"]] = [d["containerName"] for d in deps]
    state: dict[str, int] = {}

    def visit(name: str) -> None:
        state[name] = 1
        for dep in graph[name]:
            if state.get(dep) == 1:
                raise _fail("containerDefinitions", f"dependsOn has a cycle through {dep!r}")
            if dep not in state:
                visit(dep)
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name)


def _check_sizes(where: str, container: dict, task_memory: str | None) -> None:
    cpu = container.get("cpu")
    if cpu is not None and cpu < 0:
        raise _fail(
            f"{where}.cpu", f"must not be negative (got {cpu}); give CPU units, 1024 per vCPU"
        )
    memory, reservation = container.get("memory"), container.get("memoryReservation")
    for field, value in (("memory", memory), ("memoryReservation", reservation)):
        if value is not None and value <= 0:
            raise _fail(f"{where}.{field}", f"must be a positive number of MiB (got {value})")
    if memory is None and reservation is None and task_memory is None:
        raise _fail(
            where,
            "at least one of 'memory' or 'memoryReservation' must be specified (or set the"
            " task-level 'memory')",
        )
    if memory is not None and reservation is not None and reservation > memory:
        raise _fail(
            f"{where}.memoryReservation",
            f"must not exceed memory (got memoryReservation={reservation}, memory={memory});"
            " lower memoryReservation or raise memory",
        )


def _check_resource_requirements(where: str, requirements: list[dict]) -> None:
    seen: set[str] = set()
    for index, requirement in enumerate(requirements):
        path = f"{where}.resourceRequirements[{index}]"
        kind, value = requirement["type"], requirement.get("value")
        if kind in seen:
            raise _fail(
                path, f"duplicate {kind} requirement; give each resource type once per container"
            )
        seen.add(kind)
        if kind == "InferenceAccelerator":
            raise _fail(
                path,
                "InferenceAccelerator (Elastic Inference) is not supported; use"
                " {'type': 'NeuronDevice', 'value': 'ALL'} on an Inferentia instance",
            )
        if kind == "GPU":
            if value is None or not re.fullmatch(r"[0-9]+", value) or int(value) <= 0:
                raise _fail(
                    path,
                    f"GPU value must be a positive integer (got {value!r}); set it to the number of"
                    " physical GPUs the container needs, e.g. '1'",
                )
        elif kind == "NeuronDevice" and value != "ALL":
            raise _fail(
                path,
                f"NeuronDevice value must be 'ALL' (got {value!r}); managed Neuron allocation gives"
                " the container every device of its instance",
            )
        if "sharingStrategy" in requirement:
            raise _fail(
                f"{path}.sharingStrategy",
                "GPU sharing is not supported; remove sharingStrategy to get whole GPUs",
            )


def _check_devices(where: str, linux: dict) -> None:
    devices = linux.get("devices")
    if devices is None:
        return
    seen: dict[str, int] = {}
    for index, device in enumerate(devices):
        path = f"{where}.devices[{index}]"
        host_path = device["hostPath"]
        if not host_path.startswith("/"):
            raise _fail(
                f"{path}.hostPath",
                f"must be an absolute path (got {host_path!r}), e.g. '/dev/neuron0'",
            )
        if host_path in seen:
            raise _fail(
                f"{path}.hostPath",
                f"{host_path!r} is already mapped by {where}.devices[{seen[host_path]}];"
                " map each host device once",
            )
        seen[host_path] = index
        container_path = _default(device, "containerPath", host_path)
        if not container_path.startswith("/"):
            raise _fail(
                f"{path}.containerPath",
                f"must be an absolute path (got {container_path!r}); omit it to use the host path",
            )
        permissions = _default(device, "permissions", list(PERMISSIONS))
        for position, permission in enumerate(permissions):
            if permission not in PERMISSIONS:
                raise _fail(
                    f"{path}.permissions[{position}]",
                    f"invalid permission {permission!r}; use read, write and/or mknod",
                )
        if len(set(permissions)) != len(permissions):
            raise _fail(f"{path}.permissions", "lists a permission twice; give each at most once")
        if not permissions:
            raise _fail(
                f"{path}.permissions",
                "must not be empty; omit it to get read, write and mknod",
            )


def _check_accelerator_consistency(containers: list[dict]) -> None:
    """One NeuronDevice container per task; managed and manual allocation not mixed."""
    neuron_owner: str | None = None
    gpu_owner: str | None = None
    for index, container in enumerate(containers):
        for position, requirement in enumerate(container["resourceRequirements"]):
            path = f"containerDefinitions[{index}].resourceRequirements[{position}]"
            if requirement["type"] == "NeuronDevice":
                if neuron_owner is not None:
                    raise _fail(
                        path,
                        "only one container per task may request NeuronDevice (already requested"
                        f" by container {neuron_owner!r}); keep the requirement on one container",
                    )
                neuron_owner = container["name"]
            elif requirement["type"] == "GPU":
                gpu_owner = gpu_owner or container["name"]
    if neuron_owner is not None and gpu_owner is not None:
        raise _fail(
            "containerDefinitions",
            f"the task requests both NeuronDevice (container {neuron_owner!r}) and GPU (container"
            f" {gpu_owner!r}); no instance type has both, request one kind of accelerator",
        )
    for index, container in enumerate(containers):
        devices = (container.get("linuxParameters") or {}).get("devices") or []
        for position, device in enumerate(devices):
            path = f"containerDefinitions[{index}].linuxParameters.devices[{position}]"
            host_path = device["hostPath"]
            if neuron_owner is not None and _NEURON_PATH.fullmatch(host_path):
                raise _fail(
                    path,
                    f"{host_path!r} is mapped manually but container {neuron_owner!r} requests"
                    " NeuronDevice; use either resourceRequirements NeuronDevice 'ALL' or"
                    " linuxParameters.devices for Neuron devices, not both",
                )
            if gpu_owner is not None and _NVIDIA_PATH.fullmatch(host_path):
                raise _fail(
                    path,
                    f"{host_path!r} is mapped manually but container {gpu_owner!r} requests GPUs;"
                    " use either resourceRequirements GPU or linuxParameters.devices, not both",
                )


def container_device_request(container: dict) -> dict:
    """What placement must reserve for one (validated) container.

    Returns ``{"gpu": n, "neuron_all": bool, "devices": [hostPath, ...]}``: the GPU count, whether
    the container takes every Neuron device of its instance, and the host paths it maps manually
    through ``linuxParameters.devices`` (placement reserves those it tracks, e.g. /dev/neuronN).
    """
    gpu = 0
    neuron_all = False
    for requirement in container.get("resourceRequirements") or []:
        if requirement.get("type") == "GPU":
            gpu += int(requirement.get("value") or 0)
        elif requirement.get("type") == "NeuronDevice":
            neuron_all = True
    devices = (container.get("linuxParameters") or {}).get("devices") or []
    paths = list(dict.fromkeys(d["hostPath"] for d in devices if d.get("hostPath")))
    return {"gpu": gpu, "neuron_all": neuron_all, "devices": paths}


def override_requirements(containers: list[dict], overrides: dict[str, list[dict]]) -> list[dict]:
    """``containers`` with RunTask's ``containerOverrides[].resourceRequirements`` applied.

    ``overrides`` maps a container name to its override's requirements; each replaces the
    definition's requirement of the same type and keeps the others.  The result is checked as a
    registration would check it (GPU a positive integer, NeuronDevice ``ALL``, one NeuronDevice
    container, no GPU with NeuronDevice); a violation is InvalidParameterException.
    """
    out = []
    for container in containers:
        wanted = overrides.get(container["name"])
        if wanted is not None:
            where = f"overrides.containerOverrides[name={container['name']}]"
            try:
                _check_resource_requirements(where, wanted)
            except ClientException as e:
                raise InvalidParameterException(str(e)) from e
            kinds = {r["type"] for r in wanted}
            kept = [
                r for r in container.get("resourceRequirements") or [] if r["type"] not in kinds
            ]
            container = {**container, "resourceRequirements": kept + list(wanted)}
        out.append(container)
    try:
        _check_accelerator_consistency(out)
    except ClientException as e:
        raise InvalidParameterException(f"with containerOverrides applied: {e}") from e
    return out


def task_device_requests(task: dict) -> list[dict]:
    """``container_device_request`` for every container of a task definition, in order."""
    return [container_device_request(c) for c in task.get("containerDefinitions") or []]


def model_available() -> bool:
    """Whether botocore's service model was found (unknown-field checks need it)."""
    return _ecs_model.AVAILABLE


__all__ = [
    "InvalidParameterException",
    "container_device_request",
    "override_requirements",
    "task_device_requests",
    "validate_task_definition",
]
