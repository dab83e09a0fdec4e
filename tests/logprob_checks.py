"""Comparing greedy runs whose arithmetic legitimately differs, by vLLM's `check_logprobs_close` rule.

Two runs of the same model that differ in batch shape, quantization, kernel, swap or chunking may
round a near-tie differently on another CPU (AMX, AVX-512-BF16 and Zen 4's FMA order differ), and
greedy decoding then follows another branch from that token on. The rule: the token lists are equal,
or at the first difference each side's token is among the other side's top-k logprobs at that
position, and the comparison stops there (the continuations condition on different tokens).

A broken run (a wrong scale, a mixed-up page) puts a token that the other run does not rank in its
top-k, usually within a few positions, so the rule still fails it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TopK = Mapping[int, float]  # token id -> logprob at one position


def top_k_of(logprobs: Sequence[Any]) -> list[dict[int, float]]:
    """Per position {token id: logprob} from a `CompletionOutput.logprobs` list (vLLM's
    `dict[int, Logprob]` entries) or from plain mappings of token id to logprob."""
    out = []
    for entry in logprobs:
        out.append({int(t): float(getattr(v, "logprob", v)) for t, v in entry.items()})
    return out


def top_from_array(logp: Any, k: int = 5) -> list[dict[int, float]]:
    """Per position the k best {token id: logprob} of a [N, V] logprob array (transformers')."""
    import numpy as np

    logp = np.asarray(logp)
    best = np.argsort(-logp, axis=-1)[:, :k]
    return [{int(t): float(row[t]) for t in ids} for row, ids in zip(logp, best)]


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where `a` and `b` differ (or where one ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_greedy_close(want_tokens: Sequence[int], want_top: Sequence[TopK], got_tokens: Sequence[int],
                       got_top: Sequence[TopK], *, name: str = "", top_k: int | None = None) -> int | None:
    """Assert the rule above for one sequence; returns the divergence index (None: identical).

    `*_top[i]` holds the top-k logprobs at output position i (at least the sampled token);
    `top_k` limits the candidates to the k most likely of each side."""
    i = first_divergence(want_tokens, got_tokens)
    if i is None:
        return None
    if i >= min(len(want_tokens), len(got_tokens)):
        raise AssertionError(f"{name}: lengths differ ({len(want_tokens)} vs {len(got_tokens)}) "
                             f"with equal tokens up to {i}")
    w, g = want_tokens[i], got_tokens[i]
    want_cands, got_cands = _best(want_top[i], top_k), _best(got_top[i], top_k)
    assert g in want_cands and w in got_cands, (
        f"{name}: at output position {i} the runs chose {w} vs {g}, and not each within the other's "
        f"top-{top_k or len(want_top[i])}: want {dict(want_top[i])}, got {dict(got_top[i])}; "
        f"tokens want {list(want_tokens)}, got {list(got_tokens)}")
    return i


def check_outputs_close(want: Sequence[Any], got: Sequence[Any], *, top_k: int | None = None) -> list[int | None]:
    """`check_greedy_close` over paired `CompletionOutput`s (logprobs requested on both sides)."""
    assert len(want) == len(got), (len(want), len(got))
    return [check_greedy_close(w.token_ids, top_k_of(w.logprobs), g.token_ids, top_k_of(g.logprobs),
                               name=f"sequence {n}", top_k=top_k)
            for n, (w, g) in enumerate(zip(want, got))]


def _best(top: TopK, k: int | None) -> set[int]:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    return {t for t, _ in (ranked if k is None else ranked[:k])}


def sampled_logprobs(completion: Any) -> list[float]:
    """Each sampled token's own logprob from a `CompletionOutput` (vLLM's shape)."""
    return [entry[t].logprob for t, entry in zip(completion.token_ids, completion.logprobs)]


def check_runs_close(want: Sequence[Any], got: Sequence[Any], *, name: str = "") -> None:
    """Two runs of several prompts as (tokens per prompt, top-k per prompt and position): each
    prompt by `check_greedy_close` (JSON's string token ids are read back as ints)."""
    (want_tokens, want_top), (got_tokens, got_top) = want[:2], got[:2]
    assert len(want_tokens) == len(got_tokens), (name, len(want_tokens), len(got_tokens))
    for i, (wt, gt) in enumerate(zip(want_tokens, got_tokens)):
        check_greedy_close(wt, top_k_of(want_top[i]), gt, top_k_of(got_top[i]), name=f"{name} prompt {i}")
