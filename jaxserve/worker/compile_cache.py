"""JAX's persistent compilation cache, compile-event counting and the post-warmup guard.

`/jax/core/compile/backend_compile_duration` fires once per XLA compile, and also when an
executable is loaded from the persistent cache; `/jax/compilation_cache/cache_hits` and
`cache_misses` tell the two apart. Events fire on the compiling thread, so per-shape hit/miss
attribution during a threaded warmup uses thread-local counters.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import threading
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import jax

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
HIT_EVENT = "/jax/compilation_cache/cache_hits"
MISS_EVENT = "/jax/compilation_cache/cache_misses"


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxserve", "xla")


class CompileEvents:
    """Process-wide counters of compile events (registered once: JAX listeners cannot be removed).

    `setup_compiles` counts the compiles made while some engine is built or warmed up (on its
    thread inside `setup_scope`, or on a warmup worker with a thread tally); the compile
    guards count only the others, so one engine's start is never another's "compilation
    after warmup"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.compiles = 0
        self.setup_compiles = 0
        self.hits = 0
        self.misses = 0
        self._tls = threading.local()
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)

    def _on_duration(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            setup = getattr(self._tls, "setup", 0) > 0 or getattr(self._tls, "tally", None) is not None
            with self._lock:
                self.compiles += 1
                self.setup_compiles += setup

    @property
    def serving_compiles(self) -> int:
        """Compiles made outside any engine's build and warmup."""
        return self.compiles - self.setup_compiles

    @contextlib.contextmanager
    def setup_scope(self) -> Iterator[None]:
        """Compiles on this thread inside the block count as setup (nestable)."""
        self._tls.setup = getattr(self._tls, "setup", 0) + 1
        try:
            yield
        finally:
            self._tls.setup -= 1

    def _on_event(self, event: str, **kwargs) -> None:
        if event not in (HIT_EVENT, MISS_EVENT):
            return
        with self._lock:
            if event == HIT_EVENT:
                self.hits += 1
            else:
                self.misses += 1
        tally = getattr(self._tls, "tally", None)
        if tally is not None:
            tally[event == HIT_EVENT] += 1

    def start_thread_tally(self) -> None:
        self._tls.tally = [0, 0]  # [misses, hits] on this thread

    def stop_thread_tally(self) -> tuple[int, int]:
        """(hits, misses) on this thread since `start_thread_tally`."""
        misses, hits = self._tls.tally
        self._tls.tally = None
        return hits, misses


EVENTS = CompileEvents()


def during_setup(fn: Callable[P, R]) -> Callable[P, R]:
    """Runs `fn` inside `EVENTS.setup_scope()` (an engine's constructor and warmup)."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        with EVENTS.setup_scope():
            return fn(*args, **kwargs)

    return wrapped


_cache_dir: str | None = None


def host_cpu_key() -> str:
    """A short key of the host CPU's model and feature flags. XLA:CPU compiles for the host
    CPU, and JAX's cache key does not say which: an executable cached on one machine must
    not be loaded on another with other CPU features (a home directory shared between
    machines). Entries live in a subdirectory per key."""
    from pallas_kernels._native_cpu import cpu_features

    model = platform.processor()
    try:
        model = next((ln for ln in open("/proc/cpuinfo").read().splitlines() if ln.startswith("model name")), model)
    except OSError:
        pass
    return "host-" + hashlib.sha256(f"{model}\0{cpu_features()}".encode()).hexdigest()[:12]


def enable_persistent_cache(cache_dir: str) -> str:
    """Points JAX's persistent cache at `cache_dir`/<host CPU key> (`host_cpu_key`) and makes
    it cache every executable (no minimum compile time or size). The directory is
    process-wide: the first engine sets it. Returns the directory in use."""
    global _cache_dir
    cache_dir = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), host_cpu_key())
    if _cache_dir is not None:
        if _cache_dir != cache_dir:
            logger.warning("compilation cache already at %s; ignoring %s", _cache_dir, cache_dir)
        return _cache_dir
    os.makedirs(cache_dir, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _cache_dir = cache_dir
    return cache_dir


class UnplannedCompilationError(RuntimeError):
    """A shape outside the compile plan was compiled while serving (strict guard)."""


class CompileGuard:
    """Counts compilations after warmup; names the step shapes that caused them."""

    def __init__(self, strict: bool = False):
        self.strict = strict
        self.armed = False
        self._base = 0
        self._seen = 0

    def arm(self) -> None:
        self.armed = True
        self._base = self._seen = EVENTS.serving_compiles

    @property
    def compiles_after_warmup(self) -> int:
        return EVENTS.serving_compiles - self._base if self.armed else 0

    def check(self, shape_names: list[str]) -> None:
        """Called after each step with the shapes the step used."""
        now = EVENTS.serving_compiles
        if not self.armed or now == self._seen:
            return
        new = now - self._seen
        self._seen = now
        msg = f"{new} XLA compilation(s) after warmup while running {', '.join(shape_names) or 'no step'}"
        if self.strict:
            raise UnplannedCompilationError(msg)
        logger.warning(msg)
