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
        if snap.spec_decode is not None and prev.spec_decode is not None:
            logger.info("speculative decoding: %s", spec_line(snap.spec_decode, prev.spec_decode))
        prev = snap


def spec_line(now: Any, before: Any) -> str:
    """Acceptance since the last line: kept / proposed drafts, and the mean tokens a drafted
    sequence gained per step (kept drafts plus the target's own token)."""
    drafts = now.num_drafts - before.num_drafts
    proposed = now.num_draft_tokens - before.num_draft_tokens
    kept = now.num_accepted_tokens - before.num_accepted_tokens
    if not drafts:
        return "no drafts"
    return (f"acceptance {100 * kept / proposed:.1f}% ({kept} of {proposed} drafts), mean accepted length "
            f"{1 + kept / drafts:.2f} over {drafts} drafted steps")
