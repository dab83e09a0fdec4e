"""KV-cache update for NVIDIA GPUs: a Triton kernel (Pallas) scattering rows in place.

Grid (token block, KV head): a program loads `block_t` new rows of one head ([Bt, D]) and
stores each at its slot's row of the cache viewed as [P * ps * Hkv, D]. The cache is
aliased input -> output, so nothing else of it is touched (under jit with a donated or
scan-carried cache, XLA keeps it in place). A head dim that is not a power of two moves as
power-of-two column pieces, like the attention kernel's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention.gpu import head_dim_pieces, supports


def _kernel(
    slots_ref,
    k_new_ref,
    v_new_ref,
    k_in_ref,
    v_in_ref,
    k_out_ref,
    v_out_ref,
    *,
    block_t: int,
    num_kv_heads: int,
    pieces: tuple[tuple[int, int], ...],
):
    del k_in_ref, v_in_ref  # aliased with the outputs
    t0, h = pl.program_id(0) * block_t, pl.program_id(1)
    slots = slots_ref[pl.ds(t0, block_t)]  # [Bt]
    rows = slots * num_kv_heads + h  # [Bt]
    for off, w in pieces:
        cols = pl.ds(off, w)
        k_out_ref[rows, cols] = k_new_ref[pl.ds(t0, block_t), h, cols].astype(k_out_ref.dtype)
        v_out_ref[rows, cols] = v_new_ref[pl.ds(t0, block_t), h, cols].astype(v_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def update_kv_cache_gpu(
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32
    *,
    block_t: int = 16,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Write the new K/V rows into their slots; padding tokens must point at page 0."""
    num_tokens, num_kv_heads, head_dim = k_new.shape
    if not supports(head_dim):
        raise ValueError(f"the GPU KV-update kernel needs head_dim in [16, 256], a multiple of 16; got {head_dim}")
    shape = k_pages.shape
    pad = -num_tokens % block_t
    # Extra rows go to slot 0 (null page), so the kernel needs no masks.
    slots = jnp.pad(slot_mapping.astype(jnp.int32), (0, pad))
    k_new = jnp.pad(k_new, ((0, pad), (0, 0), (0, 0)))
    v_new = jnp.pad(v_new, ((0, pad), (0, 0), (0, 0)))
    rows = (-1, head_dim)  # [P * ps * Hkv, D]
    k_out, v_out = pl.pallas_call(
        functools.partial(_kernel, block_t=block_t, num_kv_heads=num_kv_heads, pieces=head_dim_pieces(head_dim)),
        grid=((num_tokens + pad) // block_t, num_kv_heads),
        out_shape=(
            jax.ShapeDtypeStruct((shape[0] * shape[1] * num_kv_heads, head_dim), k_pages.dtype),
            jax.ShapeDtypeStruct((shape[0] * shape[1] * num_kv_heads, head_dim), v_pages.dtype),
        ),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="update_kv_cache_gpu",
    )(slots, k_new, v_new, k_pages.reshape(rows), v_pages.reshape(rows))
    return k_out.reshape(shape), v_out.reshape(shape)
