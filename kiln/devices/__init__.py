"""Kiln devices.

``kiln.devices.discovery`` finds the accelerators of a host (Neuron chips from sysfs/devfs, GPUs
through NVML) or simulates them from the instance catalog (``kiln.devices.instances``); the
cluster agent, ``kiln ls`` and ``kiln top`` share it.  ``kiln.devices.cpu`` reads the CPU topology
(sockets, cores, NUMA nodes, caches, memory) and ``kiln.devices.nvml`` the live state of GPUs.
"""
