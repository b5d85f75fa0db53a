"""Kiln's former device-backend autoload hook (entry point group ``torch.backends``): now a no-op.

Kiln no longer registers anything at ``import torch``.  It used to register the kiln device guard
here, so that PyTorch's autograd engine, which sizes its per-device queues at the first backward
pass of a process, would have a kiln queue even when kiln was imported after eager training.  But
with that guard every process of an environment with kiln installed started an autograd device
thread at its first backward pass, and PyTorch then refuses autograd in forked children: kiln
changed programs that never use it.  ``import kiln`` registers the guard now, and a process that
ran a backward pass before importing kiln runs its backward passes on the calling thread instead
(kiln/frontends/lazy/backward_thread.py).

The module stays so that environments installed while the entry point existed (their package
metadata still names ``kiln_autoload:load``) keep importing torch: PyTorch raises at ``import
torch`` when a listed entry point cannot be loaded.  Reinstalling kiln drops the entry point.
"""

from __future__ import annotations


def load() -> None:
    """Called by ``import torch`` in environments installed with the old entry point: nothing."""
