"""Assembling the stacked params tree from per-layer tensors, checked against the model's shapes.

Quantized weights follow `jaxserve.quantization`'s representation: `name` holds int8 /
float8_e4m3fn values, `name + "_scale"` one f32 per output channel. A loader's getter returns
either a float array or a `QuantizedTensor` (a pre-quantized checkpoint's values and scales,
already per output channel); `assemble_params` quantizes the float projections itself when a
method is asked for, one layer's tensor at a time, so the model is never held twice in f32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np

from jaxserve.loading.errors import CheckpointError
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import expected_param_shapes
from jaxserve.quantization import (
    QUANTIZED_LAYER_WEIGHTS,
    SCALE_SUFFIX,
    is_quantized,
    method_of,
    quantize_weight,
    scale_name,
    scale_shape,
    storage_dtype,
)

# Projections stored [out, in] by HF and GGUF, kept [in, out] here so activations multiply as x @ W.
TRANSPOSED = frozenset({"lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# Routed experts come stacked per layer ([X, ...]); loaders return them in jaxserve's layout.


class QuantizedTensor(NamedTuple):
    """A weight as a pre-quantized checkpoint holds it: int8 / float8_e4m3fn `values` and an
    f32 `scale` per output channel (the values' shape without the contraction axis)."""

    values: np.ndarray
    scale: np.ndarray

    @property
    def method(self) -> str | None:
        return method_of(self.values.dtype)

    def transposed(self) -> QuantizedTensor:
        """[out, in] -> [in, out] (the scale, per output channel, is unchanged)."""
        return QuantizedTensor(self.values.T, self.scale)

    def dequantized(self, axis: int = -1) -> np.ndarray:
        """f32 values; `axis` is the contraction axis (-1 for the [out, in] layout)."""
        return self.values.astype(np.float32) * np.expand_dims(self.scale.astype(np.float32), axis)


# getter(name, layer) -> array in jaxserve's layout ([in, out] for projections) or a
# QuantizedTensor in that layout, or raises
TensorGetter = Callable[[str, int | None], "np.ndarray | QuantizedTensor"]


def quantized_head_name(cfg: ModelConfig) -> str:
    """The params entry that computes the logits: `lm_head`, or `embed` when tied."""
    return "embed" if cfg.tie_word_embeddings else "lm_head"


def assemble_params(cfg: ModelConfig, get: TensorGetter, dtype: Any, quantization: str | None = None,
                    quantize_lm_head: bool = False) -> dict[str, Any]:
    """Builds {"embed", "layers": {...stacked [L, ...]}, "final_norm", ["lm_head"]} as numpy.

    With `quantization` ("int8" / "fp8"), the layer projections (and, with `quantize_lm_head`,
    the LM head, or the tied embedding per row) are stored quantized with their `_scale`
    entries: a `QuantizedTensor` from the getter is kept as the checkpoint holds it, a float
    one is quantized per output channel from the getter's f32 values. A published quantized
    LM head is kept quantized whatever `quantize_lm_head` says. Everything else is cast to
    `dtype`; scales are f32.
    """
    shapes = expected_param_shapes(cfg)
    out: dict[str, Any] = {"layers": {}}
    head = quantized_head_name(cfg)
    for name, shape in shapes.items():
        if name == "layers":
            continue
        t = get(name, None)
        axis = -1 if name == "embed" else -2
        if isinstance(t, QuantizedTensor) and quantization is not None and name == head:
            _check_method(t, quantization, name)
            out[name] = _checked(t.values, shape, name)
            out[scale_name(name)] = _checked(np.asarray(t.scale, np.float32), scale_shape(name, shape), f"{name} scale")
        elif isinstance(t, QuantizedTensor):
            out[name] = _checked(t.dequantized(axis), shape, name).astype(dtype)
        elif quantization is not None and quantize_lm_head and name == head:
            out[name], out[scale_name(name)] = quantize_weight(_checked(t, shape, name), quantization, axis=axis)
        else:
            out[name] = _checked(t, shape, name).astype(dtype)
    for name, shape in shapes["layers"].items():
        if quantization is None or name not in QUANTIZED_LAYER_WEIGHTS:
            stacked = np.empty(shape, dtype=dtype)
            for i in range(cfg.num_layers):
                t = get(name, i)
                if isinstance(t, QuantizedTensor):  # e.g. a router the checkpoint quantized
                    t = t.dequantized(-2)
                stacked[i] = _checked(t, shape[1:], f"layer {i} {name}")
            out["layers"][name] = stacked
            continue
        values = np.empty(shape, dtype=storage_dtype(quantization))
        scales = np.empty(scale_shape(name, shape), dtype=np.float32)
        for i in range(cfg.num_layers):
            t = get(name, i)
            what = f"layer {i} {name}"
            if isinstance(t, QuantizedTensor):
                _check_method(t, quantization, what)
                values[i] = _checked(t.values, shape[1:], what)
                scales[i] = _checked(np.asarray(t.scale, np.float32), scales.shape[1:], f"{what} scale")
            else:
                values[i], scales[i] = quantize_weight(_checked(t, shape[1:], what), quantization)
        out["layers"][name] = values
        out["layers"][scale_name(name)] = scales
    return out


def quantize_loaded_params(params: dict[str, Any], cfg: ModelConfig, method: str,
                           quantize_lm_head: bool = False) -> dict[str, Any]:
    """`jaxserve.quantization.quantize_params` done in place, one tensor at a time, so each
    full-precision tensor is dropped as soon as its quantized copy exists."""
    layers = params["layers"]
    for name in QUANTIZED_LAYER_WEIGHTS:
        if name in layers and not is_quantized(layers[name]):
            layers[name], layers[scale_name(name)] = quantize_weight(np.asarray(layers[name]), method)
    head = quantized_head_name(cfg)
    if quantize_lm_head and not is_quantized(params[head]):
        params[head], params[scale_name(head)] = quantize_weight(
            np.asarray(params[head]), method, axis=-1 if head == "embed" else -2)
    return params


def quantized_weight_names(params: dict[str, Any]) -> list[str]:
    """Paths ("layers.q_proj", "lm_head", ...) of the quantized weights of a params tree."""
    names = [f"layers.{k}" for k, v in params["layers"].items() if not k.endswith(SCALE_SUFFIX) and is_quantized(v)]
    names += [k for k, v in params.items() if k != "layers" and not k.endswith(SCALE_SUFFIX) and is_quantized(v)]
    return sorted(names)


def quantized_param_shapes(cfg: ModelConfig, quantized: Iterable[str] = ()) -> dict[str, Any]:
    """`expected_param_shapes(cfg)` with a `_scale` entry (`jaxserve.quantization.scale_shape`)
    beside each weight named in `quantized` ("layers.q_proj", "lm_head", "embed", ...)."""
    shapes = expected_param_shapes(cfg)
    shapes = {**shapes, "layers": dict(shapes["layers"])}
    for path in quantized:
        tree, name = (shapes["layers"], path[len("layers."):]) if path.startswith("layers.") else (shapes, path)
        if name not in tree:
            raise CheckpointError(f"quantized weight {path!r} is not a weight of this model")
        tree[scale_name(name)] = scale_shape(name, tuple(tree[name]))
    return shapes


def _check_method(t: QuantizedTensor, method: str, what: str) -> None:
    if t.method != method:
        raise CheckpointError(f"tensor {what} is stored as {t.values.dtype}, expected {method} ({storage_dtype(method)})")


def _checked(arr: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor {what} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    return arr
