"""Tests of the on-device sampler against numpy references of HF/vLLM semantics."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxserve.worker.sampler import SamplerFlags, SamplingTensors, _row_uniforms, sample_jit

V = 64


def _tensors(r: int, s: int = 2, p: int = 16, **fields) -> SamplingTensors:
    """Neutral host tensors for r rows, with the given fields broadcast into them."""
    t = SamplingTensors.neutral(r, s, p)
    for name, value in fields.items():
        getattr(t, name)[...] = value
    return t


def _logits(r: int, v: int = V, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((r, v)) * scale).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _many_samples(logits_row: np.ndarray, n: int, **fields) -> np.ndarray:
    """n draws from one row: n rows with the same logits and distinct seeds."""
    t = _tensors(n, seeds=np.arange(n, dtype=np.uint32), **fields)
    logits = np.broadcast_to(logits_row, (n, logits_row.shape[-1])).copy()
    flags = SamplerFlags.from_host(t, n)
    return np.asarray(sample_jit(logits, t, **flags._asdict()).token_ids)


def test_greedy_is_argmax():
    logits = _logits(8)
    out = sample_jit(logits, _tensors(8), all_greedy=True)
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    # The non-greedy variant treats temperature-0 rows the same way (no division by 0).
    out = sample_jit(logits, _tensors(8))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == np.int32


@pytest.mark.parametrize("v", [4096, 5000])  # whole chunks; a tail past the last chunk
def test_greedy_argmax_by_chunks_is_the_first_row_max(v):
    """Large vocabularies take the chunked argmax: ties across and within chunks, the max in
    the tail, +inf, an all -inf row and a NaN entry (skipped, as XLA:CPU's max does) give the
    first index of the row max, as the two-pass rule and numpy do."""
    from jaxserve.worker.sampler import ARGMAX_CHUNK, _argmax_two_pass

    assert v // ARGMAX_CHUNK >= 2
    x = _logits(8, v)
    x[0, [5, ARGMAX_CHUNK + 5, 2 * ARGMAX_CHUNK + 1]] = 50.0  # a tie across chunks: the first
    x[1, [ARGMAX_CHUNK + 7, ARGMAX_CHUNK + 3]] = 50.0  # a tie within a chunk
    x[2, -1] = 50.0  # the last entry (in the tail when v has one)
    x[3, [17, v - 2]] = np.inf
    x[4] = -np.inf
    x[5, 3] = np.nan
    out = np.asarray(sample_jit(x, _tensors(8), all_greedy=True).token_ids)
    np.testing.assert_array_equal(out, np.nanargmax(x, axis=-1))
    np.testing.assert_array_equal(out, np.asarray(jax.jit(_argmax_two_pass)(x)))


def test_temperature_matches_softmax():
    row = _logits(1, v=8, scale=1.0)[0]
    n, temp = 8000, 0.7
    draws = _many_samples(row, n, temperature=temp)
    expected = _softmax(row / temp) * n
    observed = np.bincount(draws, minlength=8)
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < 30.0, (chi2, observed, expected)  # 7 dof: p(chi2 > 30) ~ 1e-4


def test_top_k_only_picks_top_k():
    row = _logits(1)[0]
    draws = _many_samples(row, 2000, temperature=2.0, top_k=5)
    top5 = set(np.argsort(-row)[:5].tolist())
    assert set(draws.tolist()) <= top5
    assert len(set(draws.tolist())) == 5  # temperature 2 spreads over all five


def test_top_p_nucleus():
    row = np.log(np.array([0.5, 0.25, 0.15, 0.06, 0.04], np.float32))
    row = np.concatenate([row, np.full(11, -30.0, np.float32)])
    # Nucleus for p=0.8: smallest top set reaching 0.8 = {0, 1, 2} (mass 0.9).
    draws = _many_samples(row, 3000, temperature=1.0, top_p=0.8)
    assert set(draws.tolist()) == {0, 1, 2}
    observed = np.bincount(draws, minlength=3)[:3] / len(draws)
    np.testing.assert_allclose(observed, np.array([0.5, 0.25, 0.15]) / 0.9, atol=0.04)


def test_top_k_then_top_p():
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1], np.float32))
    # top_k=2 leaves {0.4, 0.3} -> renormalised {0.57, 0.43}; top_p=0.5 keeps only token 0.
    draws = _many_samples(row, 500, temperature=1.0, top_k=2, top_p=0.5)
    assert set(draws.tolist()) == {0}


def test_min_p():
    row = np.log(np.array([0.5, 0.3, 0.12, 0.08], np.float32))
    # min_p=0.2 keeps p >= 0.1: tokens 0, 1, 2.
    draws = _many_samples(row, 2000, temperature=1.0, min_p=0.2)
    assert set(draws.tolist()) == {0, 1, 2}


def _hf_penalties(logits, prompt, output, rep, pres, freq):
    """Reference: HF RepetitionPenaltyLogitsProcessor + OpenAI presence/frequency."""
    x = logits.copy()
    seen = np.unique(np.array(prompt + output, dtype=np.int64))
    x[seen] = np.where(x[seen] > 0, x[seen] / rep, x[seen] * rep)
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=x.shape[0])
    return x - freq * counts - pres * (counts > 0)


@pytest.mark.parametrize(
    "rep,pres,freq", [(1.3, 0.0, 0.0), (1.0, 0.8, 0.0), (1.0, 0.0, 0.6), (1.2, 0.5, 0.3)]
)
def test_penalties_match_reference(rep, pres, freq):
    r, p = 4, 24
    rng = np.random.default_rng(1)
    logits = _logits(r, seed=2)
    t = _tensors(r, p=p, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    expected = []
    for i in range(r):
        prompt = rng.integers(0, V, 5 + i).tolist()
        output = rng.integers(0, 8, 3 + 2 * i).tolist()  # repeats, so counts > 1
        ids = prompt + output
        t.penalty_token_ids[i, : len(ids)] = ids
        t.penalty_prompt_len[i] = len(prompt)
        expected.append(_hf_penalties(logits[i], prompt, output, rep, pres, freq))
    expected = np.stack(expected)
    out = sample_jit(logits, t, all_greedy=True, use_penalties=True)
    np.testing.assert_array_equal(out.token_ids, expected.argmax(-1))
    # Compare the processed logits themselves, via the penalised greedy path's internals.
    from jaxserve.worker.sampler import apply_penalties

    got = np.asarray(jax.jit(apply_penalties)(logits, t))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_presence_frequency_ignore_prompt_tokens():
    from jaxserve.worker.sampler import apply_penalties

    logits = _logits(1)
    t = _tensors(1, p=8, presence_penalty=1.0, frequency_penalty=1.0)
    t.penalty_token_ids[0, :3] = [3, 3, 4]
    t.penalty_prompt_len[0] = 3  # all prompt: nothing changes
    np.testing.assert_array_equal(np.asarray(apply_penalties(logits, t)), logits)


def test_min_tokens_bans_stop_ids():
    logits = _logits(3)
    stops = np.stack([np.argsort(-logits[i])[:2] for i in range(3)]).astype(np.int32)
    t = _tensors(3, s=3, min_tokens_mask=[True, False, True])
    t.stop_token_ids[:, :2] = stops
    t.stop_token_ids[2, 1] = -1  # padding is ignored
    out = np.asarray(sample_jit(logits, t, all_greedy=True).token_ids)
    assert out[0] == np.argsort(-logits[0])[2]
    assert out[1] == logits[1].argmax()
    assert out[2] == np.argsort(-logits[2])[1]
    # Sampled rows never pick a banned id either.
    draws = _many_samples(
        logits[0], 500, temperature=5.0, min_tokens_mask=True, stop_token_ids=stops[0]
    )
    assert not set(draws.tolist()) & set(stops[0].tolist())


def test_all_64_bits_of_a_seed_select_the_stream():
    """Seeds that share their low 32 bits draw different streams; a seed below 2**32 keeps
    the stream of key(seed) (the high word 0 adds nothing)."""
    v, r = 1000, 64
    logits = np.broadcast_to(_logits(1, v=v, seed=3, scale=0.5)[0], (r, v)).copy()

    def draws(lo, hi):
        t = _tensors(r, temperature=1.0, seeds=lo, seeds_hi=hi, output_pos=np.arange(r))
        return np.asarray(sample_jit(logits, t).token_ids)

    base, high = draws(7, 0), draws(7, 1)
    assert (base != high).sum() > r // 2
    assert np.array_equal(draws(7, 0), base)
    want = jax.random.uniform(jax.random.fold_in(jax.random.key(np.uint32(7)), 3), ())
    assert float(_row_uniforms(np.array([7], np.uint32), np.array([0], np.uint32), np.array([3]))[0]) == float(want)


def test_seeded_row_independent_of_batch():
    """Same (seed, pos) -> same token alone or in a batch of 16 varied rows, any row index."""
    v, steps = 1000, 8
    logits_row = _logits(1, v=v, seed=5, scale=1.0)[0]
    params = dict(temperature=0.9, top_p=1.0, min_p=0.0, seeds=1234)

    alone = []
    for pos in range(steps):
        t = _tensors(1, p=32, output_pos=pos, **params)
        alone.append(int(sample_jit(logits_row[None], t).token_ids[0]))

    r, row = 16, 11
    rng = np.random.default_rng(9)
    batch_logits = _logits(r, v=v, seed=6)
    batch_logits[row] = logits_row
    t = _tensors(
        r,
        p=32,
        temperature=rng.uniform(0.0, 1.5, r).astype(np.float32),
        top_k=rng.integers(0, 50, r),
        top_p=rng.uniform(0.5, 1.0, r).astype(np.float32),
        min_p=rng.uniform(0.0, 0.1, r).astype(np.float32),
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        seeds=rng.integers(0, 2**32, r, dtype=np.uint32),
    )
    t.penalty_token_ids[:, :10] = rng.integers(0, v, (r, 10))
    t.penalty_prompt_len[:] = 5
    for name, value in params.items():
        getattr(t, name)[row] = value
    t.top_k[row] = 0
    t.repetition_penalty[row], t.frequency_penalty[row] = 1.0, 0.0
    flags = SamplerFlags.from_host(t, r, num_logprobs=5)
    assert flags.use_penalties and flags.use_top_k_top_p
    in_batch = []
    for pos in range(steps):
        t.output_pos[:] = pos
        out = sample_jit(batch_logits, t, **flags._asdict())
        in_batch.append(int(out.token_ids[row]))
    assert alone == in_batch
    assert len(set(alone)) > 1  # positions give different draws


def test_logprobs_are_raw_log_softmax():
    r, k = 5, 4
    logits = _logits(r)
    t = _tensors(
        r,
        temperature=[0.0, 0.5, 1.0, 2.0, 0.0],
        seeds=np.arange(r),
        top_k=[0, 3, 0, 0, 0],
        repetition_penalty=1.5,
    )
    t.penalty_token_ids[:, 0] = logits.argmax(-1)
    t.penalty_prompt_len[:] = 1
    out = sample_jit(logits, t, use_penalties=True, use_top_k_top_p=True, num_logprobs=k)
    lp = np.log(_softmax(logits.astype(np.float64)))
    tok = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.chosen_logprob, lp[np.arange(r), tok], atol=1e-5)
    order = np.argsort(-lp, -1)[:, :k]
    np.testing.assert_array_equal(out.top_token_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(lp, order, 1), atol=1e-5)
    ranks = (lp > lp[np.arange(r), tok][:, None]).sum(-1) + 1
    np.testing.assert_array_equal(out.chosen_rank, ranks)
    assert out.top_logprobs.shape == (r, k) and out.chosen_rank.dtype == np.int32
    # Without logprobs, only token ids come back.
    assert sample_jit(logits, t).chosen_logprob is None


def test_mixed_greedy_and_sampled_rows():
    r = 6
    logits = _logits(r, scale=0.5)
    temps = np.array([0.0, 1.0, 0.0, 1.0, 0.0, 1.0], np.float32)
    t = _tensors(r, temperature=temps, top_k=[0, 0, 2, 0, 0, 0])
    sampled_rows = temps > 0
    seen = [set() for _ in range(r)]
    for seed in range(40):
        t.seeds[:] = seed * 100 + np.arange(r)
        out = np.asarray(sample_jit(logits, t, use_top_k_top_p=True).token_ids)
        np.testing.assert_array_equal(out[~sampled_rows], logits[~sampled_rows].argmax(-1))
        for i in range(r):
            seen[i].add(int(out[i]))
    assert all(len(seen[i]) > 3 for i in np.flatnonzero(sampled_rows))


def test_tensors_are_a_pytree_and_flags():
    t = _tensors(4, temperature=[0, 0, 0, 0.5])
    leaves = jax.tree.leaves(t)
    assert len(leaves) == len(dataclasses.fields(SamplingTensors))
    assert SamplerFlags.from_host(t, 3) == SamplerFlags(True, False, False, None)
    assert SamplerFlags.from_host(t, 4).all_greedy is False


def test_full_vocab_smoke():
    """V = 49152 (SmolLM2) with every feature on, once."""
    r, v = 8, 49152
    logits = _logits(r, v=v, seed=3)
    t = _tensors(
        r,
        p=64,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        seeds=np.arange(r),
    )
    t.temperature[0] = 0.0
    t.penalty_token_ids[:, :20] = np.random.default_rng(0).integers(0, v, (r, 20))
    t.penalty_prompt_len[:] = 10
    out = sample_jit(logits, t, **SamplerFlags.from_host(t, r, num_logprobs=20)._asdict())
    tok = np.asarray(out.token_ids)
    assert tok.shape == (r,) and ((tok >= 0) & (tok < v)).all()
    for i in range(1, r):
        assert tok[i] in np.argsort(-logits[i])[:60]  # top-k 40 (penalties shuffle a little)
    assert out.top_token_ids.shape == (r, 20)


def test_new_data_does_not_recompile():
    """Per-row params are data: different values with the same flags reuse one executable."""
    logits = _logits(4, seed=7)
    flags = dict(use_penalties=True, use_top_k_top_p=True, num_logprobs=3)
    sample_jit(logits, _tensors(4, p=8, temperature=0.5), **flags)
    before = sample_jit._cache_size()
    t = _tensors(4, p=8, temperature=[0, 1, 2, 3], top_k=[0, 1, 2, 3], top_p=0.5, seeds=7)
    t.penalty_token_ids[:, :2] = 1
    sample_jit(logits + 1, t, **flags)
    assert sample_jit._cache_size() == before


def test_degenerate_top_p_and_dead_rows_stay_in_vocab():
    # V not a multiple of the CDF block: an out-of-range id would be >= V.
    r, v = 4, 300
    logits = np.asarray(np.random.default_rng(3).normal(size=(r, v)), np.float32)
    logits[3] = -np.inf  # a row with no mass at all (everything banned)
    t = SamplingTensors.neutral(r, 2, 8)
    t.temperature[:] = 1.0
    t.seeds[:] = np.arange(r)
    t.top_p[:] = np.float32(5e-324)  # rounds to 0 in f32
    t.top_p[2] = 1.0
    for pos in range(3):
        t.output_pos[:] = pos
        out = np.asarray(sample_jit(logits, t, use_top_k_top_p=True).token_ids)
        assert ((0 <= out) & (out < v)).all(), out
        assert out[0] == logits[0].argmax() and out[1] == logits[1].argmax()  # nucleus of one


def test_logprobs_zero_returns_the_sampled_token_only():
    r = 3
    logits = _logits(r)
    t = SamplingTensors.neutral(r, 2, 8)
    out = sample_jit(logits, t, all_greedy=True, num_logprobs=0)
    lp = np.log(_softmax(logits.astype(np.float64)))
    tok = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.chosen_logprob, lp[np.arange(r), tok], atol=1e-5)
    assert out.top_logprobs.shape == (r, 0) and (np.asarray(out.chosen_rank) == 1).all()
    assert sample_jit(logits, t, all_greedy=True).chosen_logprob is None


def test_logit_bias_adds_to_listed_tokens_before_penalties():
    """OpenAI's logit_bias: each listed id's logit moves by its value; -100 bans in practice,
    +100 forces; padding ids (-1) and unlisted tokens are untouched; the repetition penalty
    then applies to the biased logit (vLLM's order)."""
    from jaxserve.worker.sampler import apply_penalties

    logits = _logits(3)
    t = _tensors(3, p=8)
    top = [int(np.argmax(logits[i])) for i in range(3)]
    t.bias_token_ids[0, :2] = [top[0], 5]
    t.bias_values[0, :2] = [-100.0, 3.5]
    t.bias_token_ids[1, 0] = 7
    t.bias_values[1, 0] = 100.0
    t.repetition_penalty[2] = 2.0  # row 2: bias on a token seen in the prompt
    t.penalty_token_ids[2, 0] = 9
    t.penalty_prompt_len[2] = 1
    t.bias_token_ids[2, 0] = 9
    t.bias_values[2, 0] = 10.0
    got = np.asarray(jax.jit(apply_penalties)(logits, t))
    expected = logits.copy()
    expected[0, top[0]] -= 100.0
    expected[0, 5] += 3.5
    expected[1, 7] += 100.0
    biased = logits[2, 9] + 10.0
    expected[2, 9] = biased / 2.0 if biased > 0 else biased * 2.0
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    out = np.asarray(sample_jit(logits, t, all_greedy=True, use_penalties=True).token_ids)
    assert out[0] != top[0] and out[1] == 7
    assert SamplerFlags.from_host(t, 2).use_penalties  # a bias alone selects the full variant


def test_input_batch_clears_a_finished_requests_bias_row():
    """A row reused by a request without logit_bias must not keep the last one's bias."""
    from jaxserve.worker.input_batch import InputBatch
    from scheduler import NewRequestData, SamplingParams, ScheduledRequest

    ib = InputBatch([2], max_model_len=16, max_logprobs=0, seed=0)

    def new(rid, **kw):
        return NewRequestData(request_id=rid, prompt_token_ids=[1, 2], sampling_params=SamplingParams(**kw),
                              eos_token_id=0)

    def rows(*rids):
        return ib.sampling_rows([ScheduledRequest(request_id=r, start=2, num_tokens=1, token_ids=[3], new_block_ids=[],
                                                  block_table=np.zeros(4, np.int32), samples=True) for r in rids], 2)

    ib.update([], [new("a", logit_bias={5: 2.0, 6: -1.0}), new("b", temperature=0.0)])
    t, flags = rows("a", "b")
    assert flags.use_penalties and t.bias_token_ids[0, :3].tolist() == [5, 6, -1]
    assert t.bias_values[0, :2].tolist() == [2.0, -1.0]
    ib.update(["a"], [new("c", temperature=0.0)])
    t, flags = rows("c", "b")
    assert not flags.use_penalties and (t.bias_token_ids == -1).all() and (t.bias_values == 0).all()


@pytest.mark.parametrize("vocab", [576, 1000])
def test_one_row_at_a_time_gives_each_row_its_alone_bits_in_any_request_bucket(vocab):
    """Batch-invariant mode's sampler (the engine's head program, `one_row_at_a_time`): each
    row's token, logprob, rank and top-k are bitwise those of the row sampled alone, for
    request buckets of 2, 3, 5, 25 and 64 rows. XLA:CPU's plain [R, V] program reduced some
    rows of these vocabularies in another order than alone (a few rows 1 ulp off from 8 or
    16 rows up, measured on a Xeon)."""
    from jaxserve.worker.step_programs import sample_jit as head_jit

    x = _logits(64, vocab, scale=3.0)
    flags = SamplerFlags(False, False, False, 2)

    def head(rows, first):
        t = SamplingTensors.neutral(len(rows), 4, 8, vocab_size=vocab)
        t.temperature[:] = 0.8
        t.seeds[:] = np.arange(first, first + len(rows))
        out = head_jit(rows.copy(), t, flags=flags, one_row_at_a_time=True)
        return [tuple(np.asarray(a[i]).tobytes() for a in (out.token_ids, out.chosen_logprob, out.chosen_rank,
                                                         out.top_logprobs, out.top_token_ids))
                for i in range(len(rows))]

    alone = [head(x[i:i + 1], i)[0] for i in range(64)]
    for r in (2, 3, 5, 25, 64):
        assert head(x[:r], 0) == alone[:r], f"request bucket {r}"
