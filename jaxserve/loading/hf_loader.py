"""HF model directories: config.json plus one or more safetensors files."""

from __future__ import annotations

import glob
import json
import logging
import math
import os
from typing import Any

import numpy as np

from jaxserve.loading.errors import CheckpointError, MissingTensorError, ModelFileNotFoundError
from jaxserve.loading.hf_quant import (
    CheckpointQuantization,
    hf_checkpoint_quantization,
    read_linear,
)
from jaxserve.loading.host_copy import copy_into
from jaxserve.loading.mxfp4 import check_mxfp4, dequantize_mxfp4
from jaxserve.loading.params import TRANSPOSED, QuantizedTensor, assemble_params
from jaxserve.loading.part import LoadPart, TensorPart
from jaxserve.loading.safetensors_file import SafetensorsFile, scratch
from jaxserve.models import gemma3_vision
from jaxserve.models.config import ModelConfig
from jaxserve.models.moe import MOE_WEIGHTS
from jaxserve.models.qwen_vision import vision_params_from_tensors
from jaxserve.models.registry import family_of

logger = logging.getLogger(__name__)

def is_hf_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))


def _raw_config(path: str, name: str = "config.json") -> dict[str, Any]:
    cfg_path = os.path.join(path, name)
    try:
        with open(cfg_path) as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ModelFileNotFoundError(f"no {name} in {path}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path} is not valid JSON ({e})") from e


def hf_config(path: str, name: str = "config.json") -> ModelConfig:
    """The model config of config.json; a vision-language checkpoint's image preprocessing
    (preprocessor_config.json beside it) joins it as `preprocessor_config`, since the
    encoder's program shapes follow from its pixel limits."""
    raw = _raw_config(path, name)
    if "vision_config" in raw and "preprocessor_config" not in raw:
        raw = {**raw, "preprocessor_config": preprocessor_config(path)}
    return ModelConfig.from_hf_config(raw)


def load_hf_vision(path: str, cfg: ModelConfig) -> dict[str, np.ndarray] | None:
    """A vision-language checkpoint's image encoder (`visual.*`) as f32 host arrays
    (`qwen_vision.vision_params_from_tensors`); None for a text model."""
    if cfg.vision is None:
        return None
    index = _SafetensorsIndex(path)
    if cfg.vision.kind == "gemma3":
        return _load_gemma3_vision(index, path, cfg)
    prefix = next((p for p in ("visual.", "model.visual.") if index.has(p + "patch_embed.proj.weight")), None)
    if prefix is None:
        raise CheckpointError(f"{path}: {cfg.architecture} needs its image encoder's weights (visual.*), "
                              "which the checkpoint lacks")
    return vision_params_from_tensors(lambda name: index.get(prefix + name), cfg.vision, np.float32)


def _load_gemma3_vision(index: Any, path: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Gemma 3's SigLIP tower and multimodal projector (`gemma3_vision` names)."""
    tower = next((p for p in gemma3_vision.TOWER_PREFIXES if index.has(p + "embeddings.patch_embedding.weight")),
                 None)
    projector = next((p for p in gemma3_vision.PROJECTOR_PREFIXES
                      if index.has(p + "mm_input_projection_weight")), None)
    if tower is None or projector is None:
        raise CheckpointError(f"{path}: {cfg.architecture} needs its image encoder's weights (vision_tower.*, "
                              "multi_modal_projector.*), which the checkpoint lacks")
    return gemma3_vision.vision_params_from_tensors(lambda n: index.get(tower + n), lambda n: index.get(projector + n),
                                                    cfg.vision, np.float32)


def preprocessor_config(path: str) -> dict[str, Any]:
    """preprocessor_config.json of an HF directory ({} when absent: the processor's defaults)."""
    f = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(f):
        return {}
    with open(f, encoding="utf-8") as fh:
        return json.load(fh)


def hf_quantization(path: str) -> CheckpointQuantization | None:
    """The HF directory's own quantization (None: full precision); raises
    `UnsupportedQuantizationError` for a method or scheme jaxserve cannot load."""
    return hf_checkpoint_quantization(_raw_config(path), path)


class _SafetensorsIndex:
    """Finds each tensor in whichever shard holds it (the shards `model.safetensors.index.json`
    lists, else every `*.safetensors` file)."""

    def __init__(self, path: str):
        self._files = [SafetensorsFile(f) for f in _shard_files(path)]
        self._where = {name: f for f in self._files for name in f.tensors}
        self.path = path

    def has(self, name: str) -> bool:
        return name in self._where

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._files)

    @property
    def nbytes(self) -> int:
        """The tensors' bytes in every shard."""
        return sum(t.nbytes for f in self._files for t in f.tensors.values())

    def _file(self, name: str) -> SafetensorsFile:
        f = self._where.get(name)
        if f is None:
            raise MissingTensorError(f"safetensors checkpoint {self.path} is missing tensor {name!r}")
        return f

    def raw(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype."""
        return self._file(name).read(name)

    def get(self, name: str) -> np.ndarray:
        return _float_tensor(self.raw(name), name, f"safetensors checkpoint {self.path}")

    def fill(self, name: str, out: np.ndarray, transpose: bool, part: TensorPart | None = None) -> None:
        """Reads float tensor `name` into `out` (transposed from [out, in] when `transpose`),
        cast to out's dtype: straight into `out` when nothing changes, else through this
        thread's scratch buffer. With `part`, only its ranges are read and written."""
        f = self._file(name)
        info = f.info(name)
        _check_float(info.dtype, name, f"safetensors checkpoint {self.path}")
        _check_shape(info.shape, out.shape[::-1] if transpose else out.shape, name, f.path)
        if part is not None:
            self._fill_part(f, name, out, transpose, part)
            return
        if not transpose and info.dtype == out.dtype and out.flags.c_contiguous:
            f.read(name, out)
            return
        staged = f.read(name, scratch(info.nbytes).view(info.dtype).reshape(info.shape))
        copy_into(staged, out, transpose)

    @staticmethod
    def _fill_part(f: SafetensorsFile, name: str, out: np.ndarray, transpose: bool, part: TensorPart) -> None:
        """`fill` of `part`'s ranges: a range of the stored tensor's rows is one read, a
        range of its columns (an [in]-split of a transposed [out, in] weight) a read per row."""
        info = f.info(name)
        axis = part.axis % out.ndim
        stored_axis = out.ndim - 1 - axis if transpose else axis
        for start, stop in part.ranges:
            dst = out[start:stop] if axis == 0 else out[:, start:stop]
            if stored_axis == 0:
                shape = (stop - start, *info.shape[1:])
                buf = scratch(math.prod(shape) * info.dtype.itemsize).view(info.dtype)
                staged = f.read_rows(name, start, stop, buf)
            else:
                buf = scratch(info.shape[0] * (stop - start) * info.dtype.itemsize).view(info.dtype)
                staged = f.read_columns(name, start, stop, buf)
            copy_into(staged, dst, transpose)


def _shard_files(path: str) -> list[str]:
    index_file = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_file):
        try:
            with open(index_file) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index_file} is not a safetensors index ({type(e).__name__}: {e})") from None
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise ModelFileNotFoundError(f"{path}: model.safetensors.index.json lists shards that are missing: "
                                         + ", ".join(missing))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelFileNotFoundError(f"no *.safetensors files in {path}")
    return files


class TensorMapping:
    """HF-named tensors held in memory ({name: array}), read as a checkpoint's would be."""

    def __init__(self, tensors: Any, what: str = "the weight mapping"):
        self._tensors = dict(tensors)
        self.path = what
        self.read: set[str] = set()  # names asked for and found

    def has(self, name: str) -> bool:
        return name in self._tensors

    def raw(self, name: str) -> np.ndarray:
        if name not in self._tensors:
            raise MissingTensorError(f"{self.path} is missing tensor {name!r}")
        self.read.add(name)
        return np.asarray(self._tensors[name])

    def get(self, name: str) -> np.ndarray:
        return _float_tensor(self.raw(name), name, self.path)

    def fill(self, name: str, out: np.ndarray, transpose: bool, part: TensorPart | None = None) -> None:
        """Writes the whole tensor (it is in memory already), whatever `part` says."""
        arr = self.raw(name)
        _check_float(arr.dtype, name, self.path)
        _check_shape(arr.shape, out.shape[::-1] if transpose else out.shape, name, self.path)
        copy_into(arr, out, transpose)


def _check_float(dtype: np.dtype, name: str, where: str) -> None:
    """Integer or 8-bit float storage is refused: reading it as floats without its scale
    would load garbage."""
    if dtype.kind not in "fV" or dtype.itemsize < 2:  # V: ml_dtypes (bfloat16, float8_*)
        raise CheckpointError(f"{where}: tensor {name!r} is stored as {dtype}, not as floating point, "
                              "and no scale jaxserve reads is stored beside it")


def _check_shape(shape: tuple[int, ...], expected: tuple[int, ...], name: str, where: str) -> None:
    if tuple(shape) != tuple(expected):
        raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(shape)}, expected {tuple(expected)}")


def _float_tensor(arr: np.ndarray, name: str, where: str) -> np.ndarray:
    """A floating-point tensor as f32 (see `_check_float`)."""
    _check_float(arr.dtype, name, where)
    return arr.astype(np.float32, copy=False)


# Where the decoder sits: causal-LM checkpoints, then the language model of a multimodal one
# (Gemma 3 4B-27B) as published and as transformers 5 names it in memory.
_DECODER_PREFIXES = (("model.", ""), ("language_model.model.", "language_model."), ("model.language_model.", ""))


def load_hf_params(path: str, cfg: ModelConfig, dtype: Any, quantization: str | None = None,
                   quantize_lm_head: bool = False, published: str | None = None, index: Any = None,
                   part: LoadPart | None = None) -> dict[str, Any]:
    """The params tree; `quantization` as `assemble_params` takes it, `published` the
    checkpoint's own method (`hf_quantization`), which `quantization` must equal when set.
    `index`: tensors from elsewhere than `path`'s safetensors (`TensorMapping`). `part`: the
    slices this process reads of each float tensor (`loading.part`); the rest stays unwritten."""
    index = _SafetensorsIndex(path) if index is None else index
    get, fill = hf_tensor_getter(index, cfg, published), hf_tensor_filler(index, cfg)
    params = assemble_params(cfg, get, dtype, quantization, quantize_lm_head, fill=fill, part=part)
    if part is not None and isinstance(index, _SafetensorsIndex):
        logger.info("%s: read %.2f GB, %.0f%% of the checkpoint's %.2f GB (the slices this process's devices "
                    "hold)", path, index.bytes_read / 1e9, 100 * index.bytes_read / max(index.nbytes, 1),
                    index.nbytes / 1e9)
    return params


def _hf_names(index: Any, cfg: ModelConfig) -> tuple[Any, str]:
    """(`key(name, layer)`: the HF name of our tensor `name` of `layer`, None for the global
    ones; the decoder's prefix)."""
    names = family_of(cfg).hf_weight_names(cfg)
    decoder, head = next(((d, h) for d, h in _DECODER_PREFIXES if index.has(d + "embed_tokens.weight")),
                         _DECODER_PREFIXES[0])

    def key(name: str, layer: int | None) -> str:
        if layer is not None:
            return f"{decoder}layers.{layer}.{names.layers[name]}"
        return head + names.globals[name] if name == "lm_head" else decoder + names.globals[name][len("model."):]

    return key, decoder


def hf_tensor_getter(index: Any, cfg: ModelConfig, published: str | None = None) -> Any:
    """`get(name, layer)` for `assemble_params`: our tensor `name` (of `layer`, None for the
    global ones) read from `index` under its HF name, transposed where we store it so."""
    key_of, decoder = _hf_names(index, cfg)

    def get(name: str, layer: int | None) -> np.ndarray | QuantizedTensor:
        if layer is not None and name in _EXPERT_TENSORS:
            return _expert_tensor(index, cfg, name, f"{decoder}layers.{layer}.", published)
        key = key_of(name, layer)
        if name in TRANSPOSED:
            return _transposed(read_linear(index, key.removesuffix(".weight"), published))
        return index.get(key)

    return get


def hf_tensor_filler(index: Any, cfg: ModelConfig) -> Any:
    """`fill(name, layer, out) -> bool` for `assemble_params`: writes a float tensor straight
    into its place in the params (transposed and cast in one pass); False where the tensor
    needs `get` (routed experts, a tensor stored quantized)."""
    key_of, _ = _hf_names(index, cfg)

    def fill(name: str, layer: int | None, out: np.ndarray, part: TensorPart | None = None) -> bool:
        if layer is not None and name in _EXPERT_TENSORS:
            return False
        key = key_of(name, layer)
        module = key.removesuffix(".weight")
        if any(index.has(module + suffix) for suffix in (".weight_scale", ".weight_packed", ".weight_scale_inv")):
            return False
        index.fill(key, out, transpose=name in TRANSPOSED, part=part)
        return True

    return fill


def _transposed(t: np.ndarray | QuantizedTensor) -> np.ndarray | QuantizedTensor:
    """[..., out, in] -> [..., in, out]."""
    return t.transposed() if isinstance(t, QuantizedTensor) else np.swapaxes(t, -1, -2)


def _expert_tensor(index: _SafetensorsIndex, cfg: ModelConfig, name: str, prefix: str,
                   published: str | None = None) -> np.ndarray | QuantizedTensor:
    """One layer's router [E, X] or stacked expert weights ([X, E, I] gate/up, [X, I, E] down),
    from per-expert tensors or from the stacked `experts.gate_up_proj` / `experts.down_proj`
    that transformers' own in-memory layout uses. Quantized per-expert weights stack into one
    QuantizedTensor ([X, in, out] values, [X, out] scales)."""
    experts = family_of(cfg).hf_weight_names(cfg).experts
    if experts is None:
        raise CheckpointError(f"{cfg.architecture} has no routed-expert weight names")
    router, module, gate, up, down = experts
    if name == "router":
        return _transposed(read_linear(index, (prefix + router).removesuffix(".weight"), published))
    layout = family_of(cfg).hf_weight_names(cfg).stacked_experts
    if layout != "halves":
        return _in_out_expert_tensor(index, cfg, name, f"{prefix}{module}", layout == "interleaved")
    per_expert = {"expert_gate": gate, "expert_up": up, "expert_down": down}[name]
    stacked_gate_up = f"{prefix}{module}.gate_up_proj"
    if not index.has(f"{prefix}{module}.0.{per_expert}.weight") and index.has(stacked_gate_up):
        if name == "expert_down":
            return np.swapaxes(index.get(f"{prefix}{module}.down_proj"), 1, 2)  # [X, E, I] -> [X, I, E]
        gu = np.swapaxes(index.get(stacked_gate_up), 1, 2)  # [X, 2I, E] -> [X, E, 2I]
        half = gu.shape[-1] // 2
        return gu[..., :half] if name == "expert_gate" else gu[..., half:]
    experts = [read_linear(index, f"{prefix}{module}.{j}.{per_expert}", published) for j in range(cfg.num_experts)]
    if not any(isinstance(t, QuantizedTensor) for t in experts):
        return np.stack([t.T for t in experts])
    from jaxserve.models.quantization import quantize_weight

    # A quantized checkpoint that left some experts in floats: those are quantized the same way.
    experts = [t if isinstance(t, QuantizedTensor) else QuantizedTensor(*quantize_weight(t, published, axis=-1))
               for t in experts]
    return QuantizedTensor(np.stack([t.values.T for t in experts]), np.stack([t.scale for t in experts]))


# The stacked routed-expert tensors (and gpt-oss's expert biases), read through `_expert_tensor`.
_EXPERT_BIASES = ("expert_gate_bias", "expert_up_bias", "expert_down_bias")
_EXPERT_TENSORS = frozenset(MOE_WEIGHTS + _EXPERT_BIASES)


def _in_out_expert_tensor(index: Any, cfg: ModelConfig, name: str, module: str, interleaved: bool) -> np.ndarray:
    """Experts stacked [X, in, out] in jaxserve's layout: gate / up [X, E, I] from
    `gate_up_proj` [X, E, 2I] (its even / odd columns when `interleaved`, gpt-oss; its two
    halves otherwise, Llama 4), down [X, I, E], and gpt-oss's biases ([X, I], [X, E]), from
    float tensors or from gpt-oss's released MXFP4 `*_blocks` / `*_scales` (stored [X, out, in],
    decoded one expert at a time so the f32 copy of a layer is never held twice)."""
    proj = "down_proj" if name.startswith("expert_down") else "gate_up_proj"
    half = {"expert_gate": 0, "expert_up": 1, "expert_gate_bias": 0, "expert_up_bias": 1}.get(name)

    def columns(t: np.ndarray) -> np.ndarray:  # gate's or up's output columns of a gate_up tensor
        if half is None:
            return t
        width = t.shape[-1] // 2
        return t[..., half::2] if interleaved else t[..., half * width:(half + 1) * width]

    if name.endswith("_bias"):
        return columns(index.get(f"{module}.{proj}_bias"))  # [X, 2I] or [X, E]
    if not index.has(f"{module}.{proj}_blocks"):
        return columns(index.get(f"{module}.{proj}"))  # [X, E, 2I] or [X, I, E]
    if not interleaved:
        raise CheckpointError(f"{module}.{proj}_blocks: MXFP4 experts are read for gpt-oss checkpoints only")
    blocks, scales = index.raw(f"{module}.{proj}_blocks"), index.raw(f"{module}.{proj}_scales")
    X, E, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size  # noqa: E741
    rows, inputs = (E, I) if half is None else (2 * I, E)
    where = f"{module}.{proj}_blocks"
    check_mxfp4(blocks, scales, where, rows, inputs)
    if blocks.shape[0] != X:
        raise CheckpointError(f"MXFP4 tensor {where!r}: blocks {blocks.shape} hold {blocks.shape[0]} experts, "
                              f"expected {X}")
    if half is not None:  # the gate's or the up projection's output rows only
        blocks, scales = blocks[:, half::2], scales[:, half::2]
    out = np.empty((X, inputs, blocks.shape[1]), np.float32)  # [X, in, out]
    for j in range(X):
        out[j] = dequantize_mxfp4(blocks[j], scales[j], where).T
    return out
