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
    conv_out, new_conv = jax.jit(causal_conv)(jnp.asarray(x), jnp.asarray(w.T), jnp.asarray(conv_pool), md, rm)
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


def _chunk_case(rng, C, Hk, H, dk, dv, rows, decay, correlated=False):
    """Random chunks in the op's layout; keys drawn near one direction per head when
    `correlated` (the triangular system's hard case: large beta k.k' with slow decay)."""
    Nc = len(rows)

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    k = rng.standard_normal((Nc, C, Hk, dk))
    if correlated:
        k = rng.standard_normal((1, 1, Hk, dk)) + 0.3 * k
    q = l2(rng.standard_normal((Nc, C, Hk, dk))) * dk ** -0.5
    g = -rng.uniform(0.0, decay, (Nc, C, H))
    beta = rng.uniform(0.5 if correlated else 0.0, 1.0, (Nc, C, H))
    v = rng.standard_normal((Nc, C, H, dv))
    states = rng.standard_normal((max(rows) + 1, H, dk, dv)) * 0.3
    return [np.asarray(a, np.float32) for a in (q, l2(k), v, g, beta, states)]


@pytest.mark.parametrize("C,correlated", [(16, False), (64, True)])
def test_the_tpu_kernel_matches_the_reference_in_interpret_mode(C, correlated):
    """The Mosaic kernel (interpret mode): a 3-chunk sequence, a one-chunk one, a two-chunk one
    whose last chunk is part padding, then padding chunks on the dummy row; grouped heads
    (2 query/key heads for 4 value heads). Rows without chunks keep their state bit for bit.
    C = 64 with correlated keys, beta near 1 and slow decay stresses the kernel's doubling
    inverse against the reference's triangular solve."""
    from jax.experimental.pallas import tpu as pltpu

    from pallas_kernels.gated_delta_rule.ops import chunked_delta_rule

    rng = np.random.default_rng(C)
    rows = np.array([0, 0, 0, 2, 3, 3, 5, 5], np.int32)  # row 5: the dummy; 1 and 4: no chunks
    n = 6
    q, k, v, g, beta, states = _chunk_case(rng, C, 2, 4, 32, 16, rows, decay=0.02 if correlated else 0.5,
                                           correlated=correlated)
    for a in (q, k, v, g, beta):
        a[5, C // 3:] = 0  # the last chunk of row 3: part padding
    args = [jnp.asarray(a) for a in (q, k, v, g, beta, states)] + [jnp.asarray(rows), jnp.array([n], jnp.int32)]
    want_out, want_states = chunked_delta_rule(*args, backend="reference")
    out, got_states = chunked_delta_rule(*args, backend="pallas_tpu", interpret=pltpu.InterpretParams())
    scale = float(jnp.abs(want_out[:n]).max())
    np.testing.assert_allclose(np.asarray(out[:n]), np.asarray(want_out[:n]), atol=2e-5 * max(1.0, scale))
    np.testing.assert_allclose(np.asarray(got_states[np.array([0, 2, 3])]), np.asarray(want_states[np.array([0, 2, 3])]),
                               atol=2e-5 * max(1.0, float(jnp.abs(want_states).max())))
    np.testing.assert_array_equal(np.asarray(got_states[np.array([1, 4])]), states[[1, 4]])


def test_the_op_names_bad_shapes():
    from pallas_kernels.gated_delta_rule.ops import chunked_delta_rule

    z = jnp.zeros
    with pytest.raises(ValueError, match="multiple of query/key heads"):
        chunked_delta_rule(z((2, 8, 3, 4)), z((2, 8, 3, 4)), z((2, 8, 4, 4)), z((2, 8, 4)), z((2, 8, 4)),
                           z((3, 4, 4, 4)), z(2, jnp.int32), z(1, jnp.int32))
    with pytest.raises(ValueError, match="states must have shape"):
        chunked_delta_rule(z((2, 8, 2, 4)), z((2, 8, 2, 4)), z((2, 8, 4, 4)), z((2, 8, 4)), z((2, 8, 4)),
                           z((3, 4, 5, 4)), z(2, jnp.int32), z(1, jnp.int32))
