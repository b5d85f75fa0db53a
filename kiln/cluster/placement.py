"""Task placement: choose a container instance and the exact devices for each task.

Pure functions over snapshots (``Candidate``) read inside the service's exclusive transaction, so
the choice and the device reservation it implies commit together.  Checks run in the container
service's order and report its failure reasons per instance:

    INACTIVE / AGENT / ATTRIBUTE / "MemberOf placement constraint unsatisfied" /
    "DistinctInstance placement constraint unsatisfied" / RESOURCE:CPU / RESOURCE:MEMORY /
    RESOURCE:PORTS / RESOURCE:PORTS_UDP / RESOURCE:GPU / RESOURCE:NEURON / RESOURCE:DEVICE

``RESOURCE:PORTS`` (``_UDP``): a fixed ``portMappings[].hostPort`` of the task is held on the
instance by a task that has not stopped (tasks run as host processes, so the clash is real).

``RESOURCE:NEURON`` (Neuron devices of the instance already held) and ``RESOURCE:DEVICE`` (a
``linuxParameters.devices`` host path already held) are Kiln's own names in the service's style;
an instance with no Neuron devices at all fails a NeuronDevice task with ``ATTRIBUTE``, and so
does one without a ``/dev/neuronN`` or ``/dev/nvidiaN`` that a task maps by path.  (The task
definition's ``requiresAttributes`` is not used: the container service derives it from features
Kiln does not have; use a ``memberOf`` constraint on ``attribute:NAME`` instead.)

Strategies: ``binpack`` (cpu|memory: least remaining first), ``spread`` (instanceId|host|
attribute:NAME: the value with the fewest tasks of this group first), ``random``; several apply in
order as sort keys, ties broken at random.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import re
from typing import Any

from kiln.cluster.errors import InvalidParameterException

# Host paths of devices placement tracks: mapping one needs the instance to have that device.
_TRACKED_PATH = re.compile(r"/dev/(neuron|nvidia)(\d+)")
MEMBER_OF_FAILED = "MemberOf placement constraint unsatisfied"
DISTINCT_FAILED = "DistinctInstance placement constraint unsatisfied"


@dataclasses.dataclass
class Candidate:
    """What placement needs to know about one container instance (mutated as tasks land)."""

    arn: str
    ec2_instance_id: str
    status: str
    agent_connected: bool
    agent_version: str
    attributes: dict[str, str]
    registered_at: float
    remaining_cpu: int
    remaining_memory: int
    free_devices: list[dict[str, Any]]  # rows of the devices table with task_arn NULL
    all_devices: list[dict[str, Any]]  # every device of the instance
    running_tasks_count: int = 0
    groups: dict[str, int] = dataclasses.field(default_factory=dict)  # group -> active tasks
    used_ports: set[tuple[int, str]] = dataclasses.field(default_factory=set)  # (port, protocol)

    def subject(self) -> dict[str, Any]:
        """The instance as the cluster query language sees it."""
        subj: dict[str, Any] = {f"attribute:{k}": v for k, v in self.attributes.items()}
        subj.update(
            {
                "ec2InstanceId": self.ec2_instance_id,
                "agentConnected": self.agent_connected,
                "agentVersion": self.agent_version,
                "runningTasksCount": self.running_tasks_count,
                "registeredAt": dt.datetime.fromtimestamp(self.registered_at, dt.UTC),
                "task:group": set(self.groups),
            }
        )
        return subj


@dataclasses.dataclass
class TaskNeeds:
    """What one task asks for."""

    cpu: int
    memory: int
    group: str
    containers: list[dict[str, Any]]  # per container: {"gpu": n, "neuron_all": b, "devices": []}
    constraints: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    strategies: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    host_ports: list[tuple[int, str]] = dataclasses.field(default_factory=list)  # fixed ones


def host_ports(td: dict[str, Any]) -> list[tuple[int, str]]:
    """The fixed host ports ``(hostPort, protocol)`` a task definition's ``portMappings`` hold
    on its instance; ``hostPort`` 0 or absent is a dynamic port and holds nothing."""
    out = []
    for c in td.get("containerDefinitions") or []:
        for m in c.get("portMappings") or []:
            port = m.get("hostPort")
            if isinstance(port, int) and port > 0:
                out.append((port, (m.get("protocol") or "tcp").lower()))
    return out


@dataclasses.dataclass
class Placement:
    candidate: Candidate
    devices: list[list[dict[str, Any]]]  # per container, the device rows it gets


def _member_of(expression: str, candidate: Candidate) -> bool:
    from kiln.cluster import query

    return bool(query.parse(expression).evaluate(candidate.subject()))


def _device_at(c: Candidate, host_path: str) -> tuple[dict | None, bool]:
    """(the instance's device mapped by ``host_path``, whether the path is one placement tracks).

    ``/dev/neuronN`` and ``/dev/nvidiaN`` are tracked: the instance must have that device (by
    path, else the device of that kind and index).  Other paths (``/dev/fuse``) are not.
    """
    for d in c.all_devices:
        if d["path"] and d["path"] == host_path:
            return d, True
    match = _TRACKED_PATH.fullmatch(host_path)
    if match is None:
        return None, False
    kind = "neuron" if match.group(1) == "neuron" else "gpu"
    for d in c.all_devices:
        if d["kind"] == kind and d["idx"] == int(match.group(2)) and not d["path"]:
            return d, True
    return None, True


def _assign_devices(c: Candidate, needs: TaskNeeds) -> tuple[list[list[dict]] | None, str]:
    """Pick devices for every container or say which resource is short."""
    free = sorted(c.free_devices, key=lambda d: (d["kind"], d["idx"]))
    free_ids = {d["device_id"] for d in free}
    taken: set[str] = set()
    result: list[list[dict]] = []
    for req in needs.containers:
        mine: list[dict] = []
        if req.get("neuron_all"):
            neuron_all = [d for d in c.all_devices if d["kind"] == "neuron"]
            if not neuron_all:
                return None, "ATTRIBUTE"
            neuron_free = [d for d in free if d["kind"] == "neuron" and d["device_id"] not in taken]
            if len(neuron_free) != len(neuron_all):
                return None, "RESOURCE:NEURON"
            mine.extend(neuron_free)
        gpus = int(req.get("gpu") or 0)
        if gpus:
            gpu_free = [d for d in free if d["kind"] == "gpu" and d["device_id"] not in taken]
            if len(gpu_free) < gpus:
                return None, "RESOURCE:GPU"
            mine.extend(gpu_free[:gpus])
        for host_path in req.get("devices") or []:
            dev, tracked = _device_at(c, host_path)
            if dev is None and tracked:
                return None, "ATTRIBUTE"  # the instance has no such device
            if dev is None:
                continue  # an untracked host device (checked by the agent when it starts)
            if dev["device_id"] not in free_ids or dev["device_id"] in taken:
                return None, "RESOURCE:DEVICE"
            if any(m["device_id"] == dev["device_id"] for m in mine):
                continue
            mine.append(dev)
        taken.update(d["device_id"] for d in mine)
        result.append(mine)
    return result, ""


def check(c: Candidate, needs: TaskNeeds) -> tuple[list[list[dict]] | None, str]:
    """Whether ``needs`` fits on ``c`` now: (devices per container, "") or (None, reason)."""
    if c.status != "ACTIVE":
        return None, "INACTIVE"
    if not c.agent_connected:
        return None, "AGENT"
    for con in needs.constraints:
        if con.get("type") == "memberOf" and not _member_of(con.get("expression", ""), c):
            return None, MEMBER_OF_FAILED
        if con.get("type") == "distinctInstance" and c.groups.get(needs.group, 0) > 0:
            return None, DISTINCT_FAILED
    if needs.cpu > c.remaining_cpu:
        return None, "RESOURCE:CPU"
    if needs.memory > c.remaining_memory:
        return None, "RESOURCE:MEMORY"
    for port, protocol in needs.host_ports:
        if (port, protocol) in c.used_ports:
            return None, "RESOURCE:PORTS_UDP" if protocol == "udp" else "RESOURCE:PORTS"
    return _assign_devices(c, needs)


STRATEGY_TYPES = ("random", "spread", "binpack")
LAUNCH_TYPE = "EC2"  # every task runs on a registered container instance


def check_launch_type(body: dict[str, Any]) -> None:
    """Refuse what would run a task anywhere but a registered instance: ``launchType`` other
    than EC2, and any ``capacityProviderStrategy`` (Kiln has no capacity providers)."""
    launch = body.get("launchType")
    if launch not in (None, LAUNCH_TYPE):
        raise InvalidParameterException(
            f"launchType {launch!r} is not supported: Kiln runs tasks on registered container"
            f" instances only; use launchType {LAUNCH_TYPE!r} or leave it out"
        )
    if body.get("capacityProviderStrategy"):
        raise InvalidParameterException(
            "capacityProviderStrategy is not supported: Kiln has no capacity providers; leave it"
            f" out (tasks run on registered container instances, launch type {LAUNCH_TYPE})"
        )


def validate_strategies(strategies: Any) -> list[dict[str, Any]]:
    """``placementStrategy`` as given, or InvalidParameterException naming the bad entry:
    ``binpack`` needs ``field`` cpu or memory, ``spread`` needs instanceId, host or
    attribute:NAME, ``random`` takes no field; at most 5 entries."""
    if not isinstance(strategies, list):
        raise InvalidParameterException("placementStrategy must be a list of {type, field} objects")
    if len(strategies) > 5:
        raise InvalidParameterException("at most 5 placement strategies per task")
    for i, s in enumerate(strategies):
        where = f"placementStrategy[{i}]"
        if not isinstance(s, dict):
            raise InvalidParameterException(f"{where}: must be an object with 'type' and 'field'")
        kind, field = s.get("type"), s.get("field")
        if kind not in STRATEGY_TYPES:
            raise InvalidParameterException(
                f"{where}: unknown placement strategy {kind!r}; use one of binpack, random, spread"
            )
        if kind == "binpack" and (
            not isinstance(field, str) or field.lower() not in ("cpu", "memory")
        ):
            raise InvalidParameterException(
                f"{where}: binpack field must be cpu or memory, got {field!r}"
            )
        if kind == "spread" and not _spread_field_ok(field):
            raise InvalidParameterException(
                f"{where}: spread needs a field: instanceId, host or attribute:NAME"
                f" (such as attribute:ecs.availability-zone), got {field!r}"
            )
        if kind == "random" and field not in (None, ""):
            raise InvalidParameterException(f"{where}: random takes no field, got {field!r}")
    return strategies


def _spread_field_ok(field: Any) -> bool:
    if not isinstance(field, str):
        return False
    return field in ("instanceId", "host") or (
        field.startswith("attribute:") and len(field) > len("attribute:")
    )


def _sort_key(
    c: Candidate,
    strategies: list[dict],
    candidates: list[Candidate],
    group: str,
    rng: random.Random,
) -> tuple:
    key: list[Any] = []
    for s in strategies:
        kind, field = s.get("type"), (s.get("field") or "")
        if kind == "binpack":
            key.append(c.remaining_memory if field.lower() == "memory" else c.remaining_cpu)
        elif kind == "spread":
            if field in ("instanceId", "host", ""):
                key.append(c.groups.get(group, 0))
            else:
                name = field.removeprefix("attribute:")
                value = c.attributes.get(name)
                key.append(
                    sum(
                        o.groups.get(group, 0)
                        for o in candidates
                        if o.attributes.get(name) == value
                    )
                )
        elif kind == "random":
            key.append(rng.random())
    key.append(rng.random())
    return tuple(key)


def place(
    candidates: list[Candidate], needs: TaskNeeds, count: int, rng: random.Random | None = None
) -> tuple[list[Placement], list[dict[str, str]]]:
    """Place ``count`` copies of a task; returns placements and ECS-style ``failures``."""
    rng = rng or random.Random()
    placements: list[Placement] = []
    reasons: dict[str, str] = {}
    for _ in range(count):
        order = sorted(
            candidates, key=lambda c: _sort_key(c, needs.strategies, candidates, needs.group, rng)
        )
        chosen: Placement | None = None
        for c in order:
            devices, reason = check(c, needs)
            if devices is None:
                reasons[c.arn] = reason
                continue
            chosen = Placement(c, devices)
            break
        if chosen is None:
            continue
        _consume(chosen.candidate, needs, chosen.devices)
        placements.append(chosen)
    failures: list[dict[str, str]] = []
    if len(placements) < count:
        failures = [{"arn": arn, "reason": reason} for arn, reason in sorted(reasons.items())]
    return placements, failures


def _consume(c: Candidate, needs: TaskNeeds, devices: list[list[dict]]) -> None:
    c.remaining_cpu -= needs.cpu
    c.remaining_memory -= needs.memory
    used = {d["device_id"] for per in devices for d in per}
    c.free_devices = [d for d in c.free_devices if d["device_id"] not in used]
    c.used_ports.update(needs.host_ports)
    c.running_tasks_count += 1
    c.groups[needs.group] = c.groups.get(needs.group, 0) + 1
