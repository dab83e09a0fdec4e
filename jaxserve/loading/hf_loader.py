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

    def get(self, name: str) -> np.ndarray:
        h = self._where.get(name)
        if h is None:
            raise MissingTensorError(f"safetensors checkpoint {self.path} is missing tensor {name!r}")
        return np.asarray(h.get_tensor(name), dtype=np.float32)


def load_hf_params(path: str, cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    index = _SafetensorsIndex(path)

    def get(name: str, layer: int | None) -> np.ndarray:
        key = _GLOBAL_NAMES[name] if layer is None else f"model.layers.{layer}.{_LAYER_NAMES[name]}"
        w = index.get(key)
        return w.T if name in TRANSPOSED else w

    return assemble_params(cfg, get, dtype)
