"""Instance catalog numbers and instanceRequirements matching."""

from __future__ import annotations

from typing import Any

import pytest

from kiln.cluster.catalog import (
    ACCELERATOR_NAMES,
    INSTANCE_TYPES,
    get_instance_type,
    matches_instance_requirements,
    matching_instance_types,
)
from kiln.cluster.errors import InvalidParameterException

GIB = 1024

# name: (vcpu, memory GiB, kind, count, cores per device, accelerator memory GiB, chip)
EXPECTED: dict[str, tuple[int, int, str, int, int, int, str]] = {
    "inf1.xlarge": (4, 8, "neuron", 1, 4, 8, "inferentia"),
    "inf1.2xlarge": (8, 16, "neuron", 1, 4, 8, "inferentia"),
    "inf1.6xlarge": (24, 48, "neuron", 4, 4, 32, "inferentia"),
    "inf1.24xlarge": (96, 192, "neuron", 16, 4, 128, "inferentia"),
    "inf2.xlarge": (4, 16, "neuron", 1, 2, 32, "inferentia2"),
    "inf2.8xlarge": (32, 128, "neuron", 1, 2, 32, "inferentia2"),
    "inf2.24xlarge": (96, 384, "neuron", 6, 2, 192, "inferentia2"),
    "inf2.48xlarge": (192, 768, "neuron", 12, 2, 384, "inferentia2"),
    "trn1.2xlarge": (8, 32, "neuron", 1, 2, 32, "trainium"),
    "trn1.32xlarge": (128, 512, "neuron", 16, 2, 512, "trainium"),
    "trn1n.32xlarge": (128, 512, "neuron", 16, 2, 512, "trainium"),
    "trn2.48xlarge": (192, 2048, "neuron", 16, 4, 1536, "trainium2"),
    "g5.xlarge": (4, 16, "gpu", 1, 0, 24, "a10g"),
    "g5.12xlarge": (48, 192, "gpu", 4, 0, 96, "a10g"),
    "g5.48xlarge": (192, 768, "gpu", 8, 0, 192, "a10g"),
    "p4d.24xlarge": (96, 1152, "gpu", 8, 0, 320, "a100"),
    "p5.48xlarge": (192, 2048, "gpu", 8, 0, 640, "h100"),
}


def test_accelerator_names_include_every_catalog_chip() -> None:
    chips = {itype.accelerator_name for itype in INSTANCE_TYPES.values()}
    assert chips <= set(ACCELERATOR_NAMES)


def test_catalog_has_exactly_the_expected_types() -> None:
    assert set(INSTANCE_TYPES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_catalog_numbers(name: str) -> None:
    vcpu, memory, kind, count, cores, accel, chip = EXPECTED[name]
    itype = get_instance_type(name)
    assert (itype.name, itype.vcpu, itype.memory_mib) == (name, vcpu, memory * GIB)
    assert (itype.accelerator_kind, itype.accelerator_count) == (kind, count)
    assert (itype.cores_per_device, itype.accelerator_memory_mib) == (cores, accel * GIB)
    assert itype.accelerator_name == chip
    assert itype.manufacturer == ("nvidia" if kind == "gpu" else "amazon-web-services")
    assert itype.cpu_units == vcpu * 1024
    if kind == "neuron":
        assert itype.device_paths() == [f"/dev/neuron{i}" for i in range(count)]
        assert itype.total_cores == count * cores
    else:
        assert itype.device_paths() == []


def test_trn1_32xlarge_paths() -> None:
    paths = get_instance_type("trn1.32xlarge").device_paths()
    assert (paths[0], paths[-1], len(paths)) == ("/dev/neuron0", "/dev/neuron15", 16)


@pytest.mark.parametrize("name", ["trn3.large", "", "TRN1.32XLARGE", None])
def test_unknown_instance_type(name: Any) -> None:
    with pytest.raises(InvalidParameterException) as caught:
        get_instance_type(name)
    assert caught.value.message == (
        f"unknown instance type {name!r}; use one of the catalog types: {', '.join(INSTANCE_TYPES)}"
    )


def names(req: dict[str, Any]) -> list[str]:
    return [itype.name for itype in matching_instance_types(req)]


# (requirements, matching types in catalog order)
MATCHES: list[tuple[dict[str, Any], list[str]]] = [
    ({"allowedInstanceTypes": ["trn1*.*"]}, ["trn1.2xlarge", "trn1.32xlarge", "trn1n.32xlarge"]),
    ({"allowedInstanceTypes": ["trn1.*"]}, ["trn1.2xlarge", "trn1.32xlarge"]),
    (
        {"allowedInstanceTypes": ["*.48xlarge"]},
        ["inf2.48xlarge", "trn2.48xlarge", "g5.48xlarge", "p5.48xlarge"],
    ),
    (
        {"allowedInstanceTypes": ["p4d.24xlarge", "g5*"]},
        ["g5.xlarge", "g5.12xlarge", "g5.48xlarge", "p4d.24xlarge"],
    ),
    (
        {"allowedInstanceTypes": ["*2*"], "acceleratorManufacturers": ["nvidia"]},
        ["g5.12xlarge", "p4d.24xlarge"],
    ),
    ({"excludedInstanceTypes": ["inf*", "trn*", "g5.*"]}, ["p4d.24xlarge", "p5.48xlarge"]),
    (
        {"acceleratorNames": ["inferentia2"], "acceleratorCount": {"min": 6}},
        ["inf2.24xlarge", "inf2.48xlarge"],
    ),
    (
        {"acceleratorNames": ["trainium", "trainium2"], "acceleratorCount": {"max": 1}},
        ["trn1.2xlarge"],
    ),
    (
        {"acceleratorManufacturers": ["nvidia"], "acceleratorCount": {"min": 8, "max": 8}},
        ["g5.48xlarge", "p4d.24xlarge", "p5.48xlarge"],
    ),
    ({"acceleratorManufacturers": ["amd"]}, []),
    ({"acceleratorNames": ["h100", "a100"]}, ["p4d.24xlarge", "p5.48xlarge"]),
    (
        {"vCpuCount": {"min": 128}, "memoryMiB": {"max": 512 * GIB}},
        ["trn1.32xlarge", "trn1n.32xlarge"],
    ),
    ({"acceleratorTotalMemoryMiB": {"min": 1000 * GIB}}, ["trn2.48xlarge"]),
    (
        {"acceleratorNames": ["inferentia"], "spotMaxPricePercentageOverLowestPrice": 10},
        ["inf1.xlarge", "inf1.2xlarge", "inf1.6xlarge", "inf1.24xlarge"],
    ),
]


@pytest.mark.parametrize(("req", "expected"), MATCHES)
def test_matching(req: dict[str, Any], expected: list[str]) -> None:
    assert names(req) == expected


def test_empty_requirements_match_everything() -> None:
    assert names({}) == list(INSTANCE_TYPES)
    assert matches_instance_requirements(get_instance_type("trn1.32xlarge"), {})


# (requirements, exact message)
REQUIREMENT_ERRORS: list[tuple[Any, str]] = [
    ([], "instanceRequirements: expected an object, got list"),
    (
        {"allowedInstanceTypes": ["trn1.*"], "excludedInstanceTypes": ["inf1.*"]},
        (
            "instanceRequirements: allowedInstanceTypes and excludedInstanceTypes cannot both be set;"
            " keep only one of them"
        ),
    ),
    (
        {"acceleratorVendor": ["nvidia"]},
        (
            "instanceRequirements: unknown field 'acceleratorVendor'; supported fields are:"
            " acceleratorManufacturers, acceleratorNames, acceleratorCount, acceleratorTotalMemoryMiB,"
            " allowedInstanceTypes, excludedInstanceTypes, vCpuCount, memoryMiB"
        ),
    ),
    (
        {"allowedInstanceTypes": ["trn1?.*"]},
        (
            "instanceRequirements.allowedInstanceTypes: invalid pattern 'trn1?.*'; use letters,"
            " digits, '.', '-' and '*' wildcards only, e.g. 'trn1*.*'"
        ),
    ),
    (
        {"excludedInstanceTypes": [""]},
        (
            "instanceRequirements.excludedInstanceTypes: pattern '' must be a string of 1 to 30"
            " characters, e.g. 'trn1.*'"
        ),
    ),
    (
        {"allowedInstanceTypes": "trn1.*"},
        "instanceRequirements.allowedInstanceTypes: expected a list of strings, got 'trn1.*'",
    ),
    (
        {"acceleratorManufacturers": ["aws"]},
        (
            "instanceRequirements.acceleratorManufacturers: invalid value 'aws'; valid values are:"
            " amazon-web-services, amd, nvidia, xilinx, habana"
        ),
    ),
    (
        {"acceleratorNames": ["trainium3"]},
        # The list follows the installed botocore model plus the Neuron chips.
        (
            "instanceRequirements.acceleratorNames: invalid value 'trainium3'; valid values are:"
            f" {', '.join(ACCELERATOR_NAMES)}"
        ),
    ),
    (
        {"acceleratorCount": 2},
        (
            "instanceRequirements.acceleratorCount: expected an object with optional integer 'min'"
            " and 'max', got 2"
        ),
    ),
    (
        {"acceleratorCount": {"min": "2"}},
        "instanceRequirements.acceleratorCount.min: expected an integer, got '2'",
    ),
]


@pytest.mark.parametrize(("req", "message"), REQUIREMENT_ERRORS)
def test_requirement_errors(req: Any, message: str) -> None:
    with pytest.raises(InvalidParameterException) as caught:
        matches_instance_requirements(get_instance_type("trn1.32xlarge"), req)
    assert caught.value.message == message
