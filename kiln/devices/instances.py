"""Accelerator instance types: host resources and the accelerators each one has.

Numbers follow the Neuron hardware docs (inf1/inf2/trn1/trn2 architecture pages) and public
GPU catalogs; see ``shared/reference/accelerator-instances.md``. Neuron chips appear on the host
as ``/dev/neuron0`` .. ``/dev/neuron{N-1}``; GPU types expose no Neuron device paths.

Device discovery simulates hosts from this table, and ``kiln.cluster.catalog`` matches
``instanceRequirements`` against it; it lives here so that devices import nothing from cluster.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnknownInstanceType(ValueError):
    """An instance type that is not in the catalog."""


GIB = 1024  # MiB per GiB


@dataclass(frozen=True)
class InstanceType:
    """One instance type: host resources plus its accelerators."""

    name: str
    vcpu: int
    memory_mib: int
    accelerator_kind: str | None  # "neuron" | "gpu" | None
    accelerator_count: int  # chips (Neuron) or devices (GPU)
    cores_per_device: int  # NeuronCores per chip; 0 for GPUs
    accelerator_memory_mib: int  # total over all accelerators
    manufacturer: str | None  # "amazon-web-services" | "nvidia"
    accelerator_name: str | None  # "trainium", "inferentia2", "a100", ...

    def device_paths(self) -> list[str]:
        """Host device nodes of the Neuron chips ([] for GPU and CPU-only types)."""
        if self.accelerator_kind != "neuron":
            return []
        return [f"/dev/neuron{index}" for index in range(self.accelerator_count)]

    @property
    def cpu_units(self) -> int:
        """CPU the container agent registers: 1024 units per vCPU."""
        return self.vcpu * 1024

    @property
    def total_cores(self) -> int:
        """NeuronCores over all chips (0 for GPU types)."""
        return self.accelerator_count * self.cores_per_device

    @property
    def memory_per_device_mib(self) -> int:
        """Accelerator memory of one chip or GPU (0 without accelerators)."""
        if not self.accelerator_count:
            return 0
        return self.accelerator_memory_mib // self.accelerator_count


def _neuron(
    name: str, vcpu: int, memory_gib: int, chips: int, cores: int, accel_gib: int, chip: str
) -> InstanceType:
    return InstanceType(
        name=name,
        vcpu=vcpu,
        memory_mib=memory_gib * GIB,
        accelerator_kind="neuron",
        accelerator_count=chips,
        cores_per_device=cores,
        accelerator_memory_mib=accel_gib * GIB,
        manufacturer="amazon-web-services",
        accelerator_name=chip,
    )


def _gpu(
    name: str, vcpu: int, memory_gib: int, gpus: int, mib_per_gpu: int, model: str
) -> InstanceType:
    return InstanceType(
        name=name,
        vcpu=vcpu,
        memory_mib=memory_gib * GIB,
        accelerator_kind="gpu",
        accelerator_count=gpus,
        cores_per_device=0,
        accelerator_memory_mib=gpus * mib_per_gpu,
        manufacturer="nvidia",
        accelerator_name=model,
    )


_TYPES: list[InstanceType] = [
    _neuron("inf1.xlarge", 4, 8, 1, 4, 8, "inferentia"),
    _neuron("inf1.2xlarge", 8, 16, 1, 4, 8, "inferentia"),
    _neuron("inf1.6xlarge", 24, 48, 4, 4, 32, "inferentia"),
    _neuron("inf1.24xlarge", 96, 192, 16, 4, 128, "inferentia"),
    _neuron("inf2.xlarge", 4, 16, 1, 2, 32, "inferentia2"),
    _neuron("inf2.8xlarge", 32, 128, 1, 2, 32, "inferentia2"),
    _neuron("inf2.24xlarge", 96, 384, 6, 2, 192, "inferentia2"),
    _neuron("inf2.48xlarge", 192, 768, 12, 2, 384, "inferentia2"),
    _neuron("trn1.2xlarge", 8, 32, 1, 2, 32, "trainium"),
    _neuron("trn1.32xlarge", 128, 512, 16, 2, 512, "trainium"),
    _neuron("trn1n.32xlarge", 128, 512, 16, 2, 512, "trainium"),
    # Trainium2 has 8 physical NeuronCores per chip; at the default logical-core setting
    # (LNC=2) the runtime sees 4 logical cores per chip, which is what NEURON_RT_VISIBLE_CORES uses.
    _neuron("trn2.48xlarge", 192, 2048, 16, 4, 1536, "trainium2"),
    _gpu("g5.xlarge", 4, 16, 1, 24 * GIB, "a10g"),
    _gpu("g5.12xlarge", 48, 192, 4, 24 * GIB, "a10g"),
    _gpu("g5.48xlarge", 192, 768, 8, 24 * GIB, "a10g"),
    _gpu("p4d.24xlarge", 96, 1152, 8, 40 * GIB, "a100"),
    _gpu("p5.48xlarge", 192, 2048, 8, 80 * GIB, "h100"),
]

INSTANCE_TYPES: dict[str, InstanceType] = {itype.name: itype for itype in _TYPES}


def lookup_instance_type(name: str) -> InstanceType:
    """The catalog entry for ``name``; UnknownInstanceType naming the valid types."""
    found = INSTANCE_TYPES.get(name) if isinstance(name, str) else None
    if found is None:
        raise UnknownInstanceType(
            f"unknown instance type {name!r}; use one of the catalog types: "
            + ", ".join(INSTANCE_TYPES)
        )
    return found
