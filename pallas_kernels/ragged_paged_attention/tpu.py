"""Ragged paged attention for TPUs: a Mosaic kernel written in Pallas.

Grid: one program per block of `block_q` consecutive tokens of the flat batch (blocks are
aligned to the token axis, not to sequences, so the q/out BlockSpecs stay tile aligned).
A program walks the sequences that overlap its block; for each it walks that sequence's
KV chunks (`chunk_pages` pages) through the scalar-prefetched block table, copying pages
from HBM into a double-buffered VMEM scratch with manual async DMAs (the next chunk, or the
next sequence's first chunk, is in flight while the current one is used), and runs an
online softmax per KV head in f32 VMEM scratch. Rows of the block that belong to the sequence are then written into the output
block with a masked select; rows of no sequence (padding) keep the zeros written first. A
sequence whose rows in the block fit one aligned 8-token sub-block (every decode) computes
those 8 * G rows only, not all block_q * G.

The cache is in the lanes layout (`pallas_kernels.kv_layout`): a page is `[ps, C]`, the
token's heads side by side in C lanes. Each page is copied whole into a VMEM buffer
`[2, Cp, ps, C]`; KV head h is then the aligned lane window that holds it
(`buf[slot, :, :, w:w+W]`, W = max(D, 128)), a plain tile-aligned load for 32- and 16-bit
data alike. With D < 128 the window also holds other heads: the query arrives placed in
its KV head's lanes of a W-lane row (zeros elsewhere), so q.k sums only its own head's
lanes, and of the W output lanes the wrapper keeps the head's own. Selects that broadcast a
row mask across lanes run in f32 (Mosaic cannot broadcast across lanes of packed 16-bit
rows when the head group is odd).

Quantized pages (int8, float8_e4m3fn, float8_e5m2; `pallas_kernels.kv_quant`) come with f32
scales `[Hkv, ceil(P * ps / 128), 128]` (`kv_layout.kv_scales_shape`, lanes layout: slot s of
head h at `[h, s // 128, s % 128]`). With each page, the row(s) of every head holding its
scales are DMAed beside it; the chunk's scales are assembled into `[Hkv, chunk]` rows (keys in
the lanes) by rotating each page's `ps` lanes into place (`pltpu.roll`, a dynamic lane
rotate: the page's offset in its row depends on its id). Keys and values are widened to the
query's compute dtype in VMEM (exact), the scores of each key multiplied by its K scale and
each softmax weight by its key's V scale before P.V (the denominator sums the unscaled
weights): no dequantized page is written anywhere.

Only chunks a sequence's rows can see are visited (its window start to its last position
in the block), and only pages inside the block table are fetched (indices are clamped), so
nothing is read out of bounds.

`attend_until` (Gemma 3's image tokens, [T] int32) arrives expanded per row (token * G + g,
like the sinks) as a VMEM input block; a row then sees keys up to min(max(p, until), kv_len
- 1), and a sequence visits chunks up to the block's largest limit (scalar prefetch) when that
is past its last query.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.kv_layout import LANE, head_window, lanes_supported, lanes_width
from pallas_kernels.ragged_paged_attention import window

_MASKED = -1e30
_SUB = 8  # tokens: the row granularity of a sequence's work within a token block
# The block table is a scalar-prefetched operand: all of it sits in SMEM, 1 MiB on v5e, v5p and
# v6e (`pltpu.get_tpu_info().smem_capacity_bytes`). Compiled with libtpu 0.0.42.1: a 1008 KiB
# table fits on v6e (also with 256 sequences and 8192 tokens' other scalars; v5e was compiled up
# to 768 KiB), a 1024 KiB one fails on both (XLA:TPU's RESOURCE_EXHAUSTED, 3.1 KiB over). The
# rest of SMEM holds the other scalar operands ([R] lengths, [R + 1] offsets, a word per query
# block) and Mosaic's own words; 16 KiB is kept for them.
SMEM_BYTES = 1 << 20
SMEM_RESERVED_BYTES = 16 << 10


def max_table_entries() -> int:
    """The most block-table entries (max_num_seqs x pages per sequence) the kernel holds."""
    return (SMEM_BYTES - SMEM_RESERVED_BYTES) // 4


def table_fits(num_seqs: int, pages_per_seq: int) -> bool:
    return num_seqs * pages_per_seq <= max_table_entries()


def supports(num_kv_heads: int, head_dim: int, dtype=jnp.float32) -> bool:
    """Whether the kernel compiles for this cache layout on a real TPU: any KV head count,
    f32 or bf16, D in {64, 128, 256} (checked with libtpu by scripts/check_kernel_compile.py)."""
    del num_kv_heads, dtype
    return head_dim in (64, 128, 256)


def quantized_dtypes(device_kind: str | None = None) -> tuple:
    """Quantized page dtypes the kernel reads on `device_kind` (None: any generation). All
    three compile with libtpu 0.0.42.1 for v4, v5e, v5p and v6e (compile-only devices; fp8 is
    widened to the query dtype in VMEM, so chips without fp8 arithmetic take it too); no
    generation refuses one, so `device_kind` changes nothing yet."""
    del device_kind
    return (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def scales_page_size_ok(page_size: int) -> bool:
    """A page's scales lie in one 128-lane row of the scales (S divides 128) or in whole rows
    (128 divides S): the kernel DMAs rows."""
    return page_size > 0 and (LANE % page_size == 0 or page_size % LANE == 0)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,  # [R] int32
    tables_ref,  # [R * M] int32, flattened block tables
    cu_q_lens_ref,  # [R+1] int32
    num_seqs_ref,  # [1] int32
    window_ref,  # [2] int32: the effective sliding window and attention chunk (INT32_MAX: none);
    # with attend_until, then each query block's largest attend_until ([2 + num_blocks])
    # inputs
    q_ref,  # [Bq, Hq, W] VMEM block of the token axis, each head in its KV head's lanes
    k_hbm,  # [P, ps, C] HBM
    v_hbm,
    *refs,
    sm_scale: float,
    has_window: bool,
    soft_cap: float | None,
    max_pages: int,
    num_kv_heads: int,
    head_dim: int,
    quantized: bool,
    has_sinks: bool = False,
    has_chunk: bool = False,
    has_until: bool = False,
):
    # Quantized pages add inputs ks_hbm, vs_hbm ([Hkv, N, 128] f32 HBM) and scratch ks_buf,
    # vs_buf ([2, Hkv, Cp * R, 128] f32 VMEM: R rows of 128 scales per page and head).
    # o_ref: [Bq, Hq, W] output; k_buf, v_buf: [2, Cp, ps, C] VMEM (double-buffered chunks of
    # whole pages); sems: DMA semaphores [2, 2 or 4] (buffer slot, k/v/k scales/v scales);
    # m_ref, l_ref: [Hkv, Bq * G, 1] f32; acc_ref: [Hkv, Bq * G, W] f32.
    # With sinks, one more input: sink_ref [Hkv, Bq * G, 1] f32 (each row's head's sink logit).
    # With attend_until, one more: until_ref [Bq * G, 1] int32 (each row's token's limit).
    refs = list(refs)
    ks_hbm, vs_hbm = (refs.pop(0), refs.pop(0)) if quantized else (None, None)
    sink_ref = refs.pop(0) if has_sinks else None
    until_ref = refs.pop(0) if has_until else None
    if quantized:
        o_ref, k_buf, v_buf, sems, ks_buf, vs_buf, m_ref, l_ref, acc_ref = refs
    else:
        o_ref, k_buf, v_buf, sems, m_ref, l_ref, acc_ref = refs
    block_q, num_q_heads, width = q_ref.shape
    _, chunk_pages, page_size, _ = k_buf.shape
    group = num_q_heads // num_kv_heads
    chunk = chunk_pages * page_size
    blk_start = pl.program_id(0) * block_q
    blk_end = blk_start + block_q
    num_seqs = num_seqs_ref[0]
    # Data, not a constant: one kernel serves the sliding-window and global layers of a scan.
    sliding_window = window_ref[0] if has_window else None
    attention_chunk = window_ref[1] if has_chunk else None  # Llama 4's chunked local attention
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    # First sequence that ends after the block start (scalar loop over <= R entries).
    first_seq = jax.lax.while_loop(
        lambda s: (s < num_seqs) & (cu_q_lens_ref[s + 1] <= blk_start), lambda s: s + 1, 0
    )

    scale_rows_per_page = max(1, page_size // LANE)  # R

    def chunk_page(seq, c, p):
        return tables_ref[seq * max_pages + jnp.minimum(c * chunk_pages + p, max_pages - 1)]

    def chunk_copies(seq, c, slot):
        copies = []
        for p in range(chunk_pages):
            page = chunk_page(seq, c, p)
            for kv, (src, dst) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                copies.append(pltpu.make_async_copy(src.at[page], dst.at[slot, p], sems.at[slot, kv]))
            if quantized:  # the row(s) of every head holding this page's scales
                r = scale_rows_per_page
                row = page * page_size // LANE
                for kv, (src, dst) in enumerate(((ks_hbm, ks_buf), (vs_hbm, vs_buf))):
                    copies.append(pltpu.make_async_copy(src.at[:, pl.ds(row, r), :], dst.at[slot, :, pl.ds(p * r, r), :],
                                                        sems.at[slot, 2 + kv]))
        return copies

    def chunk_scales(buf, seq, c, slot):
        """[Hkv, chunk] f32: the chunk's scales per head, keys in the lanes."""
        rows = chunk_pages * scale_rows_per_page
        if page_size >= LANE:  # whole rows per page, in key order
            parts = [buf[slot, :, r, :] for r in range(rows)]  # [Hkv, 128] each
            return jnp.concatenate(parts, axis=1) if rows > 1 else parts[0]
        per_row = LANE // page_size
        lane = jax.lax.broadcasted_iota(jnp.int32, (num_kv_heads, LANE), 1)
        groups = []
        for g0 in range(0, chunk_pages, per_row):
            acc = jnp.zeros((num_kv_heads, LANE), jnp.float32)
            for j, p in enumerate(range(g0, min(g0 + per_row, chunk_pages))):
                # The page's ps scales sit at lanes [(page * ps) % 128, + ps) of its row: rotate
                # them to lanes [j * ps, (j + 1) * ps) of this group.
                at = (chunk_page(seq, c, p) * page_size) % LANE
                shifted = pltpu.roll(buf[slot, :, p, :], (j * page_size - at + LANE) % LANE, 1)
                acc = jnp.where((lane >= j * page_size) & (lane < (j + 1) * page_size), shifted, acc)
            groups.append(acc)
        out = jnp.concatenate(groups, axis=1) if len(groups) > 1 else groups[0]
        return out[:, :chunk] if out.shape[1] != chunk else out

    def in_block(s):  # sequence s is real and has rows in this block
        return (s < num_seqs) & (cu_q_lens_ref[jnp.minimum(s, num_seqs)] < blk_end)

    def kv_chunks(seq):
        """(q_start, q_end, ctx, first chunk, end chunk) of a sequence in this block."""
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        ctx = kv_lens_ref[seq] - (q_end - q_start)  # position of the sequence's first query
        hi = ctx + jnp.minimum(q_end, blk_end) - q_start  # last visible key + 1
        if has_until:  # rows may see past their positions: up to the block's largest limit
            hi = jnp.maximum(hi, jnp.minimum(window_ref[2 + pl.program_id(0)] + 1, kv_lens_ref[seq]))
        lo_chunk = jnp.int32(0)
        first_pos = ctx + jnp.maximum(q_start, blk_start) - q_start
        if sliding_window is not None:
            lo_chunk = jnp.maximum(first_pos - sliding_window + 1, 0) // chunk
        if attention_chunk is not None:
            lo_chunk = jnp.maximum(lo_chunk, window.chunk_start(first_pos, attention_chunk) // chunk)
        return q_start, q_end, ctx, lo_chunk, (hi + chunk - 1) // chunk

    def attend(seq, first_slot, tok0, ntok: int):
        """The sequence's attention for the `ntok` block tokens from `tok0` (a multiple of
        8): rows `[tok0 * G, (tok0 + ntok) * G)` of the block. Returns the buffer slot the
        next sequence's first chunk went to."""
        nrows = ntok * group
        r0 = pl.multiple_of(tok0 * group, 8) if isinstance(tok0, jax.Array) else tok0 * group
        t0 = pl.multiple_of(tok0, 8) if isinstance(tok0, jax.Array) else tok0
        q_start, q_end, ctx, lo_chunk, hi_chunk = kv_chunks(seq)
        row_tok = blk_start + t0 + jax.lax.broadcasted_iota(jnp.int32, (nrows, 1), 0) // group  # [N, 1]
        in_seq = (row_tok >= q_start) & (row_tok < q_end)  # [N, 1]
        row_pos = ctx + row_tok - q_start  # [N, 1]
        kv_len = ctx + q_end - q_start
        has_next = in_block(seq + 1)
        next_seq = jnp.minimum(seq + 1, num_seqs - 1)  # clamped: read only when has_next
        rows_of = pl.ds(r0, nrows)
        row_hi = row_pos  # [N, 1] last key a row sees: its position, or up to its attend_until
        if until_ref is not None:
            row_hi = jnp.minimum(jnp.maximum(row_pos, until_ref[rows_of, :]), kv_len - 1)

        m_ref[...] = jnp.full(m_ref.shape, _MASKED, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        def chunk_body(c, slot):
            @pl.when(c + 1 < hi_chunk)
            def _():
                for cp in chunk_copies(seq, c + 1, 1 - slot):
                    cp.start()

            # The last chunk: the next sequence's first one goes in flight meanwhile, so a
            # block of decodes (one chunk each) does not wait on every sequence's first DMA.
            @pl.when((c + 1 == hi_chunk) & has_next)
            def _():
                for cp in chunk_copies(next_seq, kv_chunks(next_seq)[3], 1 - slot):
                    cp.start()

            for cp in chunk_copies(seq, c, slot):
                cp.wait()
            k_pos = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (nrows, chunk), 1)
            mask = in_seq & (k_pos <= row_hi)  # [N, S]
            if sliding_window is not None:
                mask &= row_pos - k_pos < sliding_window
            if attention_chunk is not None:
                mask &= k_pos >= window.chunk_start(row_pos, attention_chunk)
            # Slots past the context may hold anything (NaN too): p is 0 there, 0 * NaN is not.
            live = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, width), 0) < kv_len  # [S, W]
            if quantized:
                k_sc = chunk_scales(ks_buf, seq, c, slot)  # [Hkv, S]
                live_keys = c * chunk + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1) < kv_len
                v_sc = jnp.where(live_keys, chunk_scales(vs_buf, seq, c, slot), 0.0)
            for h in range(num_kv_heads):
                q = q_ref[pl.ds(t0, ntok), h * group : (h + 1) * group, :]  # [ntok, G, W]
                if q.dtype.itemsize < 4 and group % (4 // q.dtype.itemsize):
                    # Packed rows cannot fold an odd head group into sublanes: go via f32.
                    q = q.astype(jnp.float32)
                q = q.reshape(nrows, width)  # [N, W], row = token * G + head
                # The lane window of head h in every slot of the chunk: [Cp, ps, W] -> [S, W].
                w0, _, _ = head_window(h, head_dim)
                k = k_buf[slot, :, :, w0 : w0 + width].reshape(chunk, width)
                v = v_buf[slot, :, :, w0 : w0 + width].reshape(chunk, width)
                if quantized:  # widened to the query's compute dtype (exact for int8 and fp8)
                    k, v = k.astype(q.dtype), v.astype(q.dtype)
                v = jnp.where(live, v, jnp.zeros_like(v))
                if q.dtype != k.dtype:
                    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
                s = jax.lax.dot_general(
                    q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )  # [N, S]
                s = s * (k_sc[h : h + 1, :] * sm_scale if quantized else sm_scale)
                if soft_cap is not None:
                    s = soft_cap * jnp.tanh(s / soft_cap)
                s = jnp.where(mask, s, _MASKED)
                m_prev = m_ref[h, rows_of, :]  # [N, 1]
                m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)  # [N, S]
                alpha = jnp.exp(m_prev - m_new)
                m_ref[h, rows_of, :] = m_new
                l_ref[h, rows_of, :] = alpha * l_ref[h, rows_of, :] + p.sum(axis=1, keepdims=True)
                if quantized:  # the weights of the values as stored (l summed the unscaled ones)
                    p = p * v_sc[h : h + 1, :]
                pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
                acc_ref[h, rows_of, :] = alpha * acc_ref[h, rows_of, :] + pv
            return 1 - slot

        end_slot = jax.lax.fori_loop(lo_chunk, hi_chunk, chunk_body, first_slot)
        for h in range(num_kv_heads):
            denom = l_ref[h, rows_of, :]
            acc = acc_ref[h, rows_of, :]
            if sink_ref is not None:  # the sink joins the denominator, rescaled to the larger max
                m = m_ref[h, rows_of, :]
                sink = sink_ref[h, rows_of, :]
                top = jnp.maximum(m, sink)
                scale = jnp.where(denom > 0.0, jnp.exp(m - top), 0.0)
                acc = acc * scale
                denom = jnp.where(denom > 0.0, denom * scale + jnp.exp(sink - top), 0.0)
            out = acc / jnp.where(denom == 0.0, 1.0, denom)  # [N, W]
            out = jnp.where(in_seq, out, 0.0).reshape(ntok, group, width)
            keep = in_seq.reshape(ntok, group, 1)
            cur = o_ref[pl.ds(t0, ntok), h * group : (h + 1) * group, :]
            # The select runs in f32: Mosaic cannot broadcast a mask across lanes of packed
            # 16-bit rows when the head group is odd.
            merged = jnp.where(keep, out, cur.astype(jnp.float32))
            o_ref[pl.ds(t0, ntok), h * group : (h + 1) * group, :] = merged.astype(cur.dtype)
        return end_slot

    def seq_body(carry):
        seq, first_slot = carry  # the sequence's first chunk is already in flight into first_slot
        if block_q <= _SUB:
            return seq + 1, attend(seq, first_slot, 0, block_q)
        # A sequence whose rows in this block lie in one aligned 8-token sub-block (every
        # decode) computes only those 8 * G rows, not the block's block_q * G.
        t_lo = jnp.maximum(cu_q_lens_ref[seq], blk_start) - blk_start
        t_hi = jnp.minimum(cu_q_lens_ref[seq + 1], blk_end) - blk_start
        sub = t_lo // _SUB
        end_slot = jax.lax.cond(
            sub == (t_hi - 1) // _SUB,
            lambda: attend(seq, first_slot, sub * _SUB, _SUB),
            lambda: attend(seq, first_slot, 0, block_q),
        )
        return seq + 1, end_slot

    @pl.when(in_block(first_seq))
    def _():
        for cp in chunk_copies(first_seq, kv_chunks(first_seq)[3], 0):
            cp.start()

    jax.lax.while_loop(lambda carry: in_block(carry[0]), seq_body, (first_seq, jnp.int32(0)))


# VMEM for the K and V double buffers together; the rest of the scoped VMEM (16 MiB by
# default on v5e) holds the q/out blocks and the f32 softmax state.
_KV_BUFFER_BYTES = 4 * 2**20


def _default_chunk_pages(page_size: int, lanes: int, dtype) -> int:
    """Pages per chunk: 128 tokens where the double buffers fit `_KV_BUFFER_BYTES`, fewer for
    wide rows (a page is `[ps, C]`, C a multiple of 128: no tile padding)."""
    page_bytes = page_size * lanes * jnp.dtype(dtype).itemsize
    fit = _KV_BUFFER_BYTES // (4 * page_bytes)  # 2 slots x K and V
    return max(1, min(128 // page_size, fit))


def _lane_slot_mask(num_q_heads: int, group: int, per: int) -> jax.Array:
    """[Hq, per]: which of its lane window's `per` head slots each query head's KV head has."""
    slot = (jnp.arange(num_q_heads) // group) % per
    return slot[:, None] == jnp.arange(per)[None, :]


def _head_lanes(x: jax.Array, group: int, head_dim: int) -> jax.Array:
    """q [T, Hq, D] -> [T, Hq, 128]: each query head at its KV head's offset in the lane
    window, zeros elsewhere (D < 128 only)."""
    t, hq, d = x.shape
    per = LANE // d
    sel = _lane_slot_mask(hq, group, per)
    return jnp.where(sel[None, :, :, None], x[:, :, None, :], 0).reshape(t, hq, per * d)


def _own_lanes(x: jax.Array, group: int, head_dim: int) -> jax.Array:
    """[T, Hq, 128] kernel output -> [T, Hq, D]: each head's own lanes (D < 128 only)."""
    t, hq, w = x.shape
    per = w // head_dim
    sel = _lane_slot_mask(hq, group, per)
    return jnp.where(sel[None, :, :, None], x.reshape(t, hq, per, head_dim), 0).sum(2, dtype=x.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "num_kv_heads",
        "sm_scale",
        "soft_cap",
        "block_q",
        "chunk_pages",
        "interpret",
    ),
)
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, C] (lanes layout)
    v_pages: jax.Array,  # [num_pages, page_size, C]
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [R+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    num_kv_heads: int,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    block_q: int = 32,
    chunk_pages: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
    k_scales: jax.Array | None = None,  # quantized pages: [Hkv, ceil(P * ps / 128), 128] f32
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [Hq] f32 (gpt-oss): one more softmax entry per head, no value
    attention_chunk: int | jax.Array | None = None,  # Llama 4's chunked local attention (<= 0: none)
    attend_until: jax.Array | None = None,  # [T] int32: a token's last key max(p, this), <= kv_len - 1
) -> jax.Array:  # [T, Hq, D]
    """Mosaic (Pallas TPU) ragged paged attention over the lanes layout; same contract as
    the reference (which reads either layout).

    `interpret` may be True (generic interpreter) or a `pltpu.InterpretParams()` (TPU
    interpreter that simulates DMAs/semaphores and checks out-of-bounds accesses).
    `sliding_window` (an int, or an int32 array of shape [] or [1], <= 0: none) reaches the
    kernel by scalar prefetch either way: an int is a traced argument of this jit, so layers
    with different windows share one compiled kernel. Only None compiles the mask away.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, lanes = k_pages.shape
    num_rows, max_pages = block_tables.shape
    group = num_q_heads // num_kv_heads
    if not table_fits(num_rows, max_pages):
        raise ValueError(
            f"block_tables [{num_rows}, {max_pages}] ({num_rows * max_pages * 4 / 2**10:.0f} KiB) do not fit the TPU "
            f"kernel's SMEM ({max_table_entries() * 4 // 2**10} KiB for the table): use larger pages (fewer per "
            "sequence), fewer sequences or a shorter max_model_len")
    if lanes != lanes_width(num_kv_heads, head_dim) or not lanes_supported(head_dim):
        raise ValueError(f"k_pages rows of {lanes} lanes do not hold {num_kv_heads} heads of D={head_dim} "
                         "in the lanes layout")
    _, width, _ = head_window(0, head_dim)
    quantized = k_scales is not None
    if quantized and not scales_page_size_ok(page_size):
        raise ValueError(f"quantized pages need page_size dividing 128 or a multiple of 128, got {page_size}")
    if chunk_pages is None:
        chunk_pages = _default_chunk_pages(page_size, lanes, k_pages.dtype)
    chunk_pages = min(chunk_pages, max_pages)
    block_q = min(block_q, max(8, 1 << (num_tokens - 1).bit_length()))
    padded_tokens = math.ceil(num_tokens / block_q) * block_q
    q_w = _head_lanes(q, group, head_dim) if width != head_dim else q  # [T, Hq, W]
    q_p = jnp.pad(q_w, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
    rows = block_q * group

    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        has_window=sliding_window is not None,
        soft_cap=soft_cap,
        max_pages=max_pages,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        quantized=quantized,
        has_sinks=sinks is not None,
        has_chunk=attention_chunk is not None,
        has_until=attend_until is not None,
    )
    q_spec = pl.BlockSpec((block_q, num_q_heads, width), lambda j, *_: (j, 0, 0))
    sink_in = []
    if sinks is not None:  # [Hq] -> [Hkv, Bq * G, 1]: row t * G + g of KV head h holds sinks[h * G + g]
        sink_rows = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, 1, group), (1, block_q, 1))
        sink_in = [sink_rows.reshape(num_kv_heads, rows, 1)]
    until_in = []
    bounds = window.bounds_array(sliding_window, attention_chunk)
    if attend_until is not None:  # [T] -> [padded_T * G, 1]: row t * G + g holds attend_until[t]
        until = jnp.pad(attend_until.astype(jnp.int32), (0, padded_tokens - num_tokens))
        until_in = [jnp.repeat(until, group).reshape(padded_tokens * group, 1)]
        # Each query block's largest limit (scalar prefetch): its sequences' key range ends there
        # or at their last query, whichever is later.
        bounds = jnp.concatenate([bounds, until.reshape(-1, block_q).max(1)])
    hbm = pl.BlockSpec(memory_space=pl.ANY)  # K/V stay in HBM; pages are DMAed by hand
    buf_shape = (2, chunk_pages, page_size, lanes)
    scale_bufs = [pltpu.VMEM((2, num_kv_heads, chunk_pages * max(1, page_size // LANE), LANE), jnp.float32)] * 2 \
        if quantized else []
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(padded_tokens // block_q,),
            in_specs=[q_spec, hbm, hbm] + [hbm, hbm] * quantized
            + [pl.BlockSpec((num_kv_heads, rows, 1), lambda j, *_: (0, 0, 0))] * len(sink_in)
            + [pl.BlockSpec((rows, 1), lambda j, *_: (j, 0))] * len(until_in),
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM(buf_shape, k_pages.dtype),
                pltpu.VMEM(buf_shape, v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 4 if quantized else 2)),
                *scale_bufs,
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, 1), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, width), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_p.shape, q.dtype),
        # 32 MiB of scoped VMEM (the default is 16 on v5e): every TPU since v4 has at least
        # that, and the widest rows (16 KV heads of D=256 in f32) need it.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=32 * 2**20),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        num_seqs.astype(jnp.int32),
        bounds,
        q_p,
        k_pages,
        v_pages,
        *((k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)) if quantized else ()),
        *sink_in,
        *until_in,
    )
    out = out[:num_tokens]
    return _own_lanes(out, group, head_dim) if width != head_dim else out
