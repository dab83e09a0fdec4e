"""HF model directories: config.json plus one or more safetensors files."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from jaxserve.loading.errors import CheckpointError, MissingTensorError, ModelFileNotFoundError
from jaxserve.loading.params import TRANSPOSED, assemble_params
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import MOE_WEIGHTS

_GLOBAL_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                 "lm_head": "lm_head.weight"}
_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
}
# Gemma 2/3 name their four norms after where they sit; jaxserve's pre-MLP norm is `post_norm`.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_norm": "pre_feedforward_layernorm.weight",
    "post_ffn_norm": "post_feedforward_layernorm.weight",
}
# Routed experts, per expert as published checkpoints hold them: (router, expert module,
# gate, up, down) names of each MoE family.
_MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts", "w1", "w3", "w2"),
}


def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def hf_config(path: str, name: str = "config.json") -> ModelConfig:
    cfg_path = os.path.join(path, name)
    try:
        with open(cfg_path) as f:
            raw = json.load(f)
    except FileNotFoundError as e:
        raise ModelFileNotFoundError(f"no {name} in {path}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e})") from e
    return ModelConfig.from_hf_config(raw)


class _SafetensorsIndex:
    """Finds each tensor in whichever shard holds it; reads one tensor at a time."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ModelFileNotFoundError(f"no *.safetensors files in {path}")
        self._handles = []
        self._where: dict[str, Any] = {}
        for fname in files:
            try:
                h = safe_open(fname, framework="flax")
            except Exception as e:
                raise CheckpointError(f"cannot read safetensors file {fname}: {e}") from e
            self._handles.append(h)
            for key in h.keys():
                self._where[key] = h
        self.path = path

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        h = self._where.get(name)
        if h is None:
            raise MissingTensorError(f"safetensors checkpoint {self.path} is missing tensor {name!r}")
        return np.asarray(h.get_tensor(name), dtype=np.float32)


# Where the decoder sits: causal-LM checkpoints, then the language model of a multimodal one
# (Gemma 3 4B-27B) as published and as transformers 5 names it in memory.
_DECODER_PREFIXES = (("model.", ""), ("language_model.model.", "language_model."), ("model.language_model.", ""))


def load_hf_params(path: str, cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    index = _SafetensorsIndex(path)
    names = _GEMMA_LAYER_NAMES if cfg.sandwich_norms else _LAYER_NAMES
    decoder, head = next(((d, h) for d, h in _DECODER_PREFIXES if index.has(d + "embed_tokens.weight")),
                         _DECODER_PREFIXES[0])

    def get(name: str, layer: int | None) -> np.ndarray:
        if layer is not None and name in MOE_WEIGHTS:
            return _expert_tensor(index, cfg, name, f"{decoder}layers.{layer}.")
        if layer is not None:
            key = f"{decoder}layers.{layer}.{names[name]}"
        else:
            key = head + _GLOBAL_NAMES[name] if name == "lm_head" else decoder + _GLOBAL_NAMES[name][len("model."):]
        w = index.get(key)
        return w.T if name in TRANSPOSED else w

    return assemble_params(cfg, get, dtype)


def _expert_tensor(index: _SafetensorsIndex, cfg: ModelConfig, name: str, prefix: str) -> np.ndarray:
    """One layer's router [E, X] or stacked expert weights ([X, E, I] gate/up, [X, I, E] down),
    from per-expert tensors or from the stacked `experts.gate_up_proj` / `experts.down_proj`
    that transformers' own in-memory layout uses."""
    router, module, gate, up, down = _MOE_NAMES[cfg.architecture]
    if name == "router":
        return index.get(prefix + router).T
    per_expert = {"expert_gate": gate, "expert_up": up, "expert_down": down}[name]
    stacked_gate_up = f"{prefix}{module}.gate_up_proj"
    if not index.has(f"{prefix}{module}.0.{per_expert}.weight") and index.has(stacked_gate_up):
        if name == "expert_down":
            return np.swapaxes(index.get(f"{prefix}{module}.down_proj"), 1, 2)  # [X, E, I] -> [X, I, E]
        gu = np.swapaxes(index.get(stacked_gate_up), 1, 2)  # [X, 2I, E] -> [X, E, 2I]
        half = gu.shape[-1] // 2
        return gu[..., :half] if name == "expert_gate" else gu[..., half:]
    return np.stack([index.get(f"{prefix}{module}.{j}.{per_expert}.weight").T for j in range(cfg.num_experts)])
