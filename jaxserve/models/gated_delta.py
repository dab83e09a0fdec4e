"""Gated DeltaNet's token mixing over a ragged batch, in jnp: the causal depthwise conv and the
gated delta rule, each reading and writing a fixed-size state per sequence (Qwen3-Next, Qwen3.5).

A step's tokens are packed as for attention ([T], sequences cut by `cu_q_lens`). Each sequence
owns a state slot in two pools (`RecurrentMetadata.state_slots`; slot 0 is the null slot that
padding rows use): the conv pool [N, K-1, C] (the last K-1 conv inputs) and the recurrent pool
[N, H, dk, dv] (the delta rule's matrix). A span that starts at position 0 starts from zeros,
so a slot needs no clearing between owners.

The delta rule runs two ways in one program, chosen per sequence by its span length (data):
- one token (decode): the recurrent step for every row at once, O(R H dk dv);
- more (prefill, chunked prefill, recompute): the chunked (WY) form over chunks of C tokens that
  the host lays out per sequence (`chunk_tokens`, `chunk_rows`), by
  `pallas_kernels.gated_delta_rule` (a Mosaic kernel on TPU; on CPU and GPU a jnp loop whose trip
  count is the step's real chunk count, so padding chunks cost nothing). Per chunk and head:
  O(C^2 (dk + dv) + C dk dv) work and a C x C triangular solve; a prompt of n tokens costs
  O(n C (dk + dv) + n dk dv) per head in n / C sequential steps (quadratic only within a chunk).
Everything is f32 (as transformers' torch paths compute it); the state pools are f32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxserve.models.metadata import AttentionMetadata, RecurrentMetadata
from pallas_kernels.gated_delta_rule.ops import chunked_delta_rule

CHUNK = 64  # tokens per chunk of the delta rule's chunked form (the larger token buckets)


def chunk_size(num_tokens: int) -> int:
    """The chunk length for a step of token bucket `num_tokens` (shorter buckets: the bucket)."""
    return min(CHUNK, num_tokens)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def span_info(md: AttentionMetadata) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per row: span length, whether it starts from a zero state (position 0), and whether it
    is a one-token span. [R] each."""
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    fresh = (md.kv_lens - q_lens) == 0
    return q_lens, fresh, q_lens == 1


# ---------------------------------------------------------------------- the causal conv
def causal_conv(x: jax.Array, w: jax.Array, pool: jax.Array, md: AttentionMetadata,
                rm: RecurrentMetadata) -> tuple[jax.Array, jax.Array]:
    """x [T, C] conv inputs, w [C, K] depthwise taps (w[:, K-1] on the current token), pool
    [N, K-1, C] f32. Returns silu(conv) [T, C] in x's dtype and the pool with each row's last
    K-1 inputs written to its slot."""
    T, C = x.shape
    K = w.shape[1]
    R = rm.state_slots.shape[0]
    q_lens, fresh, _ = span_info(md)
    old = jnp.take(pool, rm.state_slots, axis=0)  # [R, K-1, C]
    old = jnp.where(fresh[:, None, None], 0.0, old)
    # One source array: the step's inputs, then every row's previous inputs; a window reads
    # a token of its span or, before the span, the row's state.
    src = jnp.concatenate([x.astype(jnp.float32), old.reshape(R * (K - 1), C), jnp.zeros((1, C), jnp.float32)])
    rows = jnp.minimum(rm.token_rows, R - 1)  # [T] (padding tokens: any row; masked below)
    start = md.cu_q_lens[rows]  # [T] the row's first token
    local = jnp.arange(T, dtype=jnp.int32) - start  # [T] index in the span
    j = jnp.arange(K, dtype=jnp.int32)  # taps, oldest first
    rel = local[:, None] - (K - 1) + j[None, :]  # [T, K] position in the span (negative: the state)
    idx = jnp.where(rel >= 0, start[:, None] + rel, T + rows[:, None] * (K - 1) + (K - 1) + rel)
    win = jnp.take(src, idx, axis=0)  # [T, K, C]
    out = jax.nn.silu(jnp.einsum("tkc,ck->tc", win, w.astype(jnp.float32)))
    # The new state: each row's last K-1 inputs, from its span or (short spans) its old state.
    m = jnp.arange(K - 1, dtype=jnp.int32)
    rel = q_lens[:, None] - (K - 1) + m[None, :]  # [R, K-1]
    idx = jnp.where(rel >= 0, md.cu_q_lens[:R, None] + rel,
                    T + jnp.arange(R, dtype=jnp.int32)[:, None] * (K - 1) + (K - 1) + rel)
    new = jnp.take(src, idx, axis=0)  # [R, K-1, C]
    pool = pool.at[rm.state_slots].set(new)
    return out.astype(x.dtype), pool


# ---------------------------------------------------------------------- the delta rule
def _step(q, k, v, g, beta, state):
    """The recurrent form, one token per row: q, k [R, H, dk]; v [R, H, dv]; g, beta [R, H];
    state [R, H, dk, dv]. Returns out [R, H, dv] and the new state."""
    state = state * jnp.exp(g)[..., None, None]
    mem = jnp.einsum("rhkv,rhk->rhv", state, k)
    delta = (v - mem) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("rhkv,rhk->rhv", state, q), state


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     pool: jax.Array, md: AttentionMetadata, rm: RecurrentMetadata) -> tuple[jax.Array, jax.Array]:
    """q, k [T, Hk, dk] (raw: l2-normalised and scaled here; value head h reads head
    h // (H / Hk)), v [T, H, dv], g [T, H] (log decay, <= 0), beta [T, H], pool [N, H, dk, dv]
    f32. Returns out [T, H, dv] f32 and the pool with each row's final state in its slot."""
    T, Hk, dk = q.shape
    H = v.shape[1]
    R = rm.state_slots.shape[0]
    f32 = jnp.float32
    q = l2norm(q.astype(f32)) * dk ** -0.5
    k = l2norm(k.astype(f32))
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)
    _, fresh, single = span_info(md)
    s0 = jnp.take(pool, rm.state_slots, axis=0)  # [R, H, dk, dv]
    s0 = jnp.where(fresh[:, None, None, None], 0.0, s0)

    # One-token rows: the recurrent step on each row's token.
    first = jnp.minimum(md.cu_q_lens[:R], T - 1)
    heads = lambda a: jnp.repeat(a, H // Hk, axis=1)  # noqa: E731
    o1, s1 = _step(heads(q[first]), heads(k[first]), v[first], g[first], beta[first], s0)

    # Longer rows: their chunks, in order (the TPU kernel or the jnp loop); the dummy row R and
    # the dummy token T absorb padding.
    pad = lambda a: jnp.concatenate([a, jnp.zeros((1, *a.shape[1:]), a.dtype)])  # noqa: E731
    idx = rm.chunk_tokens  # [Nc, C]
    chunks = [pad(a)[idx] for a in (q, k, v, g, beta)]
    o_chunks, states = chunked_delta_rule(*chunks, pad(s0), rm.chunk_rows, rm.num_chunks)
    out = jnp.zeros((T + 1, H, v.shape[-1]), f32).at[idx.reshape(-1)].set(o_chunks.reshape(-1, H, v.shape[-1]))
    tok_rows = jnp.minimum(rm.token_rows, R - 1)
    tok_single = single[tok_rows] & (rm.token_rows < R)
    out = jnp.where(tok_single[:, None, None], o1[tok_rows], out[:T])
    final = jnp.where(single[:, None, None, None], s1, states[:R])
    return out, pool.at[rm.state_slots].set(final)


# ---------------------------------------------------------------------- the layer's token mixing
def linear_mixing(mixed: jax.Array, taps: jax.Array, g: jax.Array, beta: jax.Array, conv_pool: jax.Array,
                  rec_pool: jax.Array, md: AttentionMetadata, *, key_head_dim: int,
                  value_head_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The conv then the delta rule of one layer, on whichever key heads this device holds.

    mixed [T, C]: the conv's inputs with channels grouped per key head, [q_h | k_h | v of its
    value heads] for each head h (so a split of C over devices hands each whole heads); taps
    [C, K] in the same order (the checkpoint's [C, 1, K] without its unit axis: no copy);
    g, beta [T, Hv]; pools [N, K-1, C] and [N, Hv, dk, dv]. Returns out [T, Hv, dv] f32 and
    both pools with the step's rows written."""
    T, C = mixed.shape
    Hv, dk, dv = g.shape[1], key_head_dim, value_head_dim
    Hk = (C - Hv * dv) // (2 * dk)
    mixed, conv_pool = causal_conv(mixed, taps, conv_pool, md, md.recurrent)
    per_head = mixed.reshape(T, Hk, -1)
    q, k = per_head[..., :dk], per_head[..., dk:2 * dk]  # [T, Hk, dk]
    v = per_head[..., 2 * dk:].reshape(T, Hv, dv)
    out, rec_pool = gated_delta_rule(q, k, v, g, beta, rec_pool, md, md.recurrent)
    return out, conv_pool, rec_pool
