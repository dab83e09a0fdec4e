"""Pure-jnp ragged paged attention: the correctness oracle and the CPU attention path.

It runs once per layer inside the model's `lax.scan`, so it is written for XLA:CPU speed:

* Query rows are grouped into *query blocks* of `block_q` tokens that all belong to one
  sequence (a sequence's chunk is split into ceil(q_len / block_q) blocks; the last one is
  partly empty). Every block then needs the KV pages of exactly one sequence, so pages are
  gathered once per block rather than once per token. `block_q = 1` is the per-token
  layout (best for decode); larger blocks turn prefill into small matmuls.
* KV is visited in chunks of `chunk_pages` pages with an online softmax in f32, in a loop
  whose trip count is data (ceil(longest real kv_len / chunk)), so memory stays bounded by
  one chunk per block and short batches do not pay for the longest possible context.
* With one query per block, scores use multiply-and-reduce (`(q * k).sum(-1)`), which XLA:CPU
  runs about twice as fast as batches of tiny dot products (see DESIGN.md).

Only `T` (tokens) and `R` (sequences) are static; the mix of decode and prefill is data.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.kv_layout import layout_of, to_heads
from pallas_kernels.ragged_paged_attention import window

_MASKED = -1e30  # finite "minus infinity": keeps exp(m_old - m_new) free of NaNs


def default_block_q(num_tokens: int, num_seqs_max: int) -> int:
    """Query-block size for a batch of `num_tokens` tokens from up to `num_seqs_max` seqs.

    Per-token (1) when the batch is decode-like. Otherwise the largest power of two up to
    T / R (at most 32): padding each sequence to whole blocks then adds at most ~T rows,
    while every KV page is read once per block instead of once per token.
    """
    ratio = num_tokens // max(num_seqs_max, 1)
    if ratio < 4:
        return 1
    return min(32, 1 << (ratio.bit_length() - 1))


def default_chunk_pages(page_size: int, block_q: int) -> int:
    """KV pages per loop iteration: ~32 keys for per-token rows, ~128 for query blocks.

    Measured on XLA:CPU: small chunks keep the gathered K/V chunk in cache; larger ones
    were slower (the gather is materialized before the reductions).
    """
    keys = 32 if block_q == 1 else 128
    return max(1, keys // page_size)


def _token_layout(cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array, num_tokens: int):
    """Per-sequence query lengths and per-token sequence ids / positions / validity."""
    num_rows = kv_lens.shape[0]
    n = num_seqs.reshape(())
    seq_idx = jnp.arange(num_rows, dtype=jnp.int32)
    real_seq = seq_idx < n  # [R]
    q_lens = jnp.where(real_seq, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [R]
    q_starts = cu_q_lens[:-1]  # [R]
    total = cu_q_lens[n]  # tokens of real sequences
    t = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    # Sequence of each token: number of real sequences that ended at or before it.
    ends = jnp.where(real_seq, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)  # [R]
    tok_seq = jnp.sum(ends[None, :] <= t[:, None], axis=1).astype(jnp.int32)  # [T]
    tok_seq = jnp.minimum(tok_seq, num_rows - 1)
    tok_valid = t < total  # [T]
    return q_lens, q_starts, real_seq, tok_seq, tok_valid


def _gather_pages(pages_arr: jax.Array, pages: jax.Array) -> jax.Array:
    """pages_arr[pages]. Heads-layout pages are gathered as rows of a 2-D view: XLA:CPU
    copies whole pages that way (~2x faster). Lanes-layout pages ([P, S, C], the TPU's) are
    gathered as they are: a 2-D view of them is not a bitcast in XLA:TPU's tiled layout, and
    would relayout the whole pool every layer."""
    if pages_arr.ndim == 3:
        return pages_arr.at[pages].get(mode="promise_in_bounds")  # [..., S, C]
    flat = pages_arr.reshape(pages_arr.shape[0], -1)  # [P, ps*Hkv*D]
    # Block tables only hold valid page ids (0 = null page), so skip the clamping.
    return flat.at[pages].get(mode="promise_in_bounds")  # [..., ps*Hkv*D]


def _online_softmax_attention(
    q: jax.Array,  # [NB, Bq, Hkv, G, D] f32, already scaled by sm_scale
    row_pos: jax.Array,  # [NB, Bq] int32, query position in its sequence
    row_valid: jax.Array,  # [NB, Bq] bool
    row_tables: jax.Array,  # [NB, M'] int32, block-table row of each block's sequence
    k_pages: jax.Array,  # [P, ps, Hkv, D] or [P, ps, C]
    v_pages: jax.Array,  # like k_pages
    start_chunk: jax.Array,  # [] int32
    end_chunk: jax.Array,  # [] int32
    chunk_pages: int,
    sliding_window: int | jax.Array | None,  # a static int, or the effective window ([] int32)
    soft_cap: float | None,
    attention_chunk: jax.Array | None = None,  # the effective chunk size ([] int32) or None
    k_scales: jax.Array | None = None,  # quantized pages: kv_layout.kv_scales_shape(...) f32
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [Hq] f32
    row_hi: jax.Array | None = None,  # [NB, Bq] int32, last key a row sees (None: row_pos)
) -> jax.Array:  # [NB, Bq, Hkv, G, D] f32
    """Online softmax over KV chunks; scores laid out per path so no transposes run in the loop.
    Quantized pages are dequantized per gathered chunk (values * their token's scale). A
    head's sink logit joins its rows' denominators after the loop (no value of its own).

    Per-row (Bq == 1): scores [NB, S, Hkv, G] by multiply-and-reduce.
    Blocked (Bq > 1): scores [NB, Hkv, Bq, G, S] by batched matmuls (batch dims NB, Hkv).
    """
    nb, bq, hkv, g, d = q.shape
    page_size = k_pages.shape[1]
    chunk = chunk_pages * page_size
    per_row = bq == 1
    if per_row:
        q_in = q.reshape(nb, 1, hkv, g, d)  # [NB, 1, Hkv, G, D]
        stat_shape, key_axis = (nb, hkv, g), 1
    else:
        q_in = q.transpose(0, 2, 1, 3, 4)  # [NB, Hkv, Bq, G, D]
        stat_shape, key_axis = (nb, hkv, bq, g), 4

    def body(c, carry):
        m, denom, acc = carry  # stat_shape, stat_shape, stat_shape + (D,)
        pages = jax.lax.dynamic_slice_in_dim(row_tables, c * chunk_pages, chunk_pages, axis=1)
        # [NB, S, Hkv, D]; a lanes-layout row drops its padding lanes here, per chunk.
        k = to_heads(_gather_pages(k_pages, pages).reshape(nb, chunk, -1), hkv, d).astype(jnp.float32)
        v = to_heads(_gather_pages(v_pages, pages).reshape(nb, chunk, -1), hkv, d).astype(jnp.float32)
        if k_scales is not None:  # [NB, S, Hkv] per chunk
            layout = layout_of(k_pages)
            k = k * kv_quant.page_scales(k_scales, pages, page_size, layout).reshape(nb, chunk, hkv, 1)
            v = v * kv_quant.page_scales(v_scales, pages, page_size, layout).reshape(nb, chunk, hkv, 1)
        k_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)  # [S]
        # Slots past a block's kv_len may hold anything, NaN included (a freed page's stale
        # rows); p is 0 there, but 0 * NaN is not. Non-finite V is zeroed: an elementwise op
        # XLA:CPU fuses into the PV reduction (a position mask here cost ~15% of decode).
        v = jnp.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
        # The upper bound is the row's own position, or its attend_until limit (Gemma 3's image
        # tokens); the window and the attention chunk always start from its position.
        mask = k_pos[None, None, :] <= (row_pos if row_hi is None else row_hi)[:, :, None]  # [NB, Bq, S]
        if sliding_window is not None:
            mask &= row_pos[:, :, None] - k_pos[None, None, :] < sliding_window
        if attention_chunk is not None:  # only the row's own chunk
            mask &= k_pos[None, None, :] >= window.chunk_start(row_pos, attention_chunk)[:, :, None]
        mask &= row_valid[:, :, None]
        if per_row:
            s = (q_in * k[:, :, :, None, :]).sum(-1)  # [NB, S, Hkv, G]
            mask = mask[:, 0, :, None, None]  # [NB, S, 1, 1]
        else:
            s = jnp.einsum("bhqgd,bshd->bhqgs", q_in, k)  # [NB, Hkv, Bq, G, S]
            mask = mask[:, None, :, None, :]  # [NB, 1, Bq, 1, S]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, s.max(key_axis))
        p = jnp.where(mask, jnp.exp(s - jnp.expand_dims(m_new, key_axis)), 0.0)
        alpha = jnp.exp(m - m_new)
        denom_new = alpha * denom + p.sum(key_axis)
        if per_row:
            pv = (p[..., None] * v[:, :, :, None, :]).sum(1)  # [NB, Hkv, G, D]
        else:
            pv = jnp.einsum("bhqgs,bshd->bhqgd", p, v)  # [NB, Hkv, Bq, G, D]
        return m_new, denom_new, alpha[..., None] * acc + pv

    m0 = jnp.full(stat_shape, _MASKED, jnp.float32)
    l0 = jnp.zeros(stat_shape, jnp.float32)
    acc0 = jnp.zeros((*stat_shape, d), jnp.float32)
    m, denom, acc = jax.lax.fori_loop(start_chunk, end_chunk, body, (m0, l0, acc0))
    if sinks is not None:  # softmax over [scores, sink]: rescale to the larger max, add the sink's weight
        sink = sinks.astype(jnp.float32).reshape((hkv, g) if per_row else (hkv, 1, g))
        top = jnp.maximum(m, sink)
        scale = jnp.where(denom > 0.0, jnp.exp(m - top), 0.0)
        acc = acc * scale[..., None]
        denom = jnp.where(denom > 0.0, denom * scale + jnp.exp(sink - top), 0.0)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    if per_row:
        return out.reshape(nb, 1, hkv, g, d)
    return out.transpose(0, 2, 1, 3, 4)  # [NB, Bq, Hkv, G, D]


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D], or [num_pages, page_size, C] (lanes)
    v_pages: jax.Array,  # like k_pages
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [R+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    num_kv_heads: int | None = None,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    chunk_pages: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | jax.Array | None = None,
    attend_until: jax.Array | None = None,
) -> jax.Array:  # [T, Hq, D], dtype of q
    """Attention of a flat ragged token batch over a paged KV cache (see docs/architecture.md).

    Token `j` of sequence `i` sits at position `kv_lens[i] - q_len_i + j` and attends to
    cache positions `k <= p` (and `p - k < sliding_window`). The window is a static int or
    None, or an int32 array of shape [] or [1] (per-layer data; <= 0 means no window).
    Logits are `q.k * sm_scale`,
    then `soft_cap * tanh(logits / soft_cap)`. Rows past `cu_q_lens[num_seqs]` give zeros.
    `block_q` / `chunk_pages` are static tuning knobs (defaults picked from T, R, page size).
    `num_kv_heads` is needed with lanes-layout pages (their rows may be padded).
    Quantized pages (int8 / fp8, `kv_quant`) take `k_scales` / `v_scales` (f32,
    `kv_layout.kv_scales_shape`): keys and values are read as `value * scale`.
    `sinks` ([Hq] f32, gpt-oss): one learned logit per query head, a softmax entry with no
    value: weights are exp(s) / (sum exp(s) + exp(sink)). A row that sees no key gives zeros.
    `attention_chunk` (Llama 4's chunked local attention, C; an int, or int32 data where <= 0
    is none): position p also needs k >= p - p % C.
    `attend_until` ([T] int32 or None): token t's upper bound is
    k <= min(max(p, attend_until[t]), kv_len - 1) instead of k <= p (Gemma 3's image tokens
    see their whole image); the window and chunk bounds still follow from p.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    page_size = k_pages.shape[1]
    if k_pages.ndim == 4:
        num_kv_heads = k_pages.shape[2]
    elif num_kv_heads is None:
        raise ValueError("num_kv_heads is required with lanes-layout pages [P, S, C]")
    num_rows, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    if not window.is_static(sliding_window):
        # A traced window: INT32_MAX where it is <= 0, so the same mask and chunk skipping
        # below serve global layers too (every key passes, the first chunk is 0).
        sliding_window = window.effective_array(sliding_window).reshape(())
    if attention_chunk is not None:
        attention_chunk = window.effective_array(attention_chunk).reshape(())
    if block_q is None:
        block_q = default_block_q(num_tokens, num_rows)
    if chunk_pages is None:
        chunk_pages = default_chunk_pages(page_size, block_q)
    chunk_pages = min(chunk_pages, max_pages)
    chunk = chunk_pages * page_size

    kv_lens = kv_lens.astype(jnp.int32)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    q_lens, q_starts, real_seq, tok_seq, tok_valid = _token_layout(
        cu_q_lens, kv_lens, num_seqs.astype(jnp.int32), num_tokens
    )
    # Pad the block table so every chunk's dynamic slice stays in bounds (pads hit page 0).
    padded_pages = math.ceil(max_pages / chunk_pages) * chunk_pages
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_pages - max_pages)))

    qf = q.astype(jnp.float32) * jnp.float32(sm_scale)  # [T, Hq, D]
    tok_pos = kv_lens[tok_seq] - q_lens[tok_seq] + (jnp.arange(num_tokens) - q_starts[tok_seq])
    tok_hi = None  # [T] last key each token sees, with attend_until
    if attend_until is not None:
        until = jnp.minimum(attend_until.astype(jnp.int32), kv_lens[tok_seq] - 1)
        tok_hi = jnp.where(tok_valid, jnp.maximum(tok_pos, until), tok_pos)

    if block_q == 1:
        # One row per token: block b is token b.
        num_blocks = num_tokens
        q_blk = qf.reshape(num_tokens, 1, num_kv_heads, group, head_dim)
        row_pos = tok_pos[:, None]  # [T, 1]
        row_hi = None if tok_hi is None else tok_hi[:, None]
        row_valid = tok_valid[:, None]  # [T, 1]
        row_tables = tables[tok_seq]  # [T, M']
        out_row = jnp.arange(num_tokens)  # [T] flat row of each token
    else:
        # Sequence-aligned blocks: sequence i owns blocks [blk_start_i, blk_start_i + nb_i).
        num_blocks = -(-(num_tokens + min(num_rows, num_tokens) * (block_q - 1)) // block_q)
        nb_seq = (q_lens + block_q - 1) // block_q  # [R]
        blk_cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(nb_seq, dtype=jnp.int32)])
        b = jnp.arange(num_blocks, dtype=jnp.int32)
        blk_seq = jnp.sum(blk_cu[1:][None, :] <= b[:, None], axis=1).astype(jnp.int32)
        blk_seq = jnp.minimum(blk_seq, num_rows - 1)  # [NB]
        blk_real = b < blk_cu[-1]  # [NB]
        first_tok = q_starts[blk_seq] + (b - blk_cu[blk_seq]) * block_q  # [NB]
        row_tok = first_tok[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # [NB, Bq]
        seq_end = q_starts[blk_seq] + q_lens[blk_seq]  # [NB]
        row_valid = blk_real[:, None] & (row_tok < seq_end[:, None])  # [NB, Bq]
        row_tok_safe = jnp.where(row_valid, row_tok, 0)
        q_blk = qf[row_tok_safe.reshape(-1)].reshape(
            num_blocks, block_q, num_kv_heads, group, head_dim
        )
        q_blk = jnp.where(row_valid[:, :, None, None, None], q_blk, 0.0)
        row_pos = jnp.where(row_valid, tok_pos[row_tok_safe], -1)  # [NB, Bq]
        row_hi = None if tok_hi is None else jnp.where(row_valid, tok_hi[row_tok_safe], -1)
        row_tables = tables[blk_seq]  # [NB, M']
        out_row = blk_cu[tok_seq] * block_q + (jnp.arange(num_tokens) - q_starts[tok_seq])
        out_row = jnp.where(tok_valid, out_row, 0)

    # Chunks to visit: from the first one any live window can see to the longest context.
    max_kv = jnp.max(jnp.where(real_seq, kv_lens, 0))
    end_chunk = (max_kv + chunk - 1) // chunk
    start_chunk = jnp.int32(0)
    if sliding_window is not None or attention_chunk is not None:
        min_pos = jnp.min(jnp.where(tok_valid, tok_pos, jnp.iinfo(jnp.int32).max))
        first_key = jnp.int32(0)
        if sliding_window is not None:
            first_key = jnp.maximum(first_key, min_pos - sliding_window + 1)
        if attention_chunk is not None:
            first_key = jnp.maximum(first_key, window.chunk_start(min_pos, attention_chunk))
        start_chunk = jnp.clip(first_key // chunk, 0, end_chunk)
    del num_blocks

    out = _online_softmax_attention(
        q_blk,
        row_pos,
        row_valid,
        row_tables,
        k_pages,
        v_pages,
        start_chunk.astype(jnp.int32),
        end_chunk.astype(jnp.int32),
        chunk_pages,
        sliding_window,
        soft_cap,
        k_scales=k_scales,
        v_scales=v_scales,
        sinks=sinks,
        attention_chunk=attention_chunk,
        row_hi=row_hi,
    )  # [NB, Bq, Hkv, G, D]
    out = out.reshape(-1, num_q_heads, head_dim)[out_row]  # [T, Hq, D]
    out = jnp.where(tok_valid[:, None, None], out, 0.0)
    return out.astype(q.dtype)
