"""Grouped matmul for CPU programs: only the grouped product, in jnp/lax.

XLA:CPU (jax 0.10) runs `jax.lax.ragged_dot` densely: every row times every group's weights
under a mask (G x the FLOPs, and every group's weights read even when a decode step's rows
touch a few of them). This path does the work the groups need and no more.

**Loops.** An outer `lax.while_loop` runs once per *non-empty* group (the trip count is data,
computed from the group sizes, so one compile serves every size vector, a decode step whose
rows touch 8 experts runs 8 iterations whatever G is, and empty groups cost nothing). It
takes the group's weights `rhs[g]` ([K, N]: XLA:CPU copies that one group out of rhs, not
rhs) and walks the group's rows from its first row in blocks of `blocks[0]` rows while whole
blocks fit, then of `blocks[1]` rows, and so on, each size an inner loop with a
data-dependent trip count: with the default (256, 64, 16, 4, 1) a group of 37 rows is two
16-row products, one 4-row and one 1-row product, so a large group runs large products and no
row is computed twice or for nothing. With a last size above 1 the rest is covered in blocks
of that size, which may reach past the group (masked, below).

**A block** `[b, K]` of lhs times the group's weights, f32 accumulation
(`preferred_element_type=f32`; HIGHEST precision for f32, as the reference), is written into
the output in lhs's dtype with `dynamic_update_slice` (in place: the output is the loop
carry). The whole blocks lie inside the group; the last size's blocks may reach past it and
are merged with a row mask (`where`), so rows of other groups keep what their own group wrote
and a NaN in another row of lhs never reaches them (a matmul's rows are independent). A
block that would run past row M is moved back to end at M (the mask keeps the previous
group's rows), so lhs is never padded unless M is smaller than the smallest block. The output
starts as zeros: rows past sum(group_sizes) stay zero. Sizes are clamped to >= 0 and their
running sum to M, as the GPU kernel does (ragged_dot cuts the sizes at M too).

**Quantized rhs** (int8 / float8 with `rhs_scale [G, N]`): the group's `[K, N]` slice is
converted to lhs.dtype as it is sliced (one fusion: XLA:CPU writes the converted group, never
a converted copy of rhs), and each block's f32 product is scaled by the group's `[N]` scale
before the cast.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# Chosen by measurement on the 2-core development host (docs/kernels.md): a last size of 1
# helps decode (a group's few rows are matrix-vector products against weights already in
# cache, none wasted), large groups want 256-row products (G=8, K=2048, N=192, M=4096: 33 ms
# with 256 on top, 47 ms with 64 on top, 64 ms with 8-row blocks only), and the other
# tuples tried were within noise of this one elsewhere.
DEFAULT_BLOCKS = (256, 64, 16, 4, 1)


def _check_blocks(blocks: tuple[int, ...]) -> None:
    if not blocks or any(b < 1 for b in blocks) or list(blocks) != sorted(set(blocks), reverse=True):
        raise ValueError(f"blocks={blocks} must be distinct positive row counts, largest first")


@functools.partial(jax.jit, static_argnames=("blocks",))
def grouped_matmul_cpu(
    lhs: jax.Array,  # [M, K], rows sorted by group
    rhs: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int32
    rhs_scale: jax.Array | None = None,  # [G, N] f32 when rhs is int8 / float8
    *,
    blocks: tuple[int, ...] = DEFAULT_BLOCKS,
) -> jax.Array:  # [M, N], lhs.dtype
    """Same contract as `reference.grouped_matmul_reference`."""
    blocks = tuple(blocks)
    _check_blocks(blocks)
    m, _ = lhs.shape
    num_groups, _, n = rhs.shape
    # Whole-block sizes >= M are dropped: a block of all M rows would be loop-invariant, and
    # XLA hoists it out of its loop, computing it for every group even when the loop runs 0
    # times. If even the smallest block is larger than M, lhs and the output are padded to
    # one block (a few rows: M is tiny then).
    rows = max(m, blocks[-1])
    blocks = tuple(b for b in blocks[:-1] if b < m) + blocks[-1:]
    x = jnp.pad(lhs, ((0, rows - m), (0, 0))) if rows != m else lhs

    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    nonempty = ends > starts
    count = jnp.sum(nonempty, dtype=jnp.int32)
    groups = jnp.nonzero(nonempty, size=num_groups, fill_value=0)[0].astype(jnp.int32)
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    # float8 is sliced as its bytes: XLA:CPU has no fp8 arithmetic and would otherwise convert
    # all of rhs to f16 before the loop (a dequantized copy); int8 and floats as they are.
    stored = jax.lax.bitcast_convert_type(rhs, jnp.uint8) if jnp.dtype(rhs.dtype).itemsize == 1 and \
        jnp.issubdtype(rhs.dtype, jnp.floating) else rhs

    def product(a, w, s):
        y = jax.lax.dot(a, w, precision=precision, preferred_element_type=jnp.float32)
        return (y if s is None else y * s).astype(lhs.dtype)

    def group_body(state):
        i, out = state
        g = groups[i]
        start, end = starts[g], ends[g]
        w = jax.lax.dynamic_index_in_dim(stored, g, axis=0, keepdims=False)  # [K, N]
        w = (w if stored is rhs else jax.lax.bitcast_convert_type(w, rhs.dtype)).astype(lhs.dtype)
        s = None if rhs_scale is None else rhs_scale[g].astype(jnp.float32)[None, :]  # [1, N]
        row = start
        for b in blocks[:-1]:  # whole blocks only: no mask, never past M
            def whole(j, out, row=row, b=b):
                r = row + j * b
                y = product(jax.lax.dynamic_slice_in_dim(x, r, b, axis=0), w, s)
                return jax.lax.dynamic_update_slice_in_dim(out, y, r, axis=0)

            whole_blocks = (end - row) // b
            out = jax.lax.fori_loop(0, whole_blocks, whole, out)
            row = row + whole_blocks * b
        b = blocks[-1]
        offsets = jnp.arange(b, dtype=jnp.int32)[:, None]

        def last(j, out):  # the rest: masked to the group's rows
            r = jnp.minimum(row + j * b, rows - b)
            y = product(jax.lax.dynamic_slice_in_dim(x, r, b, axis=0), w, s)
            mine = (r + offsets >= start) & (r + offsets < end)
            old = jax.lax.dynamic_slice_in_dim(out, r, b, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), r, axis=0)

        out = jax.lax.fori_loop(0, (end - row + b - 1) // b, last, out)
        return i + 1, out

    out = jnp.zeros((rows, n), lhs.dtype)
    _, out = jax.lax.while_loop(lambda s: s[0] < count, group_body, (jnp.int32(0), out))
    return out if rows == m else out[:m]
