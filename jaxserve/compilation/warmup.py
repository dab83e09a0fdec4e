"""Ahead-of-time compilation of every planned shape, in a thread pool, with a manifest.

Each shape is lowered on `jax.ShapeDtypeStruct`s carrying the serving arrays' shardings and
compiled; the executables are installed in the runner, which then calls them directly. With
the persistent cache warm, "compiling" a shape is a cache load.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from jaxserve.worker.compile_cache import EVENTS
from jaxserve.worker.compile_plan import CompilePlan, CompileTier, ShapeKey, variant_name

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShapeRecord:
    name: str
    kind: str
    size: int
    variant: str | None
    seconds: float
    # "hit": loaded from the persistent cache; "miss": compiled (and written to it); "memory":
    # reused from this process's in-memory jit cache; "off": persistent cache disabled;
    # "loaded": deserialized from a `jaxserve compile --out` directory
    cache: str
    cache_hits: int = 0  # its programs loaded from the persistent cache (a shape may hold several)


@dataclasses.dataclass(frozen=True)
class WarmupReport:
    records: tuple[ShapeRecord, ...]
    wall_seconds: float

    @property
    def num_shapes(self) -> int:
        return len(self.records)

    @property
    def num_hits(self) -> int:
        return sum(r.cache == "hit" for r in self.records)

    @property
    def num_misses(self) -> int:
        return sum(r.cache == "miss" for r in self.records)

    def summary(self) -> str:
        return (f"{self.num_shapes} shapes in {self.wall_seconds:.1f} s: {self.num_hits} loaded from the "
                f"compilation cache, {self.num_misses} compiled"
                + "".join(f", {n} {what}" for what, n in (
                    ("reused in memory", sum(r.cache == "memory" for r in self.records)),
                    ("compiled without a persistent cache", sum(r.cache == "off" for r in self.records)),
                    ("loaded from compiled executables", sum(r.cache == "loaded" for r in self.records)),
                ) if n))

    def to_json(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            **(extra or {}),
            "num_shapes": self.num_shapes,
            "cache_hits": self.num_hits,
            "cache_misses": self.num_misses,
            "wall_seconds": round(self.wall_seconds, 3),
            "shapes": [dataclasses.asdict(r) for r in self.records],
        }

    def write(self, path: str, extra: dict[str, Any] | None = None) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_json(extra), f, indent=1)


def compile_ahead(runner, plan: CompilePlan, *, max_reqs: int, tensors_by_rows: dict[int, Any],
                  workers: int = 0, progress: bool = True, cache_enabled: bool = True,
                  keys: list[ShapeKey] | None = None) -> WarmupReport:
    """Compiles every shape of `plan` (or only `keys`) and installs the executables in `runner`."""
    keys = plan.shapes() if keys is None else keys
    workers = workers or max(1, min(len(keys), os.cpu_count() or 1))

    def one(key: ShapeKey) -> ShapeRecord:
        EVENTS.start_thread_tally()
        t0 = time.perf_counter()
        try:
            exe = runner.lower_shape(key, max_reqs, tensors_by_rows.get(key.size))
        finally:
            hits, misses = EVENTS.stop_thread_tally()
        seconds = time.perf_counter() - t0
        runner.install(key, exe)
        cache = "off" if not cache_enabled else ("miss" if misses else ("hit" if hits else "memory"))
        return ShapeRecord(key.name, key.kind, key.size,
                           variant_name(key.flags) if key.flags is not None else None, round(seconds, 3), cache,
                           hits)

    t0 = time.perf_counter()
    records = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, tqdm(
        total=len(keys), desc="Compiling", unit="shape", disable=not progress
    ) as bar:
        for rec in pool.map(one, keys):
            records.append(rec)
            bar.update(1)
    return WarmupReport(tuple(records), time.perf_counter() - t0)


class BackgroundCompile:
    """Compiles the later tiers of a plan (`CompilePlan.tiers`) on a thread, in order, while
    the engine already serves with the first: after each tier the step limits it allows are
    posted for the engine thread to apply (`take_limits`) between steps. `on_done` gets the
    report of everything it compiled and the error that stopped it, if any (on the thread;
    also when `stop` ended it early). A compile error stops it: the engine
    keeps serving within the limits reached, and the error is logged and kept."""

    def __init__(self, compile_tier: Callable[[CompileTier], WarmupReport], tiers: list[CompileTier],
                 on_done: Callable[[WarmupReport, Exception | None], None]):
        self._compile_tier = compile_tier
        self._tiers = tiers
        self._on_done = on_done
        self._lock = threading.Lock()
        self._limits: tuple[int, int] | None = None
        self._stop = threading.Event()
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, name="jaxserve-background-compile", daemon=True)

    def start(self) -> BackgroundCompile:
        self.thread.start()
        return self

    def _run(self) -> None:
        t0 = time.perf_counter()
        records: list[ShapeRecord] = []
        try:
            for tier in self._tiers:
                if self._stop.is_set():
                    return
                records += self._compile_tier(tier).records
                with self._lock:
                    self._limits = (tier.max_tokens, tier.max_seqs)
                logger.info("compiled steps up to %d tokens, %d sequences", tier.max_tokens, tier.max_seqs)
        except Exception as e:  # noqa: BLE001 - serving goes on within the limits reached
            self.error = e
            logger.error("background compilation stopped (%s: %s); steps stay within the shapes compiled",
                         type(e).__name__, e)
        finally:
            self._on_done(WarmupReport(tuple(records), time.perf_counter() - t0), self.error)

    def take_limits(self) -> tuple[int, int] | None:
        """The step limits (tokens, sequences) reached since the last call, else None."""
        with self._lock:
            limits, self._limits = self._limits, None
        return limits

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """No new tier starts; waits up to `timeout` for the one compiling."""
        self._stop.set()
        self.thread.join(timeout)
