"""Grouped matmul for NVIDIA GPUs: a Triton kernel written in Pallas.

XLA:GPU (jax 0.10) expands `jax.lax.ragged_dot` densely: every row is multiplied by every
group's weights under a mask, G times the FLOPs of the grouped product. This kernel does only
the grouped product.

**Work items (tiles).** The rows are cut into row blocks of `block_m`. A tile is one (group,
row block) pair where the group's rows overlap the block, in row order (megablox style): a
group spanning three blocks has three tiles; a block holding the end of one group and the
start of the next has a tile for each. The rows past sum(group_sizes) form one more group,
"group G", whose tiles store zeros without multiplying, so every output row is written by
exactly one tile and the output needs no initialisation. With at most G + 1 non-empty groups
there are at most `ceil(M / block_m) + G` tiles: the grid is static, `(that bound, N /
block_n)`; slots past the real tiles exit at once. The tile table (group and row block of
each slot) and the group boundaries are computed with jnp in the wrapper: they are data
(group sizes change every step), shapes never change.

**A program** (tile t, column block j) loads its block's rows with a mask keeping only its
group's rows (others read as zero), walks K in `block_k` steps multiplying by the group's
`[block_k, block_n]` weight block with an f32 accumulator, and stores only its group's rows
(masked store), so tiles of different groups sharing a row block never touch each other's
rows. f32 inputs use IEEE f32 dots (no TF32).

**Shapes.** K and N must be multiples of 16 (a Triton dot's minimum); `block_k` / `block_n`
are the largest of 64/32/16 and 128/64/32/16 dividing them, so no column is masked or
padded (K=96 runs as 3 x 32). M is anything: the last row block is masked.

**Quantized rhs** (int8 / float8 with `rhs_scale [G, N]` f32): the program loads the int8 /
fp8 `[block_k, block_n]` tile as stored (a quarter / half of the bf16 / f32 bytes), converts
it to lhs.dtype in registers before the dot (exact), and multiplies the f32 accumulator by the
group's `[block_n]` scale before the store. No converted copy of rhs exists anywhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_QUANTIZED = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def supports(k: int, n: int, dtype, rhs_dtype=None) -> bool:
    """Whether the kernel takes `[M, K] x [G, K, N]` with lhs in `dtype`: K and N multiples
    of 16 (at least 16), f32 / bf16 / f16; rhs in the same dtype (`rhs_dtype` None) or int8 /
    float8 (quantized, with a scale)."""
    rhs_ok = rhs_dtype is None or jnp.dtype(rhs_dtype) in (jnp.dtype(dtype), *_QUANTIZED)
    return k >= 16 and n >= 16 and k % 16 == 0 and n % 16 == 0 and jnp.dtype(dtype) in _DTYPES and rhs_ok


def _largest_dividing(x: int, choices: tuple[int, ...]) -> int:
    return next(c for c in choices if x % c == 0)


def default_blocks(m: int, k: int, n: int, num_groups: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k). block_m follows the mean rows per group (a tile that
    holds a few rows of its group still computes block_m rows): half of it rounded up to a
    power of two, in 16..64, so 4 rows per group (M=512 over 128 experts) take 16-row
    blocks and 256 take 64. Not tuned on a GPU (none was available): a starting point."""
    per_group = max(1, m // max(num_groups, 1))
    block_m = min(64, max(16, 1 << max(0, (per_group // 2 - 1).bit_length())))
    return block_m, _largest_dividing(n, (128, 64, 32, 16)), _largest_dividing(k, (64, 32, 16))


def num_tiles(m: int, num_groups: int, block_m: int) -> int:
    """Static bound on the tiles: G + 1 groups (the real ones and the rows past them) over
    ceil(M / block_m) row blocks add at most one tile per boundary between groups."""
    return math.ceil(m / block_m) + num_groups


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The tile table: (group of each slot, its row block or -1 past the real tiles, group
    boundaries [G + 2]). Group g owns rows [bounds[g], bounds[g + 1]); group G the rows past
    sum(group_sizes). Sizes are clamped to >= 0 and the boundaries to M."""
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    zero, full = jnp.zeros((1,), jnp.int32), jnp.full((1,), m, jnp.int32)
    bounds = jnp.concatenate([zero, ends.astype(jnp.int32), full])  # [G + 2]
    start, end = bounds[:-1], bounds[1:]  # [G + 1]
    first = start // block_m
    tiles = jnp.where(end > start, (end - 1) // block_m - first + 1, 0)  # [G + 1]
    cum = jnp.cumsum(tiles)
    slot = jnp.arange(num_tiles(m, num_groups, block_m), dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, slot, side="right"), num_groups).astype(jnp.int32)
    block = first[group] + slot - (cum[group] - tiles[group])
    block = jnp.where(slot < cum[-1], block, -1).astype(jnp.int32)
    return group, block, bounds


def _kernel(
    group_ref,  # [num_tiles] int32: the group of tile t (G: the rows past the groups)
    block_ref,  # [num_tiles] int32: its row block, -1 past the real tiles
    bounds_ref,  # [G + 2] int32: group g owns rows [bounds[g], bounds[g + 1])
    lhs_ref,  # [M, K]
    rhs_ref,  # [G, K, N] lhs.dtype, or int8 / float8 with scale_ref
    *refs,  # (scale_ref [G, N] f32,) out_ref [M, N]
    quantized: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    num_groups: int,
    num_rows: int,
    precision,
):
    scale_ref, out_ref = refs if quantized else (None, *refs)
    t, j = pl.program_id(0), pl.program_id(1)
    block = block_ref[t]

    @pl.when(block >= 0)
    def _():
        g = group_ref[t]
        rows = block * block_m + jnp.arange(block_m, dtype=jnp.int32)  # [BM]
        mine = (rows >= bounds_ref[g]) & (rows < bounds_ref[g + 1])  # never true for rows >= M
        # Indices stay in bounds even where masked. Stores also keep them distinct (Pallas'
        # interpreter stores a masked row by writing its old value back, so a row repeated
        # in one store could lose the real write): rows past the output move one block up,
        # onto rows of the previous block this program does not own.
        row_idx = jnp.minimum(rows, num_rows - 1)[:, None]
        out_idx = jnp.where(rows < out_ref.shape[0], rows, rows - block_m)[:, None]
        g_w = jnp.minimum(g, num_groups - 1)
        col0 = j * block_n
        k_idx = jnp.arange(block_k, dtype=jnp.int32)[None, :]
        lhs_mask = jnp.broadcast_to(mine[:, None], (block_m, block_k))

        def body(i, acc):
            k0 = i * block_k
            a = plgpu.load(lhs_ref.at[row_idx, k0 + k_idx], mask=lhs_mask, other=0.0)  # [BM, BK]
            b = rhs_ref[g_w, pl.ds(k0, block_k), pl.ds(col0, block_n)]  # [BK, BN], as stored
            b = b.astype(lhs_ref.dtype)  # int8 / fp8: converted in registers (a no-op otherwise)
            return acc + plgpu.dot(a, b, precision=precision)

        cols = col0 + jnp.arange(block_n, dtype=jnp.int32)[None, :]
        out_mask = jnp.broadcast_to(mine[:, None], (block_m, block_n))

        @pl.when(g < num_groups)
        def _():  # a static trip count: Triton pipelines the K loop
            acc = jax.lax.fori_loop(0, lhs_ref.shape[1] // block_k, body,
                                    jnp.zeros((block_m, block_n), jnp.float32))
            if quantized:  # the group's per-output-channel scale, on the f32 accumulator
                acc = acc * scale_ref[g_w, pl.ds(col0, block_n)][None, :]
            plgpu.store(out_ref.at[out_idx, cols], acc.astype(out_ref.dtype), mask=out_mask)

        @pl.when(g == num_groups)
        def _():  # the rows past the groups: zeros
            plgpu.store(out_ref.at[out_idx, cols], jnp.zeros((block_m, block_n), out_ref.dtype), mask=out_mask)


@functools.partial(
    jax.jit, static_argnames=("block_m", "block_n", "block_k", "num_warps", "num_stages", "interpret"))
def grouped_matmul_gpu(
    lhs: jax.Array,  # [M, K]
    rhs: jax.Array,  # [G, K, N] lhs.dtype, or int8 / float8 with rhs_scale
    group_sizes: jax.Array,  # [G] int32
    rhs_scale: jax.Array | None = None,  # [G, N] f32 when rhs is quantized
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    interpret: bool = False,
) -> jax.Array:  # [M, N], lhs.dtype
    """Triton (Pallas) grouped matmul; same contract as `reference.grouped_matmul_reference`."""
    m, k = lhs.shape
    num_groups, _, n = rhs.shape
    if not supports(k, n, lhs.dtype, rhs.dtype):
        raise ValueError(f"the GPU grouped matmul needs K and N multiples of 16 in f32/bf16/f16 (rhs the "
                         f"same or int8/float8); got K={k}, N={n}, {lhs.dtype} x {rhs.dtype}")
    quantized = rhs.dtype != lhs.dtype
    if quantized != (rhs_scale is not None):
        raise ValueError("rhs_scale is required with an int8 / float8 rhs, and only then")
    bm, bn, bk = default_blocks(m, k, n, num_groups)
    block_m, block_n, block_k = block_m or bm, block_n or bn, block_k or bk
    for name, b, dim in (("block_m", block_m, None), ("block_n", block_n, n), ("block_k", block_k, k)):
        if b < 16 or b & (b - 1) or (dim is not None and dim % b):
            raise ValueError(f"{name}={b} must be a power of two >= 16" + (f" dividing {dim}" if dim else ""))
    group, block, bounds = tile_schedule(group_sizes, m, block_m)
    kernel = functools.partial(
        _kernel, quantized=quantized, block_m=block_m, block_n=block_n, block_k=block_k,
        num_groups=num_groups, num_rows=m,
        precision=jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None)
    out_rows = max(m, block_m)  # at least one block of rows: see the store in _kernel
    out = pl.pallas_call(
        kernel,
        grid=(group.shape[0], n // block_n),
        out_shape=jax.ShapeDtypeStruct((out_rows, n), lhs.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul_gpu",
    )(group, block, bounds, lhs, rhs, *(() if rhs_scale is None else (rhs_scale.astype(jnp.float32),)))
    return out if out_rows == m else out[:m]
