"""Grouped matmul, the contract as pure jnp (the oracle).

`lhs [M, K]` holds rows sorted by group: group g owns the contiguous run of `group_sizes[g]`
rows after the rows of groups 0..g-1. Then

    out[i] = lhs[i] @ rhs[g]   for every row i of group g,
    out[i] = 0                 for rows past sum(group_sizes) (e.g. other devices' experts),

with the products summed in f32 and the result cast to `lhs.dtype`. This is
`jax.lax.ragged_dot` with f32 accumulation and full f32 precision. Group sizes whose sum
exceeds M are cut at M (ragged_dot does that; the GPU kernel too). Negative sizes are not valid
input (ragged_dot gives overlapping groups; the GPU kernel treats them as 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul_reference(
    lhs: jax.Array,  # [M, K]
    rhs: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int32
) -> jax.Array:  # [M, N], lhs.dtype
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=jax.lax.Precision.HIGHEST,
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)
