"""Qwen2.5-VL's image encoder: a ViT over 14x14x2 patches with 2-D rotary positions, attention
inside 112-pixel windows (and over the whole image in `fullatt_block_indexes`), and a merger
that turns each 2x2 group of patches into one language-model token.

transformers packs each window's patches back to back and attends over variable-length runs.
A jitted program needs fixed shapes, so here every window gets a fixed run of slots (the
window's patches, then padding): a windowed layer is a batched attention over [windows, slots]
with the padding keys masked, and the full layers attend over every slot. The same keys meet
the same queries in the same softmax, so the result is transformers' up to summation order.
A program's shape is its number of windows (`num_windows`), which the runner buckets.

`vision_layout` (numpy, on the host) places an image's patches in slots; `encode` (jax) runs
the tower over the slots; the runner reorders the merged rows back to the image's token order
(`VisionLayout.token_rows`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import VisionConfig

# Checkpoint names of the tower (under `visual.`), per block (`blocks.{i}.`) and global.
HF_BLOCK = {
    "norm1": "norm1.weight", "norm2": "norm2.weight",
    "qkv_w": "attn.qkv.weight", "qkv_b": "attn.qkv.bias", "proj_w": "attn.proj.weight", "proj_b": "attn.proj.bias",
    "gate_w": "mlp.gate_proj.weight", "gate_b": "mlp.gate_proj.bias", "up_w": "mlp.up_proj.weight",
    "up_b": "mlp.up_proj.bias", "down_w": "mlp.down_proj.weight", "down_b": "mlp.down_proj.bias",
}
HF_GLOBAL = {
    "patch_embed": "patch_embed.proj.weight", "merger_norm": "merger.ln_q.weight",
    "merger_fc1_w": "merger.mlp.0.weight", "merger_fc1_b": "merger.mlp.0.bias",
    "merger_fc2_w": "merger.mlp.2.weight", "merger_fc2_b": "merger.mlp.2.bias",
}
_NORM_EPS = 1e-6


def vision_params_from_tensors(get: Any, vc: VisionConfig, dtype: Any) -> dict[str, np.ndarray]:
    """The tower's params from `get(checkpoint name) -> np.ndarray` (names under `visual.`):
    linear weights transposed to [in, out], blocks stacked [depth, ...], the patch conv as a
    [patch_dim, C] matmul (its kernel covers a patch row's values in the processor's order)."""
    out: dict[str, np.ndarray] = {}
    for name, hf in HF_BLOCK.items():
        layers = [np.asarray(get(f"blocks.{i}.{hf}"), np.float32) for i in range(vc.depth)]
        out[name] = np.stack([w.T if name.endswith("_w") else w for w in layers])
    conv = np.asarray(get(HF_GLOBAL["patch_embed"]), np.float32)  # [C, 3, t, p, p]
    expected = (vc.hidden_size, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
    if conv.shape != expected:
        raise ValueError(f"visual.{HF_GLOBAL['patch_embed']} has shape {conv.shape}, expected {expected}")
    out["patch_embed"] = conv.reshape(vc.hidden_size, -1).T  # [patch_dim, C]
    for name in ("merger_norm", "merger_fc1_w", "merger_fc1_b", "merger_fc2_w", "merger_fc2_b"):
        w = np.asarray(get(HF_GLOBAL[name]), np.float32)
        out[name] = w.T if name.endswith("_w") else w
    _check_shapes(out, vc)
    return {k: np.ascontiguousarray(v).astype(dtype) for k, v in out.items()}


def vision_param_shapes(vc: VisionConfig) -> dict[str, tuple[int, ...]]:
    """The tower's params as `vision_params_from_tensors` holds them."""
    C, F, L, M = vc.hidden_size, vc.intermediate_size, vc.depth, vc.hidden_size * vc.merge_unit  # F: MLP width
    return {
        "norm1": (L, C), "norm2": (L, C), "qkv_w": (L, C, 3 * C), "qkv_b": (L, 3 * C), "proj_w": (L, C, C),
        "proj_b": (L, C), "gate_w": (L, C, F), "gate_b": (L, F), "up_w": (L, C, F), "up_b": (L, F),
        "down_w": (L, F, C), "down_b": (L, C), "patch_embed": (vc.patch_dim, C), "merger_norm": (C,),
        "merger_fc1_w": (M, M), "merger_fc1_b": (M,), "merger_fc2_w": (M, vc.out_hidden_size),
        "merger_fc2_b": (vc.out_hidden_size,),
    }


def _check_shapes(p: dict[str, np.ndarray], vc: VisionConfig) -> None:
    for name, shape in vision_param_shapes(vc).items():
        if p[name].shape != shape:
            raise ValueError(f"vision tower weight {name!r} has shape {p[name].shape}, expected {shape}")


@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """Where an image's patches sit in the encoder's slots (host arrays)."""

    num_windows: int  # windows the image covers (the program needs at least this many)
    patch_of_slot: np.ndarray  # [num_windows * S] int32: the pixel row in each slot (-1: padding)
    positions: np.ndarray  # [num_windows * S, 2] int32: each slot's (row, column) patch position
    token_rows: np.ndarray  # [num_tokens] int32: the merged output row of each image token, in order


def slots_per_window(vc: VisionConfig) -> int:
    return vc.window_patches ** 2


def vision_layout(grid_thw: tuple[int, int, int], vc: VisionConfig) -> VisionLayout:
    """The slots of one image of `grid_thw` patches (t, h, w). The processor emits patches in
    merge groups: row `u * m^2 + i * m + j` is patch (2 bh + i, 2 bw + j) of merged unit
    u = (bh, bw), row-major over the merged grid. Windows tile the merged grid in blocks of
    `window_patches / m` units, row-major; inside a window its units keep row-major order and
    fill the window's first slots (transformers' window order)."""
    t, h, w = (int(x) for x in grid_thw)
    m = vc.spatial_merge_size
    if t != 1 or h % m or w % m:
        raise ValueError(f"image grid {grid_thw} must be one frame of a height and width divisible by {m}")
    units_side = vc.window_patches // m  # merged units per window side
    mh, mw = h // m, w // m
    nwh, nww = -(-mh // units_side), -(-mw // units_side)
    S, unit = slots_per_window(vc), vc.merge_unit
    patch_of_slot = np.full(nwh * nww * S, -1, np.int32)
    positions = np.zeros((nwh * nww * S, 2), np.int32)
    token_rows = np.zeros(mh * mw, np.int32)
    ii, jj = np.divmod(np.arange(unit), m)
    for wy in range(nwh):
        for wx in range(nww):
            base = (wy * nww + wx) * S
            k = 0
            for bh in range(wy * units_side, min(mh, (wy + 1) * units_side)):
                for bw in range(wx * units_side, min(mw, (wx + 1) * units_side)):
                    u = bh * mw + bw
                    rows = slice(base + k * unit, base + (k + 1) * unit)
                    patch_of_slot[rows] = u * unit + np.arange(unit)
                    positions[rows, 0] = bh * m + ii
                    positions[rows, 1] = bw * m + jj
                    token_rows[u] = (base + k * unit) // unit
                    k += 1
    return VisionLayout(nwh * nww, patch_of_slot, positions, token_rows)


def max_windows(vc: VisionConfig) -> int:
    """The most windows an image can cover once resized (heights and widths are multiples of
    patch_size * spatial_merge_size, their product at most max_pixels, the aspect ratio at
    most 200, as transformers' resize bounds them): the largest encoder program."""
    factor = vc.patch_size * vc.spatial_merge_size
    units_side = vc.window_patches // vc.spatial_merge_size
    best = 1
    for h in range(factor, vc.max_pixels // factor + 1, factor):
        w = min(vc.max_pixels // h // factor * factor, 200 * h // factor * factor)
        if w < factor or h > 200 * w:
            continue
        best = max(best, -(-(h // factor) // units_side) * -(-(w // factor) // units_side))
    return best


def window_buckets(vc: VisionConfig) -> tuple[int, ...]:
    """The encoder programs' sizes in windows: powers of two up to `max_windows`, and it."""
    top = max_windows(vc)
    out, b = [], 1
    while b < top:
        out.append(b)
        b *= 2
    return (*out, top)


def slot_inputs(pixel_values: np.ndarray, layout: VisionLayout, num_windows: int,
                vc: VisionConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The encoder's inputs for a program of `num_windows` windows: pixels [N, patch_dim] in
    slot order (0 in padding slots), positions [N, 2] and the valid-slot mask [N] (N =
    num_windows * slots_per_window)."""
    n = num_windows * slots_per_window(vc)
    used = layout.patch_of_slot.shape[0]
    if used > n:
        raise ValueError(f"an image of {layout.num_windows} windows does not fit a program of {num_windows}")
    pixels = np.zeros((n, vc.patch_dim), np.float32)
    valid = np.zeros(n, bool)
    positions = np.zeros((n, 2), np.int32)
    real = layout.patch_of_slot >= 0
    pixels[:used][real] = pixel_values[layout.patch_of_slot[real]]
    valid[:used] = real
    positions[:used] = layout.positions
    return pixels, positions, valid


# ---------------------------------------------------------------------- the tower (jax)
def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + _NORM_EPS)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


def _rope_tables(positions: jax.Array, vc: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [N, head_dim]: the first quarter of the frequencies turn with the row, the
    second with the column, and the halves repeat (rotate-half over the whole head)."""
    quarter = vc.head_dim // 4
    inv = 1.0 / (vc.rope_theta ** (np.arange(0, 2 * quarter, 2, dtype=np.float32) / (2 * quarter)))
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv)  # [N, 2, D/4]
    angles = angles.reshape(positions.shape[0], 2 * quarter)
    angles = jnp.concatenate([angles, angles], axis=-1)  # [N, D]
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None] + rot * sin[:, None]).astype(x.dtype)


def _softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, key_valid: jax.Array, scale: float) -> jax.Array:
    """q [..., Nq, H, d], k/v [..., Nk, H, d], key_valid [..., Nk] -> [..., Nq, H, d]; f32 softmax.
    A row whose keys are all padding gets a uniform average (padding queries only)."""
    s = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(key_valid[..., None, None, :], s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("...hqk,...khd->...qhd", p, v, preferred_element_type=jnp.float32).astype(v.dtype)


def _window_attention(q, k, v, valid, *, S, scale):
    n, H, d = q.shape
    blocks = lambda x: x.reshape(n // S, S, H, d)  # noqa: E731
    return _softmax_attention(blocks(q), blocks(k), blocks(v), valid.reshape(n // S, S), scale).reshape(n, H, d)


def _full_attention(q, k, v, valid, *, S, scale):
    """Every slot attends over the whole image, one window of queries at a time, so the
    scores stay [H, S, N] however large the image."""
    n, H, d = q.shape
    qb = q.reshape(n // S, S, H, d)
    out = jax.lax.map(lambda qw: _softmax_attention(qw, k, v, valid, scale), qb)
    return out.reshape(n, H, d)


def encode(params: dict[str, jax.Array], pixels: jax.Array, positions: jax.Array, valid: jax.Array, *,
           vc: VisionConfig) -> jax.Array:
    """pixels [N, patch_dim], positions [N, 2], valid [N] (slot order, N = windows * S) ->
    merged rows [N / m^2, out_hidden_size] in slot order (padding rows are garbage)."""
    dtype = params["patch_embed"].dtype
    S, H, d = slots_per_window(vc), vc.num_heads, vc.head_dim
    n = pixels.shape[0]
    x = jnp.dot(pixels.astype(dtype), params["patch_embed"], preferred_element_type=jnp.float32).astype(dtype)
    cos, sin = _rope_tables(positions, vc)
    full = np.zeros(vc.depth, bool)
    full[list(vc.fullatt_block_indexes)] = True
    blocks = {k: params[k] for k in HF_BLOCK}
    scale = d ** -0.5

    def linear(x, w, b):
        return (jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)

    def block(x, xs):
        lp, is_full = xs
        y = _rms(x, lp["norm1"])
        qkv = linear(y, lp["qkv_w"], lp["qkv_b"]).reshape(n, 3, H, d)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        attn = jax.lax.cond(is_full, functools.partial(_full_attention, S=S, scale=scale),
                            functools.partial(_window_attention, S=S, scale=scale), q, k, v, valid)
        x = x + linear(attn.reshape(n, H * d), lp["proj_w"], lp["proj_b"])
        y = _rms(x, lp["norm2"])
        gate, up = linear(y, lp["gate_w"], lp["gate_b"]), linear(y, lp["up_w"], lp["up_b"])
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
        return x + linear(act, lp["down_w"], lp["down_b"]), None

    x, _ = jax.lax.scan(block, x, (blocks, jnp.asarray(full)))
    y = _rms(x, params["merger_norm"]).reshape(n // vc.merge_unit, vc.merge_unit * vc.hidden_size)
    y = jax.nn.gelu(linear(y, params["merger_fc1_w"], params["merger_fc1_b"]).astype(jnp.float32),
                    approximate=False).astype(dtype)
    return linear(y, params["merger_fc2_w"], params["merger_fc2_b"])


encode_jit = jax.jit(encode, static_argnames=("vc",))
