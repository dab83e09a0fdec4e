"""Workloads `jaxserve tune` replays: a JSONL trace of the user's requests, or synthetic shapes.

A trace line is one request:

    {"arrival_s": 0.25, "prompt_token_ids": [1, 2, 3], "max_tokens": 64}
    {"arrival_s": 0.40, "prompt": "Hello", "max_tokens": 16}

`arrival_s` (seconds from the trace's start; `arrival_time` is taken too) and `max_tokens` are
required, and exactly one of `prompt_token_ids` or `prompt` (text, tokenized by the engine's
tokenizer). A line that is not such an object is an error naming its line number.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence

import numpy as np


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the line."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    max_tokens: int
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None


def _line_request(obj: object, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a request is a JSON object, got {type(obj).__name__}")
    arrival = obj.get("arrival_s", obj.get("arrival_time"))
    if isinstance(arrival, bool) or not isinstance(arrival, int | float) or not arrival >= 0:
        raise TraceError(f"{where}: arrival_s must be a number of seconds >= 0, got {arrival!r}")
    max_tokens = obj.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise TraceError(f"{where}: max_tokens must be an integer >= 1, got {max_tokens!r}")
    ids, text = obj.get("prompt_token_ids"), obj.get("prompt")
    if (ids is None) == (text is None):
        raise TraceError(f"{where}: give exactly one of prompt_token_ids or prompt")
    if ids is not None:
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TraceError(f"{where}: prompt_token_ids must be a non-empty list of integers")
        return TraceRequest(float(arrival), max_tokens, prompt_token_ids=tuple(ids))
    if not isinstance(text, str) or not text:
        raise TraceError(f"{where}: prompt must be a non-empty string")
    return TraceRequest(float(arrival), max_tokens, prompt=text)


def load_trace(path: str) -> list[TraceRequest]:
    """The requests of a JSONL trace, in arrival order. Blank lines are skipped."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{n}: not JSON ({e.msg})") from None
            out.append(_line_request(obj, f"{path}:{n}"))
    if not out:
        raise TraceError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.arrival_s)


def write_trace(path: str, requests: Sequence[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            obj: dict = {"arrival_s": r.arrival_s, "max_tokens": r.max_tokens}
            if r.prompt_token_ids is not None:
                obj["prompt_token_ids"] = list(r.prompt_token_ids)
            else:
                obj["prompt"] = r.prompt
            f.write(json.dumps(obj) + "\n")


class TraceWriter:
    """Appends requests as they arrive (a server's `--record-request-trace`), arrival times
    from the writer's creation; each line is flushed, so a trace survives a crash."""

    def __init__(self, path: str, clock=None):
        self._clock = clock or time.monotonic
        self._t0 = self._clock()
        self._f = open(path, "a", buffering=1)

    def record(self, prompt_token_ids: Sequence[int], max_tokens: int) -> None:
        self._f.write(json.dumps({"arrival_s": round(self._clock() - self._t0, 6), "max_tokens": max_tokens,
                                  "prompt_token_ids": list(prompt_token_ids)}) + "\n")

    def close(self) -> None:
        self._f.close()


def _arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals at `rate` requests/s (inf: all at time 0), as `vllm bench serve`."""
    if rate == float("inf"):
        return np.zeros(n)
    return np.concatenate([[0.0], np.cumsum(rng.exponential(1.0 / rate, n - 1))])


def random_workload(num_prompts: int, input_len: int, output_len: int, request_rate: float, vocab_size: int,
                    seed: int = 0, prefix_len: int = 0, num_prefixes: int = 1) -> list[TraceRequest]:
    """Random token ids, `input_len` in and `output_len` out (the `vllm bench serve --dataset-name
    random` shape). With `prefix_len`, each prompt starts with one of `num_prefixes` shared
    prefixes of that length (where prefix caching matters)."""
    if num_prompts < 1 or input_len < 1 or output_len < 1 or not request_rate > 0:
        raise ValueError("num_prompts, input_len, output_len and request_rate must be positive")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, prefix_len).tolist() for _ in range(max(1, num_prefixes))]
    times = _arrivals(num_prompts, request_rate, rng)
    out = []
    for i, t in enumerate(times):
        ids = prefixes[i % len(prefixes)] + rng.integers(0, vocab_size, input_len).tolist()
        out.append(TraceRequest(float(t), output_len, prompt_token_ids=tuple(ids)))
    return out
