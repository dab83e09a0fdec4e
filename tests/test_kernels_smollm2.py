"""SmolLM2-135M greedy decoding with the Pallas kernels (interpret mode on CPU) vs the reference.

The runner passes `backend=` only, so the test wraps the public ops to force one kernel with
`interpret=True` (on CPU the "pallas" backend needs it). Prefill of several prompts in one
ragged step, then batched decode steps, Hkv=3 heads and pages flattened over 30 layers.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from logprob_checks import check_greedy_close, top_from_array

import pallas_kernels
from jaxserve.worker.batch import BatchBuilder, SequenceSpan
from jaxserve.worker.runner import ModelRunner

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
PAGE, MAX_NEW, T_BUCKET, R_BUCKET = 16, 6, 64, 4


def _greedy(loaded, backend: str, kv_layout: str = "heads") -> tuple[list[list[int]], np.ndarray]:
    prompts = [loaded.tokenizer(p)["input_ids"] for p in PROMPTS]
    per_seq = (max(map(len, prompts)) + MAX_NEW + PAGE - 1) // PAGE
    runner = ModelRunner(
        loaded, num_pages=1 + per_seq * len(prompts), page_size=PAGE, attention_backend=backend,
        kv_layout=kv_layout,
    )
    tables = [
        np.arange(1 + i * per_seq, 1 + (i + 1) * per_seq, dtype=np.int32)
        for i in range(len(prompts))
    ]
    builder = BatchBuilder(T_BUCKET, R_BUCKET, per_seq, PAGE)
    seqs = [list(p) for p in prompts]
    spans = [SequenceSpan(np.array(s, np.int32), 0, t) for s, t in zip(seqs, tables)]
    outs: list[list[int]] = [[] for _ in seqs]
    logits_all = []
    for _ in range(MAX_NEW):
        logits = runner.forward_numpy(builder.build(spans, T_BUCKET, R_BUCKET))
        logits_all.append(logits)
        spans = []
        for i, row in enumerate(logits):
            tok = int(np.argmax(row))
            spans.append(SequenceSpan(np.array([tok], np.int32), len(seqs[i]), tables[i]))
            seqs[i].append(tok)
            outs[i].append(tok)
    return outs, np.stack(logits_all)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_greedy_matches_reference_with_kernels(smollm, monkeypatch, kernel):
    want_tokens, want_logits = _greedy(smollm, "reference")

    def forced(op, *args, backend, **kw):
        if backend == "reference":
            return op(*args, backend=backend, **kw)
        return op(*args, backend=f"pallas_{kernel}", interpret=True, **kw)

    monkeypatch.setattr(
        pallas_kernels,
        "ragged_paged_attention",
        functools.partial(forced, pallas_kernels.ragged_paged_attention),
    )
    monkeypatch.setattr(
        pallas_kernels, "update_kv_cache", functools.partial(forced, pallas_kernels.update_kv_cache)
    )
    # Each kernel reads the layout its platform allocates: TPU the lanes one.
    got_tokens, got_logits = _greedy(smollm, "pallas", "lanes" if kernel == "tpu" else "heads")
    _assert_close(want_tokens, want_logits, got_tokens, got_logits, atol=2e-3, rtol=1e-4)


def _assert_close(want_tokens, want_logits, got_tokens, got_logits, *, atol: float, rtol: float) -> None:
    """Greedy tokens by the near-tie rule (another kernel rounds otherwise), and each sequence's
    logits [step, V] equal within tolerance up to and including its first difference (past it the
    two runs condition on different tokens)."""
    for i in range(len(PROMPTS)):
        d = check_greedy_close(want_tokens[i], top_from_array(want_logits[:, i]), got_tokens[i],
                               top_from_array(got_logits[:, i]), name=PROMPTS[i], top_k=5)
        n = MAX_NEW if d is None else d + 1
        np.testing.assert_allclose(got_logits[:n, i], want_logits[:n, i], atol=atol, rtol=rtol)


def test_the_lanes_layout_gives_the_same_greedy_tokens(smollm):
    """The TPU page layout ([L, P, S, C], SmolLM2's 192 lanes padded to 256) through the
    reference path on CPU: same tokens and logits as the heads layout."""
    want_tokens, want_logits = _greedy(smollm, "reference")
    got_tokens, got_logits = _greedy(smollm, "reference", "lanes")
    _assert_close(want_tokens, want_logits, got_tokens, got_logits, atol=1e-5, rtol=1e-5)


def test_swap_round_trips_lanes_layout_pages(smollm):
    import jax.numpy as jnp

    runner = ModelRunner(smollm, num_pages=8, page_size=PAGE, num_host_pages=4, kv_layout="lanes")
    assert runner.kv_cache[0].shape == (30, 8, PAGE, 256) and runner.host_k.shape == (30, 4, PAGE, 256)
    rng = np.random.default_rng(0)
    before = [rng.standard_normal(x.shape).astype(np.float32) for x in runner.kv_cache]
    runner.kv_cache = tuple(jnp.asarray(x) for x in before)
    runner.swap_out([(3, 0), (5, 2)])
    runner.kv_cache = tuple(jnp.zeros_like(x) for x in runner.kv_cache)
    runner.swap_in([(0, 6), (2, 1)])
    for got, want in zip(runner.kv_cache, before):
        np.testing.assert_array_equal(np.asarray(got[:, 6]), want[:, 3])
        np.testing.assert_array_equal(np.asarray(got[:, 1]), want[:, 5])
