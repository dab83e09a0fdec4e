"""The chunked gated delta rule in jnp: the oracle of the TPU kernel and the CPU / GPU path.

One chunk of C tokens of one sequence, per head (q, k l2-normalised, q scaled; g the per-token
log decay; padding positions carry k = 0, beta = 0, g = 0 and change nothing):
  cum = cumsum(g);  D[i, j] = exp(cum_i - cum_j) for j <= i, else 0
  A = strictly_lower((beta k) k^T * D);  T = (I + A)^-1
  u = T (beta v);  w = T (beta exp(cum) k);  v' = u - w S
  out = exp(cum) q S + lower(q k^T * D) v'
  S' = exp(cum_C) S + (exp(cum_C - cum) k)^T v'
Cost per chunk and head: O(C^2 (dk + dv) + C dk dv) work, plus the C x C triangular solve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def chunk_step(q, k, v, g, beta, state):
    """The chunked form on one chunk of one sequence. q, k [C, H, dk]; v [C, H, dv];
    g, beta [C, H]; state [H, dk, dv]. Returns out [C, H, dv] and the state after."""
    C = q.shape[0]
    q, k, v = (jnp.swapaxes(a, 0, 1) for a in (q, k, v))  # [H, C, d]
    g, beta = g.T, beta.T  # [H, C]
    cum = jnp.cumsum(g, axis=-1)  # [H, C]
    lower = jnp.tril(jnp.ones((C, C), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)  # [H, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = jnp.where(jnp.tril(lower, -1), (k_beta @ jnp.swapaxes(k, 1, 2)) * decay, 0.0) + jnp.eye(C)
    solve = jax.vmap(lambda a, b: jax.scipy.linalg.solve_triangular(a, b, lower=True, unit_diagonal=True))
    u = solve(system, v_beta)  # [H, C, dv]
    w = solve(system, k_beta * jnp.exp(cum)[..., None])  # [H, C, dk]
    v_new = u - w @ state  # [H, C, dv]
    attn = (q @ jnp.swapaxes(k, 1, 2)) * decay  # [H, C, C]
    out = (q * jnp.exp(cum)[..., None]) @ state + attn @ v_new
    last = cum[:, -1:]  # [H, 1]
    k_dec = k * jnp.exp(last - cum)[..., None]
    state = state * jnp.exp(last)[..., None] + jnp.swapaxes(k_dec, 1, 2) @ v_new
    return jnp.swapaxes(out, 0, 1), state


def chunked_delta_rule_reference(q, k, v, g, beta, states, chunk_rows, num_chunks):
    """The step's chunks in order (see `ops.chunked_delta_rule`), one at a time, in a loop whose
    trip count is the real chunk count."""
    group = v.shape[2] // q.shape[2]
    q, k = (jnp.repeat(a, group, axis=2) for a in (q, k))  # [Nc, C, H, dk]
    out = jnp.zeros(v.shape, jnp.float32)

    def body(c, carry):
        states, out = carry
        r = chunk_rows[c]
        o, s = chunk_step(q[c], k[c], v[c], g[c], beta[c], states[r])
        return states.at[r].set(s), out.at[c].set(o)

    states, out = jax.lax.fori_loop(0, num_chunks[0], body, (states, out))
    return out, states
