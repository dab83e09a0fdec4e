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
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import VisionConfig

# Checkpoint names of the tower (under `visual.`), per kind: per block (`blocks.{i}.`), global,
# and (Qwen3-VL) per DeepStack merger (`deepstack_merger_list.{j}.`). `_w` names are linear
# weights, held transposed [in, out].
HF_BLOCK = {
    "qwen2_5_vl": {
        "norm1": "norm1.weight", "norm2": "norm2.weight",
        "qkv_w": "attn.qkv.weight", "qkv_b": "attn.qkv.bias", "proj_w": "attn.proj.weight",
        "proj_b": "attn.proj.bias", "gate_w": "mlp.gate_proj.weight", "gate_b": "mlp.gate_proj.bias",
        "up_w": "mlp.up_proj.weight", "up_b": "mlp.up_proj.bias", "down_w": "mlp.down_proj.weight",
        "down_b": "mlp.down_proj.bias",
    },
    "qwen3_vl": {
        "norm1": "norm1.weight", "norm1_b": "norm1.bias", "norm2": "norm2.weight", "norm2_b": "norm2.bias",
        "qkv_w": "attn.qkv.weight", "qkv_b": "attn.qkv.bias", "proj_w": "attn.proj.weight",
        "proj_b": "attn.proj.bias", "fc1_w": "mlp.linear_fc1.weight", "fc1_b": "mlp.linear_fc1.bias",
        "fc2_w": "mlp.linear_fc2.weight", "fc2_b": "mlp.linear_fc2.bias",
    },
}
HF_GLOBAL = {
    "qwen2_5_vl": {
        "merger_norm": "merger.ln_q.weight", "merger_fc1_w": "merger.mlp.0.weight",
        "merger_fc1_b": "merger.mlp.0.bias", "merger_fc2_w": "merger.mlp.2.weight",
        "merger_fc2_b": "merger.mlp.2.bias",
    },
    "qwen3_vl": {
        "patch_bias": "patch_embed.proj.bias", "pos_embed": "pos_embed.weight",
        "merger_norm": "merger.norm.weight", "merger_norm_b": "merger.norm.bias",
        "merger_fc1_w": "merger.linear_fc1.weight", "merger_fc1_b": "merger.linear_fc1.bias",
        "merger_fc2_w": "merger.linear_fc2.weight", "merger_fc2_b": "merger.linear_fc2.bias",
    },
}
HF_DEEPSTACK = {
    "ds_norm": "norm.weight", "ds_norm_b": "norm.bias", "ds_fc1_w": "linear_fc1.weight",
    "ds_fc1_b": "linear_fc1.bias", "ds_fc2_w": "linear_fc2.weight", "ds_fc2_b": "linear_fc2.bias",
}
_NORM_EPS = 1e-6


def _as_held(name: str, w: np.ndarray) -> np.ndarray:
    """A checkpoint tensor as held here: linear weights transposed to [in, out]."""
    return w.T if name.endswith("_w") else w


def vision_params_from_tensors(get: Any, vc: VisionConfig, dtype: Any) -> dict[str, np.ndarray]:
    """The tower's params from `get(checkpoint name) -> np.ndarray` (names under `visual.`):
    linear weights transposed to [in, out], blocks (and DeepStack mergers) stacked, the patch
    conv as a [patch_dim, C] matmul (its kernel covers a patch row's values in the processor's
    order)."""
    out: dict[str, np.ndarray] = {}
    for name, hf in HF_BLOCK[vc.kind].items():
        out[name] = np.stack([_as_held(name, np.asarray(get(f"blocks.{i}.{hf}"), np.float32))
                              for i in range(vc.depth)])
    conv = np.asarray(get("patch_embed.proj.weight"), np.float32)  # [C, 3, t, p, p]
    expected = (vc.hidden_size, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
    if conv.shape != expected:
        raise ValueError(f"visual.patch_embed.proj.weight has shape {conv.shape}, expected {expected}")
    out["patch_embed"] = conv.reshape(vc.hidden_size, -1).T  # [patch_dim, C]
    for name, hf in HF_GLOBAL[vc.kind].items():
        out[name] = _as_held(name, np.asarray(get(hf), np.float32))
    if vc.deepstack_visual_indexes:
        for name, hf in HF_DEEPSTACK.items():
            out[name] = np.stack([_as_held(name, np.asarray(get(f"deepstack_merger_list.{j}.{hf}"), np.float32))
                                  for j in range(len(vc.deepstack_visual_indexes))])
    _check_shapes(out, vc)
    return {k: np.ascontiguousarray(v).astype(dtype) for k, v in out.items()}


def vision_param_shapes(vc: VisionConfig) -> dict[str, tuple[int, ...]]:
    """The tower's params as `vision_params_from_tensors` holds them."""
    C, F, L, M, E = (vc.hidden_size, vc.intermediate_size, vc.depth, vc.hidden_size * vc.merge_unit,
                     vc.out_hidden_size)  # F: the MLP's width, M: a merged token's, E: the decoder's
    shapes = {
        "norm1": (L, C), "norm2": (L, C), "qkv_w": (L, C, 3 * C), "qkv_b": (L, 3 * C), "proj_w": (L, C, C),
        "proj_b": (L, C), "patch_embed": (vc.patch_dim, C), "merger_norm": (C,),
        "merger_fc1_w": (M, M), "merger_fc1_b": (M,), "merger_fc2_w": (M, E), "merger_fc2_b": (E,),
    }
    if vc.kind == "qwen2_5_vl":
        return {**shapes, "gate_w": (L, C, F), "gate_b": (L, F), "up_w": (L, C, F), "up_b": (L, F),
                "down_w": (L, F, C), "down_b": (L, C)}
    D = len(vc.deepstack_visual_indexes)
    shapes.update({"norm1_b": (L, C), "norm2_b": (L, C), "fc1_w": (L, C, F), "fc1_b": (L, F), "fc2_w": (L, F, C),
                   "fc2_b": (L, C), "patch_bias": (C,), "pos_embed": (vc.num_position_embeddings, C),
                   "merger_norm_b": (C,)})
    if D:
        shapes.update({"ds_norm": (D, M), "ds_norm_b": (D, M), "ds_fc1_w": (D, M, M), "ds_fc1_b": (D, M),
                       "ds_fc2_w": (D, M, E), "ds_fc2_b": (D, E)})
    return shapes


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
    grid_hw: tuple[int, int] = (0, 0)  # the image's patch grid (rows, columns)


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
    return VisionLayout(nwh * nww, patch_of_slot, positions, token_rows, (h, w))


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
                vc: VisionConfig) -> dict[str, np.ndarray]:
    """The encoder's inputs for a program of `num_windows` windows (N = num_windows *
    slots_per_window slots): "pixels" [N, patch_dim] in slot order (0 in padding slots),
    "positions" [N, 2] (row, column), "valid" [N]; Qwen3-VL also "pos_index" / "pos_weight"
    [N, 4]: the learned position grid's bilinear taps for each slot."""
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
    out = {"pixels": pixels, "positions": positions, "valid": valid}
    if vc.kind == "qwen3_vl":
        index, weight = bilinear_taps(positions, layout.grid_hw, math.isqrt(vc.num_position_embeddings))
        out.update(pos_index=np.where(valid[:, None], index, 0), pos_weight=np.where(valid[:, None], weight, 0))
    return out


def bilinear_taps(positions: np.ndarray, grid_hw: tuple[int, int], side: int) -> tuple[np.ndarray, np.ndarray]:
    """The 4 taps [N, 4] (indices into the flattened side x side table) and weights [N, 4] that
    resample the learned grid to an h x w patch grid at `positions` [N, 2], bilinear with
    aligned corners (transformers' `F.interpolate` form), in f32 as it computes them."""
    def axis(index: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
        floor = np.floor(src)
        offsets = np.arange(2)
        taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)
        weights = np.maximum(np.float32(1) - np.abs(src[:, None] - floor[:, None] - offsets), 0).astype(np.float32)
        return taps, weights

    (ht, hw), (wt, ww) = axis(positions[:, 0], grid_hw[0]), axis(positions[:, 1], grid_hw[1])
    index = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4).astype(np.int32)
    weight = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return index, weight


# ---------------------------------------------------------------------- the tower (jax)
def _rms(x: jax.Array, w: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + _NORM_EPS)
    return (w.astype(jnp.float32) * xf).astype(x.dtype)


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + _NORM_EPS)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


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


def _linear(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return (jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _mlp(x: jax.Array, lp: dict[str, jax.Array], vc: VisionConfig) -> jax.Array:
    """The block's MLP: Qwen2.5-VL's gated SiLU, Qwen3-VL's fc1 -> tanh-GELU -> fc2."""
    f32 = jnp.float32
    if vc.kind == "qwen2_5_vl":
        gate, up = _linear(x, lp["gate_w"], lp["gate_b"]), _linear(x, lp["up_w"], lp["up_b"])
        act = (jax.nn.silu(gate.astype(f32)) * up.astype(f32)).astype(x.dtype)
        return _linear(act, lp["down_w"], lp["down_b"])
    act = jax.nn.gelu(_linear(x, lp["fc1_w"], lp["fc1_b"]).astype(f32), approximate=True).astype(x.dtype)
    return _linear(act, lp["fc2_w"], lp["fc2_b"])


def _norm(x: jax.Array, lp: dict[str, jax.Array], name: str) -> jax.Array:
    """RMSNorm (Qwen2.5-VL) or LayerNorm with a bias (Qwen3-VL) by weight `name`."""
    return _layer_norm(x, lp[name], lp[name + "_b"]) if name + "_b" in lp else _rms(x, lp[name])


def _merge(x: jax.Array, p: dict[str, jax.Array], prefix: str, vc: VisionConfig, postshuffle: bool) -> jax.Array:
    """A patch merger: [N, C] -> [N / m^2, O], normed per patch (or, after the shuffle, per
    merged group: Qwen3-VL's DeepStack mergers), then fc1 -> GELU -> fc2."""
    M = vc.merge_unit * vc.hidden_size
    if postshuffle:
        y = _norm(x.reshape(-1, M), p, prefix + "norm")
    else:
        y = _norm(x, p, prefix + "norm").reshape(-1, M)
    y = jax.nn.gelu(_linear(y, p[prefix + "fc1_w"], p[prefix + "fc1_b"]).astype(jnp.float32),
                    approximate=False).astype(x.dtype)
    return _linear(y, p[prefix + "fc2_w"], p[prefix + "fc2_b"])


def encode(params: dict[str, jax.Array], inputs: dict[str, jax.Array], *, vc: VisionConfig) -> jax.Array:
    """`slot_inputs`' arrays (N slots) -> [N / m^2, 1 + D, out_hidden_size]: each merged
    token's row for the decoder's input, then its D DeepStack rows (Qwen3-VL), in slot order
    (padding rows are garbage)."""
    dtype = params["patch_embed"].dtype
    S, H, d = slots_per_window(vc), vc.num_heads, vc.head_dim
    pixels, valid = inputs["pixels"], inputs["valid"]
    n = pixels.shape[0]
    x = jnp.dot(pixels.astype(dtype), params["patch_embed"], preferred_element_type=jnp.float32)
    if "patch_bias" in params:
        x = x + params["patch_bias"].astype(jnp.float32)
    x = x.astype(dtype)
    if "pos_embed" in params:  # the learned grid, resampled to the image's
        taps = jnp.take(params["pos_embed"], inputs["pos_index"], axis=0)  # [N, 4, C]
        x = x + jnp.sum(taps.astype(jnp.float32) * inputs["pos_weight"][..., None], axis=1).astype(dtype)
    cos, sin = _rope_tables(inputs["positions"], vc)
    full = np.zeros(vc.depth, bool)
    full[list(vc.fullatt_block_indexes)] = True
    ds_slot = np.full(vc.depth, -1, np.int32)  # each block's DeepStack merger (-1: none)
    for j, i in enumerate(vc.deepstack_visual_indexes):
        ds_slot[i] = j
    blocks = {k: params[k] for k in HF_BLOCK[vc.kind]}
    deepstack = {k: params[k] for k in HF_DEEPSTACK if k in params}
    scale = d ** -0.5
    D, rows = len(vc.deepstack_visual_indexes), n // vc.merge_unit

    def block(carry, xs):
        x, ds = carry
        lp, is_full, slot = xs
        y = _norm(x, lp, "norm1")
        qkv = _linear(y, lp["qkv_w"], lp["qkv_b"]).reshape(n, 3, H, d)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        attn = jax.lax.cond(is_full, functools.partial(_full_attention, S=S, scale=scale),
                            functools.partial(_window_attention, S=S, scale=scale), q, k, v, valid)
        x = x + _linear(attn.reshape(n, H * d), lp["proj_w"], lp["proj_b"])
        x = x + _mlp(_norm(x, lp, "norm2"), lp, vc)
        if D:
            def with_feature(ds):
                j = jnp.maximum(slot, 0)
                w = jax.tree.map(lambda a: a[j], deepstack)
                return jax.lax.dynamic_update_index_in_dim(ds, _merge(x, w, "ds_", vc, postshuffle=True), j, 0)
            ds = jax.lax.cond(slot >= 0, with_feature, lambda ds: ds, ds)
        return (x, ds), None

    ds0 = jnp.zeros((D, rows, vc.out_hidden_size), dtype)
    (x, ds), _ = jax.lax.scan(block, (x, ds0), (blocks, jnp.asarray(full), jnp.asarray(ds_slot)))
    main = _merge(x, params, "merger_", vc, postshuffle=False)  # [rows, O]
    return jnp.concatenate([main[:, None], jnp.swapaxes(ds, 0, 1)], axis=1)


encode_jit = jax.jit(encode, static_argnames=("vc",))
