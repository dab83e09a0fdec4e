"""Lower kernels for GPU/TPU on a machine without either (compile-time checks on CPU).

Pallas lowers a kernel to Triton IR (GPU) or Mosaic MLIR (TPU) while the surrounding jit
is lowered, so `lower_for_cuda` / `lower_for_tpu` catch unsupported ops, shapes and block
specs without hardware. They do not run the backend compilers (ptxas / libtpu).
"""

from __future__ import annotations

from collections.abc import Callable

import jax


def lower_for_cuda(fn: Callable, *args: jax.ShapeDtypeStruct) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for CUDA; the kernel is a Triton custom call."""
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def lower_for_tpu(
    fn: Callable, *args: jax.ShapeDtypeStruct, device_kind: str = "TPU v5 lite"
) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for TPU inside an abstract one-chip TPU mesh.

    The abstract mesh tells Pallas which chip to target (tiling, VMEM size) when no TPU is
    attached.
    """
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
