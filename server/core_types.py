"""The serving core's typed boundary: what a front hands it (`GenerateInput`, `PromptInput`)
and what it answers besides generations (`ModelInfo`, `ServerInfo`, `TokenText`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from scheduler import SamplingParams


@dataclasses.dataclass(frozen=True)
class PromptInput:
    """A prompt as a client gave it: exactly one of `text`, `token_ids`, `messages`."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    messages: list[dict[str, Any]] | None = None  # a conversation for the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None  # given to the chat template
    messages_without_tool_support: list[dict[str, Any]] | None = None  # when the template ignores tools
    # A front's own prompt format instead of the chat template (gpt-oss's harmony): called on the
    # tokenizer pool for the ids; `messages` are still given, for the size checks and the backlog.
    render: Callable[[], list[int]] | None = None
    add_special_tokens: bool = True
    param: str = "prompt"  # the client's name for the prompt field (errors name it)
    # A vision-language model's images: (source, where) in prompt order, one per placeholder
    # the prompt (or its chat template) holds; a source is a data: or http(s) URL or bytes.
    images: Sequence[tuple[Any, str]] = ()


@dataclasses.dataclass(frozen=True)
class GenerateInput:
    request_id: str  # the client's id; the engine's is scoped to the tenant
    prompt: PromptInput
    params: SamplingParams
    fill_max_tokens: bool = False  # max_tokens: the room left within max_model_len
    structured_param: str | None = None  # the client's field holding the grammar spec
    field_names: Mapping[str, str] | None = None  # the client's names where they differ (top_logprobs)
    lora_name: str | None = None  # a loaded LoRA adapter (OpenAI: the request's `model`)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    model: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    hidden_size: int
    dtype: str
    eos_token_id: int  # -1 when unknown
    has_chat_template: bool
    max_logprobs: int
    max_n: int


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """The server's state; the engine's fields only for admin tenants (they show every tenant's load)."""

    version: str
    state: str
    uptime_s: float
    max_queued_requests: int
    num_in_flight: int  # admin: the whole server's; others: the tenant's own
    engine_config: dict[str, str] | None = None
    compilations_after_warmup: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    num_swapped: int | None = None
    num_used_blocks: int | None = None
    num_free_blocks: int | None = None
    num_cached_free_blocks: int | None = None
    num_total_blocks: int | None = None
    kv_cache_usage: float | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    num_preemptions: int | None = None
