"""KV-cache update kernels (Triton GPU, Mosaic TPU) in interpret mode vs the jnp scatter."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels as pk
from pallas_kernels.kv_cache_update.gpu import update_kv_cache_gpu
from pallas_kernels.kv_cache_update.reference import update_kv_cache_reference
from pallas_kernels.kv_cache_update.tpu import update_kv_cache_tpu

ON_GPU = jax.default_backend() == "gpu"
KERNELS = {
    "gpu": functools.partial(update_kv_cache_gpu, interpret=not ON_GPU),
    "tpu": functools.partial(update_kv_cache_tpu, interpret=True),
    "tpu_interpret_params": functools.partial(
        update_kv_cache_tpu, interpret=pltpu.InterpretParams(), block_t=8
    ),
}


def _inputs(dtype, num_tokens=21, real=17, num_pages=9, page_size=16, hkv=3, d=64, seed=0):
    rng = np.random.default_rng(seed)
    k_pages = rng.standard_normal((num_pages, page_size, hkv, d))
    v_pages = k_pages + 1.0
    k_new = rng.standard_normal((num_tokens, hkv, d))
    v_new = 2.0 * k_new
    # Real tokens to distinct slots outside the null page; padding tokens to page 0.
    real_slots = rng.permutation(np.arange(page_size, num_pages * page_size))[:real]
    slots = np.concatenate([real_slots, np.arange(num_tokens - real) % page_size])
    arrs = [jnp.asarray(x, dtype) for x in (k_new, v_new, k_pages, v_pages)]
    return (*arrs, jnp.asarray(slots, jnp.int32))


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_scatter(kernel, dtype):
    args = _inputs(dtype)
    want = update_kv_cache_reference(*args)
    got = jax.block_until_ready(KERNELS[kernel](*args))  # before any eager op: see test_kernels_attention._check
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == w.shape
        # Page 0 collects the padding writes in an unspecified order; compare the rest.
        np.testing.assert_array_equal(np.asarray(g[1:], np.float32), np.asarray(w[1:], np.float32))


def test_gpu_kernel_head_dim_80_in_column_pieces():
    args = _inputs(jnp.bfloat16, hkv=2, d=80, seed=2)
    want = update_kv_cache_reference(*args)
    for g, w in zip(KERNELS["gpu"](*args), want):
        np.testing.assert_array_equal(np.asarray(g[1:], np.float32), np.asarray(w[1:], np.float32))


def test_public_op_pallas_interpret():
    args = _inputs(jnp.float32, seed=1)
    want = update_kv_cache_reference(*args)
    got = pk.update_kv_cache(*args, backend="pallas", interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g[1:]), np.asarray(w[1:]))


def test_lanes_layout_rows_are_the_heads_rows_side_by_side():
    """[P, S, C] pages get each token's heads in C lanes (padding lanes stay zero)."""
    from pallas_kernels.kv_layout import lanes_width, to_heads, to_lanes

    k_new, v_new, k_pages, v_pages, slots = _inputs(jnp.float32, seed=2)
    want = update_kv_cache_reference(k_new, v_new, k_pages, v_pages, slots)
    width = lanes_width(3, 64)  # 192 lanes of heads, padded to 256
    assert width == 256
    lanes = [to_lanes(p, width) for p in (k_pages, v_pages)]
    got = pk.update_kv_cache(k_new, v_new, *lanes, slots)
    for g, w in zip(got, want):
        assert g.shape == (9, 16, 256)
        np.testing.assert_array_equal(np.asarray(to_heads(g, 3, 64)[1:]), np.asarray(w[1:]))
        assert not np.asarray(g[1:, :, 192:]).any()
    with pytest.raises(ValueError, match="C=256"):
        pk.update_kv_cache(k_new, v_new, lanes[0][..., :192], lanes[1][..., :192], slots)
