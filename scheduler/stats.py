"""A snapshot of the scheduler for metrics and logs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges and counters. Live blocks and cached-but-free blocks are separate numbers, so
    a warm prefix cache is never mistaken for leaked memory.

    ``num_used_blocks + num_free_blocks == num_total_blocks`` (usable blocks, null block
    excluded); ``num_cached_free_blocks`` is the part of ``num_free_blocks`` that still holds
    reusable prefix K/V. Prefix-cache queries and hits count tokens.
    """

    num_running: int
    num_waiting: int
    num_swapped: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_free_blocks: int
    num_total_blocks: int
    num_host_blocks_used: int
    num_host_blocks_total: int
    preemptions: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_finished: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        """Fraction of usable device blocks held by requests (0..1)."""
        return self.num_used_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())
