"""Kiln devices.

``kiln.devices.discovery`` finds the accelerators of a host (Neuron chips from sysfs/devfs, GPUs
through NVML) or simulates them from the instance catalog; the cluster agent, ``kiln ls`` and
``kiln top`` share it.
"""
