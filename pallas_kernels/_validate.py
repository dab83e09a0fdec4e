"""Trace-time shape/dtype checks (Python on static shapes only: zero runtime cost)."""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp


def check_shape(name: str, x, expected: Sequence[int | None], meaning: str) -> None:
    """Raise ValueError unless `x.shape` matches `expected` (None = any size)."""
    shape = tuple(x.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for s, e in zip(shape, expected))
    if not ok:
        want = ", ".join("?" if e is None else str(e) for e in expected)
        raise ValueError(f"{name} must have shape {meaning} = [{want}], got {list(shape)}")


def check_int32(name: str, x) -> None:
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def check_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype (float32/bfloat16), got {x.dtype}")
