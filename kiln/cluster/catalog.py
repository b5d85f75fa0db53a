"""Catalog of accelerator instance types and ``instanceRequirements`` matching.

Numbers follow the Neuron hardware docs (inf1/inf2/trn1/trn2 architecture pages) and public
GPU catalogs; see ``shared/reference/accelerator-instances.md``. Neuron chips appear on the host
as ``/dev/neuron0`` .. ``/dev/neuron{N-1}``; GPU types expose no Neuron device paths.
"""

from __future__ import annotations

import re
from typing import Any

from kiln.cluster import _ecs_model
from kiln.cluster.errors import InvalidParameterException
from kiln.devices.instances import INSTANCE_TYPES, InstanceType

_TYPES: list[InstanceType] = list(INSTANCE_TYPES.values())


ACCELERATOR_MANUFACTURERS: tuple[str, ...] = tuple(
    _ecs_model.enum_values("AcceleratorManufacturer")
    or ["amazon-web-services", "amd", "nvidia", "xilinx", "habana"]
)
# The EC2 enum also has the Neuron chips; older ECS models list only "inferentia".
ACCELERATOR_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys(
        [*_ecs_model.enum_values("AcceleratorName"), "trainium", "trainium2", "inferentia"]
        + ["inferentia2", "a100", "a10g", "h100"]
    )
)
_PATTERN_CHARS = re.compile(r"[a-zA-Z0-9.*\-]+")
_SUPPORTED_REQUIREMENTS = (
    "acceleratorManufacturers",
    "acceleratorNames",
    "acceleratorCount",
    "acceleratorTotalMemoryMiB",
    "allowedInstanceTypes",
    "excludedInstanceTypes",
    "vCpuCount",
    "memoryMiB",
)


def get_instance_type(name: str) -> InstanceType:
    """The catalog entry for ``name``; InvalidParameterException naming the valid types."""
    found = INSTANCE_TYPES.get(name) if isinstance(name, str) else None
    if found is None:
        valid = ", ".join(INSTANCE_TYPES)
        raise InvalidParameterException(
            f"unknown instance type {name!r}; use one of the catalog types: {valid}"
        )
    return found


def _pattern_regex(pattern: Any, field: str) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not 1 <= len(pattern) <= 30:
        raise InvalidParameterException(
            f"instanceRequirements.{field}: pattern {pattern!r} must be a string of 1 to 30"
            " characters, e.g. 'trn1.*'"
        )
    if not _PATTERN_CHARS.fullmatch(pattern):
        raise InvalidParameterException(
            f"instanceRequirements.{field}: invalid pattern {pattern!r}; use letters, digits,"
            " '.', '-' and '*' wildcards only, e.g. 'trn1*.*'"
        )
    parts = [re.escape(part) for part in pattern.lower().split("*")]
    return re.compile(".*".join(parts))


def _in_range(value: int, bounds: Any, field: str) -> bool:
    if not isinstance(bounds, dict) or set(bounds) - {"min", "max"}:
        raise InvalidParameterException(
            f"instanceRequirements.{field}: expected an object with optional integer 'min' and"
            f" 'max', got {bounds!r}"
        )
    for key in ("min", "max"):
        bound = bounds.get(key)
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise InvalidParameterException(
                f"instanceRequirements.{field}.{key}: expected an integer, got {bound!r}"
            )
    low, high = bounds.get("min"), bounds.get("max")
    return (low is None or value >= low) and (high is None or value <= high)


def _string_list(req: dict, field: str, allowed: tuple[str, ...] | None) -> list[str] | None:
    values = req.get(field)
    if values is None:
        return None
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise InvalidParameterException(
            f"instanceRequirements.{field}: expected a list of strings, got {values!r}"
        )
    if allowed is not None:
        for value in values:
            if value not in allowed:
                raise InvalidParameterException(
                    f"instanceRequirements.{field}: invalid value {value!r}; valid values are:"
                    f" {', '.join(allowed)}"
                )
    return values


def matches_instance_requirements(itype: InstanceType, req: dict) -> bool:
    """Whether ``itype`` satisfies an ``instanceRequirements`` object.

    Supported keys: acceleratorManufacturers, acceleratorNames, acceleratorCount {min,max},
    acceleratorTotalMemoryMiB {min,max}, vCpuCount {min,max}, memoryMiB {min,max},
    allowedInstanceTypes / excludedInstanceTypes (``*`` wildcards; not both). Other fields of the
    model (pricing, storage, network, ...) do not apply to Kiln's catalog and are ignored; fields
    that are not in the model raise InvalidParameterException.
    """
    if not isinstance(req, dict):
        raise InvalidParameterException(
            f"instanceRequirements: expected an object, got {type(req).__name__}"
        )
    known = _ecs_model.member_names("InstanceRequirementsRequest") or list(_SUPPORTED_REQUIREMENTS)
    for key in req:
        if key not in known:
            raise InvalidParameterException(
                f"instanceRequirements: unknown field {key!r}; supported fields are:"
                f" {', '.join(_SUPPORTED_REQUIREMENTS)}"
            )
    if req.get("allowedInstanceTypes") is not None and req.get("excludedInstanceTypes") is not None:
        raise InvalidParameterException(
            "instanceRequirements: allowedInstanceTypes and excludedInstanceTypes cannot both be"
            " set; keep only one of them"
        )
    allowed = [
        _pattern_regex(p, "allowedInstanceTypes")
        for p in _string_list(req, "allowedInstanceTypes", None) or []
    ]
    excluded = [
        _pattern_regex(p, "excludedInstanceTypes")
        for p in _string_list(req, "excludedInstanceTypes", None) or []
    ]
    manufacturers = _string_list(req, "acceleratorManufacturers", ACCELERATOR_MANUFACTURERS)
    names = _string_list(req, "acceleratorNames", ACCELERATOR_NAMES)
    ranges = [
        _in_range(value, req[field], field)
        for field, value in (
            ("acceleratorCount", itype.accelerator_count),
            ("acceleratorTotalMemoryMiB", itype.accelerator_memory_mib),
            ("vCpuCount", itype.vcpu),
            ("memoryMiB", itype.memory_mib),
        )
        if req.get(field) is not None
    ]
    name = itype.name.lower()
    has_allowed = req.get("allowedInstanceTypes") is not None
    if has_allowed and not any(regex.fullmatch(name) for regex in allowed):
        return False
    if any(regex.fullmatch(name) for regex in excluded):
        return False
    if manufacturers is not None and itype.manufacturer not in manufacturers:
        return False
    if names is not None and itype.accelerator_name not in names:
        return False
    return all(ranges)


def matching_instance_types(req: dict) -> list[InstanceType]:
    """All catalog types that satisfy ``req``, in catalog order."""
    return [itype for itype in _TYPES if matches_instance_requirements(itype, req)]
