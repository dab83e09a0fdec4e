"""KV-cache update for TPUs: one HBM->HBM DMA per token row, cache aliased in place.

The slot mapping is scalar-prefetched into SMEM; a program owns `block_t` tokens, starts
one async copy per token (its row, `[Hkv, D]` or `[C]`, into `[page, offset]`) and then waits for all of them,
so the copies overlap. Both caches stay in HBM (memory space ANY) and are aliased input ->
output: only the written rows move.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


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
    *,
    block_t: int = 64,
    interpret: bool | pltpu.InterpretParams = False,
) -> tuple[jax.Array, jax.Array]:
    """Write the new K/V rows into their slots; padding tokens must point at page 0."""
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
