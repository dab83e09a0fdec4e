"""A `ServingEngine` without a model, for testing the fronts through the real serving core.

``ScriptedEngine`` replays a script: every request "generates" the ids of ``engine.script``,
one per step, and stops as the engine does (a stop token id or EOS ends it, the token included
in the output ids; ``max_tokens`` ends it with "length"). It keeps each ``EngineRequest`` it was
given, so a test sees exactly the prompt and the parameters a front sent. The core around it is
the real one (input checks, tokenizer pool, admission, engine thread, streams), so what a test
drives over HTTP is the server's own path minus the model.
"""

from __future__ import annotations

import dataclasses
import time
import types
from typing import Any

from jaxserve.engine.input_processor import EngineRequest, InputLimits, InputProcessor
from jaxserve.engine.outputs import (
    CompletionOutput,
    OutputKind,
    RequestMetrics,
    RequestOutput,
    Usage,
)
from jaxserve.worker.runner_output import SpecDecodeCounts, StepTiming
from scheduler.stats import SchedulerStats


class EncodingTokenizer:
    """The tokenizer members the server uses, over a tiktoken-style encoding (`encode`,
    `decode`, `is_special_token`: openai-harmony's). Its chat template writes `role: content`
    lines, so a prompt that went through the template is recognisable."""

    chat_template = "role: content lines"

    def __init__(self, encoding: Any):
        self.encoding = encoding

    def __deepcopy__(self, memo: dict) -> EncodingTokenizer:  # the pool copies it per thread; it is immutable
        return self

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encoding.encode(text, disallowed_special=())}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if skip_special_tokens:
            ids = [t for t in ids if not self.encoding.is_special_token(t)]
        return self.encoding.decode(ids)

    def template_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool = True,
                            add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        return self(self.template_text(messages, add_generation_prompt))["input_ids"]


@dataclasses.dataclass
class _Live:
    request: EngineRequest
    script: list[int]
    arrival: float
    emitted: int = 0


class ScriptedEngine:
    """See the module's docstring. `architecture`: what the served model reports being."""

    def __init__(self, tokenizer: EncodingTokenizer, *, architecture: str, vocab_size: int,
                 max_model_len: int = 8192, eos_token_id: int | None = None):
        self.script: list[int] = []
        self.requests: list[EngineRequest] = []  # every request admitted, in order
        self.tokenizer = tokenizer
        self.model_config = types.SimpleNamespace(architecture=architecture, vocab_size=vocab_size, num_layers=1,
                                                  hidden_size=8)
        self.config = types.SimpleNamespace(max_num_seqs=8, page_size=16)  # the engine's resolved config
        self.input_processor = InputProcessor(InputLimits(vocab_size, max_model_len, max_logprobs=5, max_n=4),
                                              tokenizer)
        self.max_model_len, self.num_pages, self.dtype = max_model_len, 64, "float32"
        self.eos_token_id = eos_token_id
        self.attention = ("none", "scripted")
        self.healthy, self.unhealthy_reason, self.sleep_level = True, None, 0
        self.scheduler = types.SimpleNamespace(stats=lambda: SchedulerStats(len(self._live), 0, 0, 0, 0, 64, 64, 0, 0))
        self.last_step = StepTiming()
        self.spec_decode = SpecDecodeCounts.zero()
        self.proposer = None
        self.lora_registry = None
        self._live: dict[str, _Live] = {}

    def encoder_activity(self) -> None:
        return None  # a text model: no image encoder

    def add_request(self, request: EngineRequest, *, request_id: str | None = None,
                    arrival_time: float | None = None, output_kind: OutputKind = OutputKind.CUMULATIVE,
                    lora_request: Any = None) -> str:
        assert output_kind == OutputKind.DELTA and request_id not in self._live
        self.requests.append(request)
        self._live[request_id] = _Live(request, list(self.script), arrival_time or time.monotonic())
        return request_id

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        outs = []
        self.last_step = StepTiming(num_tokens=len(self._live), padded_tokens=len(self._live),
                                    num_decode_tokens=len(self._live))
        for rid, live in list(self._live.items()):
            params = live.request.params
            token = live.script[live.emitted]
            live.emitted += 1
            finish, stop_reason = None, None
            if token in params.stop_token_ids:
                finish, stop_reason = "stop", token
            elif token == self.eos_token_id or live.emitted == len(live.script):
                finish = "stop"
            elif live.emitted >= params.max_tokens:
                finish = "length"
            if finish is not None:
                del self._live[rid]
            text = self.tokenizer.decode([token], skip_special_tokens=params.skip_special_tokens)
            now = time.monotonic()
            comps = [CompletionOutput(i, token_ids=live.script[:live.emitted], finish_reason=finish,
                                      stop_reason=stop_reason, delta_text=text, delta_token_ids=[token])
                     for i in range(params.n)]
            prompt = list(live.request.prompt_token_ids)
            outs.append(RequestOutput(rid, None, prompt, comps, finish is not None,
                                      Usage(len(prompt), live.emitted * params.n, 0),
                                      RequestMetrics(live.arrival, live.arrival, now, now if finish else None)))
        return outs

    def abort(self, request_id: str) -> bool:
        return self._live.pop(request_id, None) is not None

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def close(self) -> None:
        pass
