"""The server's once-a-second status line (`--log-interval`), read from the engine thread's
snapshots, never from the engine."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger("jaxserve.server")


async def log_status(loop_runner: Any, metrics: Any, interval: float) -> None:
    """One status line per `interval` seconds while the engine is busy (and one when it goes idle)."""
    prev = loop_runner.snapshot
    idle_logged = False
    while True:
        await asyncio.sleep(interval)
        snap = loop_runner.snapshot
        busy = snap.num_steps != prev.num_steps or snap.num_streams > 0
        if not busy and idle_logged:
            prev = snap
            continue
        idle_logged = not busy
        dt = max(snap.time - prev.time, 1e-9) if busy else interval
        st = snap.stats
        logger.info(
            "gen %.1f tok/s, batched %.1f tok/s, %d finished | running %d, waiting %d, swapped %d | "
            "KV %.1f%% (%d cached free) | prefix hit %.1f%% | preemptions %d | compiles %d",
            (snap.generation_tokens - prev.generation_tokens) / dt,
            (snap.batched_tokens - prev.batched_tokens) / dt,
            snap.num_finished - prev.num_finished, st.num_running, st.num_waiting, st.num_swapped,
            100 * st.kv_usage, st.num_cached_free_blocks, 100 * st.prefix_cache_hit_rate,
            st.num_preemptions, metrics.num_compilations_after_warmup)
        prev = snap
