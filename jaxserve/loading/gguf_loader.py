"""GGUF (llama.cpp) files: config, weights (numpy dequantization) and tokenizer, without torch.

Q8_0 projections (blocks of 32 int8 values along the input dimension, one f16 scale per
block) are kept as int8 when the model is loaded int8 (`fold_q8_0`); every other tensor type is
dequantized to f32 (and quantized again by `assemble_params` when a method is asked for).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxserve.loading.errors import CheckpointError, MissingTensorError, ModelFileNotFoundError
from jaxserve.loading.gguf_reader import read_gguf
from jaxserve.loading.host_copy import dequantize_gguf
from jaxserve.loading.params import (
    TRANSPOSED,
    QuantizedTensor,
    assemble_params,
    quantized_head_name,
)
from jaxserve.models.config import ModelConfig
from jaxserve.models.quantization import QUANTIZED_LAYER_WEIGHTS
from jaxserve.models.registry import WeightNames, family_of

# Expert tensors arrive [X, out, in] (HF layout per expert); jaxserve keeps [X, in, out].
_STACKED_TRANSPOSED = frozenset({"expert_gate", "expert_up", "expert_down"})
_Q8_0_BLOCK, _Q8_0_BYTES = 32, 34  # values per block; bytes per block (f16 scale + 32 int8)
# Elements requantized per numpy pass in fold_q8_0 (bounds its f32 temporaries, ~64 MiB each).
_FOLD_CHUNK = 1 << 24


def _dequantize_whole(data: np.ndarray, qtype: Any) -> np.ndarray:
    """A tensor's blocks dequantized in one pass: natively for the 32-value block formats
    (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), else by gguf's numpy block code over the whole tensor
    (gguf's own `dequantize` goes 16 rows at a time: thousands of small numpy calls)."""
    from gguf.quants import _type_traits, dequantize

    native = dequantize_gguf(int(qtype), data)
    if native is not None:
        return native
    traits = _type_traits.get(qtype)
    if traits is None:  # F32, F16, BF16: a view or a cast
        return dequantize(data, qtype)
    traits.init_grid()
    raw = data.view(np.uint8).reshape(-1)
    if raw.size % traits.type_size:
        raise ValueError(f"{raw.size} bytes is not a whole number of {qtype.name} blocks")
    return traits.dequantize_blocks(raw.reshape(-1, traits.type_size)).reshape(-1)


class GGUFFile:
    """A parsed GGUF file: metadata as plain Python values and lazily dequantized tensors."""

    def __init__(self, path: str | os.PathLike[str]):
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ModelFileNotFoundError(f"GGUF file not found: {path}")
        self.path = path
        try:  # the fast header reader; gguf's own reader for what it does not handle
            self.metadata, self._tensors = read_gguf(path)
        except Exception:  # noqa: BLE001 - GGUFReader decides, and names what is wrong
            self.metadata, self._tensors = self._read_with_gguf(path)

    @staticmethod
    def _read_with_gguf(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
        from gguf import GGUFReader

        try:
            reader = GGUFReader(path)
        except Exception as e:  # the reader raises assorted errors on damaged files
            raise CheckpointError(f"cannot read GGUF file {path}: corrupt or truncated ({e})") from e
        metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            try:
                metadata[key] = field.contents()
            except Exception as e:
                raise CheckpointError(f"GGUF file {path}: unreadable metadata field {key!r} ({e})") from e
        return metadata, {t.name: t for t in reader.tensors}

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        """The tensor dequantized to f32 in HF layout ([out, in] for matrices)."""
        t = self._tensors.get(name)
        if t is None:
            raise MissingTensorError(f"GGUF file {self.path} has no tensor {name!r}")
        try:
            arr = _dequantize_whole(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"GGUF file {self.path}: cannot dequantize {name!r} ({e})") from e
        expected = tuple(int(d) for d in reversed(t.shape))
        if arr.size != int(np.prod(expected)):
            raise CheckpointError(f"GGUF file {self.path}: tensor {name!r} is truncated")
        return np.asarray(arr, dtype=np.float32).reshape(expected)

    def tensor_type_name(self, name: str) -> str:
        t = self._tensors.get(name)
        if t is None:
            raise MissingTensorError(f"GGUF file {self.path} has no tensor {name!r}")
        return t.tensor_type.name

    def q8_0(self, name: str) -> QuantizedTensor | None:
        """A Q8_0 tensor as int8 values [..., out, in] with one f32 scale per output row
        (`fold_q8_0`); None when the tensor is not Q8_0."""
        from gguf import GGMLQuantizationType

        t = self._tensors.get(name)
        if t is None:
            raise MissingTensorError(f"GGUF file {self.path} has no tensor {name!r}")
        if t.tensor_type != GGMLQuantizationType.Q8_0:
            return None
        shape = tuple(int(d) for d in reversed(t.shape))
        blocks = np.asarray(t.data).reshape(-1)
        if shape[-1] % _Q8_0_BLOCK or blocks.size != int(np.prod(shape)) // _Q8_0_BLOCK * _Q8_0_BYTES:
            raise CheckpointError(f"GGUF file {self.path}: Q8_0 tensor {name!r} is truncated or malformed")
        return fold_q8_0(blocks.reshape(*shape[:-1], shape[-1] // _Q8_0_BLOCK * _Q8_0_BYTES), shape)


def fold_q8_0(blocks: np.ndarray, shape: tuple[int, ...]) -> QuantizedTensor:
    """Q8_0 rows (`[..., n_blocks * 34]` bytes: per block an f16 scale `d` then 32 int8 `q`,
    the value being `d * q`) as int8 values of `shape` with one f32 scale per row.

    jaxserve's int8 weights have one scale per output channel (a row here), so the block scales
    are folded into the row's: `scale = max|d * q| / 127` over the row, and each value is
    re-rounded once to that scale, `rint(d * q / scale)`, which moves it by at most half a
    step of the row (`scale / 2`). This equals `quantize_weight` of the GGUF's own dequantized
    values (gguf.quants.dequantize), computed with numpy over whole tensors (in chunks of rows
    bounding the f32 temporaries), never the model dequantized at once.
    """
    rows = int(np.prod(shape[:-1]))
    n_blocks = shape[-1] // _Q8_0_BLOCK
    flat = blocks.reshape(rows, n_blocks, _Q8_0_BYTES)
    values = np.empty((rows, shape[-1]), np.int8)
    scale = np.empty(rows, np.float32)
    step = max(1, _FOLD_CHUNK // max(shape[-1], 1))
    for r in range(0, rows, step):
        chunk = flat[r : r + step]
        d = np.ascontiguousarray(chunk[..., :2]).view(np.float16).astype(np.float32)  # [r, n_blocks, 1]
        q = np.ascontiguousarray(chunk[..., 2:]).view(np.int8).astype(np.float32)  # [r, n_blocks, 32]
        w = (q * d).reshape(len(chunk), shape[-1])  # gguf's dequantization, in f32
        amax = np.max(np.abs(w), axis=-1, keepdims=True)
        s = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
        values[r : r + step] = np.clip(np.rint(w / s), -127, 127).astype(np.int8)
        scale[r : r + step] = s[:, 0]
    return QuantizedTensor(values.reshape(shape), scale.reshape(shape[:-1]))


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves).

    w: [n_heads * D, in] in HF layout.
    """
    d_half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(gf: GGUFFile) -> ModelConfig:
    return ModelConfig.from_gguf_metadata(gf.metadata, tie_word_embeddings=not gf.has_tensor("output.weight"))


# Tensor types a Q8_0 file may hold beside its Q8_0 projections (llama.cpp keeps tensors whose
# rows are not a multiple of 32 in a float type).
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _names(cfg: ModelConfig) -> WeightNames:
    names = family_of(cfg).gguf_weight_names
    if names is None:
        raise CheckpointError(f"{cfg.architecture} has no GGUF weight names")
    return names(cfg)


def gguf_quantization(gf: GGUFFile, cfg: ModelConfig) -> str | None:
    """The file's own scheme as jaxserve serves it: "int8" when its layer projections are Q8_0
    (the others, if any, in a float type); None for anything else (Q4_1, F16, k-quants, ...),
    which loads dequantized."""
    types = set()
    names = _names(cfg)
    for layer in range(cfg.num_layers):
        for name in QUANTIZED_LAYER_WEIGHTS:
            if name not in names.layers:  # another family's projection
                continue
            gname = f"blk.{layer}.{names.layers[name]}"
            if gf.has_tensor(gname):
                types.add(gf.tensor_type_name(gname))
    if "Q8_0" in types and types <= {"Q8_0", *_FLOAT_TYPES}:
        return "int8"
    return None


def load_gguf_params(gf: GGUFFile, cfg: ModelConfig, dtype: Any, quantization: str | None = None,
                     quantize_lm_head: bool = False) -> dict[str, Any]:
    """The params tree. Loaded "int8", Q8_0 projections (and, with `quantize_lm_head`, a Q8_0
    LM head or tied embedding) are folded to int8 per output channel (`fold_q8_0`) without
    being dequantized; other tensors are dequantized, and quantized again by `assemble_params`
    when `quantization` is set."""
    family = family_of(cfg)
    permuted = family.gguf_permuted_qk(cfg)
    names = _names(cfg)
    folded = set(QUANTIZED_LAYER_WEIGHTS) | ({quantized_head_name(cfg)} if quantize_lm_head else set())

    def get(name: str, layer: int | None) -> np.ndarray | QuantizedTensor:
        gname = names.globals[name] if layer is None else f"blk.{layer}.{names.layers[name]}"
        q = gf.q8_0(gname) if quantization == "int8" and name in folded else None
        w = gf.tensor(gname) if q is None else q.values
        if permuted and name in ("q_proj", "k_proj"):
            heads = cfg.num_heads if name == "q_proj" else cfg.num_kv_heads
            w = unpermute_qk(w, heads)
            q = None if q is None else QuantizedTensor(w, unpermute_qk(q.scale, heads))
        if name in _STACKED_TRANSPOSED:
            w = np.swapaxes(w, 1, 2)
        elif name in TRANSPOSED or name == "router":
            w = w.T
        # the embedding (a tied head) keeps its [V, E] rows: one scale per token row
        return w if q is None else QuantizedTensor(w, q.scale)

    return assemble_params(cfg, get, dtype, quantization, quantize_lm_head)
