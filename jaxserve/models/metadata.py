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
    # Hybrid models' linear layers (their state slots and chunk layout); None for the others.
    recurrent: RecurrentMetadata | None = None
    # Vision-language models: image rows and 3-D positions; None for the others.
    multimodal: MultimodalMetadata | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RecurrentMetadata:
    """What linear-attention layers read besides `AttentionMetadata` (hybrid models only; see
    `models/gated_delta.py`). Built on the host (`worker/recurrent_inputs.py`): shapes depend on
    the token bucket T and request bucket R only."""

    state_slots: jax.Array  # [R] int32, each row's state slot (0: the null slot, padding rows)
    token_rows: jax.Array  # [T] int32, each token's row (R: a padding token)
    chunk_tokens: jax.Array  # [Nc, C] int32, the tokens of each chunk of a multi-token span (T: padding)
    chunk_rows: jax.Array  # [Nc] int32, the row each chunk belongs to (R: unused chunks)
    num_chunks: jax.Array  # [1] int32, chunks in use (the first ones)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MultimodalMetadata:
    """A vision-language model's step inputs besides the token ids (built on the host by
    `worker/multimodal_inputs.py`; shapes depend on the token bucket T only)."""

    embeds: jax.Array  # [T, E] activations' dtype: the encoder's row for each image token (0 elsewhere)
    is_embed: jax.Array  # [T] bool: the token's input is its `embeds` row, not its embedding
    mrope_positions: jax.Array  # [3, T] int32: (t, h, w) rotary positions (0 for padding)
    # [D, T, E]: Qwen3-VL's DeepStack rows, added to the image tokens' hidden states after
    # decoder layer i < D (D = 0 for the others)
    deepstack: jax.Array
    # [T] int32, Gemma 3: the last key position each token sees beyond its own (an image
    # token: its image's last token; 0 elsewhere, i.e. causal); None for causal-only models
    attend_until: jax.Array | None = None
