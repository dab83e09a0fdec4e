"""Orbax checkpoints of converted params, so serving restarts skip dequantization and reshaping.

Layout of a converted directory:
    jaxserve_model.json   model config + dtype (written last: its presence marks a complete save)
    params/               orbax PyTree checkpoint of the params tree
    tokenizer/            the tokenizer (save_pretrained), chat template included
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from jaxserve.loading.errors import CheckpointError, ModelFileNotFoundError
from jaxserve.models.config import ModelConfig

MARKER = "jaxserve_model.json"


def is_orbax_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, MARKER))


def save_checkpoint(dst: str, cfg: ModelConfig, params: dict[str, Any], dtype: str, tokenizer: Any) -> None:
    import orbax.checkpoint as ocp

    dst = os.path.abspath(dst)
    if os.path.exists(os.path.join(dst, "params")):
        raise FileExistsError(f"{dst} already holds a checkpoint; choose an empty destination")
    os.makedirs(dst, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(dst, "params"), jax.tree.map(np.asarray, params))
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(dst, "tokenizer"))
    with open(os.path.join(dst, MARKER), "w") as f:
        json.dump({"format": 1, "dtype": dtype, "model_config": cfg.to_dict()}, f, indent=1)


def load_checkpoint_config(path: str) -> tuple[ModelConfig, str]:
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        raise ModelFileNotFoundError(f"{path} is not a jaxserve checkpoint (no {MARKER})")
    try:
        with open(marker) as f:
            meta = json.load(f)
        return ModelConfig.from_dict(meta["model_config"]), meta["dtype"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{marker} is damaged ({e})") from e


def restore_params(path: str, target_shapes: dict[str, Any], dtype: Any) -> dict[str, Any]:
    """Restores the params tree; `target_shapes` is the model's expected shape tree."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(tuple(s), dtype), target_shapes, is_leaf=lambda x: isinstance(x, tuple)
    )
    try:
        with ocp.StandardCheckpointer() as ckptr:
            return ckptr.restore(os.path.join(os.path.abspath(path), "params"), abstract)
    except Exception as e:
        raise CheckpointError(f"cannot restore params from {path}: {e}") from e


def load_checkpoint_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tok_dir = os.path.join(path, "tokenizer")
    return AutoTokenizer.from_pretrained(tok_dir) if os.path.isdir(tok_dir) else None
