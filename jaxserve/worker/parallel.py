"""Tensor parallelism over a device mesh (Megatron-style, expressed as GSPMD shardings).

Attention heads and the MLP hidden dimension are split over the mesh's "model" axis; the
row-parallel projections (o_proj, down_proj) get their all-reduce from GSPMD. The KV cache is
sharded by KV head. When there are fewer KV heads than ranks, each KV head is replicated
(`tp / Hkv` copies) so that every rank holds exactly the KV heads its query heads read; the
result is mathematically the same model. Embeddings and logits are sharded over the
vocabulary. Attention and the KV-cache update run per shard under `shard_map`, so the
kernels see ordinary single-device arrays.

Routed experts (models/moe.py) are split one of two ways over the same axis: tensor
parallelism inside the experts (each device holds every expert's 1/tp of the intermediate
width; the default) or expert parallelism (`expert_parallel`: each device holds X/tp whole
experts). Both run per shard under `shard_map` with every token on every device and end in
one all-reduce, like the row-parallel projections.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.loading.part import LoadPart, TensorPart, merged
from jaxserve.models.config import ModelConfig
from jaxserve.models.moe import experts_forward
from jaxserve.models.registry import MODEL_AXIS, family_of
from pallas_kernels.kv_layout import kv_scales_axis_of_heads

logger = logging.getLogger(__name__)



def build_mesh(tensor_parallel_size: int, devices: list[Any] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} exceeds the {len(devices)} available devices"
        )
    return jax.make_mesh((tensor_parallel_size,), (MODEL_AXIS,), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices[:tensor_parallel_size])


def tp_model_config(cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> ModelConfig:
    """The config each rank computes with: KV heads replicated up to `tp` when fewer.

    Raises ValueError when `tp` cannot split the model's heads, MLP or experts evenly.
    """
    if expert_parallel and not cfg.is_moe:
        raise ValueError(f"expert parallelism needs a mixture-of-experts model; {cfg.architecture} has no experts")
    if tp == 1:
        return cfg
    if cfg.num_heads % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the model's {cfg.num_heads} attention heads"
        )
    if cfg.is_moe and expert_parallel and cfg.num_experts % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {cfg.num_experts} experts "
                         "(expert parallelism places whole experts on each device)")
    if cfg.is_moe and not expert_parallel and cfg.moe_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the experts' width {cfg.moe_intermediate_size}"
                         " (try expert parallelism)")
    if cfg.num_dense_layers and cfg.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size {tp} does not divide the MLP size {cfg.intermediate_size}"
        )
    if cfg.shared_expert_intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the shared expert's width "
                         f"{cfg.shared_expert_intermediate_size}")
    la = cfg.linear_attention
    if la is not None and la.num_key_heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {la.num_key_heads} linear-attention "
                         "key heads")
    cfg = dataclasses.replace(cfg, num_kv_heads=_kv_heads_per_split(cfg.num_kv_heads, tp, "KV heads"))
    if cfg.global_num_kv_heads is not None:  # Gemma 4's full layers: KV heads of their own
        cfg = dataclasses.replace(cfg, global_num_kv_heads=_kv_heads_per_split(
            cfg.global_num_kv_heads, tp, "full-attention KV heads"))
    return cfg


def _kv_heads_per_split(hkv: int, tp: int, what: str) -> int:
    """KV heads as `tp` ranks hold them: unchanged when `tp` divides them, else replicated up to `tp`."""
    if hkv >= tp:
        if hkv % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {hkv} {what}")
        return hkv
    if tp % hkv:
        raise ValueError(
            f"tensor_parallel_size {tp} is not a multiple of the model's {hkv} {what}, so they cannot be "
            "replicated evenly"
        )
    return tp


def expand_kv_heads(params: dict[str, Any], cfg: ModelConfig, new_num_kv_heads: int,
                    new_global_kv_heads: int | None = None) -> dict[str, Any]:
    """Repeats each KV head's columns in k/v projections (and biases) `new / old` times, in
    order, so expanded head j serves the query heads the original head j // rep served.
    `new_global_kv_heads`: Gemma 4's full layers' own KV heads (`global_k_proj`, ...), alike."""
    if new_global_kv_heads is not None and new_global_kv_heads != cfg.global_num_kv_heads:
        glo = dataclasses.replace(cfg, num_kv_heads=cfg.global_num_kv_heads, head_dim=cfg.global_head_dim)
        layers = {k.removeprefix("global_"): v for k, v in params["layers"].items() if k.startswith("global_")}
        layers = expand_kv_heads({"layers": layers}, glo, new_global_kv_heads)["layers"]
        params = {**params, "layers": {**params["layers"], **{"global_" + k: v for k, v in layers.items()}}}
    rep = new_num_kv_heads // cfg.num_kv_heads
    if rep == 1:
        return params
    D = cfg.head_dim
    layers = dict(params["layers"])
    for name in ("k_proj", "v_proj", "attn_k", "attn_v"):  # (attn_*: a hybrid model's full layers)
        if name not in layers:
            continue
        w = np.asarray(layers[name])  # [L, E, Hkv*D]
        L, E, _ = w.shape
        layers[name] = np.repeat(w.reshape(L, E, cfg.num_kv_heads, 1, D), rep, axis=3).reshape(L, E, -1)
    for name in ("k_bias", "v_bias", "k_proj_scale", "v_proj_scale", "attn_k_scale", "attn_v_scale"):
        if name in layers:
            b = np.asarray(layers[name])  # [L, Hkv*D]
            layers[name] = np.repeat(b.reshape(b.shape[0], cfg.num_kv_heads, 1, D), rep, axis=2).reshape(
                b.shape[0], -1)
    return {**params, "layers": layers}


def param_specs(params: dict[str, Any], cfg: ModelConfig, tp: int, expert_parallel: bool = False) -> dict[str, Any]:
    vocab_split = cfg.vocab_size % tp == 0
    if not vocab_split:
        logger.warning("vocabulary %d not divisible by tp=%d: embeddings replicated", cfg.vocab_size, tp)

    family = family_of(cfg)  # its sharding rules: fused layer weight -> PartitionSpec axes
    rules = {**family.layer_sharding, **(family.expert_parallel_sharding if expert_parallel else {})}

    def layer_spec(name: str) -> P:
        return P(*rules[name]) if name in rules else P()

    specs: dict[str, Any] = {
        "embed": P(MODEL_AXIS, None) if vocab_split else P(),
        "final_norm": P(),
        # A quantized weight's per-output-channel scale splits like the weight's output axis.
        "layers": {k: _scale_spec(layer_spec(k.removesuffix("_scale"))) if k.endswith("_scale") else layer_spec(k)
                   for k in params["layers"]},
    }
    if "lm_head" in params:
        specs["lm_head"] = P(None, MODEL_AXIS) if vocab_split else P()
    if "lm_head_scale" in params:
        specs["lm_head_scale"] = P(MODEL_AXIS) if vocab_split else P()
    if "embed_scale" in params:  # the quantized tied head: one scale per vocabulary row
        specs["embed_scale"] = P(MODEL_AXIS) if vocab_split else P()
    # the MTP layer's norms and input projection; Gemma 4's per-layer input table and projection
    specs.update({k: P() for k in params if k.startswith(("mtp_", "ple_"))})
    return specs


def _scale_spec(weight_spec: P) -> P:
    """The spec of a scale: the weight's spec without its contraction (second to last) axis."""
    axes = tuple(weight_spec)
    if len(axes) < 2:
        return P()
    return P(*axes[:-2], axes[-1])


def shard_params(params: dict[str, Any], cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False
                 ) -> dict[str, Any]:
    specs = param_specs(params, cfg, mesh.shape[MODEL_AXIS], expert_parallel)
    return jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), params, specs,
                        is_leaf=lambda x: isinstance(x, P))


def place(x: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host array placed with `sharding`. Across processes only this process's devices'
    slices are taken from `x` (its other slices may be unread: `process_load_part`), and no
    process compares its copy with the others' (`device_put` would gather every tensor)."""
    if sharding.is_fully_addressable or isinstance(x, jax.Array):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def process_ranks(mesh: Mesh) -> list[int]:
    """The positions on the model axis of this process's devices."""
    me = jax.process_index()
    return [r for r, d in enumerate(mesh.devices.flat) if d.process_index == me]


def process_load_part(cfg: ModelConfig, tp: int, ranks: list[int], expert_parallel: bool = False
                      ) -> LoadPart | None:
    """What the ranks `ranks` of a `tp`-way split hold of each projection and of the
    vocabulary, in the loaded (unfused, unexpanded) layout: their query heads, the original
    KV heads their (possibly replicated) KV heads copy, their MLP columns and vocabulary
    rows; None when they hold everything. Routed experts, norms and routers are read whole."""
    if sorted(set(ranks)) == list(range(tp)):
        return None
    if family_of(cfg).attention != "paged_kv":  # its slices are not described here: read whole tensors
        return None
    per_rank = tp_model_config(cfg, tp, expert_parallel).num_kv_heads // tp
    rep = per_rank * tp // cfg.num_kv_heads
    D = cfg.head_dim

    def blocks(total: int) -> tuple[tuple[int, int], ...]:
        w = total // tp
        return merged((r * w, (r + 1) * w) for r in ranks)

    q = blocks(cfg.q_size)
    kv = merged((j // rep * D, (j // rep + 1) * D) for r in ranks for j in range(r * per_rank, (r + 1) * per_rank))
    part = {"q_proj": TensorPart(-1, q), "q_bias": TensorPart(-1, q), "o_proj": TensorPart(-2, q)}
    part.update({n: TensorPart(-1, kv) for n in ("k_proj", "v_proj", "k_bias", "v_bias")})
    if not cfg.is_moe:
        mlp = blocks(cfg.intermediate_size)
        part.update(gate_proj=TensorPart(-1, mlp), up_proj=TensorPart(-1, mlp), down_proj=TensorPart(-2, mlp))
    if cfg.vocab_size % tp == 0:
        vocab = blocks(cfg.vocab_size)
        part.update(embed=TensorPart(-2, vocab), lm_head=TensorPart(-1, vocab))
    return part


def kv_cache_sharding(mesh: Mesh, layout: str = "heads") -> NamedSharding:
    if layout == "lanes":  # [L, P, S, C]: each rank's C/tp lanes hold its own heads
        return NamedSharding(mesh, P(None, None, None, MODEL_AXIS))
    return NamedSharding(mesh, P(None, None, None, MODEL_AXIS, None))  # [L, P, S, Hkv, D]


def kv_scales_sharding(mesh: Mesh, layout: str = "heads") -> NamedSharding:
    """A quantized cache's scales, split by KV head like its pages."""
    return NamedSharding(mesh, _scales_spec(layout))


def _scales_spec(layout: str) -> P:
    axes: list[Any] = [None, None, None]
    axes[kv_scales_axis_of_heads(layout)] = MODEL_AXIS
    return P(*axes)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_cache_shardings(mesh: Mesh, layout: str, spec: Any, quantized: bool) -> tuple[NamedSharding, ...]:
    """The shardings of a family's cache arrays (`registry.KVCacheSpec`): its page arrays then,
    when quantized, their scales; split by KV head, or replicated (a latent cache)."""
    if spec.replicated:
        pages = scales = replicated(mesh)
    else:
        pages, scales = kv_cache_sharding(mesh, layout), kv_scales_sharding(mesh, layout)
    return (pages,) * spec.page_arrays + ((scales,) * spec.page_arrays if quantized else ()) + state_shardings(
        mesh, spec)


def state_shardings(mesh: Mesh, spec: Any) -> tuple[NamedSharding, ...]:
    """A hybrid model's state pools, each split along its heads' axis (`state_split_axes`)."""
    out = []
    for axis in spec.state_split_axes:
        axes: list[Any] = [None] * (axis + 1)
        axes[axis] = MODEL_AXIS
        out.append(NamedSharding(mesh, P(*axes)))
    return tuple(out)


def per_shard_latent_attention(attention_fn, mesh: Mesh):
    """Wraps MLA's attention (`pallas_kernels.mla_attention`) so each rank attends with its own
    query heads over the whole latent cache, which every rank holds."""
    heads = P(None, MODEL_AXIS, None)  # [T, H, W] in, [T, H, Dl] out

    def attention(q, pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, scales=None, **kwargs):
        def fn_(q, pages, lens, tables, cu, n, *scales):
            return attention_fn(q, pages, lens, tables, cu, n, scales=scales[0] if scales else None, **kwargs)

        extra = () if scales is None else (scales,)
        fn = jax.shard_map(fn_, mesh=mesh, in_specs=(heads, P(), P(), P(), P(), P(), *(P() for _ in extra)),
                           out_specs=heads, check_vma=False)
        return fn(q, pages, kv_lens, block_tables, cu_q_lens, num_seqs, *extra)

    return attention


def per_shard_attention(attention_fn, kv_update_fn, mesh: Mesh):
    """Wraps the attention and KV-update ops so each rank runs them on its own heads."""
    heads = P(None, MODEL_AXIS, None)  # [T, H, D]
    tp = mesh.shape[MODEL_AXIS]

    def page_spec(pages):  # [pages, S, Hkv, D] or [pages, S, C]
        return P(None, None, MODEL_AXIS, None) if pages.ndim == 4 else P(None, None, MODEL_AXIS)

    def scales_spec(pages):
        return _scales_spec("heads" if pages.ndim == 4 else "lanes")

    def attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **kwargs):
        if kwargs.get("num_kv_heads") is not None:
            kwargs["num_kv_heads"] //= tp  # each rank's own heads
        pages = page_spec(k_pages)
        # Traced operands (a per-layer sliding window, replicated; a quantized cache's scales,
        # split by head) enter the shard_map as operands, not closures.
        extra = {}
        for name in ("sliding_window", "attention_chunk", "attend_until"):
            if isinstance(kwargs.get(name), jax.Array):
                extra[name] = (kwargs.pop(name), P())
        if kwargs.get("sinks") is not None:  # [Hq]: each rank's own heads' sinks
            extra["sinks"] = (kwargs.pop("sinks"), P(MODEL_AXIS))
        for name in ("k_scales", "v_scales"):
            if kwargs.get(name) is not None:
                extra[name] = (kwargs.pop(name), scales_spec(k_pages))
        names = list(extra)

        def fn_(q, k, v, lens, tables, cu, n, *ops):
            return attention_fn(q, k, v, lens, tables, cu, n, **dict(zip(names, ops)), **kwargs)

        fn = jax.shard_map(fn_, mesh=mesh,
                           in_specs=(heads, pages, pages, P(), P(), P(), P(), *(sp for _, sp in extra.values())),
                           out_specs=heads, check_vma=False)
        return fn(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *(x for x, _ in extra.values()))

    def kv_update(k_new, v_new, k_pages, v_pages, slot_mapping, k_scales=None, v_scales=None):
        pages = page_spec(k_pages)
        if k_scales is None:
            fn = jax.shard_map(kv_update_fn, mesh=mesh, in_specs=(heads, heads, pages, pages, P()),
                               out_specs=(pages, pages), check_vma=False)
            return fn(k_new, v_new, k_pages, v_pages, slot_mapping)
        sc = scales_spec(k_pages)

        def fn_(k_new, v_new, k_pages, v_pages, slots, k_scales, v_scales):
            return kv_update_fn(k_new, v_new, k_pages, v_pages, slots, k_scales=k_scales, v_scales=v_scales)

        fn = jax.shard_map(fn_, mesh=mesh, in_specs=(heads, heads, pages, pages, P(), sc, sc),
                           out_specs=(pages, pages, sc, sc), check_vma=False)
        return fn(k_new, v_new, k_pages, v_pages, slot_mapping, k_scales, v_scales)

    return attention, kv_update


def per_shard_moe(mesh: Mesh, expert_parallel: bool):
    """The routed experts run per device on the expert weights it holds (whole experts under
    expert parallelism, a width slice of every expert otherwise), then one all-reduce."""
    if expert_parallel:
        weights_spec = P(MODEL_AXIS, None, None)  # [X, E, 2I] / [X, I, E]: experts split
        down_spec = weights_spec
    else:
        weights_spec, down_spec = P(None, None, MODEL_AXIS), P(None, MODEL_AXIS, None)

    specs = (P(), P(), P(), weights_spec, down_spec)
    # Per-expert vectors: quantized experts' per-output-channel scales and gpt-oss's biases,
    # [X, 2I] and [X, E], split with the experts (expert parallelism) or with gate/up's
    # columns (width split; E is never split).
    vector_specs = {"gate_up": P(MODEL_AXIS, None) if expert_parallel else P(None, MODEL_AXIS),
                    "down": P(MODEL_AXIS, None) if expert_parallel else P()}

    def moe_fn(x, weights, experts, gate_up, down, gate_up_scale=None, down_scale=None, gate_up_bias=None,
               down_bias=None, glu=None, scale_inputs=False):
        vectors = {k: v for k, v in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale),
                                     ("gate_up_bias", gate_up_bias), ("down_bias", down_bias)) if v is not None}
        names = list(vectors)

        def local(x, weights, experts, gate_up, down, *ops):
            kw = dict(zip(names, ops))
            rank = jax.lax.axis_index(MODEL_AXIS)
            if "down_bias" in kw and not expert_parallel:  # each rank's partial sum: the bias once
                kw["down_bias"] = jnp.where(rank == 0, kw["down_bias"], 0)
            first = rank * gate_up.shape[0] if expert_parallel else 0
            y = experts_forward(x, weights, experts, gate_up, down, first, activation=jax.nn.silu, glu=glu,
                                scale_inputs=scale_inputs, **kw)
            return jax.lax.psum(y, MODEL_AXIS)

        in_specs = (*specs, *(vector_specs["down" if n.startswith("down") else "gate_up"] for n in names))
        fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False)
        return fn(x, weights, experts, gate_up, down, *vectors.values())

    return moe_fn


def per_shard_recurrent(mixing_fn, mesh: Mesh):
    """A hybrid model's linear-attention token mixing (conv and delta rule) per device on its
    own heads: the conv channels, gates and state pools arrive split by key head (channels
    grouped per key head), the step's metadata replicated; nothing is communicated."""
    chan, heads = P(None, MODEL_AXIS), P(None, MODEL_AXIS)

    def recurrent_fn(mixed, taps, g, beta, conv_pool, rec_pool, md, **kwargs):
        fn = jax.shard_map(lambda *a: mixing_fn(*a, **kwargs), mesh=mesh,
                           in_specs=(chan, P(MODEL_AXIS, None), heads, heads, P(None, None, MODEL_AXIS), P(None, MODEL_AXIS), P()),
                           out_specs=(P(None, MODEL_AXIS), P(None, None, MODEL_AXIS), P(None, MODEL_AXIS)),
                           check_vma=False)
        return fn(mixed, taps, g, beta, conv_pool, rec_pool, md)

    return recurrent_fn
