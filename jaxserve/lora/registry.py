"""The adapters an engine knows, on the host: loaded once from their PEFT directories, kept
until unloaded, written into device slots on demand (`slots.LoRASlots`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from jaxserve.lora.adapter import LoRAAdapter, load_adapter
from jaxserve.lora.request import LoRARequest
from jaxserve.models.config import ModelConfig


@dataclasses.dataclass
class _Entry:
    request: LoRARequest
    load_id: int  # unique per load, never reused: the prefix cache and the slots key on it
    adapter: LoRAAdapter


class LoRARegistry:
    """Adapters by name and by `lora_int_id`. A load id is what requests carry: unloading an
    adapter and loading another under the same name or id never shares a cached prefix or a
    slot with the old one."""

    def __init__(self, config: ModelConfig, max_rank: int, dtype: Any):
        self._config = config
        self._max_rank = max_rank
        self._dtype = dtype
        self._by_int_id: dict[int, _Entry] = {}
        self._by_load_id: dict[int, _Entry] = {}
        self._next_load_id = 1
        self._lock = threading.Lock()  # the server lists adapters from its own thread

    def resolve(self, lora: LoRARequest) -> int:
        """The load id of `lora`, loading it from `lora.lora_path` the first time its id is seen.
        Raises LoRAAdapterError (a ValueError) naming the adapter."""
        with self._lock:
            entry = self._by_int_id.get(lora.lora_int_id)
        if entry is not None:
            known = entry.request
            if known.lora_name != lora.lora_name or (lora.lora_path and lora.lora_path != known.lora_path):
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} is already "
                                 f"adapter {known.lora_name!r} from {known.lora_path!r}")
            return entry.load_id
        return self.load(lora)

    def read(self, name: str, path: str) -> LoRAAdapter:
        """Reads and checks an adapter without registering it (any thread: a server reads off
        its engine thread, then `load`s what it read)."""
        with self._lock:
            self._check_name_free(name)
        if not path:
            raise ValueError(f"LoRA adapter {name!r}: lora_path is required to load it")
        return load_adapter(name, path, self._config, self._max_rank, self._dtype)

    def load(self, lora: LoRARequest, adapter: LoRAAdapter | None = None) -> int:
        """Registers the adapter (read now unless `adapter`, from `read`, is given); a name or id
        already known is an error."""
        with self._lock:
            self._check_new(lora)
        if adapter is None:
            adapter = self.read(lora.lora_name, lora.lora_path)
        with self._lock:
            self._check_new(lora)  # another thread may have loaded it meanwhile
            entry = _Entry(lora, self._next_load_id, adapter)
            self._next_load_id += 1
            self._by_int_id[lora.lora_int_id] = entry
            self._by_load_id[entry.load_id] = entry
        return entry.load_id

    def _check_new(self, lora: LoRARequest) -> None:
        if lora.lora_int_id in self._by_int_id:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: lora_int_id {lora.lora_int_id} is already "
                             f"adapter {self._by_int_id[lora.lora_int_id].request.lora_name!r}")
        self._check_name_free(lora.lora_name)

    def _check_name_free(self, name: str) -> None:
        if self._named(name) is not None:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (unload it first)")

    def _named(self, name: str) -> _Entry | None:
        """The entry of adapter `name` (the caller holds the lock)."""
        return next((e for e in self._by_int_id.values() if e.request.lora_name == name), None)

    def unload(self, name: str) -> int:
        """Forgets the adapter `name`; returns its load id. Unknown names raise KeyError."""
        with self._lock:
            entry = self._named(name)
            if entry is None:
                raise KeyError(f"LoRA adapter {name!r} is not loaded")
            del self._by_int_id[entry.request.lora_int_id]
            del self._by_load_id[entry.load_id]
            return entry.load_id

    def load_id(self, name: str) -> int:
        with self._lock:
            entry = self._named(name)
            return entry.load_id if entry is not None else 0

    def adapter(self, load_id: int) -> LoRAAdapter:
        with self._lock:
            return self._by_load_id[load_id].adapter

    def loaded(self) -> list[LoRARequest]:
        """Every adapter known, in load order."""
        with self._lock:
            return [e.request for e in sorted(self._by_load_id.values(), key=lambda e: e.load_id)]

    def name_of(self, load_id: int) -> str | None:
        with self._lock:
            entry = self._by_load_id.get(load_id)
            return entry.request.lora_name if entry else None
