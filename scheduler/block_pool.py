"""Device KV blocks: reference counts, an LRU free queue, and the hash -> block map.

A block is *free* when no request holds it (``ref_cnt == 0``). A free block may still be
*cached*: it keeps its hash and its K/V, and a later request with the same prefix can take it
back from the free queue (O(1), via the doubly linked list) instead of recomputing it. A
cached free block is only evicted when the pool hands it out for new data, and the free queue
is ordered so the least recently freed cached block goes first. Blocks without a hash carry
nothing worth keeping, so they are put at the head of the queue and reused before any cached
block is evicted.

Block 0 is the reserved null block: never in the free queue, never handed out. Padding tokens
and unused block-table entries point at it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class KVBlock:
    """One device block. ``prev``/``next`` link it into the free queue while it is free."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: O(1) pop, append and remove.

    A Python deque cannot remove from the middle in O(1), and a prefix-cache hit must pull a
    cached free block out of wherever it sits in the queue.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev
        block.prev, block.next = last, self._tail
        last.next = block
        self._tail.prev = block
        self.num_free += 1

    def appendleft(self, block: KVBlock) -> None:
        first = self._head.next
        block.prev, block.next = self._head, first
        first.prev = block
        self._head.next = block
        self.num_free += 1

    def __iter__(self):
        b = self._head.next
        while b is not self._tail:
            yield b
            b = b.next

    def __len__(self) -> int:
        return self.num_free


class BlockPool:
    """All device blocks of the KV cache, with reference counting and prefix-cache lookup."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        # One block per hash is enough: a duplicate full block is simply not registered.
        self.cached: dict[bytes, KVBlock] = {}
        self.num_cached_free = 0
        # Called with a hash whose block stops being cached (hybrid models drop its state snapshot).
        self.on_evict: Callable[[bytes], None] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached free blocks included: evictable)."""
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one request."""
        return self.num_blocks - 1 - self.free_queue.num_free

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks off the head of the free queue, evicting their cached contents."""
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, only {self.free_queue.num_free} free")
        out = []
        popleft = self.free_queue.popleft
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        h = block.block_hash
        if self.cached.get(h) is block:
            del self.cached[h]
            if self.on_evict is not None:
                self.on_evict(h)
        block.block_hash = None
        if block.ref_cnt == 0:
            self.num_cached_free -= 1

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking free ones off the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free -= 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block, in eviction order (first = evicted first).

        Blocks reaching zero references go to the free queue: cached ones at the tail (LRU),
        uncached ones at the head (nothing to lose by reusing them first).
        """
        q = self.free_queue
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    q.append(block)
                    self.num_cached_free += 1
                else:
                    q.appendleft(block)
            elif block.ref_cnt < 0:
                block.ref_cnt = 0
                raise AssertionError(f"double free of {block}")

    def cache_block(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash. False if the hash is already taken."""
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, free or held; returns how many were dropped. A held
        block keeps its K/V for its owners but is never found by a lookup again, and goes to
        the head of the free queue (as uncached) when its last owner frees it."""
        dropped = 0
        for block in list(self.cached.values()):
            self._evict(block)
            dropped += 1
        return dropped


class HostBlockPool:
    """Host-side blocks that hold swapped-out K/V. Plain free list; no caching, no null block.

    Host block ids are indices into the runner's host KV store (``0 .. num_blocks - 1``).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, ids: Iterable[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise AssertionError(f"double free of host block {i}")
            self._used.remove(i)
            self._free.append(i)
