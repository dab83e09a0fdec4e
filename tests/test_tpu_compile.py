"""Compile-only TPU checks: XLA:TPU and Mosaic (libtpu) run here on abstract TPU devices.

`backend="auto"` must pick the Mosaic kernel when the program is compiled for a TPU, even
from this CPU host, and the reference where the kernel does not support the layout.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_kernels as pk
from pallas_kernels.ragged_paged_attention.ops import attention_implementation

T, R, MAX_PAGES, PAGES, PAGE = 64, 8, 16, 128, 16
KERNEL = "tpu_custom_call"


@functools.cache
def tpu_device(topology: str):
    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]


def compiled_hlo(fn, args, device) -> str:
    """The optimized HLO of `jax.jit(fn)` compiled for `device` (a TPU or the host CPU)."""
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with jax.default_device(device):  # Pallas reads the chip generation from it
        return jax.jit(fn).lower(*sds).compile().as_text()


def attention_args(dtype, hq, hkv, d):
    S = jax.ShapeDtypeStruct
    page = S((PAGES, PAGE, hkv, d), dtype)
    return (S((T, hq, d), dtype), page, page, S((R,), jnp.int32), S((R, MAX_PAGES), jnp.int32),
            S((R + 1,), jnp.int32), S((1,), jnp.int32))


ATTENTION = functools.partial(pk.ragged_paged_attention, sm_scale=0.125)
KERNEL_CASES = [  # (dtype, (Hq, Hkv, D)) the Mosaic kernel compiles for
    (jnp.float32, (9, 3, 64)),  # SmolLM2's layout
    (jnp.float32, (32, 8, 128)),  # Llama-3-8B's
    (jnp.float32, (16, 16, 64)),
    (jnp.float32, (16, 4, 256)),
    (jnp.bfloat16, (8, 1, 128)),
]


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("dtype,heads", KERNEL_CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_auto_compiles_the_mosaic_kernel_for_tpu(topology, dtype, heads):
    hq, hkv, d = heads
    assert attention_implementation("tpu", hkv, d, dtype)[0] == "pallas"
    hlo = compiled_hlo(ATTENTION, attention_args(dtype, *heads), tpu_device(topology))
    assert KERNEL in hlo and "ragged_paged_attention_tpu" in hlo


def test_auto_falls_back_to_the_reference_where_the_kernel_cannot():
    impl, why = attention_implementation("tpu", 8, 128, jnp.bfloat16)
    assert impl == "reference" and "Hkv=8" in why and "bfloat16" in why
    hlo = compiled_hlo(ATTENTION, attention_args(jnp.bfloat16, 32, 8, 128), tpu_device("v5e:2x2"))
    assert "ragged_paged_attention_tpu" not in hlo


def test_auto_on_the_host_cpu_is_the_reference():
    assert attention_implementation("cpu", 3, 64, jnp.float32)[0] == "reference"
    hlo = compiled_hlo(ATTENTION, attention_args(jnp.float32, 9, 3, 64), jax.devices("cpu")[0])
    assert KERNEL not in hlo and "ragged_paged_attention_tpu" not in hlo and "triton" not in hlo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_auto_kv_update_compiles_the_kernel_for_tpu(dtype):
    S = jax.ShapeDtypeStruct
    page = S((PAGES, PAGE, 3, 64), dtype)
    args = (S((T, 3, 64), dtype), S((T, 3, 64), dtype), page, page, S((T,), jnp.int32))
    hlo = compiled_hlo(pk.update_kv_cache, args, tpu_device("v5e:2x2"))
    assert KERNEL in hlo and "update_kv_cache_tpu" in hlo
