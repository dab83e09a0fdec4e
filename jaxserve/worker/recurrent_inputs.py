"""The host side of a hybrid model's step: each row's state slot and the chunk layout of the
delta rule's multi-token spans (`models.gated_delta`, `models.metadata.RecurrentMetadata`).

A span of n > 1 tokens takes ceil(n / C) chunks of its own, in order; a one-token span takes
none (the recurrent step serves it). The chunk grid holds ceil(T / C) + R chunks, which no step
can exceed: the spans' chunks number at most sum(n_i / C + 1) over at most R spans.
"""

from __future__ import annotations

import numpy as np

from jaxserve.models.gated_delta import chunk_size


def chunk_grid(num_tokens: int, num_reqs: int) -> tuple[int, int]:
    """(chunks, chunk length) of the layout for token bucket T and request bucket R."""
    C = chunk_size(num_tokens)
    return -(-num_tokens // C) + num_reqs, C


def recurrent_inputs(cu_q_lens: np.ndarray, num_seqs: int, state_slots: list[int], T: int,
                     R: int) -> dict[str, np.ndarray]:
    """The arrays of `RecurrentMetadata` for a built step (`cu_q_lens` [R+1] of its padded
    arrays, its `num_seqs` real rows and their state slots)."""
    if len(state_slots) != num_seqs:
        raise ValueError(f"{len(state_slots)} state slots for {num_seqs} sequences")
    slots = np.zeros(R, np.int32)
    slots[:num_seqs] = state_slots
    token_rows = np.full(T, R, np.int32)
    nc, C = chunk_grid(T, R)
    chunk_tokens = np.full((nc, C), T, np.int32)
    chunk_rows = np.full(nc, R, np.int32)
    c = 0
    for i in range(num_seqs):
        a, b = int(cu_q_lens[i]), int(cu_q_lens[i + 1])
        token_rows[a:b] = i
        if b - a <= 1:
            continue
        for s in range(a, b, C):
            e = min(s + C, b)
            chunk_tokens[c, : e - s] = np.arange(s, e, dtype=np.int32)
            chunk_rows[c] = i
            c += 1
    return {"state_slots": slots, "token_rows": token_rows, "chunk_tokens": chunk_tokens,
            "chunk_rows": chunk_rows, "num_chunks": np.array([c], np.int32)}
