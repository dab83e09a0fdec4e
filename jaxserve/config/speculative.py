"""`SpeculativeConfig`: which proposer drafts tokens, and how many, in vLLM's spelling.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    LLM(speculative_config={"model": "/path/to/small-model", "num_speculative_tokens": 4})
    LLM(model="/path/to/DeepSeek-V3", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    jaxserve serve --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'

Unknown methods and keys are refused naming them. Parsed once, into a frozen dataclass.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
# platform -> disable_by_batch_size when "auto". CPU: measured with scripts/bench_spec_decode.py
# (docs/benchmarks.md): with n-gram drafts, 0.99x-1.19x plain up to 16 running sequences,
# down to 0.90x at 32 and 64 when few drafts are kept (a CPU step's cost grows with every
# token). TPU and GPU: not measured; a step there costs about the same up to far larger
# batches, so no limit.
AUTO_DISABLE_BY_BATCH_SIZE: dict[str, int] = {"cpu": 16}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # None: "draft_model" when `model` is given, else "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None  # draft_model: a smaller model with the target's tokenizer
    prompt_lookup_max: int = 4  # n-gram: the longest suffix looked up in the history
    prompt_lookup_min: int = 2  # n-gram: the shortest
    # No drafts in a step that runs more sequences than this (at large batch a step is
    # compute-bound and verifying drafts costs more than it saves). None: no limit; "auto":
    # the platform's measured default (`AUTO_DISABLE_BY_BATCH_SIZE`).
    disable_by_batch_size: int | str | None = "auto"

    def __post_init__(self) -> None:
        if self.method is None:
            object.__setattr__(self, "method", "draft_model" if self.model is not None else "ngram")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; supported: {', '.join(METHODS)}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config: method 'draft_model' needs a model (the draft's path)")
        if self.method in ("ngram", "mtp") and self.model is not None:
            raise ValueError(f"speculative_config: method {self.method!r} takes no model (a draft model is method "
                             "'draft_model')")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) is larger than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        v = self.disable_by_batch_size
        if v is not None and v != "auto" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, null or "
                             f"'auto', got {v!r}")

    def batch_size_limit(self, platform: str) -> int | None:
        """The batch size past which no drafts are proposed, on `platform`."""
        if self.disable_by_batch_size == "auto":
            return AUTO_DISABLE_BY_BATCH_SIZE.get(platform)
        return self.disable_by_batch_size

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """A config, a dict (the Python API) or a JSON object (the flag); None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not a JSON object ({e.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**value)
