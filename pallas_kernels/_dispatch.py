"""Backend choice shared by the public ops: which implementation runs where."""

from __future__ import annotations

import jax

BACKENDS = ("auto", "pallas", "reference", "pallas_tpu", "pallas_gpu")


def by_target_platform(args: tuple, *, reference, tpu, gpu, cpu=None):
    """`backend="auto"`: the implementation of the platform the program is compiled for.

    `jax.lax.platform_dependent` picks the branch when the program is lowered, so a program
    compiled for TPU or GPU devices from a CPU host (compile-only targets, serialized
    executables) gets the kernel, and one compiled for CPU gets `cpu` (the native CPU
    kernel, attention only) or the reference. Every branch is traced, none is lowered but
    the target's. `tpu` / `gpu` / `cpu` are None where that kernel does not support the
    call (or, for `cpu`, could not be built on this host).
    """
    return jax.lax.platform_dependent(
        *args, cpu=cpu or reference, tpu=tpu or reference, cuda=gpu or reference, default=reference)


def resolve_backend(backend: str, interpret: bool) -> str:
    """Map the user's choice to "reference", "tpu" or "gpu" for the current platform.

    "auto": the kernel on TPU/GPU, the reference on CPU. "pallas": the kernel of the current
    platform; on CPU only with `interpret=True` (then the GPU kernel, interpreted).
    "pallas_tpu" / "pallas_gpu" force one kernel (for tests, lowering checks, interpret).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return "reference"
    platform = jax.default_backend()
    if backend in ("pallas_tpu", "pallas_gpu"):
        impl = backend.removeprefix("pallas_")
        native = (platform == "tpu") if impl == "tpu" else platform in ("gpu", "cuda", "rocm")
        if not native and not interpret:
            raise ValueError(f"backend={backend!r} on platform {platform!r} needs interpret=True")
        return impl
    if platform == "tpu":
        return "tpu"
    if platform in ("gpu", "cuda", "rocm"):
        return "gpu"
    if backend == "auto":
        return "reference"
    if not interpret:
        raise ValueError(
            f"backend='pallas' needs a TPU or GPU (platform is {platform!r}); "
            "pass interpret=True to run the kernel in interpret mode, or use 'reference'"
        )
    return "gpu"
