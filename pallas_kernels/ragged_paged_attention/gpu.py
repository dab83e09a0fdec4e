"""Ragged paged attention for NVIDIA GPUs: a Triton kernel written in Pallas.

Grid (work item p, KV head h), flat over the batch's real work: item p is split s of query
block b, and block b is the j-th `block_q`-token block of sequence r, a map the wrapper
computes from `cu_q_lens` (a batch of T tokens from at most R sequences has at most
ceil(T / block_q) + min(R, T) blocks, so the grid no longer grows with R x T). A program takes
that block's tokens with all `G` query heads of KV head h as the rows of one matrix
([block_q * Gp, D], Gp = G padded to a power of two, as Triton needs), walks the sequence's
block table inside the kernel `block_k` keys at a time (keys are gathered slot by slot, so
`block_k` does not depend on the page size) and keeps the online softmax in f32 registers.

Split-KV (flash-decoding): decode batches have too few blocks to fill the GPU (B * Hkv
programs; 8 at B=1 on 132 SMs), so the keys a block sees are cut into `num_splits` ranges,
each its own program writing a partial and its log-sum-exp; a combine outside the kernel
(one XLA fusion) merges them. How many splits a batch uses is data: enough to give
~`_TARGET_PROGRAMS` programs for the blocks it really has, at most the static `max_splits`.
Blocks x splits then stays under `_TARGET_PROGRAMS / Hkv + blocks`, which sizes the grid, so
few programs launch only to exit. Prefill-sized batches have blocks enough and run unsplit.

Masking: only the keys a block can see are visited (from its sliding window's start, if any,
to its last query position), and K/V rows at or past `kv_len` are never loaded (masked loads
give zeros: an unused slot holding NaN cannot leak through 0 * NaN). Head dims that are not a
power of two (80, 96, ...) are cut into power-of-two column pieces (80 = 64 + 16), each its own
dot, so no padded column is read.

Quantized pages (int8, float8_e4m3fn, float8_e5m2) come with one f32 scale per token and KV
head, read as `[P * ps * Hkv]` rows beside the K/V rows: keys and values are widened to the
query dtype on load (exact: int8 and fp8 fit bf16), the scores of a key are multiplied by its
K scale and each softmax weight by its key's V scale before P.V (the denominator sums the
unscaled weights), so dequantized pages never exist in memory.

`attend_until` (Gemma 3's image tokens, [T] int32) arrives laid out like q's rows
([(T + Bq) * Gp] int32): a row sees keys up to min(max(p, until), kv_len - 1), and a block
visits keys up to its rows' largest limit when that is past its last query.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention import window

_MASKED = -1e30
# Programs a split decode batch aims for: a few per SM on a 132-SM H100/H200.
_TARGET_PROGRAMS = 512
# Split partials are f32 [splits, Hkv, rows, D]: splits x tokens is kept under this.
_SPLIT_TOKEN_BUDGET = 4096
_MAX_SPLITS = 32


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def head_dim_pieces(head_dim: int) -> tuple[tuple[int, int], ...]:
    """(offset, width) power-of-two column pieces of a head, each >= 16 (a Triton dot's K)."""
    if head_dim % 16:
        raise ValueError(f"GPU kernel needs head_dim to be a multiple of 16, got {head_dim}")
    pieces, off = [], 0
    for bit in reversed(range(head_dim.bit_length())):
        width = 1 << bit
        if head_dim - off >= width >= 16:
            pieces.append((off, width))
            off += width
    return tuple(pieces)


# Quantized page dtypes the kernel reads (values times their per-token scales).
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def quantized_dtypes(compute_capability: float | None = None) -> tuple:
    """Quantized page dtypes on a GPU of this compute capability (None: unknown, all of them):
    Triton converts fp8 from 8.9 on (Ada, Hopper: H100/H200 are 9.0); int8 everywhere."""
    if compute_capability is not None and compute_capability < 8.9:
        return (jnp.dtype(jnp.int8),)
    return QUANTIZED_DTYPES


def supports(head_dim: int) -> bool:
    return head_dim >= 16 and head_dim % 16 == 0 and head_dim <= 256


# Shared memory a wide head's query block may take (f32 rows of D): 128 query heads of 576
# lanes asked 288 KiB of the H200's 227 (compile-only), 16 heads compiled.
_WIDE_BLOCK_BYTES = 160 * 1024


def latent_block_q(head_dim: int, num_q_heads: int) -> int | None:
    """The query block (tokens) for one KV head wider than 256 lanes (MLA's 576-lane latent
    rows), so that the block's rows fit shared memory; None where even one token's heads do not."""
    rows = _WIDE_BLOCK_BYTES // (4 * head_dim)
    group_padded = _next_pow2(num_q_heads)
    if head_dim % 16 or group_padded > rows:
        return None
    block_q = 1
    while 2 * block_q * group_padded <= rows:
        block_q *= 2
    return block_q


def _kernel(
    block_seq_ref,  # [NB] int32: the sequence of query block b
    block_idx_ref,  # [NB] int32: its index within the sequence's chunk; -1 past the last block
    num_splits_ref,  # [1] int32: splits this batch uses (<= max_splits)
    window_ref,  # [2] int32: the effective sliding window and attention chunk (INT32_MAX: none)
    kv_lens_ref,  # [R] int32
    tables_ref,  # [R * M] int32, flattened block tables
    cu_q_lens_ref,  # [R+1] int32
    q_ref,  # [Hkv, (T + Bq) * Gp, D]
    k_ref,  # [P * ps * Hkv, D]: one row per (slot, kv head)
    v_ref,  # [P * ps * Hkv, D]
    *refs,  # quantized: k/v scales [P * ps * Hkv]; with has_until: until [(T + Bq) * Gp] int32;
    # then aliased initial outputs, then the outputs
    block_q: int,
    num_blocks: int,
    group_padded: int,
    block_k: int,
    page_size: int,
    max_pages: int,
    num_kv_heads: int,
    pieces: tuple[tuple[int, int], ...],
    sm_scale: float,
    has_window: bool,
    soft_cap: float | None,
    split: bool,
    quantized: bool,
    has_chunk: bool = False,
    has_until: bool = False,
):
    # Unsplit: (o_init, o) with o [Hkv, rows, D] in q's dtype, normalised.
    # Split: (lse_init, o_part, lse) with o_part [S, Hkv, rows, D] f32, lse [S, Hkv, rows] f32.
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    refs = refs[2:] if quantized else refs
    until_ref = refs[0] if has_until else None
    refs = refs[1:] if has_until else refs
    o_ref, lse_ref = refs[1], (refs[2] if split else None)
    item, h = pl.program_id(0), pl.program_id(1)
    num_splits = num_splits_ref[0]
    # Data, not a constant: one kernel serves the sliding-window and global layers of a scan.
    sliding_window = window_ref[0] if has_window else None
    attention_chunk = window_ref[1] if has_chunk else None  # Llama 4's chunked local attention
    b, s = item // num_splits, item % num_splits
    b_safe = jnp.minimum(b, num_blocks - 1)
    r = block_seq_ref[b_safe]
    j = jnp.where(b < num_blocks, block_idx_ref[b_safe], -1)

    @pl.when(j >= 0)
    def _():
        q_start = cu_q_lens_ref[r]
        q_len = cu_q_lens_ref[r + 1] - q_start
        kv_len = kv_lens_ref[r]
        first = j * block_q  # first query of this block, within the sequence's chunk
        block_rows = block_q * group_padded
        row0 = (q_start + first) * group_padded
        qs = [q_ref[h, pl.ds(row0, block_rows), pl.ds(off, w)] for off, w in pieces]  # [BM, w] each
        tok = first + jnp.arange(block_rows, dtype=jnp.int32) // group_padded  # [BM]
        row_valid = tok < q_len
        row_pos = kv_len - q_len + tok  # [BM]
        row_hi = row_pos  # [BM] last key a row sees: its position, or up to its attend_until
        # Keys this block can see: [lo, hi), then this program's share of them.
        hi = kv_len - q_len + jnp.minimum(first + block_q, q_len)
        if until_ref is not None:
            row_hi = jnp.minimum(jnp.maximum(row_pos, until_ref[pl.ds(row0, block_rows)]), kv_len - 1)
            hi = jnp.maximum(hi, jnp.max(jnp.where(row_valid, row_hi, 0)) + 1)  # the block's largest limit
        lo = jnp.int32(0)
        if sliding_window is not None:
            lo = jnp.maximum(kv_len - q_len + first - sliding_window + 1, 0)
        if attention_chunk is not None:
            lo = jnp.maximum(lo, window.chunk_start(kv_len - q_len + first, attention_chunk))
        if sliding_window is not None or attention_chunk is not None:
            lo = (lo // block_k) * block_k
        blocks = (hi - lo + block_k - 1) // block_k
        per_split = (blocks + num_splits - 1) // num_splits
        start = lo + s * per_split * block_k
        num_iters = jnp.clip((hi - start + block_k - 1) // block_k, 0, per_split)
        precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

        def body(i, carry):
            m, denom, accs = carry  # [BM], [BM], [BM, w] f32 per piece
            k_pos = start + i * block_k + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
            live = k_pos < kv_len  # slots past kv_len may hold anything, even NaN
            page_idx = jnp.minimum(k_pos // page_size, max_pages - 1)
            pages = tables_ref[r * max_pages + page_idx]  # [BK]
            rows = (pages * page_size + k_pos % page_size) * num_kv_heads + h  # [BK]
            ks, vs = [], []
            zero = 0.0 if jnp.issubdtype(k_ref.dtype, jnp.floating) else 0  # int8 pages load int zeros
            for off, w in pieces:
                at = (rows[:, None], off + jnp.arange(w, dtype=jnp.int32)[None, :])
                mask = jnp.broadcast_to(live[:, None], (block_k, w))
                ks.append(plgpu.load(k_ref.at[at], mask=mask, other=zero))  # [BK, w]
                vs.append(plgpu.load(v_ref.at[at], mask=mask, other=zero))
            if quantized:  # widen to the query dtype (exact), scale scores and weights below
                ks = [k.astype(q_ref.dtype) for k in ks]
                vs = [v.astype(q_ref.dtype) for v in vs]
                k_scale = plgpu.load(ks_ref.at[rows], mask=live, other=0.0)  # [BK] f32
                v_scale = plgpu.load(vs_ref.at[rows], mask=live, other=0.0)
            s_ = sum(plgpu.dot(q, k, trans_b=True, precision=precision) for q, k in zip(qs, ks))
            s_ = s_ * (k_scale[None, :] * sm_scale if quantized else sm_scale)  # [BM, BK] f32
            if soft_cap is not None:
                s_ = soft_cap * jnp.tanh(s_ / soft_cap)
            mask = (k_pos[None, :] <= row_hi[:, None]) & live[None, :]
            if sliding_window is not None:
                mask &= row_pos[:, None] - k_pos[None, :] < sliding_window
            if attention_chunk is not None:
                mask &= k_pos[None, :] >= window.chunk_start(row_pos, attention_chunk)[:, None]
            s_ = jnp.where(mask, s_, _MASKED)
            m_new = jnp.maximum(m, s_.max(axis=1))
            p = jnp.where(mask, jnp.exp(s_ - m_new[:, None]), 0.0)  # [BM, BK]
            alpha = jnp.exp(m - m_new)
            pw = p * v_scale[None, :] if quantized else p  # the weights of the values as stored
            pv = [plgpu.dot(pw.astype(v.dtype), v, precision=precision) for v in vs]  # [BM, w] f32
            accs = tuple(alpha[:, None] * a + x for a, x in zip(accs, pv))
            return m_new, alpha * denom + p.sum(axis=1), accs

        m0 = jnp.full((block_rows,), _MASKED, jnp.float32)
        l0 = jnp.zeros((block_rows,), jnp.float32)
        acc0 = tuple(jnp.zeros((block_rows, w), jnp.float32) for _, w in pieces)
        m, denom, accs = jax.lax.fori_loop(0, num_iters, body, (m0, l0, acc0))
        inv = 1.0 / jnp.where(denom == 0.0, 1.0, denom)
        if split:
            lse = jnp.where(denom == 0.0, -jnp.inf, m + jnp.log(jnp.where(denom == 0.0, 1.0, denom)))
            plgpu.store(lse_ref.at[s, h, pl.ds(row0, block_rows)], lse, mask=row_valid)
        for (off, w), acc in zip(pieces, accs):
            out = acc * inv[:, None]
            mask = jnp.broadcast_to(row_valid[:, None], (block_rows, w))
            dst = o_ref.at[s, h, pl.ds(row0, block_rows), pl.ds(off, w)] if split else \
                o_ref.at[h, pl.ds(row0, block_rows), pl.ds(off, w)]
            plgpu.store(dst, out.astype(dst.dtype), mask=mask)


def default_block_q(num_tokens: int, num_seqs_max: int, group_padded: int) -> int:
    """Query tokens per program: 16 rows for decode-like batches, 64 rows otherwise."""
    rows = 16 if _decode_like(num_tokens, num_seqs_max) else 64
    return max(1, rows // group_padded)


def default_max_splits(num_tokens: int, num_seqs_max: int) -> int:
    """KV splits the kernel may use: up to 32 for decode-like batches (bounded so the f32
    partials stay small), 1 (no partials, no combine) for prefill-like ones."""
    if not _decode_like(num_tokens, num_seqs_max):
        return 1
    return max(1, min(_MAX_SPLITS, 1 << (max(1, _SPLIT_TOKEN_BUDGET // num_tokens).bit_length() - 1)))


def _decode_like(num_tokens: int, num_seqs_max: int) -> bool:
    return num_tokens <= 2 * num_seqs_max


def block_schedule(cu_q_lens: jax.Array, num_seqs: jax.Array, num_blocks: int, block_q: int,
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sequence, block index or -1, number of real blocks) of each of `num_blocks` grid slots."""
    num_rows = cu_q_lens.shape[0] - 1
    real = jnp.arange(num_rows) < num_seqs[0]
    q_lens = jnp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0)  # [R]
    per_seq = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(per_seq)  # [R]
    b = jnp.arange(num_blocks, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, b, side="right"), num_rows - 1).astype(jnp.int32)
    idx = b - (ends[seq] - per_seq[seq])
    total = ends[-1]
    return seq, jnp.where(b < total, idx, -1).astype(jnp.int32), total.astype(jnp.int32)


def _combine(o_part: jax.Array, lse: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Merge split partials: [S, Hkv, rows, D] f32 and [S, Hkv, rows] -> [Hkv, rows, D] f32.
    Rows no split wrote (padding) come out zero. `sinks` [Hkv, rows] (each row's head's sink
    logit): the row's weights shrink by sigmoid(lse - sink), its keys' share of a softmax
    that has the sink as one more entry."""
    top = lse.max(axis=0)  # [Hkv, rows]
    safe_top = jnp.where(jnp.isfinite(top), top, 0.0)
    w = jnp.exp(lse - safe_top)  # -inf (empty split) -> 0
    total = w.sum(axis=0)
    out = jnp.where(w[..., None] > 0.0, w[..., None] * o_part, 0.0).sum(axis=0)
    out = out / jnp.where(total == 0.0, 1.0, total)[..., None]
    if sinks is not None:
        row_lse = safe_top + jnp.log(jnp.where(total == 0.0, 1.0, total))
        out = out * jax.nn.sigmoid(row_lse - sinks)[..., None]
    return out


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "soft_cap",
        "block_q",
        "block_k",
        "max_splits",
        "num_warps",
        "num_stages",
        "interpret",
        "batch_invariant",
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
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    max_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
    k_scales: jax.Array | None = None,  # quantized pages: [num_pages, page_size, Hkv] f32
    v_scales: jax.Array | None = None,
    batch_invariant: bool = False,
    sinks: jax.Array | None = None,  # [Hq] f32
    attention_chunk: int | jax.Array | None = None,  # Llama 4's chunked local attention (<= 0: none)
    attend_until: jax.Array | None = None,  # [T] int32: a token's last key max(p, this), <= kv_len - 1
) -> jax.Array:  # [T, Hq, D]
    """Triton (Pallas) ragged paged attention; same contract as the reference.

    `sinks` (gpt-oss) are applied where the split partials merge, from each row's
    log-sum-exp: a batch with sinks always takes the split path (one split at least).

    `batch_invariant`: one block shape (16 query rows) and no KV split whatever the batch, so
    a row's sums never depend on the batch around it (the split count is otherwise data: it
    grows as the batch shrinks).

    `sliding_window` (an int, or an int32 array of shape [] or [1], <= 0: none) is a kernel
    input read as a scalar either way: an int is a traced argument of this jit, so layers with
    different windows share one compiled kernel. Only None compiles the mask away.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_rows, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    group_padded = _next_pow2(group)
    wide = num_kv_heads == 1 and block_q is not None and block_q == latent_block_q(head_dim, num_q_heads)
    if not supports(head_dim) and not wide:
        raise ValueError(f"GPU kernel needs head_dim in [16, 256], a multiple of 16 (or one KV head with "
                         f"block_q=latent_block_q(...)); got {head_dim}")
    pieces = head_dim_pieces(head_dim)
    if batch_invariant:
        block_q, max_splits = block_q or max(1, 16 // group_padded), 1
    if block_q is None:
        block_q = default_block_q(num_tokens, num_rows, group_padded)
    if block_q * group_padded < 16 or block_q != _next_pow2(block_q):
        raise ValueError(f"block_q={block_q} must be a power of two with block_q*Gp >= 16")
    block_rows = block_q * group_padded
    block_k = block_k or (32 if head_dim > 128 or block_rows > 64 else 64)
    num_warps = num_warps or (8 if head_dim > 128 or block_rows >= 64 else 4)
    max_splits = max_splits or default_max_splits(num_tokens, num_rows)
    num_blocks = math.ceil(num_tokens / block_q) + min(num_rows, num_tokens)
    block_seq, block_idx, real_blocks = block_schedule(cu_q_lens.astype(jnp.int32), num_seqs, num_blocks, block_q)
    wanted = (_TARGET_PROGRAMS + real_blocks * num_kv_heads - 1) // jnp.maximum(real_blocks * num_kv_heads, 1)
    num_splits = jnp.clip(wanted, 1, max_splits).astype(jnp.int32).reshape(1)
    # Work items: blocks x splits, at most blocks x max_splits, and at most
    # ceil(target / Hkv) + blocks whenever more than one split runs.
    num_items = min(num_blocks * max_splits, num_blocks + -(-_TARGET_PROGRAMS // num_kv_heads))

    # [T, Hq, D] -> [Hkv, (T + Bq) * Gp, D]: rows of one KV head contiguous, token-major.
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_padded - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
    k_rows = k_pages.reshape(num_pages * page_size * num_kv_heads, head_dim)
    v_rows = v_pages.reshape(num_pages * page_size * num_kv_heads, head_dim)
    quantized = k_scales is not None
    scales = (k_scales.reshape(-1).astype(jnp.float32), v_scales.reshape(-1).astype(jnp.float32)) if quantized \
        else ()
    until_in = ()
    if attend_until is not None:  # [T] -> [(T + Bq) * Gp], laid out like q's rows
        until = jnp.pad(attend_until.astype(jnp.int32), (0, block_q))
        until_in = (jnp.repeat(until, group_padded),)
    init_at = 10 + len(scales) + len(until_in)  # operand index of the aliased initial output
    split = max_splits > 1 or sinks is not None  # (the row log-sum-exps carry the sinks)
    if split:
        lse_shape = (max_splits, num_kv_heads, qg.shape[1])
        init = jnp.full(lse_shape, -jnp.inf, jnp.float32)
        out_shape = (jax.ShapeDtypeStruct((max_splits, *qg.shape), jnp.float32),
                     jax.ShapeDtypeStruct(lse_shape, jnp.float32))
        aliases = {init_at: 1}
    else:
        init = jnp.zeros(qg.shape, q.dtype)  # rows no program writes (padding) stay zero
        out_shape = (jax.ShapeDtypeStruct(qg.shape, q.dtype),)
        aliases = {init_at: 0}

    kernel = functools.partial(
        _kernel,
        block_q=block_q,
        num_blocks=num_blocks,
        group_padded=group_padded,
        block_k=block_k,
        page_size=page_size,
        max_pages=max_pages,
        num_kv_heads=num_kv_heads,
        pieces=pieces,
        sm_scale=sm_scale,
        has_window=sliding_window is not None,
        has_chunk=attention_chunk is not None,
        has_until=attend_until is not None,
        soft_cap=soft_cap,
        split=split,
        quantized=quantized,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        block_seq,
        block_idx,
        num_splits,
        window.bounds_array(sliding_window, attention_chunk),
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        qg,
        k_rows,
        v_rows,
        *scales,
        *until_in,
        init,
    )
    sink_rows = None
    if sinks is not None:  # [Hq] -> [Hkv, (T + Bq) * Gp], each row its head's sink
        per_head = jnp.pad(sinks.astype(jnp.float32).reshape(num_kv_heads, group), ((0, 0), (0, group_padded - group)))
        sink_rows = jnp.tile(per_head, (1, num_tokens + block_q))
    out = _combine(*outs, sink_rows).astype(q.dtype) if split else outs[0]  # [Hkv, (T + Bq) * Gp, D]
    out = out.reshape(num_kv_heads, num_tokens + block_q, group_padded, head_dim)
    out = out[:, :num_tokens, :group].transpose(1, 0, 2, 3)
    return out.reshape(num_tokens, num_q_heads, head_dim)
