"""The chunked gated delta rule as a Mosaic TPU kernel.

Grid (heads, chunks): the chunks of one head run in order ("arbitrary") and carry the state
in VMEM; heads are independent ("parallel"). A sequence's chunks are consecutive, so its
state block (row, head) stays resident across them: the kernel loads it from the input pool at
the sequence's first chunk and writes it every chunk, and Pallas writes it back to HBM when the
row changes. The pool is aliased in and out, so rows without chunks keep their state. Chunks
past the step's real count (`num_chunks`, scalar-prefetched) do no work.

The C x C unit-lower-triangular solve has no Mosaic primitive; the kernel forms T = (I + A)^-1
with C x C matmuls on the MXU, never a Neumann series (its terms grow like binomials when keys
repeat: 1e16 at C = 64, where T itself stays O(1)):
- the 8 x 8 diagonal blocks by forward substitution, all blocks at once: 7 steps, each
  updating row r mod 8 = s of every block from the rows above it;
- then blocks merged pairwise, 8 -> 16 -> 32 -> 64: for L = [[L11, 0], [L21, L22]],
  L^-1 = [[X11, 0], [-X22 L21 X11, X22]], i.e. X <- X - X L_off X over the whole matrix.
13 matmuls for C = 64, each computing exact quantities of the inverse (as forward
substitution does), so no cancellation; checked against the reference's solve in tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

HIGHEST = jax.lax.Precision.HIGHEST


def _dot(a, b, contract=((1,), (0,))):
    return jax.lax.dot_general(a, b, (contract, ((), ())), precision=HIGHEST,
                               preferred_element_type=jnp.float32)


def _unit_lower_inverse(a: jax.Array, size: int, block: int = 8) -> jax.Array:
    """(I + a)^-1 for a strictly lower triangular [C, C] a (see the module docstring)."""
    ri = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
    ci = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
    eye = (ri == ci).astype(jnp.float32)
    a_diag = jnp.where(ri // block == ci // block, a, 0.0)
    inv = eye
    for step in range(1, min(block, size)):
        inv = jnp.where(ri % block == step, eye - _dot(a_diag, inv), inv)
    while block < size:
        off = jnp.where((ri // (2 * block) == ci // (2 * block)) & (ri // block != ci // block), a, 0.0)
        inv = inv - _dot(_dot(inv, off), inv)
        block *= 2
    return inv


def _kernel(rows_ref, count_ref, q_ref, k_ref, v_ref, gcol_ref, grow_ref, beta_ref, s_in_ref,
            o_ref, s_out_ref, state_ref, *, size: int):
    c = pl.program_id(1)
    live = c < count_ref[0]
    first = (c == 0) | (rows_ref[c] != rows_ref[jnp.maximum(c - 1, 0)])

    @pl.when(live & first)
    def _():
        state_ref[...] = s_in_ref[...]

    @pl.when(live)
    def _():
        q, k, v = q_ref[...], k_ref[...], v_ref[...]  # [C, dk], [C, dk], [C, dv]
        cum_col, cum_row, beta = gcol_ref[...], grow_ref[...], beta_ref[...]  # [C, 1], [1, C], [C, 1]
        state = state_ref[...]  # [dk, dv]
        ri = jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
        ci = jax.lax.broadcasted_iota(jnp.int32, (size, size), 1)
        lower = ri >= ci
        decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum_col - cum_row, 0.0)), 0.0)  # [C, C]
        k_beta = k * beta
        a = jnp.where(ri > ci, _dot(k_beta, k, ((1,), (1,))) * decay, 0.0)
        inv = _unit_lower_inverse(a, size)
        u = _dot(inv, v * beta)  # [C, dv]
        w = _dot(inv, k_beta * jnp.exp(cum_col))  # [C, dk]
        v_new = u - _dot(w, state)
        attn = _dot(q, k, ((1,), (1,))) * decay  # [C, C]
        o_ref[...] = _dot(q * jnp.exp(cum_col), state) + _dot(attn, v_new)
        last = cum_row[:, size - 1:size]  # [1, 1]
        k_dec = k * jnp.exp(last - cum_col)  # [C, dk]
        state = state * jnp.exp(last) + _dot(k_dec, v_new, ((0,), (0,)))
        state_ref[...] = state
        s_out_ref[...] = state

    @pl.when(jnp.logical_not(live))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        s_out_ref[...] = s_in_ref[...]


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunked_delta_rule_tpu(q, k, v, g, beta, states, chunk_rows, num_chunks, *, interpret=False):
    """See `ops.chunked_delta_rule`; same arguments and results."""
    Nc, C, Hk, dk = q.shape
    H, dv = v.shape[2], v.shape[3]
    group = H // Hk
    f32 = jnp.float32
    heads_first = lambda a: jnp.transpose(a.astype(f32), (0, 2, 1, 3))  # noqa: E731  [Nc, H, C, d]
    cum = jnp.transpose(jnp.cumsum(g.astype(f32), axis=1), (0, 2, 1))  # [Nc, H, C]
    b = jnp.transpose(beta.astype(f32), (0, 2, 1))
    qk_spec = lambda d: pl.BlockSpec((None, None, C, d), lambda h, c, *_: (c, h // group, 0, 0))  # noqa: E731
    tok_spec = lambda d: pl.BlockSpec((None, None, C, d), lambda h, c, *_: (c, h, 0, 0))  # noqa: E731
    state_spec = pl.BlockSpec((None, None, dk, dv), lambda h, c, rows, _: (rows[c], h, 0, 0))
    out, states = pl.pallas_call(
        functools.partial(_kernel, size=C),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(H, Nc),
            in_specs=[qk_spec(dk), qk_spec(dk), tok_spec(dv), tok_spec(1),
                      pl.BlockSpec((None, None, 1, C), lambda h, c, *_: (c, h, 0, 0)), tok_spec(1), state_spec],
            out_specs=[tok_spec(dv), state_spec],
            scratch_shapes=[pltpu.VMEM((dk, dv), f32)],
        ),
        out_shape=[jax.ShapeDtypeStruct((Nc, H, C, dv), f32), jax.ShapeDtypeStruct(states.shape, f32)],
        input_output_aliases={8: 1},  # the state pool (after the 2 scalar-prefetch operands)
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="chunked_delta_rule_tpu",
    )(chunk_rows.astype(jnp.int32), num_chunks.astype(jnp.int32), heads_first(q), heads_first(k),
      heads_first(v), cum[..., None], cum[:, :, None, :], b[..., None], states.astype(f32))
    return jnp.transpose(out, (0, 2, 1, 3)), states
