"""The native CPU KV-cache write (`cpu_kernel.cc`): build, load, call.

XLA:CPU has no bf16 scatter: it upcasts the reference's scatter, converting the whole page
pool to f32 and back around every layer's write (measured 170 ms of a 180 ms SmolLM2 decode
step with bf16 pages); a bit-level scatter (`bitcast_convert_type` to u16) was worse, the
bitcast of the pool being a copy there. This custom call copies each new row into its slot,
the pages aliased in and out, so it writes in place like the f32 scatter. Built like the
other native CPU kernels (`pallas_kernels._native_cpu`); without a compiler `available()`
says why and callers use the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax

from pallas_kernels._native_cpu import build

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_SYMBOL = "JaxserveKvWriteCpu"


@functools.cache
def _register() -> tuple[str | None, str]:
    """(FFI target name or None, why): builds, loads and registers the kernel once."""
    path, why, name = build(_SOURCE, "jaxserve_kv_write_cpu", "CPU KV-cache write")
    if path is None:
        return None, why
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, _SYMBOL)), platform="cpu")
    except (OSError, AttributeError) as e:
        return None, f"loading the CPU KV-cache write {path} failed: {e}"
    return name, why


def available() -> tuple[bool, str]:
    """(whether the native kernel can run here, why). Builds it on first call."""
    name, why = _register()
    return name is not None, why


def update_kv_cache_cpu(k_new: jax.Array, v_new: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                        slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The reference's contract (`update_kv_cache_reference` for float pages): row t of
    k_new / v_new ([T, ...], cast to the pages' dtype) into slot slot_mapping[t] of the
    pages ([P, S, ...], slot = page * S + offset), in place."""
    name, why = _register()
    if name is None:
        raise RuntimeError(why)
    out = (jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype))
    call = jax.ffi.ffi_call(name, out, input_output_aliases={2: 0, 3: 1}, vmap_method="sequential")
    return call(k_new.astype(k_pages.dtype), v_new.astype(v_pages.dtype), k_pages, v_pages,
                slot_mapping.astype("int32"))
