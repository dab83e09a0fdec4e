"""Ragged paged attention for NVIDIA GPUs: a Triton kernel written in Pallas.

Grid (sequence r, query block j, KV head h). A program takes `block_q` query tokens of one
sequence with all `G` query heads of KV head `h` as the rows of one matrix
([block_q * Gp, D], Gp = G padded to a power of two, as Triton needs), walks that sequence's
block table inside the kernel `block_k` keys at a time (keys are gathered slot by slot, so
`block_k` does not depend on the page size), and keeps the online softmax in f32 registers.
Programs whose block lies past the sequence's query length, or whose sequence is padding,
exit at once; rows they would own keep the zeros of the aliased output buffer.

Only the keys a block can see are visited: from the start of its sliding window (if any)
to its last query position, so decode rows never read padded pages and causal prefill
blocks stop at their diagonal.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MASKED = -1e30


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _kernel(
    kv_lens_ref,  # [R] int32
    tables_ref,  # [R * M] int32, flattened block tables
    cu_q_lens_ref,  # [R+1] int32
    num_seqs_ref,  # [1] int32
    q_ref,  # [Hkv, (T + Bq) * Gp, D]
    k_ref,  # [P * ps * Hkv, D]: one row per (slot, kv head)
    v_ref,  # [P * ps * Hkv, D]
    o_init_ref,  # aliased with o_ref (zeros): untouched rows stay zero
    o_ref,  # [Hkv, (T + Bq) * Gp, D]
    *,
    block_q: int,
    group_padded: int,
    block_k: int,
    page_size: int,
    max_pages: int,
    num_kv_heads: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    del o_init_ref
    r, j, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_start = cu_q_lens_ref[r]
    q_len = cu_q_lens_ref[r + 1] - q_start
    kv_len = kv_lens_ref[r]
    first = j * block_q  # first query of this block, within the sequence's chunk
    block_rows = block_q * group_padded

    @pl.when((r < num_seqs_ref[0]) & (first < q_len))
    def _():
        row0 = (q_start + first) * group_padded
        q = q_ref[h, pl.ds(row0, block_rows), :]  # [BM, D]
        tok = first + jnp.arange(block_rows, dtype=jnp.int32) // group_padded  # [BM]
        row_valid = tok < q_len
        row_pos = kv_len - q_len + tok  # [BM]
        # Keys this block can see: [lo, hi).
        hi = kv_len - q_len + jnp.minimum(first + block_q, q_len)
        lo = jnp.int32(0)
        if sliding_window is not None:
            lo = jnp.maximum(kv_len - q_len + first - sliding_window + 1, 0)
            lo = (lo // block_k) * block_k
        num_iters = (hi - lo + block_k - 1) // block_k
        precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

        def body(i, carry):
            m, denom, acc = carry  # [BM], [BM], [BM, D] f32
            k_pos = lo + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
            page_idx = jnp.minimum(k_pos // page_size, max_pages - 1)
            pages = tables_ref[r * max_pages + page_idx]  # [BK]
            rows = (pages * page_size + k_pos % page_size) * num_kv_heads + h  # [BK]
            k = k_ref[rows, :]  # [BK, D]
            v = v_ref[rows, :]  # [BK, D]
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [BM, BK] f32
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            mask = k_pos[None, :] <= row_pos[:, None]
            if sliding_window is not None:
                mask &= row_pos[:, None] - k_pos[None, :] < sliding_window
            s = jnp.where(mask, s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=1))
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [BM, BK]
            alpha = jnp.exp(m - m_new)
            pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)  # [BM, D] f32
            return m_new, alpha * denom + p.sum(axis=1), alpha[:, None] * acc + pv

        head_dim = q.shape[-1]
        m0 = jnp.full((block_rows,), _MASKED, jnp.float32)
        l0 = jnp.zeros((block_rows,), jnp.float32)
        acc0 = jnp.zeros((block_rows, head_dim), jnp.float32)
        _, denom, acc = jax.lax.fori_loop(0, num_iters, body, (m0, l0, acc0))
        out = acc / jnp.where(denom == 0.0, 1.0, denom)[:, None]
        plgpu.store(
            o_ref.at[h, pl.ds(row0, block_rows), :],
            out.astype(o_ref.dtype),
            mask=row_valid[:, None],
        )


def default_block_q(num_tokens: int, num_seqs_max: int, group_padded: int) -> int:
    """Query tokens per program: 16 rows for decode-like batches, 64 rows otherwise."""
    rows = 16 if num_tokens <= 2 * num_seqs_max else 64
    return max(1, rows // group_padded)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "block_q",
        "block_k",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [R+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_k: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Triton (Pallas) ragged paged attention; same contract as the reference."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_rows, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    group_padded = _next_pow2(group)
    if head_dim != _next_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"GPU kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    if block_q is None:
        block_q = default_block_q(num_tokens, num_rows, group_padded)
    if block_q * group_padded < 16 or block_q != _next_pow2(block_q):
        raise ValueError(f"block_q={block_q} must be a power of two with block_q*Gp >= 16")

    # [T, Hq, D] -> [Hkv, (T + Bq) * Gp, D]: rows of one KV head contiguous, token-major.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_padded - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    k_rows = k_pages.reshape(num_pages * page_size * num_kv_heads, head_dim)
    v_rows = v_pages.reshape(num_pages * page_size * num_kv_heads, head_dim)
    o_init = jnp.zeros(qg.shape, q.dtype)

    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        group_padded=group_padded,
        block_k=block_k,
        page_size=page_size,
        max_pages=max_pages,
        num_kv_heads=num_kv_heads,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        grid=(num_rows, math.ceil(num_tokens / block_q), num_kv_heads),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        input_output_aliases={7: 0},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        qg,
        k_rows,
        v_rows,
        o_init,
    )  # [Hkv, (T + Bq) * Gp, D]
    out = out.reshape(num_kv_heads, num_tokens + block_q, group_padded, head_dim)
    out = out[:, :num_tokens, :group].transpose(1, 0, 2, 3)
    return out.reshape(num_tokens, num_q_heads, head_dim)
