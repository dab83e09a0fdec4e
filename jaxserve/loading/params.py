"""Assembling the stacked params tree from per-layer tensors, checked against the model's shapes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from jaxserve.loading.errors import CheckpointError
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import expected_param_shapes

# Projections stored [out, in] by HF and GGUF, kept [in, out] here so activations multiply as x @ W.
TRANSPOSED = frozenset({"lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# Routed experts come stacked per layer ([X, ...]); loaders return them in jaxserve's layout.

# getter(name, layer) -> array in jaxserve's layout ([in, out] for projections), or raises
TensorGetter = Callable[[str, int | None], np.ndarray]


def assemble_params(cfg: ModelConfig, get: TensorGetter, dtype: Any) -> dict[str, Any]:
    """Builds {"embed", "layers": {...stacked [L, ...]}, "final_norm", ["lm_head"]} as numpy."""
    shapes = expected_param_shapes(cfg)
    out: dict[str, Any] = {"layers": {}}
    for name, shape in shapes.items():
        if name == "layers":
            continue
        out[name] = _checked(get(name, None), shape, name).astype(dtype)
    for name, shape in shapes["layers"].items():
        stacked = np.empty(shape, dtype=dtype)
        for i in range(cfg.num_layers):
            stacked[i] = _checked(get(name, i), shape[1:], f"layer {i} {name}")
        out["layers"][name] = stacked
    return out


def _checked(arr: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    if tuple(arr.shape) != tuple(shape):
        raise CheckpointError(f"tensor {what} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    return arr
