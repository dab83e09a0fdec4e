"""Rotary position embeddings as HF computes them: inverse frequencies with the config's scaling
(default, linear, llama3, yarn), the cos/sin tables of a step's positions (times YaRN's attention
factor), and rotate-half rotation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import ModelConfig, yarn_mscale


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [D/2] (f32), with the config's scaling applied, as HF computes them."""
    d = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    s = config.rope_scaling
    if s.kind == "yarn":
        inv = _yarn_inv_freq(inv, d, config.rope_theta, s)
    elif s.kind == "linear":
        inv = inv / s.factor
    elif s.kind == "llama3":
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / s.factor, inv)
        band = s.high_freq_factor - s.low_freq_factor  # 0 (Llama 4 Scout): no medium band to smooth
        if band:
            smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / band
            smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv = np.where(medium, smoothed, scaled)
        else:
            inv = scaled
    return inv.astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, d: int, base: float, s) -> np.ndarray:
    """YaRN: interpolated frequencies (inv / factor) below the correction range, the original
    ones above it, a linear ramp between (transformers' `_compute_yarn_parameters`)."""
    def correction_dim(rotations: float) -> float:
        return d * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv32 = inv.astype(np.float32)
    return (inv32 / s.factor) * (1 - extrapolation) + inv32 * extrapolation


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other scalings)."""
    s = config.rope_scaling
    if s.kind != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return float(s.attention_factor)
    if s.mscale and s.mscale_all_dim:
        return yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    return yarn_mscale(s.factor)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, factor: float = 1.0) -> tuple[jax.Array, jax.Array]:
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    if factor == 1.0:
        return jnp.cos(angles), jnp.sin(angles)  # [T, D/2] each
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def mrope_axes(section: tuple[int, ...], interleaved: bool = False) -> np.ndarray:
    """[D/2]: which position row (t, h, w) turns each frequency. Qwen2-VL: the first
    `section[0]` frequencies turn with t, the next `section[1]` with h, the rest with w.
    Qwen3-VL (interleaved): h on f % 3 == 1 below 3 * section[1], w on f % 3 == 2 below
    3 * section[2], t elsewhere."""
    if not interleaved:
        return np.repeat(np.arange(len(section)), section)
    f = np.arange(sum(section))
    axis = np.zeros_like(f)
    axis[(f % 3 == 1) & (f < 3 * section[1])] = 1
    axis[(f % 3 == 2) & (f < 3 * section[2])] = 2
    return axis


def mrope_tables(positions: jax.Array, inv_freq: np.ndarray, section: tuple[int, ...],
                 factor: float = 1.0, interleaved: bool = False) -> tuple[jax.Array, jax.Array]:
    """Multimodal RoPE: positions [3, T] (t, h, w), each frequency turned by the row
    `mrope_axes` gives it. -> cos, sin [T, D/2]."""
    axis = mrope_axes(section, interleaved)
    pos = jnp.take(positions, jnp.asarray(axis), axis=0).astype(jnp.float32)  # [D/2, T]
    angles = pos.T * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention). x: [T, H, D]; cos, sin: [T, R/2]: the first R dims
    rotate, the rest pass through (partial rotary, R < D: GLM-4.5)."""
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    xf1, xf2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    out = jnp.concatenate([xf1 * c - xf2 * s, xf2 * c + xf1 * s], axis=-1)
    return out.astype(x.dtype)
