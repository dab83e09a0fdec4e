"""Weight quantization: the schemes jaxserve serves and the per-channel math, on host arrays.

A quantized projection is held as two entries of the params tree: `name` with int8 (or
float8_e4m3fn) values and `name + "_scale"` with one f32 factor per output channel, the
weight's shape without its contraction axis:

    q_proj [L, E, Hq*D] int8       q_proj_scale [L, Hq*D] f32
    expert_gate [L, X, E, I] int8  expert_gate_scale [L, X, I] f32
    lm_head [E, V] int8            lm_head_scale [V] f32
    embed [V, E] int8 (tied head)  embed_scale [V] f32   (a row per token: its output channel)

so `x @ w` becomes `(x @ w_q) * scale` (pallas_kernels.quantized_matmul). Per-output-channel
scales commute with concatenating columns, so loaders (and pre-quantized checkpoints) hold
the unfused q/k/v and gate/up with their scales, and `models/fused.py` fuses both alike.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

QUANTIZATION_METHODS = ("int8", "fp8")
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
SCALE_SUFFIX = "_scale"

# The layer projections that are quantized (loader names, before fusion).
QUANTIZED_LAYER_WEIGHTS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "expert_gate", "expert_up", "expert_down",
    # multi-head latent attention's plain projections and the shared experts (models/deepseek.py);
    # kv_b_proj, absorbed into the query and the output per head, stays in the activations' dtype
    "q_a_proj", "q_b_proj", "q_head_proj", "kv_a_proj", "shared_gate", "shared_up", "shared_down",
    # Gemma 4's full-attention layers (models/gemma4.py)
    "global_q_proj", "global_k_proj", "global_v_proj", "global_o_proj",
    # Qwen3-Next / Qwen3.5 (models/qwen3_next.py): the full layers' and the linear layers' wide
    # projections; the per-head gate inputs (lin_ba, lin_b, lin_a) stay in the activations' dtype
    "attn_q", "attn_k", "attn_v", "attn_o", "lin_qkvz", "lin_qkv", "lin_z", "lin_out",
)
# After fusion (models/fused.py), as the model holds them.
QUANTIZED_FUSED_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "expert_gate_up", "expert_down",
                           "q_a_proj", "q_b_proj", "q_head_proj", "kv_a_proj", "shared_gate", "shared_up",
                           "shared_down", "global_q_proj", "global_k_proj", "global_v_proj", "global_o_proj",
                           "attn_q", "attn_k", "attn_v", "attn_o", "lin_qkvz", "lin_qkv", "lin_z", "lin_out")

_STORAGE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
_QMAX = {"int8": 127.0, "fp8": float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)}


def check_quantization(method: str | None) -> None:
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS} (or None), got {method!r}")


def check_kv_cache_dtype(name: str) -> None:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def storage_dtype(method: str) -> np.dtype:
    """The dtype a weight quantized with `method` is stored in."""
    check_quantization(method)
    return _STORAGE[method]


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def is_quantized(x: Any) -> bool:
    return np.dtype(x.dtype) in (_STORAGE["int8"], _STORAGE["fp8"], np.dtype(ml_dtypes.float8_e5m2))


def method_of(dtype: Any) -> str | None:
    """"int8" / "fp8" for a quantized storage dtype, None for a float one."""
    dt = np.dtype(dtype)
    if dt == _STORAGE["int8"]:
        return "int8"
    if dt in (_STORAGE["fp8"], np.dtype(ml_dtypes.float8_e5m2)):
        return "fp8"
    return None


def quantize_weight(w: np.ndarray, method: str, axis: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-channel quantization: one scale per slice along every axis but `axis`
    (the contraction axis; -2 for [..., in, out] projections, -1 for an embedding's rows).

    scale = max|w| / qmax over `axis` (1 where a channel is all zeros); int8 values are
    rounded to nearest and lie in [-127, 127], fp8 values are cast (round to nearest even).
    """
    method_dtype = storage_dtype(method)
    w = np.asarray(w)
    wf = w.astype(np.float32, copy=False)
    amax = np.max(np.abs(wf), axis=axis, keepdims=True)
    scale = np.where(amax > 0, amax / _QMAX[method], 1.0).astype(np.float32)
    scaled = wf / scale
    if method == "int8":
        q = np.clip(np.rint(scaled), -127, 127).astype(method_dtype)
    else:
        q = np.clip(scaled, -_QMAX[method], _QMAX[method]).astype(method_dtype)
    return q, np.squeeze(scale, axis=axis)


def dequantize_weight(q: np.ndarray, scale: np.ndarray, axis: int = -2, dtype: Any = np.float32) -> np.ndarray:
    return (np.asarray(q).astype(np.float32) * np.expand_dims(np.asarray(scale, np.float32), axis)).astype(dtype)


def quantize_params(params: dict[str, Any], method: str, quantize_lm_head: bool = False) -> dict[str, Any]:
    """The loader-level params tree (unfused, [in, out] projections) with every linear layer
    quantized per output channel; norms, biases, routers and (unless `quantize_lm_head`) the
    embedding and LM head stay as they are. Weights already quantized are kept."""
    check_quantization(method)
    out = dict(params)
    layers = dict(params["layers"])
    for name in QUANTIZED_LAYER_WEIGHTS:
        if name in layers and not is_quantized(layers[name]):
            layers[name], layers[scale_name(name)] = quantize_weight(layers[name], method)
    out["layers"] = layers
    if quantize_lm_head:
        if "lm_head" in params:
            if not is_quantized(params["lm_head"]):
                out["lm_head"], out[scale_name("lm_head")] = quantize_weight(params["lm_head"], method)
        elif not is_quantized(params["embed"]):  # tied: the embedding is the head, one scale per row
            out["embed"], out[scale_name("embed")] = quantize_weight(params["embed"], method, axis=-1)
    return out


def params_quantization(params: dict[str, Any]) -> str | None:
    """The method the params' layer projections are stored in (None: full precision)."""
    for name, x in params["layers"].items():
        if not name.endswith(SCALE_SUFFIX) and is_quantized(x):
            return method_of(x.dtype)
    return None


def scale_shape(weight_name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale's shape for a weight of `shape` (the contraction axis removed)."""
    if weight_name == "embed":
        return shape[:-1]
    return (*shape[:-2], shape[-1])


def kv_storage_dtype(kv_cache_dtype: str) -> np.dtype | None:
    """The page dtype of a quantized KV cache (None: 'auto', the model dtype)."""
    check_kv_cache_dtype(kv_cache_dtype)
    return {"auto": None, "int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
            "fp8_e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
            "fp8_e5m2": np.dtype(ml_dtypes.float8_e5m2)}[kv_cache_dtype]


def with_scale_shapes(shapes: dict[str, Any], method: str | None, quantize_lm_head: bool = False) -> dict[str, Any]:
    """The expected param shapes (`models.llama.expected_param_shapes`, unfused) with the
    `_scale` entries that quantization `method` adds (unchanged when None)."""
    if method is None:
        return shapes
    out = dict(shapes)
    layers = dict(shapes["layers"])
    for name in QUANTIZED_LAYER_WEIGHTS:
        if name in layers:
            layers[scale_name(name)] = scale_shape(name, layers[name])
    out["layers"] = layers
    if quantize_lm_head:
        head = "lm_head" if "lm_head" in shapes else "embed"
        out[scale_name(head)] = scale_shape(head, shapes[head])
    return out


def param_dtype(name: str, method: str | None, quantize_lm_head: bool, dtype: Any, tied: bool) -> Any:
    """The dtype a param (by its name in the fused tree) is held in under `method`."""
    if method is None:
        return dtype
    if name.endswith(SCALE_SUFFIX):
        return np.float32
    if name in QUANTIZED_FUSED_WEIGHTS or (quantize_lm_head and name == ("embed" if tied else "lm_head")):
        return storage_dtype(method)
    return dtype
