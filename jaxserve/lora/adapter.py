"""Reading a PEFT LoRA adapter as published (`adapter_config.json` + `adapter_model.safetensors`)
into host arrays shaped for the engine's slots.

Each target module becomes A [L, in, r] and B [L, r, out] (zero-padded up to the engine's
`max_lora_rank`; layers or modules the adapter leaves out are zeros) with the scaling
(`lora_alpha / r`, or `/ sqrt(r)` with rank-stabilised LoRA) folded into B, so the device
computes `x @ A @ B` and nothing else. Anything the engine cannot apply exactly is refused
with the adapter's name and the reason: DoRA, biases, `modules_to_save`, per-module rank or
alpha patterns, routed-expert targets, a rank above `max_lora_rank`, shapes that do not fit
the base model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any

import numpy as np

from jaxserve.loading.safetensors_file import SafetensorsFile
from jaxserve.models.config import ModelConfig

# The projections an adapter may target, as PEFT names them in Llama-family checkpoints.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be loaded; the message names the adapter and the reason."""


@dataclasses.dataclass(frozen=True)
class LoRAAdapter:
    """One adapter's weights on the host, ready to be written into a slot."""

    name: str
    path: str
    rank: int
    a: dict[str, np.ndarray]  # target -> [L, in, max_rank]
    b: dict[str, np.ndarray]  # target -> [L, max_rank, out], scaling folded in

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for x in (*self.a.values(), *self.b.values()))


def target_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """What an adapter may target on this model: the routed-expert MLPs have no dense gate /
    up / down projections to adapt."""
    return ATTENTION_TARGETS if cfg.is_moe else TARGETS


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module."""
    E, Q, KV, I = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size  # noqa: E741
    dims = {"q_proj": (E, Q), "k_proj": (E, KV), "v_proj": (E, KV), "o_proj": (Q, E),
            "gate_proj": (E, I), "up_proj": (E, I), "down_proj": (I, E)}
    return {t: dims[t] for t in target_modules(cfg)}


def load_adapter(name: str, path: str | os.PathLike, cfg: ModelConfig, max_rank: int, dtype: Any) -> LoRAAdapter:
    """Reads and checks the adapter at `path` for the base model `cfg`; raises LoRAAdapterError."""
    path = os.fspath(path)
    config = _read_config(name, path)
    rank, scaling = _check_config(name, config, cfg, max_rank)
    tensors = _read_tensors(name, path)
    L = cfg.num_layers
    dims = target_dims(cfg)
    a = {t: np.zeros((L, dims[t][0], max_rank), dtype) for t in dims}
    b = {t: np.zeros((L, max_rank, dims[t][1]), dtype) for t in dims}
    seen: set[tuple[int, str, str]] = set()
    for key, value in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only lora_A / lora_B "
                                   f"weights of {', '.join(target_modules(cfg))} are supported)")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in dims:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: target module {module!r} ({key}) is not supported "
                                   f"on this model; supported: {', '.join(dims)}")
        if layer >= L:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} is for layer {layer}, the base model has {L}")
        fin, fout = dims[module]
        want = (rank, fin) if which == "A" else (fout, rank)
        if tuple(value.shape) != want:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {key} has shape {tuple(value.shape)}, the base "
                                   f"model needs {want} (is it an adapter for this model?)")
        w = np.asarray(value, np.float32)
        if which == "A":
            a[module][layer, :, :rank] = w.T.astype(dtype)  # [in, r]
        else:
            b[module][layer, :rank, :] = (w.T * scaling).astype(dtype)  # [r, out]
        seen.add((layer, module, which))
    for layer, module, which in seen:
        if (layer, module, "B" if which == "A" else "A") not in seen:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: layer {layer} {module} has lora_{which} without "
                                   f"its lora_{'B' if which == 'A' else 'A'}")
    if not seen:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no LoRA weights in {path}")
    return LoRAAdapter(name=name, path=path, rank=rank, a=a, b=b)


def _read_config(name: str, path: str) -> dict[str, Any]:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {file} is not a JSON object")
    return config


def _check_config(name: str, config: dict[str, Any], cfg: ModelConfig, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a LoRA config this engine can apply exactly."""
    def refuse(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {name!r}: {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {config.get('peft_type')!r} is not LoRA")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be an integer >= 1, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is larger than max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)):
        raise refuse(f"lora_alpha must be a number, got {alpha!r}")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if config.get(key, ok) != ok:
            raise refuse(f"{key}={config.get(key)!r} is not supported")
    if config.get("bias", "none") != "none":
        raise refuse(f"bias={config.get('bias')!r} is not supported (only 'none')")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if config.get(key):
            raise refuse(f"{key} is not supported")
    targets = config.get("target_modules") or ()
    if isinstance(targets, str):  # a regex over module names: checked per tensor instead
        targets = ()
    allowed = target_modules(cfg)
    for t in targets:
        if t not in allowed:
            raise refuse(f"target module {t!r} is not supported on this model; supported: {', '.join(allowed)}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, float(scaling)


def _read_tensors(name: str, path: str) -> dict[str, np.ndarray]:
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        other = " (adapter_model.bin is not read: convert it to safetensors)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoRAAdapterError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r}{other}")
    try:
        return _read_safetensors(file)
    except (OSError, ValueError, KeyError, TypeError) as e:  # a corrupt or truncated file: name it
        raise LoRAAdapterError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None


def _read_safetensors(file: str) -> dict[str, np.ndarray]:
    """Every tensor of a small safetensors file as f32 (jaxserve's own reader: a framework
    reader would compile a device program per tensor shape while the engine serves)."""
    f = SafetensorsFile(file)
    try:
        out = {}
        for key, info in f.tensors.items():
            if info.dtype.kind not in "fV" or info.dtype.itemsize < 2:
                raise ValueError(f"tensor {key!r} has dtype {info.dtype}, not a float")
            out[key] = f.read(key).astype(np.float32)
        return out
    finally:
        f.close()
