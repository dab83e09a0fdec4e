"""Snapshots of a hybrid model's linear-layer states at block boundaries, for prefix caching.

A paged prefix hit restores K/V by sharing blocks; a linear layer's state cannot be rebuilt from
blocks, so a hit must also restore the state the sequence had at the hit's last block boundary.
A snapshot is a copy of a request's state slot taken when one of its multi-token spans ends on
a block boundary (`Scheduler` ends prefill chunks there, and stops a prompt's prefill at its
last full block), keyed by the chained hash of the block that ends there: equal hashes mean
equal prefixes, so equal states.

The snapshots live in state slots of their own (after the running requests' slots), at most
`capacity`. When they are all taken, the least recently used one is overwritten. A snapshot is
dropped with its block: when the block pool evicts the hash, the slot is free again.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_slot: int, capacity: int) -> None:
        self.capacity = capacity
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._free = list(range(first_slot + capacity - 1, first_slot - 1, -1))

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hash: bytes) -> int | None:
        """The snapshot slot of the prefix ending with this block, marked recently used."""
        slot = self._by_hash.get(block_hash)
        if slot is not None:
            self._by_hash.move_to_end(block_hash)
        return slot

    def has(self, block_hash: bytes) -> bool:
        return block_hash in self._by_hash

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to copy the state ending at this block into: a free one, else the least
        recently used snapshot's. None when the hash has one already or there are no slots."""
        if not self.capacity or block_hash in self._by_hash:
            return None
        slot = self._free.pop() if self._free else self._by_hash.popitem(last=False)[1]
        self._by_hash[block_hash] = slot
        return slot

    def drop(self, block_hash: bytes) -> None:
        """The block with this hash was evicted: its snapshot slot is free."""
        slot = self._by_hash.pop(block_hash, None)
        if slot is not None:
            self._free.append(slot)

    def clear(self) -> int:
        """Forget every snapshot (a prefix-cache reset); returns how many there were."""
        n = len(self._by_hash)
        for slot in self._by_hash.values():
            self._free.append(slot)
        self._by_hash.clear()
        return n
