"""Gemma 3's image encoder: a SigLIP ViT over the image's fixed patch grid, then the
multimodal projector (average pooling to `tokens_per_image` tokens, Gemma's RMSNorm, a
projection to the decoder's width).

Every image is resized to one size, so the encoder has one program shape: a batch of one
image's patches (`ShapeKey("vision", 1)`), planned and warmed with the steps. Attention is
plain bidirectional softmax attention over all patches (XLA's dots; 4096 patches for the
896-pixel images of the released checkpoints).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models.config import UnsupportedModelError, VisionConfig

# Checkpoint names under the tower's prefix (released files: `vision_tower.vision_model.`;
# transformers 5 saves `vision_tower.`): ours -> theirs, per block and global.
HF_BLOCK = {
    "ln1_w": "layer_norm1.weight", "ln1_b": "layer_norm1.bias", "ln2_w": "layer_norm2.weight",
    "ln2_b": "layer_norm2.bias", "q_w": "self_attn.q_proj.weight", "q_b": "self_attn.q_proj.bias",
    "k_w": "self_attn.k_proj.weight", "k_b": "self_attn.k_proj.bias", "v_w": "self_attn.v_proj.weight",
    "v_b": "self_attn.v_proj.bias", "o_w": "self_attn.out_proj.weight", "o_b": "self_attn.out_proj.bias",
    "fc1_w": "mlp.fc1.weight", "fc1_b": "mlp.fc1.bias", "fc2_w": "mlp.fc2.weight", "fc2_b": "mlp.fc2.bias",
}
HF_GLOBAL = {"patch_b": "embeddings.patch_embedding.bias", "pos_embed": "embeddings.position_embedding.weight",
             "post_w": "post_layernorm.weight", "post_b": "post_layernorm.bias"}
HF_PROJECTOR = {"mm_norm": "mm_soft_emb_norm.weight", "mm_proj": "mm_input_projection_weight"}
TOWER_PREFIXES = ("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                  "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def num_patches(vc: VisionConfig) -> int:
    return (vc.image_size // vc.patch_size) ** 2


def vision_config_from_hf(hf: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """A `Gemma3ForConditionalGeneration` config.json (with `preprocessor_config` beside it,
    when the checkpoint has one) -> the tower's config."""
    v = hf.get("vision_config") or {}
    pre = hf.get("preprocessor_config") or {}
    image_size, patch = int(v.get("image_size", 896)), int(v.get("patch_size", 14))
    tokens = int(hf.get("mm_tokens_per_image", 256))
    side = math.isqrt(tokens)
    if side * side != tokens or (image_size // patch) % side:
        raise UnsupportedModelError(f"gemma3 config: mm_tokens_per_image {tokens} must be a square whose side "
                                    f"divides the patch grid's ({image_size // patch})")
    size = pre.get("size") or {}
    if size and (size.get("height"), size.get("width")) != (image_size, image_size):
        raise UnsupportedModelError(f"gemma3 preprocessor size {size} differs from the tower's image_size "
                                    f"{image_size}")
    if pre.get("do_pan_and_scan"):
        raise UnsupportedModelError("gemma3 preprocessor do_pan_and_scan is not supported (one crop per image)")
    return VisionConfig(
        kind="gemma3",
        depth=int(v.get("num_hidden_layers", 27)),
        hidden_size=int(v.get("hidden_size", 1152)),
        intermediate_size=int(v.get("intermediate_size", 4304)),
        num_heads=int(v.get("num_attention_heads", 16)),
        out_hidden_size=text_hidden_size,
        patch_size=patch,
        temporal_patch_size=1,
        spatial_merge_size=(image_size // patch) // side,
        in_channels=int(v.get("num_channels", 3)),
        window_size=image_size,
        fullatt_block_indexes=tuple(range(int(v.get("num_hidden_layers", 27)))),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        image_token_id=int(hf.get("image_token_index", 262144)),
        vision_start_token_id=int(hf.get("boi_token_index", 255999)),
        vision_end_token_id=int(hf.get("eoi_token_index", 256000)),
        min_pixels=image_size * image_size,
        max_pixels=image_size * image_size,
        image_mean=tuple(float(x) for x in pre.get("image_mean", (0.5, 0.5, 0.5))),
        image_std=tuple(float(x) for x in pre.get("image_std", (0.5, 0.5, 0.5))),
        image_size=image_size,
        layer_norm_eps=float(v.get("layer_norm_eps", 1e-6)),
    )


def vision_param_shapes(vc: VisionConfig) -> dict[str, tuple[int, ...]]:
    C, F, L, E = vc.hidden_size, vc.intermediate_size, vc.depth, vc.out_hidden_size
    shapes = {name: (L, C) for name in ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "q_b", "k_b", "v_b", "o_b", "fc2_b")}
    shapes.update({"q_w": (L, C, C), "k_w": (L, C, C), "v_w": (L, C, C), "o_w": (L, C, C), "fc1_w": (L, C, F),
                   "fc1_b": (L, F), "fc2_w": (L, F, C), "patch_w": (vc.patch_dim, C), "patch_b": (C,),
                   "pos_embed": (num_patches(vc), C), "post_w": (C,), "post_b": (C,), "mm_norm": (C,),
                   "mm_proj": (C, E)})
    return shapes


def vision_params_from_tensors(get_tower: Any, get_projector: Any, vc: VisionConfig,
                               dtype: Any) -> dict[str, np.ndarray]:
    """The tower's and projector's params from `get_*(checkpoint name) -> np.ndarray`:
    linear weights transposed to [in, out], blocks stacked, the patch conv as a
    [3 * p * p, C] matmul over (channel, row, column)-ordered patch values."""
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    out: dict[str, np.ndarray] = {}
    for name, hf in HF_BLOCK.items():
        rows = [f32(get_tower(f"encoder.layers.{i}.{hf}")) for i in range(vc.depth)]
        out[name] = np.stack([r.T if name.endswith("_w") and not name.startswith("ln") else r for r in rows])
    conv = f32(get_tower("embeddings.patch_embedding.weight"))  # [C, 3, p, p]
    if conv.shape != (vc.hidden_size, vc.in_channels, vc.patch_size, vc.patch_size):
        raise ValueError(f"vision patch_embedding.weight has shape {conv.shape}, expected "
                         f"{(vc.hidden_size, vc.in_channels, vc.patch_size, vc.patch_size)}")
    out["patch_w"] = conv.reshape(vc.hidden_size, -1).T
    for name, hf in HF_GLOBAL.items():
        out[name] = f32(get_tower(hf))
    for name, hf in HF_PROJECTOR.items():
        out[name] = f32(get_projector(hf))
    want = vision_param_shapes(vc)
    bad = {k: (v.shape, want[k]) for k, v in out.items() if v.shape != want[k]}
    if bad:
        raise ValueError(f"gemma3 vision params of unexpected shape (got, expected): {bad}")
    return {k: np.ascontiguousarray(v).astype(dtype) for k, v in out.items()}


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _block(x: jax.Array, lp: dict[str, jax.Array], vc: VisionConfig) -> jax.Array:
    """One pre-norm SigLIP block over [N, P, C]."""
    N, P, C = x.shape
    H, Dh = vc.num_heads, vc.head_dim
    h = _layer_norm(x, lp["ln1_w"], lp["ln1_b"], vc.layer_norm_eps)
    q, k, v = ((h @ lp[f"{n}_w"] + lp[f"{n}_b"]).reshape(N, P, H, Dh) for n in ("q", "k", "v"))
    s = jnp.einsum("nqhd,nkhd->nhqk", q, k) * (Dh ** -0.5)  # [N, H, P, P]
    a = jnp.einsum("nhqk,nkhd->nqhd", jax.nn.softmax(s.astype(jnp.float32), -1).astype(v.dtype), v)
    x = x + a.reshape(N, P, C) @ lp["o_w"] + lp["o_b"]
    h = _layer_norm(x, lp["ln2_w"], lp["ln2_b"], vc.layer_norm_eps)
    return x + jax.nn.gelu(h @ lp["fc1_w"] + lp["fc1_b"], approximate=True) @ lp["fc2_w"] + lp["fc2_b"]


def encode(params: dict[str, jax.Array], patches: jax.Array, vc: VisionConfig) -> jax.Array:
    """[N, P, 3 * p * p] patches (row-major over the grid) -> [N, tokens_per_image, 1, E]
    decoder input rows (the 1: no DeepStack rows, the runner's row layout)."""
    N, P, _ = patches.shape
    x = patches.astype(params["patch_w"].dtype) @ params["patch_w"] + params["patch_b"] + params["pos_embed"]
    blocks = {k: params[k] for k in HF_BLOCK}
    x, _ = jax.lax.scan(lambda h, lp: (_block(h, lp, vc), None), x, blocks)
    x = _layer_norm(x, params["post_w"], params["post_b"], vc.layer_norm_eps)
    side, k = vc.image_size // vc.patch_size, vc.spatial_merge_size
    t = side // k
    x = x.reshape(N, t, k, t, k, -1).mean((2, 4)).reshape(N, t * t, -1)  # [N, tokens, C]: k x k average pool
    xf = x.astype(jnp.float32)  # Gemma's RMSNorm (1 + w), in f32
    xf = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + vc.layer_norm_eps)
    x = (xf * (1.0 + params["mm_norm"].astype(jnp.float32))).astype(x.dtype)
    return (x @ params["mm_proj"])[:, :, None, :]


@functools.partial(jax.jit, static_argnames=("vc",))
def encode_jit(params: dict[str, jax.Array], inputs: dict[str, jax.Array], *, vc: VisionConfig) -> jax.Array:
    return encode(params, inputs["patches"], vc)
