"""The per-step ragged batch description the attention layers read (see docs/architecture.md).

Passed explicitly through the forward, never through a global: every field is a device array
whose shape depends only on the token bucket T and the request bucket R.
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: jax.Array  # [T] int32, cache slot of each token (null page for padding)
    cu_q_lens: jax.Array  # [R+1] int32, query start of each sequence
    kv_lens: jax.Array  # [R] int32, cached tokens per sequence after this step
    block_tables: jax.Array  # [R, max_pages_per_seq] int32
    num_seqs: jax.Array  # [1] int32
