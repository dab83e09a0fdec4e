"""Grammars compiled once per distinct spec, off the engine thread.

The engine asks `grammar_for(spec)` when a structured-output request arrives and gets a
`GrammarFuture` at once; the scheduler holds the request back until the future is done
(or ends it with ERROR if the spec does not compile), so the engine thread never waits on a
compile. Fronts call `validate(spec)` first (from their own threads) so a bad schema is a
400 / INVALID_ARGUMENT before the request is admitted; the compiled grammar is then cached
and the engine finds it ready.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Sequence

import numpy as np

from jaxserve.structured.backend import CompiledGrammar, GrammarBackend, GrammarError, Matcher
from scheduler.structured_params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 512  # distinct specs kept compiled (least recently used evicted)


class GrammarFuture:
    """A grammar being compiled; satisfies the scheduler's `GrammarHandle`."""

    __slots__ = ("_future",)

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def ready(self) -> bool:
        return self._future.done()

    @property
    def error(self) -> str | None:
        if not self._future.done():
            return None
        if self._future.cancelled():
            return "the engine shut down before the grammar compiled"
        e = self._future.exception()
        return None if e is None else str(e)

    def new_matcher(self) -> Matcher:
        """A matcher in the grammar's start state (call once the future is ready)."""
        grammar: CompiledGrammar = self._future.result()
        return grammar.new_matcher()


class StructuredOutputManager:
    def __init__(self, backend: GrammarBackend, *, cache_size: int = DEFAULT_CACHE_SIZE,
                 workers: int = 2):
        self.backend = backend
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")

    def grammar_for(self, spec: StructuredOutputsParams) -> GrammarFuture:
        """The (possibly still compiling) grammar of `spec`; never blocks."""
        key = spec.key
        with self._lock:
            fut = self._cache.get(key)
            if fut is None:
                fut = self._pool.submit(self.backend.compile, spec)
                self._cache[key] = fut
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        return GrammarFuture(fut)

    def validate(self, spec: StructuredOutputsParams, timeout_s: float | None = None) -> None:
        """Compiles (or finds compiled) `spec`; raises GrammarError naming what is wrong."""
        fut = self.grammar_for(spec)._future
        try:
            fut.result(timeout=timeout_s)
        except GrammarError:
            raise
        except concurrent.futures.TimeoutError:
            raise GrammarError(f"structured_outputs.{spec.kind}: the grammar did not compile "
                               f"within {timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - a backend failure is the spec's problem to the client
            raise GrammarError(f"structured_outputs.{spec.kind}: {e}") from None

    def prepare_in_background(self) -> None:
        """Starts the backend's one-time setup (~0.5 s for llguidance) on a worker, so the
        first structured request does not wait for it."""
        self._pool.submit(self.backend.prepare)

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        self.backend.fill_bitmask(rows, bitmask)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
