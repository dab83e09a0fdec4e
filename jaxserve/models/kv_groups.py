"""KV layer groups: how a model whose layers attend within windows or chunks lays out its cache.

Every layer of a plain model keeps every token's K/V. A windowed layer reads only the last W
positions and a chunked layer only its own chunk, so their older pages can be handed back
while the sequence runs, and only if those layers' pages are not the full layers' pages. The
cache is therefore split into groups of `group_size` layers, each group one kind (full, one
window, one chunk size) with its own block table over the one pool of pages (a page holds
`group_size` layers of one group; the scheduler's `kv_groups` are the groups' kinds). Layer
l's K/V lives in cache slot `layer_slot[l]` of the pages of group `layer_group[l]`.

The group size is the smallest kind's layer count (vLLM's choice): gpt-oss's 12 + 12 layers
are two groups of 12, Gemma 3 27B's 52 windowed and 10 full layers seven groups of 10 (the
last windowed group has 2 slots unused).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

FULL = ("full", 0)


@dataclasses.dataclass(frozen=True)
class KVLayerGroups:
    group_size: int  # cache layers per page (the cache's leading axis)
    kinds: tuple[tuple[str, int], ...]  # per group: ("full", 0) | ("window", W) | ("chunk", C)
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in the group's pages

    @property
    def num_groups(self) -> int:
        return len(self.kinds)

    @property
    def num_full_groups(self) -> int:
        return sum(1 for k in self.kinds if k == FULL)


@functools.lru_cache(maxsize=64)
def plan_layer_groups(layer_kinds: Sequence[tuple[str, int]]) -> KVLayerGroups | None:
    """The groups of these per-layer kinds, or None when no layer is bounded (one plain cache)."""
    layer_kinds = tuple(layer_kinds)
    if all(k == FULL for k in layer_kinds):
        return None
    by_kind: dict[tuple[str, int], list[int]] = {}
    for layer, kind in enumerate(layer_kinds):
        by_kind.setdefault(kind, []).append(layer)
    size = min(len(layers) for layers in by_kind.values())
    kinds: list[tuple[str, int]] = []
    group = [0] * len(layer_kinds)
    slot = [0] * len(layer_kinds)
    # full groups first: the first group is then the one a request's whole prefix lives in
    for kind in sorted(by_kind, key=lambda k: k != FULL):
        layers = by_kind[kind]
        for i, layer in enumerate(layers):
            if i % size == 0:
                kinds.append(kind)
            group[layer] = len(kinds) - 1
            slot[layer] = i % size
    return KVLayerGroups(size, tuple(kinds), tuple(group), tuple(slot))
