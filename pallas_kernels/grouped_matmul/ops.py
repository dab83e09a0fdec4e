"""Public entry point for the grouped matmul: validate, then dispatch by backend."""

from __future__ import annotations

import jax

from pallas_kernels._dispatch import by_target_platform
from pallas_kernels._validate import check_float, check_int32, check_shape
from pallas_kernels.grouped_matmul.cpu import grouped_matmul_cpu
from pallas_kernels.grouped_matmul.gpu import supports as gpu_supports
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

BACKENDS = ("auto", "cpu", "pallas_gpu", "reference", "xla")


def _validate(lhs, rhs, group_sizes) -> None:
    check_shape("lhs", lhs, (None, None), "[M, K]")
    k = lhs.shape[1]
    check_shape("rhs", rhs, (None, k, None), "[G, K, N]")
    if rhs.shape[0] == 0:
        raise ValueError("rhs must hold at least one group, got G=0")
    check_shape("group_sizes", group_sizes, (rhs.shape[0],), "[G]")
    check_int32("group_sizes", group_sizes)
    check_float("lhs", lhs)
    check_float("rhs", rhs)
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype} vs {rhs.dtype}")


def _xla_ragged_dot(lhs, rhs, group_sizes):
    """`jax.lax.ragged_dot` as jax 0.10 lowers it: XLA:TPU's native grouped matmul on TPU; on
    GPU and CPU a dense masked expansion (every row times every group: G x the FLOPs)."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes)


def grouped_matmul(
    lhs: jax.Array,  # [M, K], rows sorted by group
    rhs: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # [G] int32
    *,
    backend: str = "auto",
    interpret: bool = False,
) -> jax.Array:  # [M, N], lhs.dtype
    """`out[i] = lhs[i] @ rhs[g]` for the rows i of group g (the contiguous run of
    `group_sizes[g]` rows after the previous groups); rows past sum(group_sizes) are zero.
    f32 accumulation, output in lhs.dtype (see reference.py).

    backend: "auto" (decided by the platform the program is compiled for: the Triton kernel
    on a GPU when `gpu.supports(K, N, dtype)`, else `jax.lax.ragged_dot`; XLA's own ragged
    dot on TPU; the jnp loop over the non-empty groups of `cpu.py` on CPU), "cpu" (that loop,
    on any platform), "pallas_gpu" (the Triton kernel; on a host without a GPU only with
    `interpret=True`), "reference" (the f32-accumulating oracle), "xla" (`jax.lax.ragged_dot`
    as XLA lowers it on the current platform, for comparisons: dense on GPU and CPU).
    """
    _validate(lhs, rhs, group_sizes)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    _, k = lhs.shape
    n = rhs.shape[2]
    if backend == "reference":
        return grouped_matmul_reference(lhs, rhs, group_sizes)
    if backend == "xla":
        return _xla_ragged_dot(lhs, rhs, group_sizes)
    if backend == "cpu":
        if interpret:
            raise ValueError("interpret=True needs backend='pallas_gpu'")
        return grouped_matmul_cpu(lhs, rhs, group_sizes)
    from pallas_kernels.grouped_matmul.gpu import grouped_matmul_gpu

    if backend == "pallas_gpu":
        if not interpret and jax.default_backend() not in ("gpu", "cuda", "rocm"):
            raise ValueError(f"backend='pallas_gpu' on platform {jax.default_backend()!r} needs interpret=True")
        if not gpu_supports(k, n, lhs.dtype):
            raise ValueError(f"the GPU grouped matmul does not support K={k}, N={n} in {lhs.dtype} "
                             "(K and N must be multiples of 16); use backend='auto' or 'reference'")
        return grouped_matmul_gpu(lhs, rhs, group_sizes, interpret=interpret)
    # auto
    if interpret:
        raise ValueError("interpret=True needs backend='pallas_gpu'")
    gpu = grouped_matmul_gpu if gpu_supports(k, n, lhs.dtype) else None
    return by_target_platform((lhs, rhs, group_sizes), reference=_xla_ragged_dot, tpu=None, gpu=gpu,
                              cpu=grouped_matmul_cpu)


def grouped_matmul_implementation(platform: str, k: int, n: int, dtype) -> tuple[str, str]:
    """What `backend="auto"` runs on `platform` ("cpu" | "tpu" | "gpu" | "cuda"):
    ("pallas" | "cpu" | "xla", why)."""
    if platform == "cpu":
        return "cpu", "the jnp grouped matmul (a loop over the non-empty groups; grouped_matmul/cpu.py)"
    if platform not in ("gpu", "cuda"):
        return "xla", f"jax.lax.ragged_dot (XLA's own lowering on {platform})"
    if not gpu_supports(k, n, dtype):
        return "xla", (f"the GPU grouped matmul does not support K={k}, N={n} in {jax.numpy.dtype(dtype).name}; "
                       "XLA's dense ragged_dot expansion runs")
    return "pallas", "the Triton grouped matmul"
