"""HF model directories: config.json plus one or more safetensors files."""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.loading.errors import CheckpointError, MissingTensorError, ModelFileNotFoundError
from jaxserve.loading.hf_quant import (
    CheckpointQuantization,
    hf_checkpoint_quantization,
    read_linear,
)
from jaxserve.loading.params import TRANSPOSED, QuantizedTensor, assemble_params
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


def _raw_config(path: str, name: str = "config.json") -> dict[str, Any]:
    cfg_path = os.path.join(path, name)
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ModelFileNotFoundError(f"no {name} in {path}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e})") from e


def hf_config(path: str, name: str = "config.json") -> ModelConfig:
    return ModelConfig.from_hf_config(_raw_config(path, name))


def hf_quantization(path: str) -> CheckpointQuantization | None:
    """The HF directory's own quantization (None: full precision); raises
    `UnsupportedQuantizationError` for a method or scheme jaxserve cannot load."""
    return hf_checkpoint_quantization(_raw_config(path), path)


class _SafetensorsIndex:
    """Finds each tensor in whichever shard holds it; reads one tensor at a time."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ModelFileNotFoundError(f"no *.safetensors files in {path}")
        self._handles = []
        self._where: dict[str, Any] = {}
        self._file_of: dict[int, str] = {}
        for fname in files:
            try:
                h = safe_open(fname, framework="flax")
            except Exception as e:
                raise CheckpointError(f"cannot read safetensors file {fname}: {e}") from e
            self._handles.append(h)
            self._file_of[id(h)] = fname
            for key in h.keys():
                self._where[key] = h
        self.path = path

    def has(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype."""
        h = self._where.get(name)
        if h is None:
            raise MissingTensorError(f"safetensors checkpoint {self.path} is missing tensor {name!r}")
        if h.get_slice(name).get_dtype() in _FP8_DTYPES:  # safetensors' numpy/flax readers lack them
            return _read_fp8(self._file_of[id(h)], name)
        return np.asarray(h.get_tensor(name))

    def get(self, name: str) -> np.ndarray:
        return _float_tensor(self.raw(name), name, f"safetensors checkpoint {self.path}")


class TensorMapping:
    """HF-named tensors held in memory ({name: array}), read as a checkpoint's would be."""

    def __init__(self, tensors: Any, what: str = "the weight mapping"):
        self._tensors = dict(tensors)
        self.path = what
        self.read: set[str] = set()  # names asked for and found

    def has(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise MissingTensorError(f"{self.path} is missing tensor {name!r}")
        self.read.add(name)
        return np.asarray(self._tensors[name])

    def get(self, name: str) -> np.ndarray:
        return _float_tensor(self.raw(name), name, self.path)


def _float_tensor(arr: np.ndarray, name: str, where: str) -> np.ndarray:
    """A floating-point tensor as f32 (integer or 8-bit float storage is refused: reading it
    as floats without its scale would load garbage)."""
    if arr.dtype.kind not in "fV" or arr.dtype.itemsize < 2:  # V: ml_dtypes (bfloat16, float8_*)
        raise CheckpointError(f"{where}: tensor {name!r} is stored as {arr.dtype}, not as floating point, "
                              "and no scale jaxserve reads is stored beside it")
    return arr.astype(np.float32, copy=False)


_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}


def _read_fp8(fname: str, name: str) -> np.ndarray:
    """An 8-bit float tensor read from the safetensors layout itself (an 8-byte little-endian
    header length, a JSON header of dtype / shape / data_offsets, then the data)."""
    with open(fname, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(n))[name]
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    data = np.memmap(fname, dtype=np.uint8, mode="r", offset=8 + n + begin, shape=(end - begin,))
    if data.size != int(np.prod(shape)):
        raise CheckpointError(f"safetensors file {fname}: tensor {name!r} is truncated")
    return np.array(data).view(_FP8_DTYPES[info["dtype"]]).reshape(shape)


# Where the decoder sits: causal-LM checkpoints, then the language model of a multimodal one
# (Gemma 3 4B-27B) as published and as transformers 5 names it in memory.
_DECODER_PREFIXES = (("model.", ""), ("language_model.model.", "language_model."), ("model.language_model.", ""))


def load_hf_params(path: str, cfg: ModelConfig, dtype: Any, quantization: str | None = None,
                   quantize_lm_head: bool = False, published: str | None = None, index: Any = None) -> dict[str, Any]:
    """The params tree; `quantization` as `assemble_params` takes it, `published` the
    checkpoint's own method (`hf_quantization`), which `quantization` must equal when set.
    `index`: tensors from elsewhere than `path`'s safetensors (`TensorMapping`)."""
    index = _SafetensorsIndex(path) if index is None else index
    return assemble_params(cfg, hf_tensor_getter(index, cfg, published), dtype, quantization, quantize_lm_head)


def hf_tensor_getter(index: Any, cfg: ModelConfig, published: str | None = None) -> Any:
    """`get(name, layer)` for `assemble_params`: our tensor `name` (of `layer`, None for the
    global ones) read from `index` under its HF name, transposed where we store it so."""
    names = _GEMMA_LAYER_NAMES if cfg.sandwich_norms else _LAYER_NAMES
    decoder, head = next(((d, h) for d, h in _DECODER_PREFIXES if index.has(d + "embed_tokens.weight")),
                         _DECODER_PREFIXES[0])

    def get(name: str, layer: int | None) -> np.ndarray | QuantizedTensor:
        if layer is not None and name in MOE_WEIGHTS:
            return _expert_tensor(index, cfg, name, f"{decoder}layers.{layer}.", published)
        if layer is not None:
            key = f"{decoder}layers.{layer}.{names[name]}"
        else:
            key = head + _GLOBAL_NAMES[name] if name == "lm_head" else decoder + _GLOBAL_NAMES[name][len("model."):]
        if name in TRANSPOSED:
            return _transposed(read_linear(index, key.removesuffix(".weight"), published))
        return index.get(key)

    return get


def _transposed(t: np.ndarray | QuantizedTensor) -> np.ndarray | QuantizedTensor:
    """[..., out, in] -> [..., in, out]."""
    return t.transposed() if isinstance(t, QuantizedTensor) else np.swapaxes(t, -1, -2)


def _expert_tensor(index: _SafetensorsIndex, cfg: ModelConfig, name: str, prefix: str,
                   published: str | None = None) -> np.ndarray | QuantizedTensor:
    """One layer's router [E, X] or stacked expert weights ([X, E, I] gate/up, [X, I, E] down),
    from per-expert tensors or from the stacked `experts.gate_up_proj` / `experts.down_proj`
    that transformers' own in-memory layout uses. Quantized per-expert weights stack into one
    QuantizedTensor ([X, in, out] values, [X, out] scales)."""
    router, module, gate, up, down = _MOE_NAMES[cfg.architecture]
    if name == "router":
        return _transposed(read_linear(index, (prefix + router).removesuffix(".weight"), published))
    per_expert = {"expert_gate": gate, "expert_up": up, "expert_down": down}[name]
    stacked_gate_up = f"{prefix}{module}.gate_up_proj"
    if not index.has(f"{prefix}{module}.0.{per_expert}.weight") and index.has(stacked_gate_up):
        if name == "expert_down":
            return np.swapaxes(index.get(f"{prefix}{module}.down_proj"), 1, 2)  # [X, E, I] -> [X, I, E]
        gu = np.swapaxes(index.get(stacked_gate_up), 1, 2)  # [X, 2I, E] -> [X, E, 2I]
        half = gu.shape[-1] // 2
        return gu[..., :half] if name == "expert_gate" else gu[..., half:]
    experts = [read_linear(index, f"{prefix}{module}.{j}.{per_expert}", published) for j in range(cfg.num_experts)]
    if not any(isinstance(t, QuantizedTensor) for t in experts):
        return np.stack([t.T for t in experts])
    from jaxserve.quantization import quantize_weight

    # A quantized checkpoint that left some experts in floats: those are quantized the same way.
    experts = [t if isinstance(t, QuantizedTensor) else QuantizedTensor(*quantize_weight(t, published, axis=-1))
               for t in experts]
    return QuantizedTensor(np.stack([t.values.T for t in experts]), np.stack([t.scale for t in experts]))
