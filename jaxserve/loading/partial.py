"""Partial weight updates: some of a model's HF tensors, as params plus a mask of what they cover.

The running params hold projections fused and stacked over layers, so one HF tensor (layer 3's
q_proj, say) is a slice of a larger array. Rather than invert each fusion, the given tensors
are assembled into a whole params tree with zeros elsewhere, and a second tree of the same
shapes holds 1 where a given tensor landed and 0 elsewhere; both then go through the same
fusion, and the runner keeps its own values where the mask is 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxserve.loading.errors import CheckpointError, MissingTensorError
from jaxserve.loading.hf_loader import TensorMapping, hf_tensor_getter
from jaxserve.loading.params import assemble_params
from jaxserve.models.config import ModelConfig
from jaxserve.models.registry import family_of


def load_partial_params(tensors: Mapping[str, Any], cfg: ModelConfig, dtype: Any) -> tuple[dict, dict]:
    """(params with zeros where `tensors` has nothing, a 0/1 f32 mask of what it gave), both
    in the loaded layout. Unknown names are refused (a typo would otherwise change nothing)."""
    index = TensorMapping(tensors, "the partial weight mapping")
    get = hf_tensor_getter(index, cfg)
    shapes = family_of(cfg).param_shapes(cfg)
    given: set[tuple[str, int | None]] = set()

    def expected(name: str, layer: int | None) -> tuple[int, ...]:
        return tuple(shapes["layers"][name][1:]) if layer is not None else tuple(shapes[name])

    def values(name: str, layer: int | None) -> Any:
        try:
            t = get(name, layer)
        except MissingTensorError:
            return np.zeros(expected(name, layer), np.float32)
        given.add((name, layer))
        return t

    params = assemble_params(cfg, values, dtype)
    unknown = sorted(set(tensors) - index.read)
    if unknown:
        raise CheckpointError(f"update_weights: {len(unknown)} tensors are not of this model: {unknown[:5]}")
    if not given:
        raise CheckpointError("update_weights: the mapping holds no tensor of this model")
    mask = assemble_params(cfg, lambda n, i: np.full(expected(n, i), float((n, i) in given), np.float32),
                           np.float32)
    return params, mask
