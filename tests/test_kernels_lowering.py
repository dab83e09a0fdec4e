"""The kernels lower without hardware: Triton for CUDA, Mosaic for TPU (abstract TPU mesh)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.kv_cache_update.gpu import update_kv_cache_gpu
from pallas_kernels.kv_cache_update.tpu import update_kv_cache_tpu
from pallas_kernels.kv_layout import lanes_width
from pallas_kernels.lowering import lower_for_cuda, lower_for_tpu
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

S = jax.ShapeDtypeStruct
T, R, MAX_PAGES, PAGES, PAGE = 128, 16, 32, 256, 16


def _attn_args(dtype, hq, hkv, d, layout="heads"):
    page = (PAGES, PAGE, lanes_width(hkv, d)) if layout == "lanes" else (PAGES, PAGE, hkv, d)
    return (
        S((T, hq, d), dtype),
        S(page, dtype),
        S(page, dtype),
        S((R,), jnp.int32),
        S((R, MAX_PAGES), jnp.int32),
        S((R + 1,), jnp.int32),
        S((1,), jnp.int32),
    )


def _update_args(dtype, hkv, d):
    cache = S((PAGES, PAGE, hkv, d), dtype)
    return (S((T, hkv, d), dtype), S((T, hkv, d), dtype), cache, cache, S((T,), jnp.int32))


OPTIONS = [{}, dict(sliding_window=64, soft_cap=30.0)]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("heads", [(9, 3, 64), (32, 8, 128)], ids=["smollm", "llama8b"])
@pytest.mark.parametrize("opts", OPTIONS, ids=["plain", "window_cap"])
def test_gpu_attention_lowers_for_cuda(dtype, heads, opts):
    fn = functools.partial(ragged_paged_attention_gpu, sm_scale=0.125, **opts)
    text = lower_for_cuda(fn, *_attn_args(dtype, *heads))
    assert "ragged_paged_attention_gpu" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("heads", [(8, 2, 128), (32, 8, 128), (8, 4, 64)])
@pytest.mark.parametrize("opts", OPTIONS, ids=["plain", "window_cap"])
def test_tpu_attention_lowers_for_tpu(dtype, heads, opts):
    fn = functools.partial(ragged_paged_attention_tpu, sm_scale=0.125, num_kv_heads=heads[1], **opts)
    text = lower_for_tpu(fn, *_attn_args(dtype, *heads, layout="lanes"))
    assert "tpu_custom_call" in text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_attention_lowers_with_a_traced_window(dtype):
    """The window as data ([] int32, Gemma's per-layer windows): a Triton input, a Mosaic
    scalar prefetch operand."""
    def with_window(kernel, **kw):
        return lambda *a: kernel(*a[:-1], sm_scale=0.125, sliding_window=a[-1], soft_cap=30.0, **kw)

    window = S((), jnp.int32)
    gpu = lower_for_cuda(with_window(ragged_paged_attention_gpu), *_attn_args(dtype, 9, 3, 64), window)
    assert "ragged_paged_attention_gpu" in gpu
    tpu = lower_for_tpu(with_window(ragged_paged_attention_tpu, num_kv_heads=2),
                        *_attn_args(dtype, 8, 2, 128, layout="lanes"), window)
    assert "tpu_custom_call" in tpu


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kv_update_kernels_lower(dtype):
    assert "update_kv_cache_gpu" in lower_for_cuda(update_kv_cache_gpu, *_update_args(dtype, 3, 64))
    assert "tpu_custom_call" in lower_for_tpu(update_kv_cache_tpu, *_update_args(dtype, 8, 128))


def test_auto_lowers_each_targets_kernel():
    """backend="auto" is resolved per lowering platform: Triton for CUDA, Mosaic for TPU, the
    native CPU kernel (an FFI call) for CPU, from the same traced program."""
    import pallas_kernels as pk

    fn = functools.partial(pk.ragged_paged_attention, sm_scale=0.125, num_kv_heads=3)
    args = _attn_args(jnp.bfloat16, 9, 3, 64)
    assert "ragged_paged_attention_gpu" in lower_for_cuda(fn, *args)
    tpu = lower_for_tpu(fn, *_attn_args(jnp.bfloat16, 9, 3, 64, layout="lanes"))  # the TPU cache layout
    assert "tpu_custom_call" in tpu and "ragged_paged_attention_gpu" not in tpu
    assert "tpu_custom_call" not in lower_for_tpu(fn, *args)  # heads pages: the reference reads them
    cpu = jax.jit(fn).trace(*args).lower(lowering_platforms=("cpu",)).as_text()
    assert "tpu_custom_call" not in cpu and "ragged_paged_attention_gpu" not in cpu
    assert "jaxserve_ragged_paged_attention_cpu_" in cpu
    update = lower_for_cuda(pk.update_kv_cache, *_update_args(jnp.bfloat16, 3, 64))
    assert "update_kv_cache_gpu" in update
