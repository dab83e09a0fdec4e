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

Layer groups (``SchedulerConfig.kv_groups``; hybrid allocation, as vLLM's): a model whose
layers attend within a window or a chunk splits its cache layers into groups of equal size,
each with its own block table (a request's row is the groups' rows side by side, ``G * width``)
over the one shared pool. A windowed or chunked group's blocks that no later token can read
are released as the request advances (their table entries become the null block, which the
kernels never read unmasked), so those layers hold a bounded tail while full layers keep every
token. A block's prefix-cache key is its hash plus its group; a hit needs the full groups'
blocks up to its end and each bounded group's blocks that its next token reads.
"""

from __future__ import annotations

import sys
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
    ``_groups[g]`` holds group g's blocks of the hit (the null block where a bounded group no
    longer needs one).
    """

    __slots__ = ("_groups", "num_tokens", "snapshot")

    def __init__(self, groups: list[list[KVBlock]], block_size: int, snapshot: int = 0) -> None:
        self._groups = groups
        self.num_tokens = len(groups[0]) * block_size if groups else 0
        # Hybrid models: the state snapshot slot to restore (the state at the hit's end); 0: none.
        self.snapshot = snapshot

    def __len__(self) -> int:
        return len(self._groups[0]) if self._groups else 0

    def real_blocks(self) -> list[KVBlock]:
        """The hit's blocks that hold K/V (the null entries left out)."""
        return [b for blocks in self._groups for b in blocks if b.block_id]


_NO_HIT = ComputedBlocks([], 1)


def first_readable(kind: str, size: int, pos: int) -> int:
    """The first position a token at `pos` (or after it) reads in a layer group of this kind."""
    if kind == "window":
        return max(0, pos - size + 1)
    if kind == "chunk":
        return pos - pos % size
    return 0


def group_key(block_hash: bytes, group: int) -> bytes:
    """A block's prefix-cache key in its layer group: the same tokens' K/V differs by group."""
    return block_hash if not group else block_hash + bytes((group,))


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
    """Per-request device allocation: logical -> physical blocks per layer group, its table slot."""

    __slots__ = ("groups", "released", "release_at", "slot", "num_registered", "cacheable")

    def __init__(self, slot: int, num_groups: int) -> None:
        # groups[g][i]: group g's block for logical block i (the null block once released)
        self.groups: list[list[KVBlock]] = [[] for _ in range(num_groups)]
        self.released = [0] * num_groups  # per group: leading blocks already released
        self.release_at = 0  # the first next-token position at which a bounded group has a block to hand back
        self.slot = slot  # row of KVCacheManager.tables holding this request's block ids
        # Leading blocks already offered to the prefix cache (registered or duplicates).
        self.num_registered = 0
        # False once the prefix cache was reset under this allocation: K/V computed before
        # the reset (e.g. with old weights) must never be shared afterwards.
        self.cacheable = True

    @property
    def blocks(self) -> list[KVBlock]:
        """The first group's blocks (the only group of a model without layer groups)."""
        return self.groups[0]

    @property
    def num_blocks(self) -> int:
        """Logical blocks held (the same in every group)."""
        return len(self.groups[0])

    def held(self) -> list[KVBlock]:
        """Every block holding K/V, group by group (the released null entries left out)."""
        return [b for blocks in self.groups for b in blocks if b.block_id]


class KVCacheManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.width = config.max_blocks_per_seq
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(config.num_blocks, config.enable_prefix_caching)
        self.host_pool = HostBlockPool(config.num_host_blocks)
        self._reqs: dict[str, _Blocks] = {}
        self.kv_groups = config.kv_groups or (("full", 0),)
        self.num_groups = len(self.kv_groups)
        # Groups whose blocks are released behind the sequence (windowed, chunked layers).
        self._bounded = [g for g, (kind, _) in enumerate(self.kv_groups) if kind != "full"]
        # One group of each bounded kind: the groups of a kind hand blocks back together.
        first_of_kind: dict[tuple[str, int], int] = {}
        for g in self._bounded:
            first_of_kind.setdefault(self.kv_groups[g], g)
        self._bounded_kinds = list(first_of_kind.values())
        # Only running requests hold device blocks, so max_num_seqs rows usually suffice;
        # the table grows if a caller holds more. A row is the groups' rows side by side.
        self.tables = np.zeros((config.max_num_seqs, self.num_groups * self.width), dtype=np.int32)
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._host: dict[str, list[int]] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.num_released_blocks = 0  # bounded groups' blocks handed back while their request ran
        self.recurrent = config.recurrent_state
        if self.recurrent and self.num_groups > 1:
            raise ValueError("kv_groups: layer groups are not supported with recurrent state")
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

    def _bounded_span_blocks(self, group: int) -> int:
        """The most blocks a bounded group's request holds at once: what one step's span
        (up to the token budget) and the positions its first token reads can touch."""
        _, size = self.kv_groups[group]
        return self.num_blocks_for(size + self.config.max_num_batched_tokens) + 1

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` of K/V fit in the whole device pool and a table row."""
        n = self.num_blocks_for(num_tokens)
        total = sum(n if kind == "full" else min(n, self._bounded_span_blocks(g))
                    for g, (kind, _) in enumerate(self.kv_groups))
        return total <= self.pool.num_usable_blocks and n <= self.width

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids in its first group (the only one without layer groups)."""
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
        """A copy of the request's block-table row (width ``num_groups * max_blocks_per_seq``)."""
        return self.tables[self._reqs[request_id].slot].copy()

    def slot_of(self, request_id: str) -> int:
        return self._reqs[request_id].slot

    def gather_block_tables(self, slots: Sequence[int]) -> np.ndarray:
        """Copies of the given table rows, ``[len(slots), num_groups * max_blocks_per_seq]`` int32."""
        return self.tables[slots] if slots else np.zeros((0, self.tables.shape[1]), dtype=np.int32)

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
        st = self._reqs[request_id] = _Blocks(self._free_slots.pop(), self.num_groups)
        return st

    def _drop_state(self, request_id: str) -> _Blocks | None:
        st = self._reqs.pop(request_id, None)
        if st is not None:
            self.tables[st.slot] = 0
            self._free_slots.append(st.slot)
        return st

    def get_host_block_ids(self, request_id: str) -> list[int]:
        return [h for _, _, h in self._host.get(request_id, ())]

    def _set(self, st: _Blocks, group: int, start: int, blocks: Sequence[KVBlock]) -> None:
        """Group `group`'s blocks from logical block `start` on, in the request and its table row."""
        mine = st.groups[group]
        del mine[start:]
        mine.extend(blocks)
        base = group * self.width
        self.tables[st.slot, base + start: base + start + len(blocks)] = [b.block_id for b in blocks]

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
        if self.num_groups > 1 or self._bounded:
            return self._grouped_hit(hashes[:max_hit_blocks])
        hits: list[KVBlock] = []
        get = self.pool.cached.get
        for i in range(max_hit_blocks):
            block = get(hashes[i])
            if block is None:
                break
            hits.append(block)
        if not self.recurrent:
            return ComputedBlocks([hits], self.block_size)
        # A hybrid model resumes only where a state snapshot was kept: the longest such hit.
        for n in range(len(hits), 0, -1):
            if self.snapshots.has(hashes[n - 1]):
                return ComputedBlocks([hits[:n]], self.block_size, self.snapshots.lookup(hashes[n - 1]))
        return _NO_HIT

    def _grouped_hit(self, hashes: list[bytes]) -> ComputedBlocks:
        """The longest hit of n blocks with every full group's blocks 0..n-1 cached and every
        bounded group's blocks that position n*S reads (a run ending at block n - 1)."""
        get, S = self.pool.cached.get, self.block_size
        limit = len(hashes)
        found: list[list[KVBlock | None]] = []
        for g, (kind, _) in enumerate(self.kv_groups):
            blocks = [get(group_key(h, g)) for h in hashes[:limit]]
            if kind == "full":
                limit = next((i for i, b in enumerate(blocks) if b is None), limit)
            found.append(blocks)
        run = {g: _runs(found[g]) for g in self._bounded}
        n = limit
        while n > 0 and not all(
                run[g][n - 1] >= n - first_readable(*self.kv_groups[g], n * S) // S for g in self._bounded):
            n -= 1
        if n == 0:
            return _NO_HIT
        null = self.pool.null_block
        groups = []
        for g, (kind, size) in enumerate(self.kv_groups):
            lo = first_readable(kind, size, n * S) // S
            groups.append([null] * lo + [b for b in found[g][lo:n]])  # type: ignore[misc]
        return ComputedBlocks(groups, S)

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

    def _blocks_needed(self, st: _Blocks | None, start: int, total: int,
                       computed: ComputedBlocks = _NO_HIT) -> int:
        """New blocks taking the request to `total` tokens, its next token at `start`, net of
        the bounded groups' blocks that the same call releases."""
        held = st.groups if st is not None else computed._groups or [[] for _ in self.kv_groups]
        n = self.num_blocks_for(total)
        need = 0
        for g, (kind, size) in enumerate(self.kv_groups):
            have = len(held[g])
            if kind == "full":
                need += max(n - have, 0)
                continue
            lo = first_readable(kind, size, start) // self.block_size
            need += max(n - max(have, lo), 0)
            if st is not None:  # held blocks below lo are released first
                need -= sum(1 for b in held[g][st.released[g]:min(lo, have)] if b.block_id)
        return need

    def num_tokens_that_fit(self, request: Request, computed: ComputedBlocks = _NO_HIT) -> int:
        """How many new tokens ``allocate_slots`` could take right now for this request."""
        st = self._reqs.get(request.request_id)
        hit = computed.real_blocks()
        room = self.pool.num_free_blocks - sum(1 for b in hit if b.ref_cnt == 0)
        start = request.num_computed_tokens + computed.num_tokens
        if self.num_groups == 1 and not self._bounded:  # closed form
            num_held = (st.num_blocks if st is not None else 0) + len(computed)
            return max(min(num_held + room, self.width) * self.block_size - start, 0)
        lo, hi = 0, max(self.width * self.block_size - start, 0)
        while lo < hi:  # the largest n whose blocks fit (needs grow with n)
            mid = (lo + hi + 1) // 2
            if self._blocks_needed(st, start, start + mid, computed) <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

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
        for g, blocks in enumerate(st.groups):
            for i in range(st.num_registered, num_full):
                if blocks[i].block_id:  # (a bounded group's released entries hold nothing)
                    cache_block(blocks[i], group_key(hashes[i], g))
        st.num_registered = num_full

    # ----------------------------------------------------------------- allocation
    def _release_unreadable(self, st: _Blocks, start: int) -> None:
        """Release the bounded groups' blocks that no token from `start` on reads."""
        null = self.pool.null_block
        for g in self._bounded:
            blocks = st.groups[g]
            lo = min(first_readable(*self.kv_groups[g], start) // self.block_size, len(blocks))
            if lo <= st.released[g]:
                continue
            gone = [b for b in blocks[st.released[g]:lo] if b.block_id]
            self._set_range(st, g, st.released[g], [null] * (lo - st.released[g]))
            st.released[g] = lo
            self.num_released_blocks += len(gone)
            self.pool.free_blocks(gone)  # (older first: evicted first)

    def _set_range(self, st: _Blocks, group: int, start: int, blocks: Sequence[KVBlock]) -> None:
        """Overwrite group `group`'s entries start .. start + len(blocks) - 1."""
        st.groups[group][start: start + len(blocks)] = blocks
        base = group * self.width
        self.tables[st.slot, base + start: base + start + len(blocks)] = [b.block_id for b in blocks]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks = _NO_HIT
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed`` is a prefix-cache hit from ``get_computed_blocks`` (only for a request
        that holds no blocks yet). Returns the ids of newly allocated blocks (possibly
        empty), or None if the pool cannot supply them; nothing changes on None except that
        bounded groups may release blocks no later token reads.
        """
        st = self._reqs.get(request.request_id)
        start = request.num_computed_tokens + computed.num_tokens
        total = start + num_new_tokens
        num_needed = -(-total // self.block_size)
        if not len(computed) and num_needed <= (st.num_blocks if st is not None else 0) and (
                st is None or start < st.release_at):
            return []  # fast path: decode inside the current blocks, nothing to hand back
        if num_needed > self.width:
            return None
        if st is not None and self._bounded:
            self._release_unreadable(st, start)
        pool = self.pool
        hit = computed.real_blocks()
        # Cached hits sitting in the free queue stop being free when we take them.
        num_revived = sum(1 for b in hit if b.ref_cnt == 0)
        num_new = self._blocks_needed(st, start, total, computed)
        if num_new > pool.num_free_blocks - num_revived:
            return None
        if st is None:
            st = self._new_state(request.request_id)
        if len(computed):
            assert st.num_blocks == 0, "prefix hits only for a request without blocks"
            pool.touch(hit)
            for g, blocks in enumerate(computed._groups):
                self._set(st, g, 0, blocks)
                st.released[g] = next((i for i, b in enumerate(blocks) if b.block_id), len(blocks))
            st.num_registered = st.num_blocks
        ids: list[int] = []
        null = pool.null_block
        for g, (kind, size) in enumerate(self.kv_groups):
            have = len(st.groups[g])
            lo = have if kind == "full" else max(have, first_readable(kind, size, start) // self.block_size)
            if num_needed <= lo:
                continue
            if lo > have:  # positions no token of this span reads: never allocated
                self._set(st, g, have, [null] * (lo - have))
                st.released[g] = max(st.released[g], lo)
            new_blocks = pool.get_new_blocks(num_needed - lo)
            self._set(st, g, lo, new_blocks)
            ids += [b.block_id for b in new_blocks]
        self._update_release_at(st)
        return ids

    def _update_release_at(self, st: _Blocks) -> None:
        """The first next-token position at which a bounded group has a block to hand back:
        where its first readable position reaches the block after those released."""
        at = sys.maxsize
        for g in self._bounded_kinds:
            kind, size = self.kv_groups[g]
            reach = (st.released[g] + 1) * self.block_size  # first_readable(p) >= reach
            at = min(at, reach + size - 1 if kind == "window" else -(-reach // size) * size)
        st.release_at = at

    def trim(self, request: Request, num_tokens: int) -> int:
        """Frees the request's blocks past its first ``num_tokens`` tokens (after rejected
        speculative drafts: those blocks hold only K/V of tokens that were not kept; they were
        never registered in the prefix cache, which covers computed blocks only). Returns
        how many blocks were freed."""
        st = self._reqs.get(request.request_id)
        keep = -(-num_tokens // self.block_size)
        if st is None or st.num_blocks <= keep:
            return 0
        freed = 0
        for g, blocks in enumerate(st.groups):
            extra = [b for b in blocks[keep:] if b.block_id]
            base = g * self.width
            self.tables[st.slot, base + keep: base + len(blocks)] = 0
            del blocks[keep:]
            st.released[g] = min(st.released[g], keep)
            self.pool.free_blocks(reversed(extra))
            freed += len(extra)
        self._update_release_at(st)
        return freed

    def free(self, request: Request) -> None:
        """Release all device and host blocks of the request.

        Device blocks are freed last block first, so that when cached blocks are evicted the
        tail of a sequence (least likely to be shared) goes before its prefix.
        """
        st = self._drop_state(request.request_id)
        if st is not None:
            for blocks in st.groups:
                self.pool.free_blocks(b for b in reversed(blocks) if b.block_id)
        host = self._host.pop(request.request_id, None)
        if host is not None:
            self.host_pool.free([h for _, _, h in host])
        host_state = self._host_state.pop(request.request_id, None)
        if host_state is not None:
            self.host_states.free([host_state])

    # ----------------------------------------------------------------- swapping
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's computed K/V to host blocks and free its device blocks.

        Returns ``(device_block, host_block)`` copies the runner must do before the step's
        compute (the freed device blocks may be reused within the same step), or None when
        the host pool has no room (the caller then recomputes instead). A bounded group's
        released entries are not copied.
        """
        st = self._reqs.get(request.request_id)
        keep: list[tuple[int, int, KVBlock]] = []  # (group, logical block, device block)
        if st is not None:
            n = min(self.num_blocks_for(request.num_computed_tokens), st.num_blocks)
            keep = [(g, i, blocks[i]) for g, blocks in enumerate(st.groups) for i in range(n) if blocks[i].block_id]
        host_state = None
        if self.recurrent:
            if st is None:
                return None
            host_state = self.host_states.allocate(1)
            if host_state is None:
                return None
        host = self.host_pool.allocate(len(keep))
        if host is None:
            if host_state is not None:
                self.host_states.free(host_state)
            return None
        mapping = [(b.block_id, h) for (_, _, b), h in zip(keep, host)]
        if host_state is not None:
            self._host_state[request.request_id] = host_state[0]
            self.state_swap_out.append((st.slot + 1, host_state[0]))
        if st is not None:
            self._drop_state(request.request_id)
            for blocks in st.groups:
                self.pool.free_blocks(b for b in reversed(blocks) if b.block_id)
        self._host[request.request_id] = [(g, i, h) for (g, i, _), h in zip(keep, host)]
        return mapping

    def swap_in(
        self, request: Request, num_new_tokens: int
    ) -> tuple[list[tuple[int, int]], list[int]] | None:
        """Bring a swapped request back: device blocks for its host blocks plus the new span.

        Returns ``(host_block, device_block)`` copies and all new device block ids, or None
        when the device pool cannot hold them (nothing changes then).
        """
        host = self._host[request.request_id]
        start = request.num_computed_tokens
        num_needed = max([self.num_blocks_for(start + num_new_tokens)] + [i + 1 for _, i, _ in host])
        lows = [first_readable(kind, size, start) // self.block_size for kind, size in self.kv_groups]
        total = sum(max(num_needed - lo, 0) for lo in lows)
        if total > self.pool.num_free_blocks or num_needed > self.width:
            return None
        del self._host[request.request_id]
        st = self._new_state(request.request_id)
        null = self.pool.null_block
        ids: list[int] = []
        where: dict[tuple[int, int], int] = {}
        for g, lo in enumerate(lows):
            lo = min(lo, num_needed)
            blocks = self.pool.get_new_blocks(num_needed - lo)
            self._set(st, g, 0, [null] * lo + blocks)
            st.released[g] = lo
            ids += [b.block_id for b in blocks]
            where.update(((g, lo + k), b.block_id) for k, b in enumerate(blocks))
        self._update_release_at(st)
        # host copies of blocks no token reads any more are dropped, not copied back
        mapping = [(h, where[(g, i)]) for g, i, h in host if (g, i) in where]
        self.host_pool.free([h for _, _, h in host])
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
            for b in st.held():
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


def _runs(blocks: list[KVBlock | None]) -> list[int]:
    """runs[i]: how many blocks end at i without a miss (blocks[i - runs[i] + 1 .. i] all found)."""
    out, n = [], 0
    for b in blocks:
        n = n + 1 if b is not None else 0
        out.append(n)
    return out
