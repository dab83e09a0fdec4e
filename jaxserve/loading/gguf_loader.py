"""GGUF (llama.cpp) files: config, weights (numpy dequantization) and tokenizer, without torch."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxserve.loading.errors import CheckpointError, MissingTensorError, ModelFileNotFoundError
from jaxserve.loading.gguf_reader import read_gguf
from jaxserve.loading.params import TRANSPOSED, assemble_params
from jaxserve.models.config import ModelConfig

# jaxserve param name -> GGUF tensor name (per layer names take the layer index).
_GLOBAL_NAMES = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}
_LAYER_NAMES = {
    "input_norm": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "post_norm": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    # routed experts (llama.cpp stacks each layer's experts in one tensor)
    "router": "ffn_gate_inp.weight",
    "expert_gate": "ffn_gate_exps.weight",
    "expert_up": "ffn_up_exps.weight",
    "expert_down": "ffn_down_exps.weight",
}
# Expert tensors arrive [X, out, in] (HF layout per expert); jaxserve keeps [X, in, out].
_STACKED_TRANSPOSED = frozenset({"expert_gate", "expert_up", "expert_down"})


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
        from gguf.quants import dequantize

        t = self._tensors.get(name)
        if t is None:
            raise MissingTensorError(f"GGUF file {self.path} has no tensor {name!r}")
        try:
            arr = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"GGUF file {self.path}: cannot dequantize {name!r} ({e})") from e
        expected = tuple(int(d) for d in reversed(t.shape))
        if arr.size != int(np.prod(expected)):
            raise CheckpointError(f"GGUF file {self.path}: tensor {name!r} is truncated")
        return np.asarray(arr, dtype=np.float32).reshape(expected)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves).

    w: [n_heads * D, in] in HF layout.
    """
    d_half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, d_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(gf: GGUFFile) -> ModelConfig:
    return ModelConfig.from_gguf_metadata(gf.metadata, tie_word_embeddings=not gf.has_tensor("output.weight"))


def load_gguf_params(gf: GGUFFile, cfg: ModelConfig, dtype: Any) -> dict[str, Any]:
    permuted = cfg.architecture in ("llama", "mistral", "mixtral")

    def get(name: str, layer: int | None) -> np.ndarray:
        gname = _GLOBAL_NAMES[name] if layer is None else f"blk.{layer}.{_LAYER_NAMES[name]}"
        w = gf.tensor(gname)
        if permuted and name == "q_proj":
            w = unpermute_qk(w, cfg.num_heads)
        elif permuted and name == "k_proj":
            w = unpermute_qk(w, cfg.num_kv_heads)
        if name in _STACKED_TRANSPOSED:
            return np.swapaxes(w, 1, 2)
        return w.T if name in TRANSPOSED or name == "router" else w

    return assemble_params(cfg, get, dtype)
