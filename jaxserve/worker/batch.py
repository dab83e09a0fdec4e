"""Building the flat ragged step input in persistent host arrays, padded to static buckets.

The arrays are allocated once at the largest bucket and filled in place each step; a step
sends views of the first T / R entries. Padding tokens write to the null page (slot 0..S-1 of
page 0) and padding sequences have zero length, so a padded batch computes the same values
for its real rows as an unpadded one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxserve.worker.recurrent_inputs import recurrent_inputs


@dataclasses.dataclass(frozen=True)
class SequenceSpan:
    """One sequence's share of a step: `token_ids` at positions start .. start+len-1.
    Its last `num_rows` positions get a logits row each (more than one: a decode verifying
    speculative drafts)."""

    token_ids: np.ndarray  # [n] int32
    start: int
    block_table: np.ndarray  # [<= max_pages_per_seq] int32
    num_rows: int = 1
    lora_slot: int = 0  # the LoRA adapter's device slot (1..max_loras; 0: the base model)
    state_slot: int = 0  # hybrid models: the sequence's state slot


@dataclasses.dataclass(frozen=True)
class StepArrays:
    """Host views of one padded step (shapes depend on T and R only)."""

    token_ids: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [G * T] int32 (G layer groups' slots side by side; G = 1 mostly)
    cu_q_lens: np.ndarray  # [R+1] int32
    kv_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, G * max_pages_per_seq] int32
    num_seqs: np.ndarray  # [1] int32
    logits_indices: np.ndarray  # [R] int32: the token of each logits row
    num_tokens: int  # real tokens
    num_reqs: int  # real sequences
    num_rows: int = 0  # real logits rows (num_reqs, plus one per speculative draft)
    lora_slots: np.ndarray | None = None  # [T] int32: each token's LoRA slot (0: the base model)
    recurrent: dict[str, np.ndarray] | None = None  # hybrid models: `RecurrentMetadata`'s arrays
    multimodal: dict[str, np.ndarray] | None = None  # vision-language models: `MultimodalMetadata`'s arrays


class BatchBuilder:
    def __init__(self, max_tokens: int, max_reqs: int, max_pages_per_seq: int, page_size: int,
                 recurrent: bool = False, num_kv_groups: int = 1):
        self.recurrent = recurrent  # also lay out the linear layers' state slots and chunks
        # Layer groups: a row holds G block tables of max_pages_per_seq / G pages side by side,
        # and each token gets a slot in each group's pages.
        self.num_kv_groups = num_kv_groups
        self.page_size = page_size
        self.max_pages_per_seq = max_pages_per_seq
        self._token_ids = np.zeros(max_tokens, np.int32)
        self._positions = np.zeros(max_tokens, np.int32)
        self._slots = np.zeros(num_kv_groups * max_tokens, np.int32)
        self._cu = np.zeros(max_reqs + 1, np.int32)
        self._kv_lens = np.zeros(max_reqs, np.int32)
        self._tables = np.zeros((max_reqs, max_pages_per_seq), np.int32)
        self._num_seqs = np.zeros(1, np.int32)
        self._logits_idx = np.zeros(max_reqs, np.int32)
        self._lora_slots = np.zeros(max_tokens, np.int32)

    def build(self, spans: list[SequenceSpan], num_tokens_bucket: int, num_reqs_bucket: int) -> StepArrays:
        T, R, S = num_tokens_bucket, num_reqs_bucket, self.page_size
        n_reqs = len(spans)
        if n_reqs > R:
            raise ValueError(f"{n_reqs} sequences do not fit the request bucket {R}")
        G = self.num_kv_groups
        W = self.max_pages_per_seq // G
        tok, pos, lora = self._token_ids[:T], self._positions[:T], self._lora_slots[:T]
        slots = self._slots[: G * T].reshape(G, T)
        cu, kv, tables, lidx = self._cu[: R + 1], self._kv_lens[:R], self._tables[:R], self._logits_idx[:R]
        t = row = 0
        for i, sp in enumerate(spans):
            n = len(sp.token_ids)
            if t + n > T:
                raise ValueError(f"{t + n} tokens do not fit the token bucket {T}")
            tok[t : t + n] = sp.token_ids
            lora[t : t + n] = sp.lora_slot
            p = np.arange(sp.start, sp.start + n, dtype=np.int32)
            pos[t : t + n] = p
            width = len(sp.block_table)
            tables[i, :width] = sp.block_table
            tables[i, width:] = 0
            for g in range(G):
                slots[g, t : t + n] = tables[i, g * W + p // S] * S + p % S
            cu[i] = t
            kv[i] = sp.start + n
            if row + sp.num_rows > R:
                raise ValueError(f"{row + sp.num_rows} logits rows do not fit the request bucket {R}")
            lidx[row : row + sp.num_rows] = np.arange(t + n - sp.num_rows, t + n, dtype=np.int32)
            row += sp.num_rows
            t += n
        tok[t:] = 0
        lora[t:] = 0
        pos[t:] = 0
        slots[:, t:] = np.arange(T - t, dtype=np.int32) % S  # null page
        cu[n_reqs:] = t
        kv[n_reqs:] = 0
        tables[n_reqs:] = 0
        lidx[row:] = 0
        self._num_seqs[0] = n_reqs
        rec = recurrent_inputs(cu, n_reqs, [sp.state_slot for sp in spans], T, R) if self.recurrent else None
        return StepArrays(tok, pos, slots.reshape(G * T), cu, kv, tables, self._num_seqs, lidx, t, n_reqs, row, lora_slots=lora,
                          recurrent=rec)
