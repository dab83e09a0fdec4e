"""What a serving front uses of the engine, as a type.

`server/` holds an engine through this Protocol: its state is read as attributes every engine
has (no probing), and its work is called through these methods only. `Engine`
(`llm_engine.py`) implements it; another engine (a remote worker's proxy, a test double) does
by having the same members.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from jaxserve.compilation.warmup import WarmupReport
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.input_processor import EngineRequest, InputProcessor
from jaxserve.engine.outputs import OutputKind, RequestOutput
from jaxserve.lora.registry import LoRARegistry
from jaxserve.lora.request import LoRARequest
from jaxserve.models.config import ModelConfig
from jaxserve.worker.runner_output import SpecDecodeCounts, StepTiming
from scheduler import Scheduler


class ServingEngine(Protocol):
    # ---------------------------------------------------------------- what it serves
    config: EngineConfig  # the engine's own, with platform defaults filled in
    model_config: ModelConfig
    tokenizer: Any  # None: token-id prompts only
    input_processor: InputProcessor
    max_model_len: int
    num_pages: int
    dtype: str
    eos_token_id: int | None
    attention: tuple[str, str]  # (kernel, why it was chosen)
    # ---------------------------------------------------------------- its state
    healthy: bool  # False once it cannot recover (a multi-host peer died): the server stops serving
    unhealthy_reason: str | None
    sleep_level: int  # 0: awake
    scheduler: Scheduler
    last_step: StepTiming
    spec_decode: SpecDecodeCounts  # since start
    proposer: Any  # None: no speculative decoding
    lora_registry: LoRARegistry | None  # None: LoRA off

    # ---------------------------------------------------------------- requests
    def add_request(self, request: EngineRequest, *, request_id: str | None = None,
                    arrival_time: float | None = None, output_kind: OutputKind = OutputKind.CUMULATIVE,
                    lora_request: LoRARequest | str | None = None) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> bool: ...

    def has_unfinished_requests(self) -> bool: ...

    # ---------------------------------------------------------------- life cycle
    def warmup(self, *, progress: bool = False) -> WarmupReport: ...

    def close(self) -> None: ...

    def sleep(self, level: int = 1) -> None: ...

    def wake_up(self) -> None: ...

    def update_weights(self, source: str | os.PathLike | Mapping[str, Any]) -> int: ...

    # ---------------------------------------------------------------- adapters
    def load_lora(self, lora: LoRARequest, adapter: Any = None) -> None: ...

    def unload_lora(self, name: str) -> None: ...

    def list_loras(self) -> list[LoRARequest]: ...

    def lora_activity(self) -> dict[str, Any] | None: ...
