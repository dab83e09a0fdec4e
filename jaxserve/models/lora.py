"""The LoRA delta inside the jitted step: every adapter slot's low-rank product, masked per token.

The slots' A and B of one target are held as one matrix each: A [in, N, r] -> [in, N*r] and
B [N, r, out] -> [N*r, out]. A step computes `x @ A` for all N slots at once ([T, N*r]), zeroes
each token's columns outside its own slot, and multiplies by B: two dense GEMMs whose shapes
depend on N and r only, never on which adapters are loaded or how the batch mixes them. A
token of slot 0 (the base model) gets an exact zero. The cost is N*r*(in + out) multiply-adds
per token and target (N times one adapter's), which at N*r <= a few hundred stays well under
the projection's own in*out; a per-slot gather of A and B would move [T, in, r] per target
instead. The same formulation serves CPU, TPU and GPU: XLA's dense dots, checked in the
compiled HLO (docs/lora.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoRABatch:
    """What the backbone needs to apply adapters in one step."""

    # "<target>.a": [L, in, N, r], "<target>.b": [L, N, r, out] (N = max_loras slots; scaling
    # folded into B); sliced per layer by the layer scan.
    weights: dict[str, jax.Array]
    token_slots: jax.Array  # [T] int32: the token's slot (1..N), 0 for the base model

    def onehot(self, num_slots: int, dtype) -> jax.Array:
        """[T, N]: 1 where the token uses slot n + 1."""
        return (self.token_slots[:, None] == jnp.arange(1, num_slots + 1, dtype=jnp.int32)[None, :]).astype(dtype)


def num_slots(weights: dict[str, jax.Array]) -> int:
    """N of the stacked slot weights (`LoRABatch.weights`)."""
    return next(w for k, w in weights.items() if k.endswith(".a")).shape[2]


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, onehot: jax.Array, matmul) -> jax.Array:
    """x [T, in]; one layer's a [in, N, r], b [N, r, out]; onehot [T, N] -> [T, out].
    `matmul(x, w)` is the model's dense product (batch-invariant tiles when asked)."""
    n, r = a.shape[1], a.shape[2]
    xa = matmul(x, a.reshape(a.shape[0], n * r))  # [T, N*r]
    xa = (xa.reshape(-1, n, r) * onehot[:, :, None]).reshape(-1, n * r)
    return matmul(xa, b.reshape(n * r, b.shape[-1]))  # [T, out]
