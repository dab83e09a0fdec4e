"""Prompt logprobs on the embedded model, against transformers' log_softmax over the prompt."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.engine.outputs import top_logprobs
from jaxserve.worker.compile_cache import EVENTS
from scheduler import SamplingParams

SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=96, max_model_len=256)  # shared with test_engine_semantics
SHORT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
LONG = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "who repaired every clock in the valley. Each morning he opened his shop, wound the tall clock by the "
        "door, and listened to the ticking of a hundred small machines. Children came to watch him work, and "
        "he told them stories about the gears. ") * 2


def _hf_prompt_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    """[len(ids) - 1, V]: row i is the distribution of token i + 1 given tokens 0..i."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()[:-1]


def _score(engine, prompt: str, k: int, rid: str):
    engine.add_prompt(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=k), request_id=rid)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.request_id == rid), out)
    assert out is not None and out.finished
    return out


def _check_against_hf(out, ref: np.ndarray, k: int) -> None:
    ids = out.prompt_token_ids
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for i in range(1, len(ids)):
        entry, row = lps[i], ref[i - 1]  # vLLM's shape: {token id: Logprob}, the prompt's token first
        assert next(iter(entry)) == ids[i]
        e = entry[ids[i]]
        assert abs(e.logprob - row[ids[i]]) < 2e-3, (i, e.logprob, row[ids[i]])
        assert e.decoded_token is not None
        hf_rank = int((row > row[ids[i]] + 2e-3).sum()) + 1  # ranks may differ only within a near tie
        assert hf_rank <= e.rank <= int((row > row[ids[i]] - 2e-3).sum()) + 1, (i, e.rank)
        best = top_logprobs(entry, k)
        assert [lp.rank for _, lp in best] == list(range(1, k + 1))
        assert len(entry) == k + (e.rank > k)  # the top k, and the prompt's token when beside them
        top = np.sort(row)[::-1][:k]
        assert np.allclose([lp.logprob for _, lp in best], top, atol=2e-3), (i, best, top)
        for tid, _ in best:  # the same set, except a token tied with the k-th
            assert row[tid] >= top[-1] - 2e-3


def test_prompt_logprobs_match_transformers_chunked_unchunked_and_after_a_prefix_hit(engine, hf_smollm):
    """One chunk (a 20-token prompt), three chunks (a long prompt over a 64-token budget),
    and the long prompt again once a plain request has cached it: the asking request skips
    the cache (no cached tokens), so its logprobs are all computed, and still equal HF's."""
    before = EVENTS.compiles
    short = _score(engine, SHORT, 3, "short")
    assert len(short.prompt_token_ids) < SMALL["max_num_batched_tokens"]
    _check_against_hf(short, _hf_prompt_logprobs(hf_smollm, short.prompt_token_ids), 3)

    long = _score(engine, LONG, 0, "long")
    assert len(long.prompt_token_ids) > 2 * SMALL["max_num_batched_tokens"]
    ref = _hf_prompt_logprobs(hf_smollm, long.prompt_token_ids)
    _check_against_hf(long, ref, 0)

    engine.add_prompt(LONG, SamplingParams(max_tokens=1), request_id="warm-the-cache")
    while engine.has_unfinished_requests():
        engine.step()
    again = _score(engine, LONG, 5, "again")
    assert again.usage.cached_tokens == 0
    _check_against_hf(again, ref, 5)
    assert EVENTS.compiles == before, f"{EVENTS.compiles - before} compilations after warmup"


def test_prompt_logprobs_beside_other_requests_and_through_delta_outputs(engine):
    """Batched with plain requests (their spans sit between the asking one's rows) the
    entries are the same as alone; a DELTA stream sends them once, with the first output."""
    from jaxserve.engine.outputs import OutputKind

    alone_out = _score(engine, SHORT, 2, "alone")
    alone, ids = alone_out.prompt_logprobs, alone_out.prompt_token_ids
    engine.add_prompt(LONG, SamplingParams(max_tokens=8), request_id="other")
    engine.add_prompt(SHORT, SamplingParams(max_tokens=4, prompt_logprobs=2), request_id="delta",
                      output_kind=OutputKind.DELTA)
    engine.add_prompt(LONG[:100], SamplingParams(max_tokens=8), request_id="third")
    sent = []
    while engine.has_unfinished_requests():
        sent += [o.prompt_logprobs for o in engine.step() if o.request_id == "delta"]
    assert sent[0] is not None and all(s is None for s in sent[1:])
    def own(lps):  # (rank, logprob) of each prompt token's own entry
        return [(e[t].rank, e[t].logprob) for t, e in zip(ids[1:], lps[1:])]

    assert sent[0][0] is None and alone[0] is None
    assert [r for r, _ in own(sent[0])] == [r for r, _ in own(alone)]
    assert np.allclose([v for _, v in own(sent[0])], [v for _, v in own(alone)], atol=1e-4)


def test_prompt_logprobs_are_checked(engine):
    with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer >= 0"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= 20 \(max_logprobs\)"):
        engine.add_prompt(SHORT, SamplingParams(prompt_logprobs=21))


# ---------------------------------------------------------------------- batch invariance
TARGET = (LONG[:160], SamplingParams(max_tokens=20, temperature=0.8, seed=3, logprobs=2, prompt_logprobs=1))


def _others(n: int) -> list[tuple[str, SamplingParams]]:
    """n requests of other lengths, budgets and sampling settings: their prefills (in chunks
    of 256 tokens a step) run beside the target's decodes, and they end at other steps (so
    the request and token buckets change under it)."""
    rng = np.random.default_rng(0)
    return [(" ".join(["word"] * int(w)) + f" {i}",
             SamplingParams(max_tokens=int(m), temperature=float(t), seed=i, logprobs=1 if i % 3 else None))
            for i, (w, m, t) in enumerate(zip(rng.integers(5, 150, n), rng.integers(2, 30, n), rng.random(n)))]


def _target_in(engine, requests: list, at: int) -> tuple:
    """Runs `requests` together; the tokens, logprobs and prompt logprobs of requests[at]
    (and the prompt tokens it found cached)."""
    ids = [engine.add_prompt(p, sp) for p, sp in requests]
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    out = done[ids[at]]
    c = out.outputs[0]
    return ((c.token_ids, c.logprobs and [[(t, lp.logprob, lp.rank) for t, lp in e.items()] for e in c.logprobs],
             out.prompt_logprobs and [e and [(t, lp.logprob) for t, lp in e.items()] for e in out.prompt_logprobs]),
            out.usage.cached_tokens)


def _placed(others: list, n: int, at: int, target=TARGET) -> list:
    """The target at position `at` of a batch of n requests."""
    rest = others[: n - 1]
    return rest[:at] + [target] + rest[at:]


def test_batch_invariant_mode_is_bitwise_equal_alone_and_in_any_batch(smollm):
    """The same seeded request (sampled, logprobs and prompt logprobs) alone and at several
    positions of batches of 2, 3, 25 and 64 requests (prefill chunks beside its decodes,
    other token and request buckets, requests ending under it), and with its prompt found in
    the prefix cache: bitwise-equal tokens, logprobs and prompt logprobs with
    batch_invariant=True. The default mode differs in the low bits on the batch of 25 (the
    comparison can fail)."""
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine

    cfg = dict(max_num_seqs=64, max_num_batched_tokens=256, num_pages=600, max_model_len=256)
    engine = Engine(EngineConfig(batch_invariant=True, **cfg), loaded=smollm)
    others = _others(63)
    alone, _ = _target_in(engine, [TARGET], 0)
    for n, at in ((2, 1), (3, 0), (25, 12), (64, 63)):
        got, _ = _target_in(engine, _placed(others, n, at), at)
        assert got == alone, f"batch of {n}, position {at}"

    # Prefix caching: prompt logprobs bypass the cache, so the cached case scores tokens only.
    target = (TARGET[0], SamplingParams(max_tokens=20, temperature=0.8, seed=3, logprobs=2))
    engine.reset_prefix_cache()
    uncached, hits = _target_in(engine, [target], 0)
    assert hits == 0
    _target_in(engine, [(TARGET[0], SamplingParams(max_tokens=1))], 0)  # leaves its prompt's pages cached
    cached, hits = _target_in(engine, _placed(others, 25, 24, target), 24)
    assert hits > 0 and cached == uncached
    assert uncached[:2] == alone[:2]

    default = Engine(EngineConfig(**cfg), loaded=smollm)
    alone, _ = _target_in(default, [TARGET], 0)
    batched, _ = _target_in(default, _placed(others, 25, 12), 12)
    assert alone[0] == batched[0] and alone[1:] != batched[1:]  # same tokens, other low bits


def test_vllm_logprob_access_patterns(engine):
    """Code written for vLLM's outputs runs unchanged: `out.prompt_logprobs[i][tok].logprob`
    (None first), `c.logprobs[j][tok]` holding the sampled token and the top-k as `Logprob`s
    with rank and decoded_token; prompt_logprobs=0 holds the prompt's token alone."""
    from jaxserve import Logprob

    out = _score(engine, SHORT, 0, "vllm-shape")
    assert out.prompt_logprobs[0] is None
    for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert list(entry) == [tok] and isinstance(entry[tok], Logprob) and entry[tok].logprob <= 0
    engine.add_prompt(SHORT, SamplingParams(max_tokens=4, temperature=0, logprobs=3), request_id="sampled")
    done = None
    while engine.has_unfinished_requests():
        done = next((o for o in engine.step() if o.finished), done)
    c = done.outputs[0]
    tok_text = engine.tokenizer.decode
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert next(iter(entry)) == tok and entry[tok].rank == 1 and len(entry) == 3  # greedy: its token is the best
        assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]
        assert all(lp.decoded_token == tok_text([t]) for t, lp in entry.items())
        assert max(entry.values(), key=lambda lp: lp.logprob) is entry[tok]
