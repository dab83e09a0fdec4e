"""KV-cache update for TPUs: one HBM->HBM DMA per token row, cache aliased in place.

The slot mapping is scalar-prefetched into SMEM; a program owns `block_t` tokens, starts
one async copy per token (its row, `[Hkv, D]` or `[C]`, into `[page, offset]`) and then waits for all of them,
so the copies overlap. Both caches stay in HBM (memory space ANY) and are aliased input ->
output: only the written rows move.

Quantized pages: the rows arrive quantized (`ops.update_kv_cache`, `kv_quant`); the kernel
moves them like any rows and their scales are written by XLA's scatter (one f32 per token
and head: a DMA per element would cost more than it moves).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import kv_quant
from pallas_kernels.kv_layout import layout_of


def _kernel(
    slots_ref,
    k_new_hbm,
    v_new_hbm,
    k_in_hbm,
    v_in_hbm,
    k_hbm,
    v_hbm,
    sems,
    *,
    block_t: int,
    num_tokens: int,
    page_size: int,
):
    del k_in_hbm, v_in_hbm  # aliased with the outputs
    t0 = pl.program_id(0) * block_t
    count = jnp.minimum(block_t, num_tokens - t0)

    def copies(i):
        t = t0 + i
        slot = slots_ref[t]
        page, off = slot // page_size, slot % page_size
        return (
            pltpu.make_async_copy(k_new_hbm.at[t], k_hbm.at[page, off], sems.at[0]),
            pltpu.make_async_copy(v_new_hbm.at[t], v_hbm.at[page, off], sems.at[1]),
        )

    def start(i, carry):
        for cp in copies(i):
            cp.start()
        return carry

    def wait(i, carry):
        for cp in copies(i):
            cp.wait()
        return carry

    jax.lax.fori_loop(0, count, start, 0)
    jax.lax.fori_loop(0, count, wait, 0)


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def update_kv_cache_tpu(
    k_new: jax.Array,  # [T, *row]: [T, C] in the lanes layout the engine uses on TPU
    v_new: jax.Array,  # [T, *row]
    k_pages: jax.Array,  # [num_pages, page_size, *row]
    v_pages: jax.Array,  # [num_pages, page_size, *row]
    slot_mapping: jax.Array,  # [T] int32
    k_scales: jax.Array | None = None,  # quantized pages: kv_layout.kv_scales_shape(...) f32
    v_scales: jax.Array | None = None,
    k_new_scales: jax.Array | None = None,  # [T, Hkv] f32, the scales of the (quantized) new rows
    v_new_scales: jax.Array | None = None,
    *,
    block_t: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
):
    """Write the new K/V rows into their slots; padding tokens must point at page 0.
    Quantized pages: k_new / v_new hold quantized values, their scales are written too, and
    the result is (k_pages, v_pages, k_scales, v_scales)."""
    pages = _write_rows(k_new, v_new, k_pages, v_pages, slot_mapping, block_t=block_t, interpret=interpret)
    if k_scales is None:
        return pages
    layout, slots = layout_of(k_pages), slot_mapping.astype(jnp.int32)
    return (*pages, kv_quant.write_scales(k_scales, slots, k_new_scales, layout),
            kv_quant.write_scales(v_scales, slots, v_new_scales, layout))


def _write_rows(k_new, v_new, k_pages, v_pages, slot_mapping, *, block_t, interpret):
    num_tokens = k_new.shape[0]
    page_size = k_pages.shape[1]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_kernel, block_t=block_t, num_tokens=num_tokens, page_size=page_size),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(math.ceil(num_tokens / block_t),),
            in_specs=[any_spec] * 4,
            out_specs=[any_spec] * 2,
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))],
        ),
        out_shape=(
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        input_output_aliases={3: 0, 4: 1},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="update_kv_cache_tpu",
    )(
        slot_mapping.astype(jnp.int32),
        k_new.astype(k_pages.dtype),
        v_new.astype(v_pages.dtype),
        k_pages,
        v_pages,
    )
