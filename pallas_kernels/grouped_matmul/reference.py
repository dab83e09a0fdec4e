"""Grouped matmul, the contract as pure jnp (the oracle).

`lhs [M, K]` holds rows sorted by group: group g owns the contiguous run of `group_sizes[g]`
rows after the rows of groups 0..g-1. Then

    out[i] = lhs[i] @ rhs[g]   for every row i of group g,
    out[i] = 0                 for rows past sum(group_sizes) (e.g. other devices' experts),

with the products summed in f32 and the result cast to `lhs.dtype`. This is
`jax.lax.ragged_dot` with f32 accumulation and full f32 precision. Group sizes whose sum
exceeds M are cut at M (ragged_dot does that; the GPU kernel too). Negative sizes are not valid
input (ragged_dot gives overlapping groups; the GPU kernel treats them as 0).

**Quantized rhs** (weight-only: int8 / float8 values, `rhs_scale [G, N]` f32, one factor per
group and output channel):

    out[i] = (lhs[i] @ rhs[g]) * rhs_scale[g]   for every row i of group g,

the values converted to lhs.dtype (exact: int8 and float8_e4m3fn values are bf16 / f32
values), summed in f32, scaled in f32, then cast to lhs.dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def row_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """[M] int32: the group of each row (G for the rows past the groups), sizes clamped to
    >= 0 and their running sum to M."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def scale_rows(acc: jax.Array, rhs_scale: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`acc [M, N]` f32 times each row's group's scale ([G, N]); rows past the groups keep
    their value (zero in every caller), times the last group's scale."""
    g = jnp.minimum(row_groups(group_sizes, acc.shape[0]), rhs_scale.shape[0] - 1)
    return acc * jnp.take(rhs_scale.astype(jnp.float32), g, axis=0)


def grouped_matmul_reference(
    lhs: jax.Array,  # [M, K]
    rhs: jax.Array,  # [G, K, N] lhs.dtype, or int8 / float8 with rhs_scale
    group_sizes: jax.Array,  # [G] int32
    rhs_scale: jax.Array | None = None,  # [G, N] f32 when rhs is quantized
) -> jax.Array:  # [M, N], lhs.dtype
    out = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    if rhs_scale is not None:
        out = scale_rows(out, rhs_scale, group_sizes)
    return out.astype(lhs.dtype)
