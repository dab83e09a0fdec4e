"""Assembling the stacked params tree from per-layer tensors, checked against the model's shapes.

Quantized weights follow `jaxserve.models.quantization`'s representation: `name` holds int8 /
float8_e4m3fn values, `name + "_scale"` one f32 per output channel. A loader's getter returns
either a float array or a `QuantizedTensor` (a pre-quantized checkpoint's values and scales,
already per output channel); `assemble_params` quantizes the float projections itself when a
method is asked for, one layer's tensor at a time, so the model is never held twice in f32.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxserve.loading.errors import CheckpointError
from jaxserve.loading.host_copy import aligned_empty, copy_into
from jaxserve.loading.part import LoadPart, TensorPart
from jaxserve.models.config import ModelConfig
from jaxserve.models.fused import FUSED_GROUPS
from jaxserve.models.quantization import (
    QUANTIZED_LAYER_WEIGHTS,
    SCALE_SUFFIX,
    is_quantized,
    method_of,
    quantize_weight,
    scale_name,
    scale_shape,
    storage_dtype,
)
from jaxserve.models.registry import family_of

# Projections stored [out, in] by HF and GGUF, kept [in, out] here so activations multiply as x @ W.
TRANSPOSED = frozenset({"lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                        # multi-head latent attention and shared experts (models/deepseek.py)
                        "q_a_proj", "q_b_proj", "q_head_proj", "kv_a_proj", "kv_b_proj",
                        "shared_gate", "shared_up", "shared_down", "mtp_eh_proj",
                        # Gemma 4's full-attention layers (models/gemma4.py)
                        "global_q_proj", "global_k_proj", "global_v_proj", "global_o_proj", "reuse_q_proj",
                        "reuse_o_proj", "global_reuse_q_proj", "global_reuse_o_proj", "wide_gate_proj",
                        "wide_up_proj", "wide_down_proj", "ple_gate", "ple_proj", "ple_model_projection",
                        # Qwen3-Next / Qwen3.5's gated attention and Gated DeltaNet (models/qwen3_next.py)
                        "attn_q", "attn_k", "attn_v", "attn_o", "lin_qkvz", "lin_ba", "lin_qkv", "lin_z",
                        "lin_b", "lin_a", "lin_out"})
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
# filler(name, layer, out, part) -> True when it wrote the float tensor (only `part`'s slices
# when given) into `out` (jaxserve's layout, out's dtype), False when the getter must be used
# instead; or raises. Called from several threads at once.
TensorFiller = Callable[[str, int | None, np.ndarray, "TensorPart | None"], bool]


def quantized_head_name(cfg: ModelConfig) -> str:
    """The params entry that computes the logits: `lm_head`, or `embed` when tied."""
    return "embed" if cfg.tie_word_embeddings else "lm_head"


def assemble_params(cfg: ModelConfig, get: TensorGetter, dtype: Any, quantization: str | None = None,
                    quantize_lm_head: bool = False, fill: TensorFiller | None = None, workers: int = 0,
                    part: LoadPart | None = None) -> dict[str, Any]:
    """Builds {"embed", "layers": {...stacked [L, ...]}, "final_norm", ["lm_head"]} as numpy.

    With `quantization` ("int8" / "fp8"), the layer projections (and, with `quantize_lm_head`,
    the LM head, or the tied embedding per row) are stored quantized with their `_scale`
    entries: a `QuantizedTensor` from the getter is kept as the checkpoint holds it, a float
    one is quantized per output channel from the getter's f32 values. A published quantized
    LM head is kept quantized whatever `quantize_lm_head` says. Everything else is in
    `dtype`; scales are f32.

    Float tensors go straight into their place when `fill` can write them (else through
    `get`), every tensor a job on `workers` threads (0: one per core, at most 8). The float
    arrays are 64-byte aligned, and q/k/v (and gate/up) are column slices of one buffer, so
    fusing them later costs no copy (`jaxserve.models.fused`). With `part` (multi-host), `fill`
    writes only the slices it names of each float tensor; the rest stays uninitialised.
    """
    family = family_of(cfg)
    shapes = family.param_shapes(cfg)
    out: dict[str, Any] = {}
    itemsize = np.dtype(dtype).itemsize

    def put_global(name: str, shape: tuple[int, ...]) -> int:
        out.update(_global_entries(cfg, get, fill, name, shape, dtype, quantization, quantize_lm_head,
                                   part.get(name) if part else None))
        return math.prod(shape) * itemsize

    jobs = [functools.partial(put_global, n, s) for n, s in shapes.items() if n != "layers"]
    layer_shapes = shapes["layers"]
    floats = {n: s for n, s in layer_shapes.items() if quantization is None or n not in QUANTIZED_LAYER_WEIGHTS}
    out["layers"] = stacked = float_layer_buffers(floats, dtype)
    for name, shape in layer_shapes.items():
        if name in floats:
            tensor_part = part.get(name) if part else None
            jobs += [functools.partial(_fill_float, get, fill, name, layer, stacked[name][j], tensor_part)
                     for j, layer in enumerate(family.layer_ids(cfg, name))]
            continue
        values = stacked[name] = np.empty(shape, dtype=storage_dtype(quantization))
        scales = stacked[scale_name(name)] = np.empty(scale_shape(name, shape), dtype=np.float32)
        jobs += [functools.partial(_fill_quantized, get, name, layer, values[j], scales[j], quantization)
                 for j, layer in enumerate(family.layer_ids(cfg, name))]
    workers = workers or min(8, os.cpu_count() or 1)
    total = sum(a.nbytes for n, a in stacked.items() if not n.endswith(SCALE_SUFFIX)) + sum(
        math.prod(s) * itemsize for n, s in shapes.items() if n != "layers")
    # A bar on an interactive terminal only (tqdm's `disable=None`); logs get `load_model`'s line.
    with concurrent.futures.ThreadPoolExecutor(workers) as pool, tqdm(
            total=total, desc="Loading weights", unit="B", unit_scale=True, disable=None, leave=False) as bar:
        for done in pool.map(lambda job: job(), jobs):
            bar.update(done)
    return out


def _global_entries(cfg: ModelConfig, get: TensorGetter, fill: TensorFiller | None, name: str,
                    shape: tuple[int, ...], dtype: Any, quantization: str | None, quantize_lm_head: bool,
                    part: TensorPart | None = None) -> dict[str, np.ndarray]:
    """{name: array} for a tensor outside the layers, plus its scale where it is quantized."""
    head = quantized_head_name(cfg)
    quantize_here = quantization is not None and quantize_lm_head and name == head
    buf = aligned_empty(shape, dtype) if not quantize_here else None
    if fill is not None and buf is not None and fill(name, None, buf, part):
        return {name: buf}
    t = get(name, None)
    axis = -1 if name == "embed" else -2
    if isinstance(t, QuantizedTensor) and quantization is not None and name == head:
        _check_method(t, quantization, name)
        return {name: _checked(t.values, shape, name),
                scale_name(name): _checked(np.asarray(t.scale, np.float32), scale_shape(name, shape), f"{name} scale")}
    if quantize_here:
        values, scale = quantize_weight(_checked(t, shape, name), quantization, axis=axis)
        return {name: values, scale_name(name): scale}
    t = t.dequantized(axis) if isinstance(t, QuantizedTensor) else t
    copy_into(_checked(t, shape, name), buf)
    return {name: buf}


def float_layer_buffers(shapes: dict[str, tuple[int, ...]], dtype: Any) -> dict[str, np.ndarray]:
    """Aligned uninitialised stacked arrays for the float layer tensors; each group that the
    model fuses (`FUSED_GROUPS`) as column slices of one buffer."""
    out: dict[str, np.ndarray] = {}
    for parts in FUSED_GROUPS:
        if not all(p in shapes for p in parts):
            continue
        lead = shapes[parts[0]][:-1]
        if any(tuple(shapes[p][:-1]) != tuple(lead) for p in parts):
            continue
        base = aligned_empty((*lead, sum(shapes[p][-1] for p in parts)), dtype)
        start = 0
        for p in parts:
            out[p] = base[..., start:start + shapes[p][-1]]
            start += shapes[p][-1]
    for name, shape in shapes.items():
        if name not in out:
            out[name] = aligned_empty(shape, dtype)
    return out


def _fill_float(get: TensorGetter, fill: TensorFiller | None, name: str, layer: int, dst: np.ndarray,
                part: TensorPart | None = None) -> int:
    """Writes one layer's float tensor (or `part` of it) into `dst`; returns its bytes."""
    if fill is not None and fill(name, layer, dst, part):
        return dst.nbytes
    t = get(name, layer)
    if isinstance(t, QuantizedTensor):  # e.g. a router the checkpoint quantized
        t = t.dequantized(-2)
    copy_into(_checked(t, dst.shape, f"layer {layer} {name}"), dst)
    return dst.nbytes


def _fill_quantized(get: TensorGetter, name: str, layer: int, values: np.ndarray, scales: np.ndarray,
                    quantization: str) -> int:
    """Writes checkpoint layer `layer`'s quantized tensor and its scales into `values` and
    `scales` (its slices of the stacks); returns the values' bytes."""
    t = get(name, layer)
    what = f"layer {layer} {name}"
    if isinstance(t, QuantizedTensor):
        _check_method(t, quantization, what)
        values[...] = _checked(t.values, values.shape, what)
        scales[...] = _checked(np.asarray(t.scale, np.float32), scales.shape, f"{what} scale")
    else:
        values[...], scales[...] = quantize_weight(_checked(t, values.shape, what), quantization)
    return values.nbytes


def freeze_params(params: dict[str, Any]) -> dict[str, Any]:
    """Marks the host arrays read-only (in place; returns `params`): a CPU runner then shares
    their memory instead of copying them, and a stray in-place write fails loudly."""
    for leaf in jax.tree.leaves(params):
        if isinstance(leaf, np.ndarray):
            leaf.flags.writeable = False
    return params


def quantize_loaded_params(params: dict[str, Any], cfg: ModelConfig, method: str,
                           quantize_lm_head: bool = False) -> dict[str, Any]:
    """`jaxserve.models.quantization.quantize_params` done in place, one tensor at a time, so each
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
    """The family's param shapes (`ModelFamily.param_shapes`) with a `_scale` entry (`jaxserve.models.quantization.scale_shape`)
    beside each weight named in `quantized` ("layers.q_proj", "lm_head", "embed", ...)."""
    shapes = family_of(cfg).param_shapes(cfg)
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
