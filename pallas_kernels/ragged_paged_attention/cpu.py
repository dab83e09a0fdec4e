"""The native CPU attention kernel (`cpu_kernel.cc`): build, load, call.

XLA:CPU runs the reference's decode attention (a few query heads per KV head against a few
hundred keys per sequence) as tiny reductions at 3-5 GB/s of K/V; a C++ loop over each
sequence's live pages, all heads at once, reads them at the memory bandwidth. It is an XLA
FFI custom call, so it sits inside the jitted step like any op.

The source is compiled on first use for the host CPU (`-march=native`) into a cache keyed
by everything that changes the binary (source, flags, compiler, jaxlib, CPU features), so a
home directory shared between machines never runs code built for another CPU. Without a
C++ compiler `available()` says why and callers use the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._native_cpu import build, instruction_set
from pallas_kernels.ragged_paged_attention import window

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_SYMBOL = "JaxserveRaggedPagedAttentionCpu"
_SYMBOL_QUANTIZED = "JaxserveRaggedPagedAttentionCpuQuantized"  # + k_scales, v_scales operands
_QUANTIZED_SUFFIX = "_quantized"


@functools.cache
def _build() -> tuple[Path | None, str, str]:
    """(shared library or None, why, target name), built once per process."""
    return build(_SOURCE, "jaxserve_ragged_paged_attention_cpu", "CPU attention kernel")


@functools.cache
def _register() -> tuple[str | None, str]:
    """(FFI target name or None, why): builds, loads and registers the kernel once."""
    path, why, name = _build()
    if path is None:
        return None, why
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
        jax.ffi.register_ffi_target(name + _QUANTIZED_SUFFIX, jax.ffi.pycapsule(getattr(lib, _SYMBOL_QUANTIZED)),
                                    platform="cpu")
    except (OSError, AttributeError) as e:
        return None, f"loading the CPU attention kernel {path} failed: {e}"
    return name, why


def isa() -> str:
    """The instruction set the native kernel was built for (builds it on first call)."""
    return instruction_set(_build()[0], _SYMBOL + "Isa")


def available() -> tuple[bool, str]:
    """(whether the native CPU kernel can run here, why). Builds it on first call."""
    name, why = _register()
    return name is not None, why


def status() -> tuple[bool | None, str]:
    """Like `available()`, without building: None while nobody has asked for the kernel yet
    (the engine builds it at start-up, `jaxserve.worker.kernel_choice.prepare_native_kernels`)."""
    if _register.cache_info().currsize == 0:
        return None, "not built yet (it is built on first use)"
    return available()


# Quantized page dtypes the kernel reads (values times their per-token scales).
QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def supports(layout: str, num_q_heads: int) -> bool:
    """Heads-layout pages ([P, S, Hkv, D]), at most 256 query heads; any D, page size; pages
    f32/bf16, or int8/fp8 with scales (QUANTIZED_DTYPES)."""
    return layout == "heads" and num_q_heads <= 256


def ragged_paged_attention_cpu(
    q: jax.Array,  # [T, Hq, D] f32 or bf16
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D] f32, bf16, int8, float8_e4m3fn, float8_e5m2
    v_pages: jax.Array,  # like k_pages
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [R+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,  # quantized pages: [num_pages, page_size, Hkv] f32
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,  # [Hq] f32 learned logits in each row's softmax denominator
    attention_chunk: int | jax.Array | None = None,  # chunked local attention (<= 0: none)
    attend_until: jax.Array | None = None,  # [T] int32: a token's last key max(p, this), <= kv_len - 1
) -> jax.Array:  # [T, Hq, D], dtype of q
    """The reference's contract (see reference.py), computed by the native kernel.

    The window is an operand ([1] int32, <= 0: none), not an attribute, so one compiled call
    serves every layer of a scan whose layers differ in window; a static int is a constant.
    `attend_until` is always an operand: zeros (plain causal) when None.
    """
    name, why = _register()
    if name is None:
        raise RuntimeError(why)
    scales = ()
    if k_scales is not None:
        name += _QUANTIZED_SUFFIX
        scales = (k_scales.astype(jnp.float32), v_scales.astype(jnp.float32))
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct(q.shape, q.dtype))
    sink_arr = sinks.astype(jnp.float32) if sinks is not None else jnp.zeros((q.shape[1],), jnp.float32)
    until = attend_until.astype(jnp.int32) if attend_until is not None else jnp.zeros((q.shape[0],), jnp.int32)
    return call(q, k_pages, v_pages, *scales, kv_lens, block_tables, cu_q_lens, num_seqs,
                window.raw_bounds(sliding_window, attention_chunk), sink_arr, until, sm_scale=np.float32(sm_scale),
                soft_cap=np.float32(soft_cap or 0.0), use_sinks=sinks is not None)
