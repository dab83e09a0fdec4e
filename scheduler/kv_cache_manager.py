"""The KV cache manager: the only owner of block tables.

The scheduler talks to it in tokens (``allocate_slots(request, num_new_tokens)``); blocks,
reference counts, hashes and the host swap pool stay behind this interface. Each request
holding device blocks has a list of ``KVBlock`` (logical block i -> physical block) and a
row of one persistent ``[rows, max_blocks_per_seq]`` int32 table (the same ids, padded with
the null block 0). Rows are updated in place as blocks are added, so a step's block tables
are one fancy-indexing copy (``gather_block_tables``), never rebuilt from lists.

Prefix-cache registration happens *after* a block's K/V has been computed
(``cache_computed_blocks``, called from ``update_from_output``), so a cached block always
holds valid data.

Callers never see a ``KVBlock``: a prefix-cache hit is an opaque ``ComputedBlocks`` handed
back to ``allocate_slots``, and ``usage()`` is the one snapshot of pool occupancy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scheduler.block_pool import BlockPool, HostBlockPool, KVBlock
from scheduler.config import SchedulerConfig
from scheduler.prefix_cache import extend_block_hashes
from scheduler.request import Request
from scheduler.state_snapshots import StateSnapshots


class ComputedBlocks:
    """A prefix-cache hit: leading blocks whose K/V is already computed, not yet referenced.

    Opaque to callers except for its length in tokens; pass it to ``allocate_slots``.
    """

    __slots__ = ("_blocks", "num_tokens", "snapshot")

    def __init__(self, blocks: list[KVBlock], block_size: int, snapshot: int = 0) -> None:
        self._blocks = blocks
        self.num_tokens = len(blocks) * block_size
        # Hybrid models: the state snapshot slot to restore (the state at the hit's end); 0: none.
        self.snapshot = snapshot

    def __len__(self) -> int:
        return len(self._blocks)


_NO_HIT = ComputedBlocks([], 1)


@dataclass(frozen=True)
class KVUsage:
    """Occupancy of the device and host pools (usable blocks: the null block is excluded).

    ``num_used + num_free == num_total``; ``num_cached_free`` is the part of ``num_free``
    that still holds reusable prefix K/V. Prefix-cache queries and hits count tokens.
    """

    num_used: int
    num_cached_free: int
    num_free: int
    num_total: int
    num_host_used: int
    num_host_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class _Blocks:
    """Per-request device allocation: logical -> physical blocks and its table slot."""

    __slots__ = ("blocks", "slot", "num_registered", "cacheable")

    def __init__(self, slot: int) -> None:
        self.blocks: list[KVBlock] = []
        self.slot = slot  # row of KVCacheManager.tables holding this request's block ids
        # Leading blocks already offered to the prefix cache (registered or duplicates).
        self.num_registered = 0
        # False once the prefix cache was reset under this allocation: K/V computed before
        # the reset (e.g. with old weights) must never be shared afterwards.
        self.cacheable = True


class KVCacheManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.width = config.max_blocks_per_seq
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.host_pool = HostBlockPool(config.num_host_blocks)
        self._reqs: dict[str, _Blocks] = {}
        # Only running requests hold device blocks, so max_num_seqs rows usually suffice;
        # the table grows if a caller holds more.
        self.tables = np.zeros((config.max_num_seqs, self.width), dtype=np.int32)
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._host: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.recurrent = config.recurrent_state
        self.snapshots = StateSnapshots(config.max_num_seqs + 1, config.num_state_snapshots)
        if self.recurrent:
            self.pool.on_evict = self.snapshots.drop
        # A swapped-out hybrid request's state waits in a host state slot (one per request that
        # can be preempted); the copies of this step's swaps, drained by the scheduler.
        self.host_states = HostBlockPool(config.max_num_seqs if self.recurrent and config.num_host_blocks else 0)
        self._host_state: dict[str, int] = {}
        self.state_swap_out: list[tuple[int, int]] = []  # (state slot, host state slot)
        self.state_swap_in: list[tuple[int, int]] = []  # (host state slot, state slot)

    # ----------------------------------------------------------------- queries
    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` of K/V fit in the whole device pool and a table row."""
        n = self.num_blocks_for(num_tokens)
        return n <= self.pool.num_usable_blocks and n <= self.width

    def get_block_ids(self, request_id: str) -> list[int]:
        st = self._reqs.get(request_id)
        return [b.block_id for b in st.blocks] if st else []

    def usage(self) -> KVUsage:
        pool, host = self.pool, self.host_pool
        return KVUsage(
            num_used=pool.num_used_blocks,
            num_cached_free=pool.num_cached_free,
            num_free=pool.num_free_blocks,
            num_total=pool.num_usable_blocks,
            num_host_used=host.num_blocks - host.num_free_blocks,
            num_host_total=host.num_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def block_table_row(self, request_id: str) -> np.ndarray:
        """A copy of the request's block-table row (width ``max_blocks_per_seq``)."""
        return self.tables[self._reqs[request_id].slot].copy()

    def slot_of(self, request_id: str) -> int:
        return self._reqs[request_id].slot

    def gather_block_tables(self, slots: Sequence[int]) -> np.ndarray:
        """Copies of the given table rows, ``[len(slots), max_blocks_per_seq]`` int32."""
        return self.tables[slots] if slots else np.zeros((0, self.width), dtype=np.int32)

    def state_slot_of(self, request_id: str) -> int:
        """A hybrid model's state slot of a request holding device blocks: its table row + 1
        (slot 0 is the null slot); 0 for other models."""
        return self._reqs[request_id].slot + 1 if self.recurrent else 0

    def _new_state(self, request_id: str) -> _Blocks:
        if not self._free_slots:
            if self.recurrent:  # the state pools hold max_num_seqs running slots, no more
                raise AssertionError(f"more than max_num_seqs={self.config.max_num_seqs} requests hold blocks")
            old = self.tables.shape[0]
            self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
            self._free_slots = list(range(2 * old - 1, old - 1, -1))
        st = self._reqs[request_id] = _Blocks(self._free_slots.pop())
        return st

    def _drop_state(self, request_id: str) -> _Blocks | None:
        st = self._reqs.pop(request_id, None)
        if st is not None:
            self.tables[st.slot, : len(st.blocks)] = 0
            self._free_slots.append(st.slot)
        return st

    def get_host_block_ids(self, request_id: str) -> list[int]:
        return list(self._host.get(request_id, ()))

    # ----------------------------------------------------------------- prefix cache
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of the request, in whole blocks.

        At least the last token is always left to compute (the runner needs its logits), so
        the hit is capped at ``num_tokens - 1`` and floored to the block size. The blocks are
        not yet referenced; pass them to ``allocate_slots``. A request that asks for prompt
        logprobs never hits: its prompt's logits must all be computed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return _NO_HIT
        num_tokens = request.num_tokens
        max_hit_blocks = (num_tokens - 1) // self.block_size
        hashes = extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.cache_salt,
            max_blocks=max_hit_blocks,
            lora_id=request.lora_id,
            mm_keys=request.mm_keys,
        )
        hits: list[KVBlock] = []
        get = self.pool.cached.get
        for i in range(max_hit_blocks):
            block = get(hashes[i])
            if block is None:
                break
            hits.append(block)
        if not self.recurrent:
            return ComputedBlocks(hits, self.block_size)
        # A hybrid model resumes only where a state snapshot was kept: the longest such hit.
        for n in range(len(hits), 0, -1):
            if self.snapshots.has(hashes[n - 1]):
                return ComputedBlocks(hits[:n], self.block_size, self.snapshots.lookup(hashes[n - 1]))
        return _NO_HIT

    def snapshot_state(self, request: Request, num_tokens: int) -> tuple[int, int] | None:
        """A hybrid model's request computed exactly `num_tokens` (a block boundary): the
        (state slot, snapshot slot) copy that keeps its state for prefix hits, or None (no
        snapshots, not a registered block, or one is kept already)."""
        if not (self.recurrent and self.enable_caching) or num_tokens % self.block_size or not num_tokens:
            return None
        st = self._reqs.get(request.request_id)
        i = num_tokens // self.block_size - 1
        if st is None or not st.cacheable or i >= len(request.block_hashes):
            return None
        block_hash = request.block_hashes[i]
        if block_hash not in self.pool.cached:
            return None
        snap = self.snapshots.reserve(block_hash)
        return None if snap is None else (st.slot + 1, snap)

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup in tokens. The scheduler calls this once per admission, so a
        request retried over several steps is not counted several times."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def num_tokens_that_fit(self, request: Request, computed: ComputedBlocks = _NO_HIT) -> int:
        """How many new tokens ``allocate_slots`` could take right now for this request."""
        new_computed_blocks = computed._blocks
        st = self._reqs.get(request.request_id)
        num_held = (len(st.blocks) if st is not None else 0) + len(new_computed_blocks)
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        num_blocks = min(num_held + self.pool.num_free_blocks - num_revived, self.width)
        done = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        return max(num_blocks * self.block_size - done, 0)

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        st = self._reqs.get(request.request_id)
        if st is None or not self.enable_caching or not st.cacheable:
            return
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= st.num_registered:
            return
        hashes = extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            request.cache_salt,
            max_blocks=num_full,
            lora_id=request.lora_id,
            mm_keys=request.mm_keys,
        )
        cache_block = self.pool.cache_block
        blocks = st.blocks
        for i in range(st.num_registered, num_full):
            cache_block(blocks[i], hashes[i])
        st.num_registered = num_full

    # ----------------------------------------------------------------- allocation
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = _NO_HIT
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed`` is a prefix-cache hit from ``get_computed_blocks`` (only for a request
        that holds no blocks yet). Returns the ids of newly allocated blocks (possibly
        empty), or None if the pool cannot supply them; nothing changes on None.
        """
        new_computed_blocks = computed._blocks
        num_new_computed_tokens = computed.num_tokens
        st = self._reqs.get(request.request_id)
        num_held = len(st.blocks) if st is not None else 0
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_needed = -(-total // self.block_size)
        num_new = num_needed - num_held - len(new_computed_blocks)
        if num_new <= 0 and not new_computed_blocks:
            return []  # fast path: decode inside the current block
        if num_needed > self.width:
            return None
        pool = self.pool
        # Cached hits sitting in the free queue stop being free when we take them.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if max(num_new, 0) > pool.num_free_blocks - num_revived:
            return None
        if st is None:
            st = self._new_state(request.request_id)
        row = self.tables[st.slot]
        if new_computed_blocks:
            assert num_held == 0, "prefix hits only for a request without blocks"
            pool.touch(new_computed_blocks)
            for b in new_computed_blocks:
                row[len(st.blocks)] = b.block_id
                st.blocks.append(b)
            st.num_registered = len(st.blocks)
        if num_new <= 0:
            return []
        new_blocks = pool.get_new_blocks(num_new)
        start = len(st.blocks)
        st.blocks.extend(new_blocks)
        ids = [b.block_id for b in new_blocks]
        row[start : start + num_new] = ids
        return ids

    def trim(self, request: Request, num_tokens: int) -> int:
        """Frees the request's blocks past its first ``num_tokens`` tokens (after rejected
        speculative drafts: those blocks hold only K/V of tokens that were not kept; they were
        never registered in the prefix cache, which covers computed blocks only). Returns
        how many blocks were freed."""
        st = self._reqs.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if st is None or len(st.blocks) <= keep:
            return 0
        extra = st.blocks[keep:]
        del st.blocks[keep:]
        self.tables[st.slot, keep : keep + len(extra)] = 0
        self.pool.free_blocks(reversed(extra))
        return len(extra)

    def free(self, request: Request) -> None:
        """Release all device and host blocks of the request.

        Device blocks are freed last block first, so that when cached blocks are evicted the
        tail of a sequence (least likely to be shared) goes before its prefix.
        """
        st = self._drop_state(request.request_id)
        if st is not None:
            self.pool.free_blocks(reversed(st.blocks))
        host = self._host.pop(request.request_id, None)
        if host is not None:
            self.host_pool.free(host)
        host_state = self._host_state.pop(request.request_id, None)
        if host_state is not None:
            self.host_states.free([host_state])

    # ----------------------------------------------------------------- swapping
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's computed K/V to host blocks and free its device blocks.

        Returns ``(device_block, host_block)`` copies the runner must do before the step's
        compute (the freed device blocks may be reused within the same step), or None when
        the host pool has no room (the caller then recomputes instead).
        """
        st = self._reqs.get(request.request_id)
        num_copy = self.num_blocks_for(request.num_computed_tokens)
        if st is not None:
            num_copy = min(num_copy, len(st.blocks))
        else:
            num_copy = 0
        host_state = None
        if self.recurrent:
            if st is None:
                return None
            host_state = self.host_states.allocate(1)
            if host_state is None:
                return None
        host = self.host_pool.allocate(num_copy)
        if host is None:
            if host_state is not None:
                self.host_states.free(host_state)
            return None
        mapping = [(st.blocks[i].block_id, host[i]) for i in range(num_copy)] if st else []
        if host_state is not None:
            self._host_state[request.request_id] = host_state[0]
            self.state_swap_out.append((st.slot + 1, host_state[0]))
        if st is not None:
            self._drop_state(request.request_id)
            self.pool.free_blocks(reversed(st.blocks))
        self._host[request.request_id] = host
        return mapping

    def swap_in(
        self, request: Request, num_new_tokens: int
    ) -> tuple[list[tuple[int, int]], list[int]] | None:
        """Bring a swapped request back: device blocks for its host blocks plus the new span.

        Returns ``(host_block, device_block)`` copies and all new device block ids, or None
        when the device pool cannot hold them (nothing changes then).
        """
        host = self._host[request.request_id]
        total = request.num_computed_tokens + num_new_tokens
        num_needed = max(self.num_blocks_for(total), len(host))
        if num_needed > self.pool.num_free_blocks or num_needed > self.width:
            return None
        del self._host[request.request_id]
        st = self._new_state(request.request_id)
        st.blocks = self.pool.get_new_blocks(num_needed)
        ids = [b.block_id for b in st.blocks]
        self.tables[st.slot, :num_needed] = ids
        mapping = list(zip(host, ids))
        self.host_pool.free(host)
        host_state = self._host_state.pop(request.request_id, None)
        if host_state is not None:
            self.state_swap_in.append((host_state, st.slot + 1))
            self.host_states.free([host_state])
        return mapping, ids

    # ----------------------------------------------------------------- introspection
    def num_owned_refs(self) -> dict[int, int]:
        """block id -> number of requests whose table holds it (for invariant checks)."""
        refs: dict[int, int] = {}
        for st in self._reqs.values():
            for b in st.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        return refs

    def reset_prefix_cache(self) -> int:
        """Forget every cached block, held ones included, and stop registering blocks of the
        current allocations: after a reset no K/V computed before it is ever shared again.
        Returns how many blocks lost their hash."""
        for st in self._reqs.values():
            st.cacheable = False
        self.snapshots.clear()
        return self.pool.reset_prefix_cache()
