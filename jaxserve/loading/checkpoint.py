"""Orbax checkpoints of converted params, so serving restarts skip dequantization and reshaping.

Layout of a converted directory:
    jaxserve_model.json   model config, dtype and quantization (written last: its presence
                          marks a complete save)
    params/               orbax PyTree checkpoint of the params tree
    tokenizer/            the tokenizer (save_pretrained), chat template included

Quantized params are saved as they are: int8 / float8_e4m3fn values and their f32 `_scale`
entries; `jaxserve_model.json` records the method ("quantization") and which weights hold it
("quantized_weights"), and restoring keeps those dtypes (only float weights take `dtype`).
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from jaxserve.loading.errors import CheckpointError, ModelFileNotFoundError
from jaxserve.loading.params import quantized_weight_names
from jaxserve.models.config import ModelConfig
from jaxserve.models.quantization import SCALE_SUFFIX, check_quantization, method_of, storage_dtype

MARKER = "jaxserve_model.json"


def is_orbax_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER))


def save_checkpoint(dst: str, cfg: ModelConfig, params: dict[str, Any], dtype: str, tokenizer: Any,
                    vision: dict[str, Any] | None = None) -> None:
    """Saves the params (quantized ones as they are, their method read from the params) and a
    vision-language model's image encoder (`vision`, f32 host arrays: `LoadedModel.vision`)."""
    import orbax.checkpoint as ocp

    quantized = quantized_weight_names(params)
    methods = {method_of((params["layers"][p[len("layers."):]] if p.startswith("layers.") else params[p]).dtype)
               for p in quantized}
    if len(methods) > 1:
        raise ValueError(f"params mix quantization methods {sorted(methods)}; a checkpoint holds one")
    method = methods.pop() if methods else None

    dst = os.path.abspath(dst)
    if os.path.exists(os.path.join(dst, "params")):
        raise FileExistsError(f"{dst} already holds a checkpoint; choose an empty destination")
    os.makedirs(dst, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(dst, "params"), jax.tree.map(np.asarray, params))
        if vision is not None:
            ckptr.save(os.path.join(dst, "vision"), {k: np.asarray(v) for k, v in vision.items()})
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(dst, "tokenizer"))
    with open(os.path.join(dst, MARKER), "w") as f:
        json.dump({"format": 1, "dtype": dtype, "model_config": cfg.to_dict(), "quantization": method,
                   "quantized_weights": quantized}, f, indent=1)


def _read_marker(path: str) -> tuple[str, dict[str, Any]]:
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ModelFileNotFoundError(f"{path} is not a jaxserve checkpoint (no {MARKER})")
    try:
        with open(marker) as f:
            return marker, json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{marker} is damaged ({e})") from e


def load_checkpoint_config(path: str) -> tuple[ModelConfig, str]:
    marker, meta = _read_marker(path)
    try:
        return ModelConfig.from_dict(meta["model_config"]), meta["dtype"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{marker} is damaged ({e})") from e


def load_checkpoint_quantization(path: str) -> tuple[str | None, list[str]]:
    """(method, quantized weight paths) of a checkpoint; (None, []) for full precision (and
    for checkpoints saved before quantization was recorded)."""
    marker, meta = _read_marker(path)
    method, quantized = meta.get("quantization"), list(meta.get("quantized_weights") or [])
    try:
        check_quantization(method)
    except ValueError as e:
        raise CheckpointError(f"{marker}: unknown quantization {method!r}") from e
    if bool(method) != bool(quantized):
        raise CheckpointError(f"{marker} is damaged (quantization {method!r} with quantized weights {quantized})")
    return method, quantized


def restore_params(path: str, target_shapes: dict[str, Any], dtype: Any, quantization: str | None = None,
                   quantized: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Restores the params tree; `target_shapes` is the model's expected shape tree (with the
    `_scale` entries of the `quantized` weights: params.quantized_param_shapes). Float weights
    are restored in `dtype`, the quantized ones in `quantization`'s storage dtype, scales in f32."""
    import orbax.checkpoint as ocp

    qset = set(quantized)

    def leaf_dtype(where: str) -> Any:
        if where in qset:
            return storage_dtype(quantization)
        if where.endswith(SCALE_SUFFIX) and where[: -len(SCALE_SUFFIX)] in qset:
            return np.float32
        return dtype

    abstract = {
        k: ({n: jax.ShapeDtypeStruct(tuple(s), leaf_dtype(f"layers.{n}")) for n, s in v.items()} if k == "layers"
            else jax.ShapeDtypeStruct(tuple(v), leaf_dtype(k)))
        for k, v in target_shapes.items()
    }
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(os.path.join(os.path.abspath(path), "params"), abstract)
    except Exception as e:
        raise CheckpointError(f"cannot restore params from {path}: {e}") from e


def restore_vision(path: str, cfg: ModelConfig) -> dict[str, np.ndarray] | None:
    """A vision-language checkpoint's image encoder (f32 host arrays); None for a text model.
    A VL config without its encoder is an error naming what is missing."""
    if cfg.vision is None:
        return None
    where = os.path.join(os.path.abspath(path), "vision")
    if not os.path.isdir(where):
        raise CheckpointError(f"{path}: {cfg.architecture} needs its image encoder's weights, which this "
                              "checkpoint lacks (convert it again from the HF directory)")
    import orbax.checkpoint as ocp

    try:
        with ocp.StandardCheckpointer() as ckptr:
            return {k: np.asarray(v, np.float32) for k, v in ckptr.restore(where).items()}
    except Exception as e:
        raise CheckpointError(f"cannot restore the image encoder from {path}: {e}") from e


def load_checkpoint_tokenizer(path: str) -> Any:
    from jaxserve.loading.tokenizer import tokenizer_from_hf_dir

    tok_dir = os.path.join(path, "tokenizer")
    return tokenizer_from_hf_dir(tok_dir) if os.path.isdir(tok_dir) else None
