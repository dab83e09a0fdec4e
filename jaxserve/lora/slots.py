"""The adapters' device slots: fixed arrays `[L, ..., N, ...]` per target, written in place.

A request carries its adapter's slot as data (`LoRABatch.token_slots`), so loading, evicting and
mixing adapters never changes a shape and never compiles. Slots are assigned least recently
used first; the scheduler never runs more distinct adapters at once than there are slots
(`SchedulerConfig.max_loras`), so the adapters of one step always fit, and a slot whose adapter
a step uses is never taken in that step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.lora.adapter import LoRAAdapter, target_dims
from jaxserve.models.config import ModelConfig

_ROW_PARALLEL = ("o_proj", "down_proj")  # their input features are split under tensor parallelism


def slot_shapes(cfg: ModelConfig, max_loras: int, max_rank: int) -> dict[str, tuple[int, ...]]:
    """`LoRABatch.weights` shapes for the (per-device view of the) serving model config."""
    L = cfg.num_layers
    shapes = {}
    for t, (fin, fout) in target_dims(cfg).items():
        shapes[f"{t}.a"] = (L, fin, max_loras, max_rank)
        shapes[f"{t}.b"] = (L, max_loras, max_rank, fout)
    return shapes


def slot_specs(cfg: ModelConfig, axis: str) -> dict[str, P]:
    """Shardings as the projections they adapt: B with the output columns of a column-parallel
    layer, A with the input rows of a row-parallel one, so each device computes its own slice
    (the row-parallel layers' partial sums join the layer's own reduction)."""
    specs = {}
    for t in target_dims(cfg):
        row = t in _ROW_PARALLEL
        specs[f"{t}.a"] = P(None, axis, None, None) if row else P()
        specs[f"{t}.b"] = P() if row else P(None, None, None, axis)
    return specs


def _write_slot(weights: dict[str, jax.Array], slot: jax.Array, new: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Slot `slot` (0-based) of every target := `new` ("<t>.a" [L, in, r], "<t>.b" [L, r, out])."""
    out = {}
    for k, w in weights.items():
        if k.endswith(".a"):
            out[k] = w.at[:, :, slot].set(new[k].astype(w.dtype))
        else:
            out[k] = w.at[:, slot].set(new[k].astype(w.dtype))
    return out


class LoRASlots:
    """The device slot arrays and which adapter (load id) each slot holds."""

    def __init__(self, config: ModelConfig, base_config: ModelConfig, max_loras: int, max_rank: int, dtype: Any,
                 mesh: Mesh | None = None, axis: str = "model"):
        """`config` is the serving (per-device view) model config, `base_config` the
        checkpoint's: under tensor parallelism with KV heads replicated up to the degree, an
        adapter's k/v columns are replicated likewise."""
        self.config, self.base_config = config, base_config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype = jnp.dtype(dtype)
        shapes = slot_shapes(config, max_loras, max_rank)
        shardings = None
        if mesh is not None:
            shardings = {k: NamedSharding(mesh, s) for k, s in slot_specs(config, axis).items()}
        zeros = jax.jit(lambda: {k: jnp.zeros(s, self.dtype) for k, s in shapes.items()}, out_shardings=shardings)
        self.weights: dict[str, jax.Array] = zeros()
        self._write = jax.jit(_write_slot, donate_argnums=(0,), out_shardings=shardings)
        self._holder: list[int] = [0] * max_loras  # load id in each slot (0: empty)
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # load id -> slot, oldest first
        self.num_loads = 0  # adapters written into a slot (a metric: misses of the slot cache)
        # Compiled now, before warmup ends: a zero adapter into slot 0 (it is empty anyway).
        self._write_adapter(0, {k: np.zeros((s[0], s[1], s[3]) if k.endswith(".a") else (s[0], s[2], s[3]),
                                            self.dtype) for k, s in shapes.items()})

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in self.weights.values())

    def assign(self, load_ids: Iterable[int], adapter_of: Callable[[int], LoRAAdapter]) -> dict[int, int]:
        """Token slot (1..N) of each adapter a step uses, writing the missing ones into the
        least recently used slots the step does not use."""
        wanted = [i for i in dict.fromkeys(load_ids) if i]
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} LoRA adapters in one step, {self.max_loras} slots")
        for i in wanted:
            if i in self._lru:
                self._lru.move_to_end(i)
        for i in wanted:
            if i not in self._lru:
                slot = self._free_slot(set(wanted))
                self._write_adapter(slot, self._device_layout(adapter_of(i)))
                self._holder[slot] = i
                self._lru[i] = slot
                self.num_loads += 1
        return {i: self._lru[i] + 1 for i in wanted}

    def _free_slot(self, keep: set[int]) -> int:
        if 0 in self._holder:
            return self._holder.index(0)
        victim = next(i for i in self._lru if i not in keep)
        slot = self._lru.pop(victim)
        self._holder[slot] = 0
        return slot

    def drop(self, load_id: int) -> None:
        """The adapter is gone (unloaded): its slot is free. Its weights stay until overwritten,
        but no token refers to the slot any more."""
        slot = self._lru.pop(load_id, None)
        if slot is not None:
            self._holder[slot] = 0

    def _write_adapter(self, slot: int, new: dict[str, np.ndarray]) -> None:
        self.weights = self._write(self.weights, jnp.int32(slot), new)

    def _device_layout(self, adapter: LoRAAdapter) -> dict[str, np.ndarray]:
        """The adapter's A and B as the slots hold them (k/v columns replicated like the KV
        heads under tensor parallelism)."""
        new = {}
        for t in target_dims(self.config):
            new[f"{t}.a"] = adapter.a[t]
            b = adapter.b[t]
            if t in ("k_proj", "v_proj") and self.config.num_kv_heads != self.base_config.num_kv_heads:
                b = _repeat_heads(b, self.base_config.num_kv_heads, self.config.num_kv_heads, self.config.head_dim)
            new[f"{t}.b"] = b
        return new


def _repeat_heads(b: np.ndarray, heads: int, new_heads: int, head_dim: int) -> np.ndarray:
    """[L, r, heads*D] -> [L, r, new_heads*D], each head's columns repeated in order (as
    `parallel.expand_kv_heads` does for the projection)."""
    L, r, _ = b.shape
    rep = new_heads // heads
    return np.repeat(b.reshape(L, r, heads, 1, head_dim), rep, axis=3).reshape(L, r, -1)
