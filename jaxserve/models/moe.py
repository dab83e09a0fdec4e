"""Routed experts (Qwen3-MoE, Mixtral): dropless top-k routing and grouped matmuls.

Every token's k (expert, weight) assignments are sorted by expert, so each expert's rows are
one contiguous group, and the experts run as two grouped matmuls (gate+up, then down) over the
sorted rows (`pallas_kernels.grouped_matmul`: XLA's native ragged dot on TPU; on GPU a Triton
kernel and on CPU a loop over the non-empty experts, where XLA would expand it densely over all
experts): no token is dropped and no capacity is padded. The weighted rows are summed back into their tokens with one scatter-add.

Under parallelism the same function runs per device (`parallel.per_shard_moe`) on the
experts that device holds:

- expert parallelism: device r holds experts [r*X/n, (r+1)*X/n). Its rows are a contiguous
  run of the sorted assignments; they are rotated to the front, so the grouped matmul covers
  exactly them and leaves the other rows zero;
- tensor parallelism inside the experts: every device holds every expert's slice of the
  intermediate width, so each computes a partial sum of the down projection.

Either way each device returns a partial [T, E] and one all-reduce (psum) completes it.

    router          [E, X]         (X experts, E hidden)
    expert_gate_up  [X, E, 2I]     gate and up, interleaved per tensor-parallel shard
    expert_down     [X, I, E]

Weight-only quantized experts (int8 / float8_e4m3fn, `jaxserve.models.quantization`) come with one
f32 scale per expert and output channel, `expert_gate_up_scale [X, 2I]` and
`expert_down_scale [X, E]`, sliced like their weights (a device's experts' rows under expert
parallelism; the last axis split like the weight's under the width split). The grouped
matmuls take them as stored: no dequantized copy of the experts is made.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from jaxserve.models.config import ModelConfig
from jaxserve.models.fused import split_gate_up

# Routed experts replace gate/up/down (Qwen3-MoE, Mixtral); X experts of width I.
MOE_WEIGHTS = (
    "router",  # [L, E, X]
    "expert_gate",  # [L, X, E, I]
    "expert_up",  # [L, X, E, I]
    "expert_down",  # [L, X, I, E]
)


def route(x: jax.Array, router: jax.Array, cfg: ModelConfig,
          correction_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-k experts of each token and their weights, as HF computes them: softmax in f32 over
    all experts, top-k, renormalised when the config says so, cast to the activations' dtype;
    for `router_scoring="sigmoid"`, `route_sigmoid`; for "topk_softmax", `route_topk_softmax`
    (`correction_bias` is then the router's logit bias).

    x: [T, E] -> weights [T, k] (x.dtype), experts [T, k] int32."""
    if cfg.router_scoring == "sigmoid":
        return route_sigmoid(x, router, cfg, correction_bias)
    if cfg.router_scoring == "topk_softmax":
        return route_topk_softmax(x, router, cfg, correction_bias)
    if cfg.router_scoring == "topk_sigmoid":  # Llama 4: each chosen logit's sigmoid (f32, as HF)
        top, experts = jax.lax.top_k(x @ router, cfg.num_experts_per_tok)
        return jax.nn.sigmoid(top.astype(jnp.float32)).astype(x.dtype), experts.astype(jnp.int32)
    if cfg.n_group > 1 or cfg.routed_scaling_factor != 1.0:  # DeepSeek-V2's routing, in f32 as HF runs it
        logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))
    else:
        logits = (x @ router).astype(jnp.float32)  # [T, X]
    probs = jax.nn.softmax(logits, axis=-1)
    if cfg.n_group > 1:  # group-limited: experts of the best `topk_group` groups only (others 0)
        probs = jnp.where(_group_mask(probs, cfg), probs, 0.0)
    weights, experts = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def _group_mask(scores: jax.Array, cfg: ModelConfig) -> jax.Array:
    """[T, X] bool: the experts of each token's `topk_group` best groups, a group scored by
    its best expert ("max") or its best two experts' sum ("top2_sum")."""
    T, X = scores.shape
    groups = scores.reshape(T, cfg.n_group, X // cfg.n_group)
    if cfg.group_scoring == "max":
        group_scores = jnp.max(groups, axis=-1)
    else:
        group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [T, G]
    _, best = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
    keep = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], best].set(True)
    return jnp.repeat(keep, X // cfg.n_group, axis=1)


def route_sigmoid(x: jax.Array, router: jax.Array, cfg: ModelConfig,
                  correction_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's routing (also GLM-4.5's): sigmoid scores in f32; the scores plus a
    per-expert correction bias choose the experts, first the `topk_group` best groups (a
    group scored by its best two experts), then the top k inside them; the *unbiased* scores
    weight the chosen experts, renormalised when the config says so, times
    `routed_scaling_factor`.

    x: [T, E], router [E, X], correction_bias [X] -> weights [T, k] (x.dtype), experts [T, k] int32."""
    logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))  # [T, X] (HF routes in f32)
    scores = jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)[None, :]
    if cfg.n_group > 1:
        choice = jnp.where(_group_mask(choice, cfg), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)  # [T, k]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * cfg.routed_scaling_factor
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def route_topk_softmax(x: jax.Array, router: jax.Array, cfg: ModelConfig,
                       logit_bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """gpt-oss's routing: the router is a linear layer with a bias; the top k of its logits
    choose the experts and a softmax over those k alone weights them (in the activations'
    dtype, as HF computes it).

    x: [T, E], router [E, X], logit_bias [X] -> weights [T, k] (x.dtype), experts [T, k] int32."""
    logits = x @ router  # [T, X]
    if logit_bias is not None:
        logits = logits + logit_bias.astype(logits.dtype)
    top, experts = jax.lax.top_k(logits, cfg.num_experts_per_tok)
    weights = jax.nn.softmax(top.astype(jnp.float32), axis=-1)
    return weights.astype(x.dtype), experts.astype(jnp.int32)


def experts_forward(
    x: jax.Array,  # [T, E]
    weights: jax.Array,  # [T, k]
    experts: jax.Array,  # [T, k] int32, global expert ids
    gate_up: jax.Array,  # [Xl, E, 2 * Il] the experts this device holds
    down: jax.Array,  # [Xl, Il, E]
    first_expert: jax.Array | int,  # global id of this device's first expert
    *,
    activation,
    gate_up_scale: jax.Array | None = None,  # [Xl, 2 * Il] f32 when gate_up is int8 / float8
    down_scale: jax.Array | None = None,  # [Xl, E] f32 when down is int8 / float8
    gate_up_bias: jax.Array | None = None,  # [Xl, 2 * Il] (gpt-oss), interleaved like gate_up
    down_bias: jax.Array | None = None,  # [Xl, E] (gpt-oss; pass it on one width shard only)
    glu: Callable[[jax.Array, jax.Array], jax.Array] | None = None,  # (gate, up) -> activation(gate) * up
    scale_inputs: bool = False,  # Llama 4: the weights scale each row's input, not its output
) -> jax.Array:  # [T, E], this device's share of the output (f32 accumulation, x.dtype)
    T, k = experts.shape
    num_local = gate_up.shape[0]
    flat = experts.reshape(-1)  # [M], M = T*k
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    local = flat - first_expert
    local = jnp.where((local >= 0) & (local < num_local), local, num_local)  # others: out of range
    counts = jnp.zeros((num_local,), jnp.int32).at[local].add(1, mode="drop")  # [Xl] rows per local expert
    # The local experts' rows start after every row of a lower expert id.
    start = jnp.sum((flat < first_expert).astype(jnp.int32))
    M = flat.shape[0]
    rows = order[(jnp.arange(M, dtype=jnp.int32) + start) % M]  # local rows first
    token = rows // k  # [M] token of each row
    xs = jnp.take(x, token, axis=0)  # [M, E]
    w = jnp.take(weights.reshape(-1), rows)  # [M]
    if scale_inputs:
        xs = xs * w[:, None].astype(xs.dtype)
    gu = pallas_kernels.grouped_matmul(xs, gate_up, counts, rhs_scale=gate_up_scale)  # [M, 2 Il]; rows past sum(counts) are zero
    if gate_up_bias is not None or down_bias is not None:
        # Each row's local expert (num_local for the rows another device computes, whose
        # bias must stay out: their products are zero and so must their outputs be).
        row_expert = jnp.take(local, rows)  # [M]
        mine = (row_expert < num_local)[:, None]
        row_expert = jnp.minimum(row_expert, num_local - 1)
    if gate_up_bias is not None:
        gu = gu + jnp.where(mine, jnp.take(gate_up_bias, row_expert, axis=0), 0).astype(gu.dtype)
    gate, up = split_gate_up(gu, 1)
    act = glu(gate, up) if glu is not None else activation(gate) * up
    y = pallas_kernels.grouped_matmul(act, down, counts, rhs_scale=down_scale)  # [M, E]
    if down_bias is not None:
        y = y + jnp.where(mine, jnp.take(down_bias, row_expert, axis=0), 0).astype(y.dtype)
    y = y.astype(jnp.float32)
    if not scale_inputs:
        y = y * w.astype(jnp.float32)[:, None]
    out = jnp.zeros((T, x.shape[1]), jnp.float32).at[token].add(y)
    return out.astype(x.dtype)
