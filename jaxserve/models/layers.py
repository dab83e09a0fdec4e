"""Layers every family shares: RMS norms (plain and zero-centred, `offset=1`), activations,
soft-caps, the row-tiled matmul and row loop of batch-invariant mode, and the signatures of the
attention, KV-update and MoE calls a model receives from the worker (the kernels per platform,
or their per-shard wrappers under a mesh)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

# attention_fn(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, *, sm_scale,
#              sliding_window) -> [T, Hq, D]
AttentionFn = Callable[..., jax.Array]
# kv_update_fn(k_new, v_new, k_pages, v_pages, slot_mapping) -> (k_pages, v_pages)
KVUpdateFn = Callable[..., tuple[jax.Array, jax.Array]]
# moe_fn(x [T, E], weights [T, k], experts [T, k], gate_up, down) -> [T, E]: the routed experts
# over the expert weights as this program holds them (`parallel.per_shard_moe` under a mesh).
MoEFn = Callable[..., jax.Array]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0, row_tile: int = 0) -> jax.Array:
    """RMSNorm computed in f32 (as HF does), scaled by (offset + weight) (Gemma's offset is 1),
    cast back to the input dtype. `row_tile` > 0 (batch-invariant mode): over fixed row tiles
    (`tiled_rows`), so a row's sum of squares runs in one order whatever the token bucket."""
    if row_tile:
        return tiled_rows(lambda t: rms_norm(t, weight, eps, offset), x, row_tile)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = weight.astype(jnp.float32) + offset if offset else weight.astype(jnp.float32)
    return (scale * xf).astype(x.dtype)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def gated_activation(name: str, gate: jax.Array, up: jax.Array) -> jax.Array:
    """act(gate) * up (a gated MLP's SwiGLU / GeGLU) computed in f32 and rounded once to
    the inputs' dtype (their promotion, as the plain product gives). In bf16, XLA:CPU evaluates the activation elementwise in bf16 with a
    rounding after each op: 2x slower there (SmolLM2's [512, 1536]: 1.75 -> 0.88 ms per
    layer) and half as accurate (mean relative error 2.9e-3 -> 1.4e-3). f32 inputs give the
    bits of `ACTIVATIONS[name](gate) * up`."""
    f32 = jnp.float32
    return (ACTIVATIONS[name](gate.astype(f32)) * up.astype(f32)).astype(jnp.result_type(gate, up))


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """gpt-oss's gated activation: the gate clamped from above and the up projection to
    [-limit, limit] (bounded activations for its low-precision experts), then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


def tiled_matmul(x: jax.Array, w: jax.Array, row_tile: int, transposed: bool = False) -> jax.Array:
    """x [N, K] @ w [K, F] (`transposed`: w is [F, K], as a tied head's embedding); with
    `row_tile` > 0, over [row_tile, K] tiles (`tiled_rows`). XLA:CPU's GEMM sums a row in an
    order that depends on the row count and the row's position, so the plain product of one
    row changes with the batch around it; one fixed tile shape fixes the order. A transposed
    weight is contracted on its own dim 1 (written as `w.T`, XLA hoisted a transposed copy
    out of some loops and not others, and the two dots summed differently). The loop costs
    the parallelism a large GEMM has (about 2x on a 2048-row prefill on this CPU)."""
    if not row_tile:
        return x @ (w.T if transposed else w)
    dims = (((1,), (1 if transposed else 0,)), ((), ()))
    out_dtype = jnp.result_type(x, w)
    return tiled_rows(lambda t: jax.lax.dot_general(t, w, dims).astype(out_dtype), x, row_tile)


def tiled_rows(fn: Callable[[jax.Array], jax.Array], x: jax.Array, row_tile: int) -> jax.Array:
    """fn applied to x [N, ...] as a loop over [row_tile, ...] tiles (rows padded up to a whole
    tile), so that every row is computed by one program whatever N is: batch-invariant mode.
    XLA:CPU reduces rows in an order that depends on the row count (a log-softmax row of a
    [3, V] array measured 1 ulp from the same row alone), so a row-wise op compiled once per
    bucket is not the same arithmetic in every bucket. The trip count is hidden from XLA (an
    optimization barrier), so it never unrolls or drops the loop for one shape and not
    another. `fn` must be row-wise (row i of its output depends on row i of its input only)."""
    n = x.shape[0]
    tiles = -(-n // row_tile)
    xp = jnp.pad(x, ((0, tiles * row_tile - n),) + ((0, 0),) * (x.ndim - 1))  # [tiles * row_tile, ...]
    tile_out = jax.eval_shape(fn, jax.ShapeDtypeStruct((row_tile, *x.shape[1:]), x.dtype))
    out = jnp.zeros((tiles * row_tile, *tile_out.shape[1:]), tile_out.dtype)

    def tile(i, out):
        t = jax.lax.dynamic_slice_in_dim(xp, i * row_tile, row_tile, 0)
        return jax.lax.dynamic_update_slice_in_dim(out, fn(t), i * row_tile, 0)

    trips = jax.lax.optimization_barrier(jnp.int32(tiles))
    return jax.lax.fori_loop(0, trips, tile, out)[:n]
