"""The Gated DeltaNet ops (`models/gated_delta.py`) against transformers' torch paths: a ragged
batch of decodes, short and multi-chunk spans, fresh and resumed states, each sequence checked
on its own outputs and on the state written to its slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.gated_delta import causal_conv, gated_delta_rule
from jaxserve.models.metadata import AttentionMetadata, RecurrentMetadata
from jaxserve.worker.recurrent_inputs import recurrent_inputs

torch = pytest.importorskip("torch")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def test_ragged_delta_rule_and_conv_match_transformers():
    rng = np.random.default_rng(0)
    H, dk, dv, K, C = 4, 8, 6, 4, 10
    lens, starts, slots = [1, 37, 5, 1, 70], [9, 0, 3, 2, 0], [3, 1, 7, 2, 5]  # 70: two chunks and a part
    T, R, N = 128, 8, 10
    pool = rng.standard_normal((N, H, dk, dv)).astype(np.float32) * 0.3
    conv_pool = rng.standard_normal((N, K - 1, C)).astype(np.float32)
    cu = np.full(R + 1, sum(lens), np.int32)
    cu[:len(lens)] = np.cumsum([0] + lens[:-1])
    kv = np.zeros(R, np.int32)
    kv[:len(lens)] = np.add(starts, lens)
    q, k = (rng.standard_normal((T, H, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((T, H, dv)).astype(np.float32)
    g = -np.abs(rng.standard_normal((T, H))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((T, H))))).astype(np.float32)
    x, w = rng.standard_normal((T, C)).astype(np.float32), rng.standard_normal((K, C)).astype(np.float32)
    md = AttentionMetadata(slot_mapping=jnp.zeros(T, jnp.int32), cu_q_lens=jnp.asarray(cu), kv_lens=jnp.asarray(kv),
                           block_tables=jnp.zeros((R, 1), jnp.int32), num_seqs=jnp.array([len(lens)], jnp.int32))
    rm = RecurrentMetadata(**{n: jnp.asarray(a) for n, a in recurrent_inputs(cu, len(lens), slots, T, R).items()})
    out, new_pool = jax.jit(gated_delta_rule)(q, k, v, g, beta, jnp.asarray(pool), md, rm)
    conv_out, new_conv = jax.jit(causal_conv)(jnp.asarray(x), jnp.asarray(w), jnp.asarray(conv_pool), md, rm)
    for i, n in enumerate(lens):
        span = slice(cu[i], cu[i] + n)
        fresh = starts[i] == 0

        def t(a, span=span):
            return torch.tensor(a[span])[None]

        init = None if fresh else torch.tensor(pool[slots[i]])[None]
        want, state = qwen3_next.torch_recurrent_gated_delta_rule(
            t(q), t(k), t(v), t(g), t(beta), initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(np.asarray(out[span]), want[0].numpy(), atol=5e-6, err_msg=f"sequence {i}")
        np.testing.assert_allclose(np.asarray(new_pool[slots[i]]), state[0].numpy(), atol=5e-6)
        history = np.zeros((C, K - 1), np.float32) if fresh else conv_pool[slots[i]].T
        inputs = np.concatenate([history, x[span].T], axis=1)  # [C, K-1+n]
        conv = torch.nn.functional.conv1d(torch.tensor(inputs)[None], torch.tensor(w.T)[:, None, :], groups=C)
        want_conv = torch.nn.functional.silu(conv[0, :, -n:]).numpy().T
        np.testing.assert_allclose(np.asarray(conv_out[span]), want_conv, atol=5e-6)
        np.testing.assert_array_equal(np.asarray(new_conv[slots[i]]), inputs[:, -(K - 1):].T)
