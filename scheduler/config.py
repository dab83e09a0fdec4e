"""Scheduler configuration: one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PreemptionMode = Literal["recompute", "swap"]
Policy = Literal["fcfs", "priority"]
KV_GROUP_KINDS = ("full", "window", "chunk")


@dataclass(frozen=True)
class SchedulerConfig:
    """Sizes and policies of the scheduler.

    ``num_blocks`` counts device blocks *including* the reserved null block 0, so the pool has
    ``num_blocks - 1`` usable blocks (this is the first dimension of the runner's KV cache).
    ``num_host_blocks`` sizes the host-side swap pool; 0 disables swapping, and a swap
    preemption that finds no host room falls back to recompute.
    ``long_prefill_token_threshold`` caps the tokens one prefill may take in a step (0 = off),
    so a long prompt cannot starve the others.
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_host_blocks: int = 0
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = "recompute"
    long_prefill_token_threshold: int = 0
    policy: Policy = "fcfs"
    # Distinct LoRA adapters the running requests may use at once (the device slots; 0: no
    # adapters). A waiting request whose adapter would exceed it waits, others go ahead.
    max_loras: int = 0
    # Hybrid models (linear-attention layers): each running request also holds a state slot
    # (`KVCacheManager.state_slot_of`: 1..max_num_seqs, 0 is the null slot), and prefix hits
    # need a state snapshot at their last block (`num_state_snapshots` of them, slots after
    # the running ones; 0: no prefix caching of such models' states).
    recurrent_state: bool = False
    num_state_snapshots: int = 0
    # Vision-language models: the image tokens whose encoding may start in one step (an image
    # starts when a span first reaches its first placeholder token), so a flood of new images
    # cannot make one step arbitrarily long; a span stops before the image that would exceed
    # it (the step's first image always fits). 0: no bound.
    max_num_encoder_tokens: int = 0
    # Images whose tokens attend to each other in both directions (Gemma 3): every token of an
    # image must be computed in one step, after or beside the keys of all of them, so a span
    # never ends inside an image (it stops before it, or waits for a step with room for it).
    whole_images: bool = False
    # The KV cache's layer groups (hybrid allocation): each group has its own block table over
    # one shared pool, and a kind that says which of a sequence's blocks its layers can still
    # read: ("full", 0) every one; ("window", W) the last W positions (a token sees itself and
    # the W - 1 before it); ("chunk", C) its own C-aligned chunk. Blocks no later token of the
    # sequence can read are released as the sequence moves on, so windowed and chunked layers
    # hold a bounded tail. Empty: one full group (every layer keeps every token).
    kv_groups: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        positive = ("block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.max_num_encoder_tokens, int) or self.max_num_encoder_tokens < 0:
            raise ValueError(f"max_num_encoder_tokens must be an integer >= 0 (0: no bound), "
                             f"got {self.max_num_encoder_tokens!r}")
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an integer >= 2 (block 0 is the reserved null block), "
                f"got {self.num_blocks!r}"
            )
        if not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0:
            raise ValueError(
                f"num_host_blocks must be an integer >= 0, got {self.num_host_blocks!r}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(
                f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an integer >= 0, got {self.max_loras!r}")
        if not isinstance(self.num_state_snapshots, int) or self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be an integer >= 0, got {self.num_state_snapshots!r}")
        object.__setattr__(self, "kv_groups", tuple((str(k), int(n)) for k, n in self.kv_groups))
        for kind, size in self.kv_groups:
            if kind not in KV_GROUP_KINDS or (kind != "full" and size < 1) or (kind == "full" and size):
                raise ValueError(f"kv_groups: ({kind!r}, {size}) is not a layer group; kinds are ('full', 0), "
                                 "('window', W >= 1) and ('chunk', C >= 1)")
        if len(self.kv_groups) > 255:
            raise ValueError(f"kv_groups: {len(self.kv_groups)} groups, at most 255")
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {t!r}")

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block-table row: enough blocks for ``max_model_len`` tokens."""
        return -(-self.max_model_len // self.block_size)

    @property
    def num_kv_groups(self) -> int:
        """Block-table rows per request (one per layer group; one without groups)."""
        return max(1, len(self.kv_groups))

    @property
    def table_width(self) -> int:
        """Width of a request's whole block-table row: the groups' rows side by side."""
        return self.num_kv_groups * self.max_blocks_per_seq

    @property
    def num_state_slots(self) -> int:
        """The state pools' slots: the null slot, one per running request, the snapshots."""
        return 1 + self.max_num_seqs + self.num_state_snapshots if self.recurrent_state else 0

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1
