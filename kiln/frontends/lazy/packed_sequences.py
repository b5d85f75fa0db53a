"""``pack_padded_sequence`` on the kiln device: its ``batch_sizes`` on the CPU, as on every device.

ATen's ``_pack_padded_sequence`` returns the packed data on the input's device and
``batch_sizes`` on the CPU (``PackedSequence`` refuses any other: "batch_sizes should always be
on CPU"); recorded on the kiln device like any op, both came out as kiln tensors.  Here
``batch_sizes`` is computed on the CPU from ``lengths`` (a CPU tensor by contract) and the data
is the input's time steps, each cut to its batch size, concatenated -- ATen's own algorithm, as
recorded ops.  Its gradient is ATen's ``_pack_padded_sequence_backward`` (composite: recorded op
by op), and ``pad_packed_sequence`` is composite too.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch

aten = torch.ops.aten


def pack_padded_sequence(
    x: torch.Tensor, lengths: torch.Tensor, batch_first: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if lengths.device.type != "cpu" or lengths.dim() != 1:
        raise RuntimeError(
            "'lengths' argument should be a 1D CPU int64 tensor, but got "
            f"{lengths.dim()}D {lengths.device} {lengths.dtype} tensor"
        )
    steps = x.transpose(0, 1) if batch_first else x  # (T, B, *)
    ls = [int(v) for v in lengths.tolist()]
    if len(ls) != steps.shape[1]:
        raise RuntimeError(
            f"Expected `len(lengths)` to be equal to batch_size, but got {len(ls)} "
            f"(batch_size={steps.shape[1]})"
        )
    if ls and ls[-1] <= 0:
        raise RuntimeError(
            "Length of all samples has to be greater than 0, but found an element in 'lengths' "
            "that is <= 0"
        )
    if any(a < b for a, b in pairwise(ls)):
        raise RuntimeError(
            "`lengths` array must be sorted in decreasing order when `enforce_sorted` is True. "
            "You can pass `enforce_sorted=False` to pack_padded_sequence and/or pack_sequence to "
            "sidestep this requirement if you do not need ONNX exportability."
        )
    if ls and ls[0] > steps.shape[0]:
        raise RuntimeError(
            f"Length of the longest sample ({ls[0]}) exceeds the sequence length ({steps.shape[0]})"
        )
    batch_sizes = [sum(1 for n in ls if n > t) for t in range(ls[0] if ls else 0)]
    data = torch.cat([steps[t, :b] for t, b in enumerate(batch_sizes)])
    return data, torch.tensor(batch_sizes, dtype=torch.int64)


DECOMPOSITIONS: dict[Any, Any] = {
    aten._pack_padded_sequence.default: pack_padded_sequence,
}
