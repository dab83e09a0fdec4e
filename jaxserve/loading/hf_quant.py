"""Pre-quantized HF checkpoints: compressed-tensors 8-bit weights, read as published.

A compressed-tensors checkpoint (config.json `quantization_config.quant_method ==
"compressed-tensors"`, written by llm-compressor) stores each quantized linear module as
`<module>.weight` (int8 or float8_e4m3fn, [out, in]) with `<module>.weight_scale` ([out, 1]
per channel, [1] or a scalar per tensor), or, in the "pack-quantized" format, as
`<module>.weight_packed` (int32 words, 32 / num_bits values each) with `<module>.weight_shape`.
Modules in the config's `ignore` list (typically `lm_head`) are stored as plain floats.

jaxserve serves 8-bit symmetric weights with channel or tensor scales (a tensor scale is
broadcast to every output channel, which is exact): int weights as "int8", float weights as
"fp8". Activation quantization in the checkpoint is not applied: the weights are served
weight-only, with activations in full precision. Everything else (4-bit and other widths,
group / block / tensor_group strategies, asymmetric weights, NVFP4 / MXFP formats, sparsity,
transforms) is refused with `UnsupportedQuantizationError` naming the scheme, as is any other
`quant_method` (awq, gptq, bitsandbytes, ...), and MXFP4 outside gpt-oss (whose released experts
`loading/mxfp4.py` decodes at load).

HF's block-scaled fp8 (`quant_method: "fp8"` with `weight_block_size`, DeepSeek-V3's release:
e4m3 `<module>.weight` and one f32 `<module>.weight_scale_inv` per 128x128 block) is
dequantized per tensor at load: the model is then served in its dtype, or quantized again per
output channel when `quantization` is set (per-channel int8 on TPU, fp8 where the GPU has it).

Each stacked params entry holds one dtype, so in a quantized checkpoint a layer projection
left in floats (listed in `ignore`) is quantized at load with the checkpoint's method; a
quantized router is dequantized (routers stay in the model's dtype); a quantized `lm_head`
(not in `ignore`) is kept quantized as published.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ml_dtypes
import numpy as np

from jaxserve.loading.errors import CheckpointError, UnsupportedQuantizationError
from jaxserve.loading.params import QuantizedTensor

log = logging.getLogger(__name__)

_SUPPORTED = ("jaxserve loads compressed-tensors checkpoints with 8-bit symmetric int or float weights "
              "and channel or tensor scales, GGUF Q8_0, or full-precision checkpoints it quantizes "
              "itself (quantization='int8' / 'fp8')")
# Formats by weight type (None: an old config without one; the tensors' dtypes are checked).
_FORMATS = {"int": ("int-quantized", "naive-quantized", "pack-quantized", None),
            "float": ("float-quantized", "naive-quantized", None)}
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
_STORED = {"int8": np.dtype(np.int8), "fp8": _FP8}


@dataclasses.dataclass(frozen=True)
class CheckpointQuantization:
    """What a pre-quantized HF checkpoint holds."""

    method: str  # "int8" | "fp8"
    description: str  # e.g. "compressed-tensors int8 channel (int-quantized)"


def hf_checkpoint_quantization(raw: dict[str, Any], path: str) -> CheckpointQuantization | None:
    """The checkpoint's own quantization from its config.json (None: full precision); raises
    `UnsupportedQuantizationError` naming the method or scheme when jaxserve cannot load it."""
    qc = raw.get("quantization_config")
    if qc is None:
        qc = raw.get("compression_config")  # compressed-tensors' name before transformers adopted it
    if qc is None:
        text = raw.get("text_config")  # multimodal configs may keep it beside the language model's
        qc = text.get("quantization_config") if isinstance(text, dict) else None
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise CheckpointError(f"{path}: config.json quantization_config is not an object")
    method = qc.get("quant_method")
    if method == "mxfp4" and _is_gpt_oss(raw):  # its released experts (`loading/mxfp4.py`); the rest is floats
        log.info("%s: MXFP4 expert weights are dequantized at load (losslessly): served in the model's dtype, or "
                 "quantized again per output channel with quantization='int8' / 'fp8'", path)
        return None
    if method == "fp8" and qc.get("weight_block_size") is not None:
        _check_block_fp8(qc, path)
        log.info("%s: block-scaled fp8 weights (%s blocks) are dequantized at load: served in the model's dtype, "
                 "or quantized again per output channel with quantization='int8' / 'fp8'", path,
                 "x".join(map(str, qc["weight_block_size"])))
        return None
    if method != "compressed-tensors":
        raise UnsupportedQuantizationError(
            f"{path}: quantization method {method!r} (config.json quantization_config.quant_method) "
            f"is not supported; {_SUPPORTED}")
    return _compressed_tensors(qc, path)


def _is_gpt_oss(raw: dict[str, Any]) -> bool:
    """MXFP4 is read where it is published: gpt-oss's expert tensors (other models' MXFP4
    linears are refused with the other methods)."""
    return raw.get("model_type") == "gpt_oss" or "GptOssForCausalLM" in (raw.get("architectures") or [])


def _check_block_fp8(qc: dict[str, Any], path: str) -> None:
    """DeepSeek's published format: e4m3 weights, one f32 `weight_scale_inv` per block."""
    block = qc.get("weight_block_size")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{path}: quantization_config.weight_block_size must be two positive ints, got {block!r}")
    if any(b & (b - 1) for b in block):  # the loader infers each tensor's blocks as powers of two
        raise UnsupportedQuantizationError(f"{path}: block fp8 with weight_block_size {block} is not supported "
                                           "(power-of-two blocks, e.g. DeepSeek's [128, 128])")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedQuantizationError(f"{path}: block fp8 format {qc.get('fmt')!r} is not supported (e4m3)")


def dequantize_blocks(values: np.ndarray, scale_inv: np.ndarray, what: str) -> np.ndarray:
    """Block-scaled weights [out, in] (f32 result): value * scale_inv of its block, the blocks
    tiling the matrix from the top left (the last row and column of blocks may be partial).
    Each block side is the power of two that gives the scales' shape (128 in DeepSeek's
    release: a 576-row weight has 5 block rows), checked to reproduce it; for the power-of-two
    block sizes a checkpoint may declare (`_check_block_fp8`) that is always its own size (a
    dimension within one block has one scale whatever the side)."""
    if scale_inv.ndim != 2 or min(scale_inv.shape) < 1:
        raise CheckpointError(f"{what}: weight_scale_inv has shape {scale_inv.shape}, expected 2-D blocks")
    sides = []
    for dim, blocks in zip(values.shape, scale_inv.shape):
        side = 1 << max(0, (-(-dim // blocks) - 1).bit_length())  # the power of two >= dim / blocks
        if -(-dim // side) != blocks:
            raise CheckpointError(f"{what}: weight_scale_inv {scale_inv.shape} does not tile a weight of shape "
                                  f"{values.shape} in power-of-two blocks")
        sides.append(side)
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), sides[0], axis=0), sides[1], axis=1)
    return values.astype(np.float32) * full[: values.shape[0], : values.shape[1]]


def _refuse(path: str, what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{path}: compressed-tensors {what} is not supported; {_SUPPORTED}")


def _compressed_tensors(qc: dict[str, Any], path: str) -> CheckpointQuantization:
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise _refuse(path, f"quantization_status {status!r} (weights not stored compressed)")
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format") not in (None, "dense"):
        raise _refuse(path, f"sparsity ({sparsity.get('format')!r})")
    if qc.get("transform_config"):
        raise _refuse(path, "transforms (transform_config: rotated weights)")
    groups = qc.get("config_groups") or {}
    top_format = qc.get("format")
    methods: dict[str, str] = {}
    activations = []
    for gname, group in groups.items():
        w = group.get("weights")
        if group.get("input_activations") or group.get("output_activations"):
            activations.append(gname)
        if not w:
            continue
        bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
        fmt = group.get("format") or top_format
        scheme = f"{bits}-bit {kind} {strategy} weights (config group {gname!r}, format {fmt!r})"
        if kind not in _FORMATS:
            raise _refuse(path, f"weight type {kind!r} in {scheme}")
        if bits != 8:
            raise _refuse(path, f"{bits}-bit weights: {scheme}")
        if strategy == "block":
            raise _refuse(path, f"'block' strategy (block_structure {w.get('block_structure')}): {scheme}")
        if strategy in ("group", "tensor_group"):
            raise _refuse(path, f"{strategy!r} strategy (group_size {w.get('group_size')}): {scheme}")
        if strategy not in ("channel", "tensor"):
            raise _refuse(path, f"{strategy!r} strategy: {scheme}")
        if not w.get("symmetric", True):
            raise _refuse(path, f"asymmetric weights (zero points): {scheme}")
        if w.get("dynamic"):
            raise _refuse(path, f"dynamic weight quantization: {scheme}")
        if fmt not in _FORMATS[kind]:
            raise _refuse(path, f"format {fmt!r}: {scheme}")
        methods[gname] = "int8" if kind == "int" else "fp8"
    if not methods:
        raise _refuse(path, "checkpoint without quantized weights (no config group has `weights`)")
    if len(set(methods.values())) > 1:
        raise _refuse(path, f"mix of int8 and fp8 weights across config groups ({methods})")
    method = next(iter(methods.values()))
    if activations:
        log.info("%s: the checkpoint quantizes activations too (config groups %s); jaxserve serves its "
                 "weights weight-only, activations stay in full precision", path, ", ".join(activations))
    if qc.get("kv_cache_scheme"):
        log.info("%s: the checkpoint's kv_cache_scheme is not applied (kv_cache_dtype decides the KV cache)", path)
    formats = sorted({g.get("format") or top_format for g in groups.values() if g.get("weights")})
    return CheckpointQuantization(method, f"compressed-tensors {method} ({', '.join(map(str, formats))})")


def read_linear(index: Any, module: str, method: str | None) -> np.ndarray | QuantizedTensor:
    """The weight of linear `module` ("model.layers.0.self_attn.q_proj") in HF layout [..., out, in]:
    an f32 array when stored as floats (a full-precision or an ignored module), else its
    8-bit values with one f32 scale per output channel. `index`: hf_loader's safetensors index."""
    if index.has(module + ".weight_scale_inv"):  # block-scaled fp8 (DeepSeek's release)
        values = np.asarray(index.raw(module + ".weight"))
        if values.dtype != _FP8:
            raise CheckpointError(f"{index.path}: tensor {module + '.weight'!r} is stored as {values.dtype} beside a "
                                  f"weight_scale_inv; expected {_FP8}")
        return dequantize_blocks(values, np.asarray(index.raw(module + ".weight_scale_inv")), f"{index.path}: {module}")
    if index.has(module + ".weight_packed"):
        if method != "int8":
            raise CheckpointError(f"{index.path}: {module}.weight_packed in a checkpoint that is not int8 compressed-tensors")
        shape = tuple(int(d) for d in np.asarray(index.raw(module + ".weight_shape")).reshape(-1))
        values = unpack_int8(np.asarray(index.raw(module + ".weight_packed")), shape, f"{module}.weight_packed")
    else:
        key = module + ".weight"
        if not index.has(module + ".weight_scale"):
            return index.get(key)  # floats (get refuses quantized dtypes without a scale)
        values = np.asarray(index.raw(key))
        if method is None:
            raise CheckpointError(f"{index.path}: {module}.weight_scale is stored, but config.json has no "
                                  "quantization_config saying how the weights are quantized")
        if values.dtype != _STORED[method]:
            raise CheckpointError(
                f"{index.path}: tensor {key!r} is stored as {values.dtype} beside a weight_scale; "
                f"expected {_STORED[method]} for this checkpoint's {method} weights")
    if index.has(module + ".weight_zero_point"):
        raise UnsupportedQuantizationError(f"{index.path}: {module}.weight_zero_point: asymmetric weights are not supported")
    scale = np.asarray(index.raw(module + ".weight_scale")).astype(np.float32)
    out_shape = values.shape[:-1]
    if scale.size == 1:  # tensor strategy: the same factor for every output channel
        scale = np.full(out_shape, scale.reshape(()), np.float32)
    elif scale.shape in (out_shape, (*out_shape, 1)):  # channel strategy
        scale = scale.reshape(out_shape)
    else:
        raise CheckpointError(
            f"{index.path}: {module}.weight_scale has shape {scale.shape}; expected {(*out_shape, 1)} "
            f"(channel) or (1,) (tensor) for a weight of shape {values.shape}")
    return QuantizedTensor(values, scale)


def unpack_int8(packed: np.ndarray, shape: tuple[int, ...], what: str) -> np.ndarray:
    """compressed-tensors' pack-quantized 8-bit weights: each int32 word holds 4 consecutive
    values of a row (along the input dimension), value i in bits 8i..8i+7 as `value + 128`."""
    if packed.dtype != np.int32 or packed.shape[:-1] != shape[:-1] or packed.shape[-1] * 4 < shape[-1]:
        raise CheckpointError(f"{what}: {packed.dtype} {packed.shape} does not hold 8-bit values of shape {shape}")
    as_bytes = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)
    as_bytes = as_bytes.reshape(*shape[:-1], packed.shape[-1] * 4)[..., : shape[-1]]
    return (as_bytes.astype(np.int16) - 128).astype(np.int8)
