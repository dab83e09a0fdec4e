"""The part of a checkpoint one process of a multi-host group reads.

Under tensor parallelism across hosts, a process's devices hold only their heads, MLP columns
and vocabulary rows of each projection; the other processes' slices never reach its devices.
A `LoadPart` names, per tensor, the index ranges this process needs along one axis of
jaxserve's layout, and the safetensors loader reads only those bytes (row ranges of an HF
`[out, in]` tensor are one contiguous read; column ranges are read row by row). The params
arrays keep their full shapes; what a process does not read is left unwritten, and only the
slices its own devices need are ever placed (`parallel.place`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class TensorPart:
    """Index ranges [start, stop) along `axis` of one tensor in jaxserve's layout, per layer
    for the layer tensors (`-1`: output columns of an `[in, out]` projection or a bias, `-2`:
    input rows, or the vocabulary rows of the `[V, E]` embedding)."""

    axis: int
    ranges: tuple[tuple[int, int], ...]


LoadPart = Mapping[str, TensorPart]  # by jaxserve tensor name ("q_proj", "embed", ...)


def merged(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted ranges with the adjacent and overlapping ones joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return tuple(out)
