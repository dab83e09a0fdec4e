"""The sliding window and chunked-attention arguments: each a static int / None, or per-layer
data (an int32 array).

Gemma 2/3 interleave sliding-window and global layers inside one `lax.scan` over layers, so
the window of a layer is a traced value there: an int32 array of shape [] or [1], where a
value <= 0 means no window (global attention) and w > 0 lets position p see key k iff
p - k < w, as the static int does.

Inside the kernels a window is one int32 scalar, the *effective* window: w where w > 0 and
INT32_MAX otherwise, so the mask `p - k < window` and the first visible key
`max(p - window + 1, 0)` need no separate "global" branch (p - k <= p < INT32_MAX, and
p - INT32_MAX + 1 cannot overflow for p >= 0).

Chunked local attention (Llama 4's `attention_chunk_size` C) is the same kind of argument:
position p sees key k iff k >= p - p % C (its own C-token chunk), besides k <= p and the
window. Its effective value is INT32_MAX where <= 0, which makes p - p % C = 0 for every p.
The kernels read both as one [2] int32 array (`bounds_array`: window, chunk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NO_WINDOW = jnp.iinfo(jnp.int32).max


def is_static(sliding_window) -> bool:
    """None or a Python int: the window is known when the kernel is traced."""
    return sliding_window is None or (isinstance(sliding_window, int) and not isinstance(sliding_window, bool))


def raw_array(sliding_window) -> jax.Array:
    """[1] int32 holding the window as given (None -> 0, i.e. no window)."""
    if sliding_window is None:
        return jnp.zeros((1,), jnp.int32)
    return jnp.asarray(sliding_window).astype(jnp.int32).reshape(1)


def effective_array(sliding_window) -> jax.Array:
    """[1] int32: the window where > 0, INT32_MAX (no window) where <= 0 or None."""
    w = raw_array(sliding_window)
    return jnp.where(w > 0, w, jnp.int32(NO_WINDOW))


def bounds_array(sliding_window, attention_chunk=None) -> jax.Array:
    """[2] int32: the effective window and the effective chunk size (INT32_MAX: none)."""
    return jnp.concatenate([effective_array(sliding_window), effective_array(attention_chunk)])


def raw_bounds(sliding_window, attention_chunk=None) -> jax.Array:
    """[2] int32: window and chunk size as given (0: none)."""
    return jnp.concatenate([raw_array(sliding_window), raw_array(attention_chunk)])


def chunk_start(pos: jax.Array, chunk: jax.Array) -> jax.Array:
    """The first key position `pos` sees in chunked attention (0 where the chunk is INT32_MAX)."""
    return pos - pos % chunk
