"""The public op: the chunked gated delta rule over a step's chunks, by platform."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import by_target_platform, resolve_backend
from pallas_kernels._validate import check_int32, check_shape
from pallas_kernels.gated_delta_rule.reference import chunked_delta_rule_reference
from pallas_kernels.gated_delta_rule.tpu import chunked_delta_rule_tpu


def chunked_delta_rule(
    q: jax.Array,  # [Nc, C, Hk, dk] f32, l2-normalised and scaled; padding positions 0
    k: jax.Array,  # [Nc, C, Hk, dk] f32, l2-normalised; padding positions 0
    v: jax.Array,  # [Nc, C, H, dv] f32; value head h reads query/key head h // (H / Hk)
    g: jax.Array,  # [Nc, C, H] f32 per-token log decay (<= 0); padding 0
    beta: jax.Array,  # [Nc, C, H] f32; padding 0
    states: jax.Array,  # [S, H, dk, dv] f32: each row's state before its first chunk
    chunk_rows: jax.Array,  # [Nc] int32: the row (index into `states`) of each chunk
    num_chunks: jax.Array,  # [1] int32: the real chunks, first; the rest are skipped
    *,
    backend: str = "auto",
    interpret: bool | object = False,
) -> tuple[jax.Array, jax.Array]:
    """Runs each sequence's chunks in order from its row's state. A row's chunks must be
    consecutive. Returns out [Nc, C, H, dv] f32 (skipped chunks: 0 on TPU, untouched zeros in
    the reference) and the pool with each chunked row's final state (other rows unchanged).

    "auto": the Mosaic kernel on TPU, the jnp reference elsewhere (CPU, and GPU through XLA).
    """
    Nc, C, Hk, dk = q.shape
    H, dv = v.shape[2], v.shape[3]
    check_shape("k", k, (Nc, C, Hk, dk), "[Nc, C, Hk, dk]")
    check_shape("v", v, (Nc, C, None, None), "[Nc, C, H, dv]")
    if H % Hk:
        raise ValueError(f"value heads ({H}) must be a multiple of query/key heads ({Hk})")
    check_shape("g", g, (Nc, C, H), "[Nc, C, H]")
    check_shape("beta", beta, (Nc, C, H), "[Nc, C, H]")
    check_shape("states", states, (None, H, dk, dv), "[S, H, dk, dv]")
    check_shape("chunk_rows", chunk_rows, (Nc,), "[Nc]")
    check_shape("num_chunks", num_chunks, (1,), "[1]")
    check_int32("chunk_rows", chunk_rows)
    check_int32("num_chunks", num_chunks)
    args = (q, k, v, g, beta, states.astype(jnp.float32), chunk_rows, num_chunks)
    impl = resolve_backend(backend if backend != "pallas_gpu" else "reference", bool(interpret))
    if backend == "auto":
        return by_target_platform(args, reference=chunked_delta_rule_reference,
                                  tpu=lambda *a: chunked_delta_rule_tpu(*a), gpu=None)
    if impl == "tpu":
        return chunked_delta_rule_tpu(*args, interpret=interpret)
    return chunked_delta_rule_reference(*args)
