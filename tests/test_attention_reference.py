"""The pure-jnp ragged paged attention against a per-token numpy loop (f32 within 1e-5)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.testing import attention_numpy, make_case

CASES = {
    "all_decode": dict(seqs=[(1, 17), (1, 1), (1, 64), (1, 33)]),
    "all_prefill": dict(seqs=[(40, 40), (7, 7), (23, 23)]),
    "mixed": dict(seqs=[(1, 50), (30, 30), (1, 9), (12, 60)], num_tokens=48, num_rows=6),
    "unaligned_chunks": dict(seqs=[(13, 29), (19, 51), (5, 16)], num_tokens=40),
    "one_token_seq": dict(seqs=[(1, 1)], num_tokens=4, num_rows=3),
    "long_context": dict(seqs=[(3, 200), (1, 150), (20, 180)], num_tokens=32, num_rows=4),
}


def _run(case, **kw):
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))
    return np.asarray(fn(*map(jnp.asarray, case.args())))


def _check(case, *, atol=1e-5, **kw):
    sm_scale = case.q.shape[-1] ** -0.5
    got = _run(case, sm_scale=sm_scale, **kw)
    extra = {k: v for k, v in kw.items() if k in ("sliding_window", "soft_cap")}
    want = attention_numpy(case, sm_scale=sm_scale, **extra)
    np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)
    total = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert np.all(got[total:] == 0.0), "padding rows must be zero"


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("block_q", [1, 4, None])
def test_matches_numpy(name, block_q):
    _check(make_case(**CASES[name], seed=hash(name) % 1000), block_q=block_q)


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("block_q", [1, 8])
def test_gqa_ratios(heads, block_q):
    hq, hkv = heads
    case = make_case(
        CASES["mixed"]["seqs"], num_tokens=48, num_rows=6, num_q_heads=hq, num_kv_heads=hkv, seed=3
    )
    _check(case, block_q=block_q)


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("block_q", [1, 4])
def test_sliding_window(window, block_q):
    case = make_case(CASES["long_context"]["seqs"], num_tokens=32, num_rows=4, seed=5)
    _check(case, sliding_window=window, block_q=block_q, chunk_pages=2)


@pytest.mark.parametrize("block_q", [1, 4])
def test_traced_window(block_q):
    """The window as data (Gemma's per-layer windows): one executable for a window, global
    (0) and a negative value (also global); chunk skipping follows the traced value."""
    case = make_case(CASES["long_context"]["seqs"], num_tokens=32, num_rows=4, seed=5)
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.25, block_q=block_q,
                                   chunk_pages=2))
    args = list(map(jnp.asarray, case.args()))
    static_fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.25, block_q=block_q,
                                          chunk_pages=2), static_argnames="sliding_window")
    for w in (5, 0, -3):
        got = np.asarray(fn(*args, sliding_window=jnp.int32(w)))  # shape []
        static = w if w > 0 else None
        np.testing.assert_allclose(got, attention_numpy(case, sm_scale=0.25, sliding_window=static), atol=1e-5,
                                   rtol=1e-5)
        want = static_fn(*args, sliding_window=static)
        np.testing.assert_allclose(got, np.asarray(want), atol=1e-6, rtol=1e-6)
    assert fn._cache_size() == 1


@pytest.mark.parametrize("block_q", [1, 4])
def test_soft_cap(block_q):
    case = make_case(CASES["mixed"]["seqs"], num_tokens=48, num_rows=6, seed=7)
    case.q[:] *= 20.0  # large logits so the cap matters
    _check(case, soft_cap=5.0, block_q=block_q)


@pytest.mark.parametrize("chunk_pages", [1, 3, 64])
def test_chunk_sizes(chunk_pages):
    _check(make_case(**CASES["long_context"], seed=11), chunk_pages=chunk_pages)


def test_contiguous_and_small_pages():
    case = make_case(
        CASES["mixed"]["seqs"], num_tokens=48, num_rows=6, page_size=4, shuffle_pages=False, seed=13
    )
    _check(case)


def test_no_real_sequences_gives_zeros():
    case = make_case([(1, 5)], num_tokens=8, num_rows=2)
    args = list(map(jnp.asarray, case.args()))
    args[6] = jnp.array([0], jnp.int32)
    out = ragged_paged_attention_reference(*args, sm_scale=0.25)
    assert np.all(np.asarray(out) == 0.0)


def test_bf16_close():
    case = make_case(CASES["mixed"]["seqs"], num_tokens=48, num_rows=6, seed=17)
    args = [
        jnp.asarray(a, jnp.bfloat16) if a.dtype == np.float32 else jnp.asarray(a)
        for a in case.args()
    ]
    got = ragged_paged_attention_reference(*args, sm_scale=0.25)
    assert got.dtype == jnp.bfloat16
    want = attention_numpy(case, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=6e-2, rtol=2e-2)


def test_same_compile_for_any_mix():
    """Batch composition is data: different decode/prefill mixes reuse one executable."""
    fn = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=0.25))
    a = make_case(
        [(1, 20), (10, 10)], num_tokens=16, num_rows=4, max_pages_per_seq=4, num_pages=12, seed=1
    )
    b = make_case(
        [(5, 40), (1, 3), (2, 2)],
        num_tokens=16,
        num_rows=4,
        max_pages_per_seq=4,
        num_pages=12,
        seed=2,
    )
    fn(*map(jnp.asarray, a.args()))
    fn(*map(jnp.asarray, b.args()))
    assert fn._cache_size() == 1


def test_public_op_dispatch_and_validation():
    import pallas_kernels as pk

    case = make_case(CASES["mixed"]["seqs"], num_tokens=48, num_rows=6, seed=19)
    args = list(map(jnp.asarray, case.args()))
    got = pk.ragged_paged_attention(*args, sm_scale=0.25)  # auto -> the native CPU kernel on CPU
    want = ragged_paged_attention_reference(*args, sm_scale=0.25)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    forced = pk.ragged_paged_attention(*args, sm_scale=0.25, backend="reference")
    np.testing.assert_array_equal(np.asarray(forced), np.asarray(want))
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="interpret=True"):
            pk.ragged_paged_attention(*args, sm_scale=0.25, backend="pallas")
    bad = list(args)
    bad[4] = bad[4][:-1]
    with pytest.raises(ValueError, match=r"block_tables must have shape \[R, max_pages_per_seq\]"):
        pk.ragged_paged_attention(*bad, sm_scale=0.25)
    bad = list(args)
    bad[3] = bad[3].astype(jnp.float32)
    with pytest.raises(ValueError, match="kv_lens must be int32"):
        pk.ragged_paged_attention(*bad, sm_scale=0.25)
    with pytest.raises(ValueError, match="backend"):
        pk.ragged_paged_attention(*args, sm_scale=0.25, backend="cuda")


def test_public_op_window_validation():
    """A window is a positive int, None, or an int32 array of shape [] or [1] whose value
    (possibly traced) is not checked."""
    import pallas_kernels as pk

    case = make_case(CASES["mixed"]["seqs"], num_tokens=48, num_rows=6, seed=19)
    args = list(map(jnp.asarray, case.args()))
    op = functools.partial(pk.ragged_paged_attention, sm_scale=0.25, backend="reference")
    for bad in (0, -4):
        with pytest.raises(ValueError, match="sliding_window must be a positive int or None"):
            op(*args, sliding_window=bad)
    with pytest.raises(ValueError, match="sliding_window must be int32"):
        op(*args, sliding_window=jnp.array([8.0]))
    with pytest.raises(ValueError, match=r"shape \[\] or \[1\], got \[2\]"):
        op(*args, sliding_window=jnp.array([8, 0], jnp.int32))
    with pytest.raises(ValueError, match="got float"):
        op(*args, sliding_window=8.0)
    traced = jax.jit(lambda w: op(*args, sliding_window=w))  # no bool() on the tracer
    for w in (jnp.int32(0), jnp.array([-1], jnp.int32), np.array([8], np.int32)):
        traced(w)
    want = attention_numpy(case, sm_scale=0.25, sliding_window=8)
    np.testing.assert_allclose(np.asarray(traced(jnp.array([8], jnp.int32))), want, atol=1e-5, rtol=1e-5)


def test_update_kv_cache_reference_and_op():
    import pallas_kernels as pk

    rng = np.random.default_rng(0)
    k_pages = jnp.asarray(rng.standard_normal((5, 4, 2, 8)), jnp.float32)
    v_pages = k_pages + 1
    k_new = jnp.asarray(rng.standard_normal((6, 2, 8)), jnp.float32)
    v_new = k_new * 2
    slots = jnp.array([4 * 3 + 1, 4 * 1 + 0, 4 * 1 + 3, 4 * 4 + 2, 0, 0], jnp.int32)
    k_out, v_out = pk.update_kv_cache(k_new, v_new, k_pages, v_pages, slots)
    want_k = np.asarray(k_pages).reshape(20, 2, 8).copy()
    want_v = np.asarray(v_pages).reshape(20, 2, 8).copy()
    want_k[np.asarray(slots[:4])] = np.asarray(k_new[:4])
    want_v[np.asarray(slots[:4])] = np.asarray(v_new[:4])
    np.testing.assert_array_equal(np.asarray(k_out).reshape(20, 2, 8)[1:], want_k[1:])
    np.testing.assert_array_equal(np.asarray(v_out).reshape(20, 2, 8)[1:], want_v[1:])
    with pytest.raises(ValueError, match=r"slot_mapping must have shape \[T\]"):
        pk.update_kv_cache(k_new, v_new, k_pages, v_pages, slots[:3])
