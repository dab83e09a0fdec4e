"""Fused projections: one QKV matmul and one gate+up matmul per layer instead of five.

Checkpoints and loaders keep the separate q/k/v and gate/up weights; they are concatenated
here, once, before the params go to the devices. Under tensor parallelism with `shards`
devices the columns are interleaved per shard: shard j's slice of the fused weight is
[q_j | k_j | v_j] (and [gate_j | up_j]), so the usual column split along the last axis
hands each device exactly the heads and halves it had before, and splitting the fused
output back needs no communication.

    qkv_proj      [L, E, shards * (q + 2 kv) / shards]
    qkv_bias      [L, shards * (q + 2 kv) / shards]          (Qwen2's attention bias)
    gate_up_proj  [L, E, shards * 2I / shards]
    expert_gate_up [L, X, E, expert_shards * 2I / expert_shards]   (routed experts)
    expert_gate_up_bias [L, X, expert_shards * 2I / expert_shards]  (gpt-oss's expert biases)

Routed experts are interleaved for `expert_shards`: the tensor-parallel degree when each
device holds a slice of every expert, 1 under expert parallelism (whole experts per device).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxserve.models.config import ModelConfig

QKV = ("q_proj", "k_proj", "v_proj")
QKV_BIAS = ("q_bias", "k_bias", "v_bias")
GATE_UP = ("gate_proj", "up_proj")
EXPERT_GATE_UP = ("expert_gate", "expert_up")
EXPERT_GATE_UP_BIAS = ("expert_gate_bias", "expert_up_bias")  # gpt-oss's experts
# Quantized weights' per-output-channel scales (jaxserve/models/quantization.py) fuse like the columns.
_SCALES = tuple(f"{n}_scale" for n in QKV + GATE_UP + EXPERT_GATE_UP)
FUSED_AWAY = QKV + QKV_BIAS + GATE_UP + EXPERT_GATE_UP + EXPERT_GATE_UP_BIAS + _SCALES
# (parts, fused name, the tensor-parallel shards they are interleaved for: "tp" or "experts")
_FUSIONS = ((QKV, "qkv_proj", "tp"), (QKV_BIAS, "qkv_bias", "tp"), (GATE_UP, "gate_up_proj", "tp"),
            (EXPERT_GATE_UP, "expert_gate_up", "experts"), (EXPERT_GATE_UP_BIAS, "expert_gate_up_bias", "experts"))
# The groups a loader may place side by side in one buffer (`_side_by_side` then fuses them
# without a copy when they are not interleaved).
FUSED_GROUPS = tuple(parts for parts, _, _ in _FUSIONS)


def _interleave(parts: list[Any], shards: int) -> Any:
    """[..., w_i] parts -> [..., sum(w_i)], each shard's columns of every part together."""
    if shards == 1 and (whole := _side_by_side(parts)) is not None:
        return whole
    lead = parts[0].shape[:-1]
    pieces = [p.reshape(*lead, shards, p.shape[-1] // shards) for p in parts]
    return np.concatenate(pieces, axis=-1).reshape(*lead, -1)


def _owner(a: np.ndarray) -> Any:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a.base if a.base is not None else a


def _side_by_side(parts: list[np.ndarray]) -> np.ndarray | None:
    """The [..., sum(w_i)] array that `parts` already are consecutive column slices of (as the
    loader allocates them), as a view; None when they are not laid out so."""
    first = parts[0]
    width = sum(p.shape[-1] for p in parts)
    if first.ndim < 2 or any(p.dtype != first.dtype or p.shape[:-1] != first.shape[:-1] or p.strides != first.strides
                             for p in parts):
        return None
    if first.strides[-1] != first.itemsize or first.strides[-2] != width * first.itemsize:
        return None
    if any(_owner(p) is not _owner(first) for p in parts):
        return None
    offset = 0
    for p in parts:
        if p.ctypes.data != first.ctypes.data + offset * first.itemsize:
            return None
        offset += p.shape[-1]
    whole = np.lib.stride_tricks.as_strided(first, (*first.shape[:-1], width), first.strides,
                                            writeable=first.flags.writeable)
    return whole if whole.flags.c_contiguous else None


def fuse_projections(layers: dict[str, Any], shards: int = 1, expert_shards: int | None = None) -> dict[str, Any]:
    """The layer params with q/k/v (and their biases) and gate/up fused (host numpy arrays).
    `expert_shards` (default: `shards`) is what routed experts' gate/up are interleaved for."""
    out = {k: v for k, v in layers.items() if k not in FUSED_AWAY}
    n_shards = {"tp": shards, "experts": shards if expert_shards is None else expert_shards}
    for parts, fused, kind in _FUSIONS:
        for suffix in ("", "_scale"):
            if parts[0] + suffix in layers:
                out[fused + suffix] = _interleave([np.asarray(layers[k + suffix]) for k in parts], n_shards[kind])
    return out


def fused_layer_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`fuse_projections` on shapes (for abstract params)."""
    out = {k: v for k, v in shapes.items() if k not in FUSED_AWAY}
    for parts, fused, _ in _FUSIONS:
        for suffix in ("", "_scale"):
            if parts[0] + suffix in shapes:
                out[fused + suffix] = (*shapes[parts[0] + suffix][:-1], sum(shapes[k + suffix][-1] for k in parts))
    return out


def split_qkv(qkv: Any, cfg: ModelConfig, shards: int) -> tuple[Any, Any, Any]:
    """The fused projection's output [T, shards * w] -> q [T, Hq*D], k, v [T, Hkv*D]."""
    T = qkv.shape[0]
    wq, wk = cfg.q_size // shards, cfg.kv_size // shards
    x = qkv.reshape(T, shards, wq + 2 * wk)
    q, k, v = x[..., :wq], x[..., wq:wq + wk], x[..., wq + wk:]
    return q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)


def split_gate_up(gu: Any, shards: int) -> tuple[Any, Any]:
    """[T, shards * 2I / shards] -> gate, up [T, I]."""
    T = gu.shape[0]
    x = gu.reshape(T, shards, -1)
    half = x.shape[-1] // 2
    return x[..., :half].reshape(T, -1), x[..., half:].reshape(T, -1)
