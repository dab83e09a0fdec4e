"""`LoRARequest`: which adapter a request runs under (vLLM's spelling)."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, a positive integer id unique to it, and its PEFT directory.

    The engine loads the adapter the first time it sees the id (and keeps it on the host
    until unloaded); the same id must always come with the same name and path."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be an integer >= 1, "
                             f"got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))
