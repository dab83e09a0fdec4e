"""Public entry point for the grouped matmul: validate, then dispatch by backend."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._dispatch import by_target_platform
from pallas_kernels._validate import check_float, check_int32, check_shape
from pallas_kernels.grouped_matmul.cpu import grouped_matmul_cpu
from pallas_kernels.grouped_matmul.gpu import supports as gpu_supports
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference, scale_rows

BACKENDS = ("auto", "cpu", "pallas_gpu", "reference", "xla")
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)  # as pallas_kernels.quantized_matmul


def is_quantized(rhs) -> bool:
    """Whether `rhs` holds int8 / float8 values (weight-only quantized: needs a scale)."""
    return any(rhs.dtype == d for d in QUANTIZED_DTYPES)


def _validate(lhs, rhs, group_sizes, rhs_scale) -> None:
    check_shape("lhs", lhs, (None, None), "[M, K]")
    k = lhs.shape[1]
    check_shape("rhs", rhs, (None, k, None), "[G, K, N]")
    if rhs.shape[0] == 0:
        raise ValueError("rhs must hold at least one group, got G=0")
    check_shape("group_sizes", group_sizes, (rhs.shape[0],), "[G]")
    check_int32("group_sizes", group_sizes)
    check_float("lhs", lhs)
    if is_quantized(rhs):
        if rhs_scale is None:
            raise ValueError(f"rhs is quantized ({rhs.dtype}): pass rhs_scale [G, N] = "
                             f"[{rhs.shape[0]}, {rhs.shape[2]}] float32 (one factor per group and output channel)")
        check_shape("rhs_scale", rhs_scale, (rhs.shape[0], rhs.shape[2]), "[G, N]")
        if rhs_scale.dtype != jnp.float32:
            raise ValueError(f"rhs_scale must be float32, got {rhs_scale.dtype}")
        return
    if rhs_scale is not None:
        raise ValueError(f"rhs_scale is only for an int8 / float8 rhs; rhs is {rhs.dtype}")
    check_float("rhs", rhs)
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype} vs {rhs.dtype} "
                         "(a quantized rhs is int8 / float8 with rhs_scale)")


def _xla_ragged_dot(lhs, rhs, group_sizes, rhs_scale=None):
    """`jax.lax.ragged_dot` as jax 0.10 lowers it: XLA:TPU's native grouped matmul on TPU; on
    GPU and CPU a dense masked expansion (every row times every group: G x the FLOPs).

    Quantized: an int8 rhs goes in as stored (mixed bf16/f32 x int8 ragged dot, f32 out):
    XLA:TPU's ragged-dot kernel takes it without a converted copy (compiled for a v5e and a
    v6e: no convert of rhs, temp 0 B for G=128, K=2048, N=192). float8 rhs is converted to
    lhs.dtype first: TPUs before v7 have no fp8 arithmetic and XLA:TPU would otherwise
    convert it to an f32 copy (4x the fp8 bytes; the bf16 copy is 2x). Then each row is
    scaled by its group's scale."""
    if rhs_scale is None:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes)
    if rhs.dtype != jnp.int8:
        rhs = rhs.astype(lhs.dtype)  # materialises a converted copy of rhs (see above)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
    return scale_rows(out, rhs_scale, group_sizes).astype(lhs.dtype)


def grouped_matmul(
    lhs: jax.Array,  # [M, K], rows sorted by group
    rhs: jax.Array,  # [G, K, N] lhs.dtype, or int8 / float8 with rhs_scale
    group_sizes: jax.Array,  # [G] int32
    *,
    rhs_scale: jax.Array | None = None,  # [G, N] f32: required iff rhs is int8 / float8
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:  # [M, N], lhs.dtype
    """`out[i] = lhs[i] @ rhs[g]` for the rows i of group g (the contiguous run of
    `group_sizes[g]` rows after the previous groups); rows past sum(group_sizes) are zero.
    f32 accumulation, output in lhs.dtype (see reference.py). With a quantized rhs (int8 /
    float8_e4m3fn values, weight-only) `out[i] = (lhs[i] @ rhs[g]) * rhs_scale[g]`, the
    values converted to lhs.dtype where they are used (no dequantized copy of rhs except
    float8 on TPU: see `_xla_ragged_dot`).

    backend: "auto" (decided by the platform the program is compiled for: the Triton kernel
    on a GPU when `gpu.supports(K, N, dtype)`, else `jax.lax.ragged_dot`; XLA's own ragged
    dot on TPU; the jnp loop over the non-empty groups of `cpu.py` on CPU), "cpu" (that loop,
    on any platform), "pallas_gpu" (the Triton kernel; on a host without a GPU only with
    `interpret=True`), "reference" (the f32-accumulating oracle), "xla" (`jax.lax.ragged_dot`
    as XLA lowers it on the current platform, for comparisons: dense on GPU and CPU).
    """
    _validate(lhs, rhs, group_sizes, rhs_scale)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _, k = lhs.shape
    n = rhs.shape[2]
    args = (lhs, rhs, group_sizes) + (() if rhs_scale is None else (rhs_scale,))
    if backend == "reference":
        return grouped_matmul_reference(*args)
    if backend == "xla":
        return _xla_ragged_dot(*args)
    if backend == "cpu":
        if interpret:
            raise ValueError("interpret=True needs backend='pallas_gpu'")
        return grouped_matmul_cpu(*args)
    from pallas_kernels.grouped_matmul.gpu import grouped_matmul_gpu

    if backend == "pallas_gpu":
        if not interpret and jax.default_backend() not in ("gpu", "cuda", "rocm"):
            raise ValueError(f"backend='pallas_gpu' on platform {jax.default_backend()!r} needs interpret=True")
        if not gpu_supports(k, n, lhs.dtype, rhs.dtype):
            raise ValueError(f"the GPU grouped matmul does not support K={k}, N={n} in {lhs.dtype} "
                             "(K and N must be multiples of 16); use backend='auto' or 'reference'")
        return grouped_matmul_gpu(*args, interpret=interpret)
    # auto
    if interpret:
        raise ValueError("interpret=True needs backend='pallas_gpu'")
    gpu = grouped_matmul_gpu if gpu_supports(k, n, lhs.dtype, rhs.dtype) else None
    return by_target_platform(args, reference=_xla_ragged_dot, tpu=None, gpu=gpu, cpu=grouped_matmul_cpu)


def grouped_matmul_implementation(platform: str, k: int, n: int, dtype, rhs_dtype=None) -> tuple[str, str]:
    """What `backend="auto"` runs on `platform` ("cpu" | "tpu" | "gpu" | "cuda") for lhs in
    `dtype` and rhs in `rhs_dtype` (None: the same; int8 / float8: quantized):
    ("pallas" | "cpu" | "xla", why)."""
    quantized = rhs_dtype is not None and jnp.dtype(rhs_dtype) != jnp.dtype(dtype)
    if platform == "cpu":
        return "cpu", ("the jnp grouped matmul (a loop over the non-empty groups; grouped_matmul/cpu.py"
                       + ("; each group's weights converted as used)" if quantized else ")"))
    if platform not in ("gpu", "cuda"):
        why = f"jax.lax.ragged_dot (XLA's own lowering on {platform})"
        if quantized and jnp.dtype(rhs_dtype) == jnp.int8:
            why += "; int8 rhs taken as stored, no dequantized copy"
        elif quantized:
            why += f"; {jnp.dtype(rhs_dtype).name} rhs converted to {jnp.dtype(dtype).name} first (a copy of rhs)"
        return "xla", why
    if not gpu_supports(k, n, dtype, rhs_dtype):
        return "xla", (f"the GPU grouped matmul does not support K={k}, N={n} in {jnp.dtype(dtype).name}; "
                       "XLA's dense ragged_dot expansion runs")
    return "pallas", "the Triton grouped matmul" + (" (int8/fp8 tiles converted in registers)" if quantized else "")
