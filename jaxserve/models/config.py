"""The frozen model configuration, built from an HF config.json or from GGUF metadata.

One dataclass covers every family served: the Llama family (Llama, Mistral, Qwen2, Qwen3),
the mixture-of-experts decoders (Qwen3-MoE, Mixtral) and Gemma 2 / Gemma 3 (text). They are
one decoder with a handful of switches: attention bias, q/k norm, tied embeddings, RoPE
scaling; routed experts in place of the dense MLP; Gemma's (1 + w) norms, sandwich norms,
GeGLU, scaled embeddings, soft-caps and per-layer sliding windows and RoPE bases.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxserve.models.kv_groups import KVLayerGroups, plan_layer_groups

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gemma2", "gemma3")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")

HF_ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# HF model_type -> architecture, for configs without `architectures`.
HF_MODEL_TYPES = {**{a: a for a in SUPPORTED_ARCHITECTURES}, "gemma3_text": "gemma3"}
# GGUF general.architecture -> architecture (Mixtral is "llama" with experts in GGUF).
GGUF_ARCH_NAMES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                    "qwen3moe": "qwen3_moe"}


ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax", "topk_sigmoid")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model family or feature jaxserve does not implement."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `kind` is "default", "linear", "llama3" or "yarn" (YaRN's ramp
    between interpolated and extrapolated frequencies, `beta_fast`/`beta_slow` its bounds, and
    its attention factor on cos/sin; `mscale_all_dim` also scales MLA's softmax scale)."""

    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None  # yarn: None derives it from factor and the mscales
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): queries through an optional
    low-rank `q_lora_rank` bottleneck; keys and values from a shared latent of
    `kv_lora_rank` plus one `qk_rope_head_dim` RoPE key per token (what the cache holds)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one plain query projection
    rope_interleave: bool = True  # RoPE pairs are (x0, x1), (x2, x3)... (DeepSeek's layout)

    @property
    def latent_width(self) -> int:
        """Width of a cache row: the latent then the RoPE key (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# The image encoders, and the activation of each one's MLP (transformers' names).
VISION_KINDS = {"qwen2_5_vl": "silu", "qwen3_vl": "gelu_pytorch_tanh", "gemma3": "gelu_pytorch_tanh"}


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image encoder (Qwen2.5-VL's windowed ViT and patch merger) and
    the tokens that carry its output into the prompt: each image becomes `num_tokens`
    `image_token_id`s between `vision_start_token_id` and `vision_end_token_id`, whose input
    embeddings are the encoder's output rows."""

    kind: str  # "qwen2_5_vl" | "qwen3_vl" | "gemma3" (SigLIP and Gemma 3's pooling projector)
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int  # the merger's output width: the language model's hidden size
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    window_size: int = 112  # pixels per side of a windowed-attention block
    fullatt_block_indexes: tuple[int, ...] = ()  # the blocks that attend over the whole image
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    image_token_id: int = 0
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    tokens_per_second: int = 2
    # The image preprocessing (the checkpoint's preprocessor_config.json): images are resized
    # to between min_pixels and max_pixels, which bounds the encoder's program shapes.
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)
    # Qwen3-VL: a learned square grid of position embeddings resampled (bilinear) to each image's
    # patch grid, and the blocks whose outputs feed the decoder's first layers (DeepStack: one
    # merger each, added to the image tokens' hidden states after decoder layer i).
    num_position_embeddings: int = 0
    deepstack_visual_indexes: tuple[int, ...] = ()
    # Gemma 3: every image is resized to image_size x image_size; its patch grid is average-
    # pooled over spatial_merge_size x spatial_merge_size patches into mm_tokens_per_image
    # tokens, which attend to each other in both directions in the decoder.
    image_size: int = 0
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kind not in VISION_KINDS:
            raise UnsupportedModelError(f"unsupported vision encoder {self.kind!r}; supported: "
                                        f"{', '.join(VISION_KINDS)}")
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                     "temporal_patch_size", "spatial_merge_size", "in_channels", "window_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"vision config field {name} must be > 0, got {getattr(self, name)}")
        rotary = self.kind != "gemma3"  # SigLIP's positions are learned: no rotary halves
        if self.hidden_size % self.num_heads or (rotary and (self.hidden_size // self.num_heads) % 4):
            raise ValueError(f"vision hidden_size {self.hidden_size} over {self.num_heads} heads must give a head "
                             "width that is a multiple of 4 (2-D rotary halves)")
        if self.window_size % (self.patch_size * self.spatial_merge_size):
            raise ValueError(f"vision window_size {self.window_size} must be a multiple of patch_size * "
                             f"spatial_merge_size ({self.patch_size * self.spatial_merge_size})")
        act = VISION_KINDS[self.kind]
        if self.hidden_act != act:
            raise UnsupportedModelError(f"{self.kind} vision hidden_act {self.hidden_act!r} is not supported "
                                        f"({act} only)")
        if self.kind == "gemma3" and (self.image_size <= 0 or self.image_size % (self.patch_size * self.spatial_merge_size)):
            raise ValueError(f"gemma3 vision image_size {self.image_size} must be a positive multiple of patch_size * "
                             f"the pooling kernel ({self.patch_size * self.spatial_merge_size})")
        if self.kind == "qwen3_vl" and math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {self.num_position_embeddings} must be a square (a grid)")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"vision min_pixels {self.min_pixels} / max_pixels {self.max_pixels}: need 0 < min <= max")
        for name in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if any(not 0 <= i < self.depth for i in getattr(self, name)):
                raise ValueError(f"{name} {getattr(self, name)} must lie in [0, depth={self.depth})")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def bidirectional_images(self) -> bool:
        """An image's tokens attend to each other in both directions in the decoder (Gemma 3),
        so a prefill chunk must hold every token of an image (`SchedulerConfig.whole_images`)."""
        return self.kind == "gemma3"

    @property
    def tokens_per_image(self) -> int:
        """Gemma 3's fixed image token count (0 for the Qwen encoders, whose count follows the
        image's size)."""
        if self.kind != "gemma3":
            return 0
        side = self.image_size // self.patch_size // self.spatial_merge_size
        return side * side

    @property
    def patch_dim(self) -> int:
        """Values per patch row of the pixel input: C * temporal_patch_size * patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches per output token (spatial_merge_size**2)."""
        return self.spatial_merge_size ** 2

    @property
    def window_patches(self) -> int:
        """Patches per side of a windowed-attention block."""
        return self.window_size // self.patch_size


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next, Qwen3.5): every `full_attention_interval`-th layer is
    gated full attention, the others linear attention with `num_key_heads` query/key heads of
    `key_head_dim` and `num_value_heads` value heads of `value_head_dim` (each key head serves
    num_value_heads / num_key_heads of them), after a causal depthwise conv of `conv_kernel`
    taps. `grouped_projection`: q, k, v, z in one projection grouped per key head and b, a in
    another (Qwen3-Next); else four projections (Qwen3.5)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    full_attention_interval: int = 4
    grouped_projection: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): every layer's MLP is `num_experts` SwiGLU
    # experts of width `moe_intermediate_size`, `num_experts_per_tok` of them per token.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    # Routing beyond softmax top-k (DeepSeek-V3, GLM-4.5): "sigmoid" scores choose experts
    # with a per-expert correction bias, within the best `topk_group` of `n_group` groups;
    # "topk_softmax" (gpt-oss): the top k of the biased logits, softmax over those k only;
    # "topk_sigmoid" (Llama 4): the top k logits, each weighted by its sigmoid.
    router_scoring: str = "softmax"  # one of ROUTER_SCORINGS
    n_group: int = 1
    topk_group: int = 1
    group_scoring: str = "top2_sum"  # a group's score: its best two experts' sum (V3) | "max" (V2)
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    first_k_dense_replace: int = 0  # the first k layers have a dense MLP of `intermediate_size`
    mla: MLAConfig | None = None
    # DeepSeek's multi-token-prediction layers: how many the checkpoint holds (after the
    # `num_layers` decoder layers), and how many are served (`with_mtp`: 0 unless speculative
    # decoding's method is "mtp", so a plain engine neither loads them nor gives them pages).
    num_nextn_predict_layers: int = 0
    mtp_layers: int = 0
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dims (GLM-4.5: 0.5)
    # Gemma 2 / 3
    hidden_act: str = "silu"  # "silu" (SwiGLU) | "gelu_tanh" (GeGLU)
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's is 1
    embed_scale: bool = False  # embeddings times sqrt(E), in the params' dtype
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too
    query_pre_attn_scalar: float | None = None  # logits scale is its -1/2 power (else head_dim's)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    # Per-layer sliding windows (0: global attention); None: `sliding_window` on every layer.
    layer_windows: tuple[int, ...] | None = None
    # RoPE base of the sliding-window layers (Gemma 3's local layers; unscaled). None: rope_theta.
    rope_local_theta: float | None = None
    # gpt-oss: one learned logit per query head joins every softmax's denominator (`sinks`
    # [L, Hq]); the attention output projection has a bias (`o_bias` [L, E]); the routed
    # experts' projections have biases; their SwiGLU is clamped (gate <= limit, |up| <= limit,
    # then (up + 1) * gate * sigmoid(alpha * gate)); `router_scoring="topk_softmax"`.
    attention_sinks: bool = False
    o_proj_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # Llama 4: per-layer RoPE (1) or NoPE (0) and attention chunk (0: none), None for every
    # layer rotating / unchunked; a weightless L2 (RMS) norm on q and k after RoPE, on the
    # RoPE layers; on the NoPE layers q scaled by log1p(floor((pos + 1) / floor_scale)) *
    # attn_scale + 1 (attention-temperature tuning); routed experts every `moe_layer_step`-th
    # layer (the others dense of `intermediate_size`), `router_scoring="topk_sigmoid"`, and
    # the routing weight scaling each expert's input instead of its output.
    layer_rope: tuple[int, ...] | None = None
    layer_chunks: tuple[int, ...] | None = None
    qk_l2_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    moe_layer_step: int = 1
    expert_input_scaling: bool = False
    # Gemma 4: the full-attention layers' own head width and KV heads (None: the sliding ones');
    # their values equal to their keys before the norms (`attention_k_eq_v`, no v_proj); their
    # RoPE rotating the first `global_rotary_fraction` of each head ("proportional"); routed
    # experts beside the dense MLP in every layer (`moe_block`).
    global_head_dim: int | None = None
    global_num_kv_heads: int | None = None
    attention_k_eq_v: bool = False
    global_rotary_fraction: float = 1.0
    moe_block: bool = False
    # Gemma 4 E2B / E4B: per-layer input embeddings (a `per_layer_input_size`-wide vector per
    # token and layer, from a table of `per_layer_vocab_size` rows and a projection of the
    # embedding), and the last `num_kv_shared_layers` layers reading the K/V of the last
    # earlier layer of their kind instead of their own (with an MLP twice as wide when
    # `double_wide_mlp`).
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    # Qwen3-Next / Qwen3.5: Gated DeltaNet layers between the full-attention ones (whose query
    # projection also gives a sigmoid gate on their output), and the routed experts' shared
    # expert scaled by a sigmoid gate of its own (`shared_expert_gate`).
    linear_attention: LinearAttentionConfig | None = None
    shared_expert_gate: bool = False
    # Multimodal RoPE (Qwen2.5-VL): the rotary frequencies split in sections rotated by the
    # temporal, height and width positions (sizes summing to rotary_dim / 2); None: 1-D RoPE.
    mrope_section: tuple[int, ...] | None = None
    # Qwen3-VL: the sections interleaved (frequency f turns with h when f % 3 == 1 and
    # f < 3 * section[1], with w when f % 3 == 2 and f < 3 * section[2], else with t).
    mrope_interleaved: bool = False
    # The image encoder of a vision-language model (None: text only).
    vision: VisionConfig | None = None
    # Windowed and chunked layers keep only the K/V they can still read (`kv_layer_groups`),
    # where the family's model supports layer groups; False: every layer keeps every token.
    bounded_window_kv: bool = True

    def __post_init__(self) -> None:
        from jaxserve.models.registry import supported_architectures

        if self.architecture not in supported_architectures():
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; supported: {supported_architectures()}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config field {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.is_moe:
            if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size <= 0:
                raise ValueError(
                    f"MoE config needs 0 < num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                    f"({self.num_experts}) and moe_intermediate_size > 0 (got {self.moe_intermediate_size})")
            if self.router_scoring not in ROUTER_SCORINGS:
                raise UnsupportedModelError(f"unsupported router scoring {self.router_scoring!r}; supported: "
                                            f"{', '.join(ROUTER_SCORINGS)}")
            if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"expert groups: n_group ({self.n_group}) must divide num_experts "
                                 f"({self.num_experts}) and 1 <= topk_group ({self.topk_group}) <= n_group")
            if self.group_scoring not in ("top2_sum", "max"):
                raise UnsupportedModelError(f"unsupported expert group scoring {self.group_scoring!r}")
            if self.n_group > 1 and self.group_scoring == "top2_sum" and self.num_experts // self.n_group < 2:
                raise ValueError(f"expert groups of one expert: {self.num_experts} experts in {self.n_group} groups "
                                 "(a group's score is its best two experts')")
            if self.topk_group * (self.num_experts // self.n_group) < self.num_experts_per_tok:
                raise ValueError(f"topk_group ({self.topk_group}) groups of {self.num_experts // self.n_group} "
                                 f"experts hold fewer than num_experts_per_tok ({self.num_experts_per_tok})")
            if not 0 <= self.first_k_dense_replace <= self.num_layers:
                raise ValueError(f"first_k_dense_replace ({self.first_k_dense_replace}) must be in "
                                 f"[0, num_layers={self.num_layers}]")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise UnsupportedModelError(f"unsupported hidden activation {self.hidden_act!r}; supported: silu, gelu_tanh")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives {self.rotary_dim} rotary dims "
                             f"of a {self.head_dim}-dim head; they must be even and in (0, head_dim]")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(x) for x in self.mrope_section))
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != self.rotary_dim // 2:
                raise ValueError(f"mrope_section {self.mrope_section} must be 3 sizes summing to rotary_dim / 2 "
                                 f"({self.rotary_dim // 2})")
        if self.layer_windows is not None:
            if len(self.layer_windows) != self.num_layers or any(w < 0 for w in self.layer_windows):
                raise ValueError(f"layer_windows must hold {self.num_layers} windows >= 0 (0: global), "
                                 f"got {self.layer_windows}")
            object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def windows(self) -> tuple[int, ...]:
        """The sliding window of each layer, 0 where it attends globally."""
        if self.layer_windows is not None:
            return self.layer_windows
        return (self.sliding_window or 0,) * self.num_layers

    @property
    def sm_scale(self) -> float:
        """The attention logits' scale (MLA's: over the q/k head width, times YaRN's
        mscale(factor, mscale_all_dim) squared, as transformers and DeepSeek compute it)."""
        if self.mla is not None:
            scale = float(self.mla.qk_head_dim) ** -0.5
            s = self.rope_scaling
            if s.kind == "yarn" and s.mscale_all_dim:
                m = yarn_mscale(s.factor, s.mscale_all_dim)
                scale *= m * m
            return scale
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def rotary_dim(self) -> int:
        """The dims RoPE rotates: MLA's RoPE key width, else the head's (its leading part with
        a partial rotary factor)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_stacked_layers(self) -> int:
        """Decoder layers the params stack and the KV cache holds: the model's, then the MTP
        layers served (whose attention and experts are stacked after them)."""
        return self.num_layers + self.mtp_layers

    def layer_kv_kinds(self) -> tuple[tuple[str, int], ...]:
        """What each layer's attention reads: ("full", 0), ("window", W) or ("chunk", C)."""
        chunks = self.layer_chunks or (0,) * self.num_layers
        return tuple(("chunk", c) if c else ("window", w) if w else ("full", 0)
                     for w, c in zip(self.windows(), chunks, strict=True))

    @property
    def kv_layer_groups(self) -> KVLayerGroups | None:
        """The cache's layer groups (`models/kv_groups.py`), or None: one plain cache of every
        layer (no windowed or chunked layer, the family's model has no groups, MTP layers
        served, or `bounded_window_kv` off)."""
        from jaxserve.models.registry import family_of

        if not self.bounded_window_kv or self.mtp_layers or not family_of(self).kv_cache.layer_groups:
            return None
        return plan_layer_groups(self.layer_kv_kinds())

    @property
    def kv_group_kinds(self) -> tuple[tuple[str, int], ...]:
        """The layer groups' kinds, as the scheduler takes them (`SchedulerConfig.kv_groups`;
        empty for a plain cache)."""
        groups = self.kv_layer_groups
        return groups.kinds if groups is not None else ()

    @property
    def num_cache_layers(self) -> int:
        """The KV cache's leading axis: a layer group's size, else every stacked layer."""
        groups = self.kv_layer_groups
        return groups.group_size if groups is not None else self.num_stacked_layers

    def with_mtp(self) -> ModelConfig:
        """This config serving its first multi-token-prediction layer (speculative method "mtp")."""
        from jaxserve.models.registry import family_of

        if not hasattr(family_of(self).model_class, "mtp_forward") or not self.is_moe:
            raise ValueError(f"speculative_config: method 'mtp' is not supported for {self.architecture} (DeepSeek-V3 "
                             "and V2 MoE and GLM-4.5 MoE checkpoints with a multi-token-prediction layer only)")
        if self.num_nextn_predict_layers < 1:
            raise ValueError(f"speculative_config: method 'mtp' needs a checkpoint with a multi-token-prediction "
                             f"layer; this {self.architecture} config has num_nextn_predict_layers = "
                             f"{self.num_nextn_predict_layers}")
        return dataclasses.replace(self, mtp_layers=1)

    @property
    def num_dense_layers(self) -> int:
        """Layers with a dense MLP (all of them without experts)."""
        if not self.is_moe:
            return self.num_layers
        if self.moe_layer_step > 1:  # every moe_layer_step-th layer has experts (Llama 4)
            return self.num_layers - self.num_layers // self.moe_layer_step
        return self.first_k_dense_replace

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))
        if d.get("mla") is not None:
            d["mla"] = MLAConfig(**d["mla"])
        for key in ("layer_windows", "layer_rope", "layer_chunks", "mrope_section"):
            if d.get(key) is not None:
                d[key] = tuple(d[key])
        if d.get("vision") is not None:
            v = dict(d["vision"])
            for key in ("fullatt_block_indexes", "deepstack_visual_indexes", "image_mean", "image_std"):
                v[key] = tuple(v[key])
            d["vision"] = VisionConfig(**v)
        return cls(**d)

    # ------------------------------------------------------------------ HF config.json
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """The config of an HF config.json, parsed by the registered family that claims it."""
        from jaxserve.models.registry import config_from_hf

        return config_from_hf(hf)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, tie_word_embeddings: bool) -> ModelConfig:
        from jaxserve.models.registry import config_from_gguf

        return config_from_gguf(meta, tie_word_embeddings=tie_word_embeddings)


# ---------------------------------------------------------------------- the Llama-shaped families
def llama_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """config.json of a Llama-shaped family (`models/llama_family.py`)."""
    archs = hf.get("architectures") or []
    if "Gemma3ForConditionalGeneration" in archs or hf.get("model_type") == "gemma3":
        hf = _gemma3_text_of_multimodal(hf)  # the language model of Gemma 3 4B-27B checkpoints
        archs = hf["architectures"]
    arch = next((HF_ARCH_NAMES[a] for a in archs if a in HF_ARCH_NAMES), None)
    if arch is None:
        arch = HF_MODEL_TYPES.get(hf.get("model_type"))
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; supported: "
                f"{sorted(HF_ARCH_NAMES)}"
            )
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    eos = first_eos(hf)
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf.get("intermediate_size") or 0) or int(hf.get("moe_intermediate_size") or 0),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES)),
        attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
    )
    if arch in GEMMA_ARCHITECTURES:
        fields.update(_gemma_fields(hf, arch))
    else:
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        fields["rope_theta"] = float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        fields["rope_scaling"] = parse_rope_scaling(rope, int(hf.get("max_position_embeddings", 4096)))
        sliding = hf.get("sliding_window") if arch in ("mistral", "mixtral") else None
        fields["sliding_window"] = int(sliding) if sliding else None
        if arch in ("qwen2", "qwen3", "qwen3_moe") and hf.get("use_sliding_window"):
            raise UnsupportedModelError(f"{arch} with use_sliding_window=True is not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"{arch} with hidden_act={act!r} is not supported (silu only)")
    if arch in MOE_ARCHITECTURES:
        fields.update(_moe_fields(hf, arch))
    return ModelConfig(**fields)


def llama_config_from_gguf(meta: dict[str, Any], *, tie_word_embeddings: bool) -> ModelConfig:
    """GGUF metadata of a Llama-shaped family."""
    gguf_arch = meta.get("general.architecture")
    if gguf_arch not in GGUF_ARCH_NAMES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {gguf_arch!r}; supported: {sorted(GGUF_ARCH_NAMES)}"
        )
    arch = GGUF_ARCH_NAMES[gguf_arch]

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{gguf_arch}.{key}", default)

    num_experts = int(get("expert_count") or 0)
    if arch == "llama" and num_experts:
        arch = "mixtral"  # llama.cpp stores Mixtral as a llama with experts
    moe: dict[str, Any] = {}
    if num_experts:
        width = get("expert_feed_forward_length") or get("feed_forward_length")
        moe = dict(num_experts=num_experts, num_experts_per_tok=int(get("expert_used_count")),
                   moe_intermediate_size=int(width), norm_topk_prob=bool(get("expert_weights_norm", True)))

    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads)
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    scaling_type = get("rope.scaling.type")
    rope = RopeScaling()
    if scaling_type == "linear":
        rope = RopeScaling(kind="linear", factor=float(get("rope.scaling.factor", 1.0)))
    elif scaling_type not in (None, "none"):
        raise UnsupportedModelError(f"unsupported GGUF rope scaling {scaling_type!r}")
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length") or get("expert_feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        **moe,
    )


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    if arch == "mixtral":
        return dict(num_experts=int(hf["num_local_experts"]), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True)
    # Qwen3-MoE: one scan body means every layer must be a sparse one.
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise UnsupportedModelError(
            "qwen3_moe with dense layers (decoder_sparse_step != 1 or mlp_only_layers) is not supported")
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")  # the latter: transformers 5
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
                moe_intermediate_size=int(hf["moe_intermediate_size"]),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _gemma_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Gemma 2 / 3: per-layer windows from `layer_types` (or the family's default pattern),
    RoPE from `rope_parameters` (per layer type in Gemma 3) or the older flat keys."""
    n = int(hf["num_hidden_layers"])
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"{arch} with hidden_activation={act!r} is not supported (gelu_pytorch_tanh)")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"{arch} with use_bidirectional_attention=True is not supported")
    pattern = 2 if arch == "gemma2" else int(hf.get("sliding_window_pattern") or 6)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != n:
        raise UnsupportedModelError(f"{arch} layer_types {sorted(unknown) or types} not supported")
    window = int(hf.get("sliding_window") or 0)
    rope = hf.get("rope_parameters") or {}
    full = rope.get("full_attention", rope) if isinstance(rope, dict) else {}
    local = rope.get("sliding_attention") if isinstance(rope, dict) else None
    theta = float(full.get("rope_theta") or hf.get("rope_theta") or (1e6 if arch == "gemma3" else 1e4))
    scaling = parse_rope_scaling(full if full.get("rope_type") not in (None, "default") else
                                  (hf.get("rope_scaling") or {}))
    fields: dict[str, Any] = dict(
        hidden_act="gelu_tanh", norm_weight_offset=1.0, embed_scale=True, sandwich_norms=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim") or 256),
        attn_logit_softcap=_positive(hf.get("attn_logit_softcapping")),
        final_logit_softcap=_positive(hf.get("final_logit_softcapping")),
        layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
        rope_theta=theta, rope_scaling=scaling,
    )
    if arch == "gemma3":
        if local is not None and local.get("rope_type", "default") != "default":
            raise UnsupportedModelError("gemma3 with scaled RoPE on its sliding-window layers is not supported")
        fields["rope_local_theta"] = float((local or {}).get("rope_theta") or hf.get("rope_local_base_freq") or 1e4)
    return fields


# Gemma3TextConfig's defaults: the `text_config` of published multimodal checkpoints lists only
# what differs from them.
_GEMMA3_TEXT_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    max_position_embeddings=131_072, query_pre_attn_scalar=256, sliding_window=4096, tie_word_embeddings=True,
    bos_token_id=2, eos_token_id=1,
)


def _gemma3_text_of_multimodal(hf: dict[str, Any]) -> dict[str, Any]:
    """A `Gemma3ForConditionalGeneration` config -> its text model's config (the vision tower
    is not served: prompts are text)."""
    text = {**_GEMMA3_TEXT_DEFAULTS, **(hf.get("text_config") or {})}
    for key in ("eos_token_id", "bos_token_id"):  # the top level names the chat's end tokens
        if hf.get(key) is not None:
            text[key] = hf[key]
    return {**text, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}


def language_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's config.json -> its language model's (`text_config`, with the
    top level's end and start tokens, which name the chat's); a text model's as it is."""
    if "text_config" not in hf:
        return hf
    return {**hf["text_config"], **{k: hf[k] for k in ("eos_token_id", "bos_token_id") if hf.get(k) is not None}}


def first_eos(hf: dict[str, Any]) -> int | None:
    """config.json's `eos_token_id`, the first of a list."""
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        return eos[0] if eos else None
    return eos


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _positive(x: Any) -> float | None:
    return float(x) if x else None


def parse_rope_scaling(rope: dict[str, Any], max_position_embeddings: int = 4096) -> RopeScaling:
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind == "linear":
        return RopeScaling(kind="linear", factor=float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling(
            kind="llama3",
            factor=float(rope["factor"]),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)),
        )
    if kind == "yarn":
        return RopeScaling(
            kind="yarn",
            factor=float(rope.get("factor") or max_position_embeddings / rope["original_max_position_embeddings"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(rope.get("mscale") or 0), mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
            attention_factor=None if rope.get("attention_factor") is None else float(rope["attention_factor"]),
            truncate=bool(rope.get("truncate", True)),
        )
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3, yarn")
