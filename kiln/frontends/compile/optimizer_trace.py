"""Dynamo's tracing of ``optimizer.step()`` without importing Inductor for CPU tensors.

When Dynamo traces an optimizer's ``step`` (``torch._dynamo.variables.optimizer``), it asks of
every parameter's gradient whether CUDA graphs would treat it as a static address
(``_is_static_for_cudagraphs``).  That function imports ``torch._inductor.cudagraph_trees`` at
its top, before it looks at the tensor, and answers ``True`` for every tensor that is not on a
CUDA device without using what it imported.  The import pulls in Inductor's ``compile_fx``, its
lowering and its code generators: 0.35-0.45 s of CPU in the first step of every process that
compiles a training step, cold or warm, whatever the backend -- a third of the MLP's warm start
(1.30 -> 0.95 s of CPU, llama 3.1 -> 2.7 s, 1 thread, this machine, 2026-12-03).

:func:`install` wraps it: a tensor that is not on a CUDA device gets torch's own answer (``True``)
without the import; a CUDA tensor goes to torch's function unchanged.  The answers are the same
for every tensor, so no trace changes, for Kiln or any other backend in the process; only the
import is left to the code that uses it (Inductor imports its own modules when it compiles).
It is installed only over the function it was checked against (the torch versions in
``torch_wrap.CHECKED``, the function still torch's own): on another torch it leaves torch as it is.

Kiln installs it when ``torch.compile`` looks up Kiln's backend by name (see
``backend._OnLookup``), when ``kiln.compile`` is called, and at the latest when its backend first
runs; not at ``import kiln``: a process that imports Kiln and never compiles with it keeps torch
untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from kiln.frontends.compile.torch_wrap import defined_in, release_checked, wrap_once

# read in torch_wrap.CHECKED's releases: True for a non-CUDA tensor, the CUDA-graph manager
# consulted only for CUDA tensors
_NAME = "_is_static_for_cudagraphs"


def _wrap(original: Callable[[torch.Tensor], bool]) -> Callable[[torch.Tensor], bool]:
    @functools.wraps(original)
    def is_static_for_cudagraphs(x: torch.Tensor) -> bool:
        if not x.is_cuda:
            return True  # torch's answer for such a tensor, without its import
        return original(x)

    return is_static_for_cudagraphs


def install() -> bool:
    """Install the wrapper (once per process); whether it is in place."""
    if not release_checked():
        return False
    from torch._dynamo.variables import optimizer

    return wrap_once(optimizer, _NAME, _wrap, defined_in(optimizer.__name__))
