"""Kiln observe: see what Kiln does while a model trains.

* ``kiln ls`` (:mod:`kiln.observe.ls`): the host's CPUs, NUMA nodes, caches, memory, GPUs (NVML)
  and Neuron devices, and which running Kiln process holds which cores and devices.
* ``kiln top`` (:mod:`kiln.observe.top`): a live view of per-core utilization and every Kiln
  process with its graphs, step time, compile and execute time, host memory.
* :mod:`kiln.observe.publish`: each Kiln process publishes a small JSON record of its state in the
  runtime directory at step boundaries (rate-limited, atomic, removed at exit); the tools read it.
* :mod:`kiln.observe.tensorboard`: ``kiln.tensorboard(logdir)`` writes Kiln's metrics per step.
* :mod:`kiln.observe.ranges` and :mod:`kiln.observe.profile`: Kiln's stages as named ranges in
  ``torch.profiler`` traces; ``kiln profile -- python train.py`` writes a Chrome trace.

Layering: this package sits beside ``kiln.tools``.  The runtime reaches it only through
:func:`kiln.metrics.on_step` hooks (installed by :mod:`kiln.observe.hook`) and, while a profiler
records, a lazy import of :mod:`kiln.observe.ranges`.
"""
