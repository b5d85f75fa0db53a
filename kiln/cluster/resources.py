"""What a container instance brings: its RegisterContainerInstance request turned into a spec,
and resources rendered as the service's ``Resource`` lists.

Devices come from, in order of preference:

* Kiln's ``kilnDevices`` field (what ``kiln cluster add-instance`` discovered on the host);
* the service's ``platformDevices`` (type GPU) or a ``GPU`` string-set in ``totalResources``;
* otherwise, if the instance type (attribute ``ecs.instance-type`` or the identity document's
  ``instanceType``) is in the catalog, devices *simulated* from the catalog.

A simulated instance with no ``kiln.device-root`` attribute has no device files: its agent skips
the device-file check.  With a device root, the agent checks ``<root>/dev/neuronN`` before start.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from typing import Any

from kiln.cluster.errors import InvalidParameterException

DEVICE_ROOT_ATTRIBUTE = "kiln.device-root"


@dataclasses.dataclass
class DeviceSpec:
    kind: str
    index: int
    path: str | None
    cores: int
    memory_mib: int
    name: str
    uuid: str | None = None

    @property
    def device_id(self) -> str:
        return f"{self.kind}{self.index}"


@dataclasses.dataclass
class InstanceSpec:
    ec2_instance_id: str
    instance_type: str | None
    agent_version: str
    attributes: dict[str, str]
    cpu: int
    memory: int
    simulated: bool
    device_root: str | None
    devices: list[DeviceSpec]


def public_id(dev: dict[str, Any]) -> str:
    """The id the API shows: Neuron device index ("0" for /dev/neuron0); GPU UUID or index."""
    if dev["kind"] == "gpu" and dev.get("uuid"):
        return str(dev["uuid"])
    return str(dev["idx"])


def _resource_value(resources: list[dict[str, Any]], name: str) -> Any:
    for r in resources or []:
        if r.get("name") == name:
            for key in ("integerValue", "longValue", "doubleValue", "stringSetValue"):
                if r.get(key) is not None:
                    return r[key]
    return None


MAX_AMOUNT = 2**31 - 1  # the service's Integer fields
DEVICE_KINDS = ("neuron", "gpu")


def _amount(value: Any, where: str) -> int:
    """A whole number from 0 to 2^31-1; anything else (negative, huge, text, bool) is refused."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_AMOUNT:
        raise InvalidParameterException(
            f"{where}: must be a whole number from 0 to {MAX_AMOUNT}, got {value!r}"
        )
    return value


def _optional_text(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise InvalidParameterException(f"{where}: expected a string, got {value!r}")
    return value


def _devices_from_request(body: dict[str, Any]) -> list[DeviceSpec]:
    devices: list[DeviceSpec] = []
    given = body.get("kilnDevices") or []
    if not isinstance(given, list):
        raise InvalidParameterException("kilnDevices: expected a list of device objects")
    for i, d in enumerate(given):
        where = f"kilnDevices[{i}]"
        if not isinstance(d, dict):
            raise InvalidParameterException(f"{where}: expected an object")
        kind = d.get("kind", "neuron")
        if kind not in DEVICE_KINDS:
            raise InvalidParameterException(f"{where}.kind: must be one of {DEVICE_KINDS}")
        devices.append(
            DeviceSpec(
                kind=kind,
                index=_amount(d.get("index", i), f"{where}.index"),
                path=_optional_text(d.get("path"), f"{where}.path"),
                cores=_amount(d.get("cores", 0), f"{where}.cores"),
                memory_mib=_amount(
                    d.get("memoryMib", d.get("memory_mib", 0)), f"{where}.memoryMib"
                ),
                name=str(_optional_text(d.get("name", ""), f"{where}.name") or ""),
                uuid=_optional_text(d.get("uuid"), f"{where}.uuid"),
            )
        )
    gpu_ids = [p["id"] for p in body.get("platformDevices") or [] if p.get("type") == "GPU"]
    if not gpu_ids:
        gpu_ids = list(_resource_value(body.get("totalResources") or [], "GPU") or [])
    for i, gid in enumerate(gpu_ids):
        devices.append(DeviceSpec("gpu", i, None, 0, 0, "gpu", str(gid)))
    return devices


def _simulated(instance_type: str) -> list[DeviceSpec]:
    from kiln.devices import discovery

    return [
        DeviceSpec(d.kind, d.index, d.path, d.cores, d.memory_mib, d.name, d.uuid)
        for d in discovery.simulated_devices(instance_type)
    ]


def instance_spec(body: dict[str, Any]) -> InstanceSpec:
    """Validate a RegisterContainerInstance request and work out what the instance has."""
    from kiln.cluster import catalog

    doc: dict[str, Any] = {}
    if body.get("instanceIdentityDocument"):
        try:
            doc = json.loads(body["instanceIdentityDocument"])
        except (ValueError, RecursionError) as e:
            raise InvalidParameterException("instanceIdentityDocument is not JSON") from e
        if not isinstance(doc, dict) or not all(isinstance(v, str) for v in doc.values()):
            raise InvalidParameterException(
                "instanceIdentityDocument must be a JSON object of strings"
            )
    attrs: dict[str, str] = {}
    for a in body.get("attributes") or []:
        if not isinstance(a, dict) or not a.get("name"):
            raise InvalidParameterException("each attribute needs a name")
        attrs[a["name"]] = str(a.get("value") or "")
    type_name = attrs.get("ecs.instance-type") or doc.get("instanceType")
    itype = catalog.get_instance_type(type_name) if type_name else None
    if type_name:
        attrs["ecs.instance-type"] = type_name
    attrs.setdefault("ecs.availability-zone", doc.get("availabilityZone") or "us-east-1a")
    attrs.setdefault("ecs.os-type", "linux")
    total = body.get("totalResources") or []
    cpu = _resource_value(total, "CPU")
    memory = _resource_value(total, "MEMORY")
    if cpu is None:
        cpu = itype.vcpu * 1024 if itype else None
    if memory is None:
        memory = itype.memory_mib if itype else None
    if cpu is None or memory is None:
        raise InvalidParameterException(
            "give totalResources CPU and MEMORY, or an ecs.instance-type attribute from the catalog"
        )
    devices = _devices_from_request(body)
    simulated = False
    if not devices and itype is not None and itype.accelerator_kind:
        devices = _simulated(itype.name)
        simulated = True
    if body.get("kilnSimulated") is not None:
        simulated = bool(body["kilnSimulated"])
    cpu = _amount(cpu, "totalResources CPU")
    memory = _amount(memory, "totalResources MEMORY")
    ids = [d.device_id for d in devices]
    if len(set(ids)) != len(ids):
        raise InvalidParameterException("duplicate device indices in the registration")
    version = (body.get("versionInfo") or {}).get("agentVersion") or "kiln-1.0"
    return InstanceSpec(
        ec2_instance_id=doc.get("instanceId") or "i-" + secrets.token_hex(9)[:17],
        instance_type=type_name,
        agent_version=version,
        attributes=attrs,
        cpu=int(cpu),
        memory=int(memory),
        simulated=simulated,
        device_root=attrs.get(DEVICE_ROOT_ATTRIBUTE) or None,
        devices=devices,
    )


def resource_list(cpu: int, memory: int, devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``registeredResources`` / ``remainingResources`` in the service's shape.

    GPUs appear as the service's ``GPU`` string set; Neuron devices as Kiln's ``NEURON`` string
    set of device indices (the service has no such resource; botocore passes it through).
    """
    out: list[dict[str, Any]] = [
        {"name": "CPU", "type": "INTEGER", "integerValue": int(cpu)},
        {"name": "MEMORY", "type": "INTEGER", "integerValue": int(memory)},
        {"name": "PORTS", "type": "STRINGSET", "stringSetValue": []},
        {"name": "PORTS_UDP", "type": "STRINGSET", "stringSetValue": []},
    ]
    for kind, name in (("gpu", "GPU"), ("neuron", "NEURON")):
        ids = [public_id(d) for d in devices if d["kind"] == kind]
        out.append({"name": name, "type": "STRINGSET", "stringSetValue": ids})
    return out
