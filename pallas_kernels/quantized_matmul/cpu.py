"""The native CPU weight-only int8 matmul (`cpu_kernel.cc`): build, load, call.

XLA:CPU (jax 0.10) lowers the reference `dot(x, w.astype(f32))` as a convert fusion that
writes the whole weight as an f32 temporary, then an f32 GEMM on it: every call reads the
int8 weight, writes and reads 4x its bytes in f32, so int8 is slower than plain f32. Inside
the layer scan the dynamic slice of the stacked weight is fused into that convert (no int8
copy, but the same f32 temporary). The kernel reads the int8 weight in place (the stacked
[L, K, N] array and the layer index are operands) and widens it in registers.

Built like the attention kernel (`ragged_paged_attention/cpu.py`): compiled on first use
with the host C++ compiler (`-march=native`) into a cache keyed by source, flags, compiler,
jaxlib and CPU features; without a compiler `available()` says why and callers use the
reference. int8 weights, and bf16 weights (the CPU's bf16 serving path, `dense.py`: no
scale; XLA:CPU's bf16 dot runs one row at 1-10 GFLOP/s); float8 weights take the reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels._native_cpu import build, instruction_set
from pallas_kernels.quantized_matmul.reference import check_glu

_SOURCE = Path(__file__).with_name("cpu_kernel.cc")
_SYMBOL = "JaxserveQuantizedMatmulCpu"
_RESIDUAL = "Residual"  # the target with a residual operand: name and symbol take this suffix
_GLU = "Glu"  # the target whose epilogue is a gated activation (out [M, N / 2])
_GLU_CODES = {"silu": 1}
PRECISIONS = ("highest", "bf16")


@functools.cache
def _build() -> tuple[Path | None, str, str]:
    """(shared library or None, why, target name), built once per process."""
    return build(_SOURCE, "jaxserve_quantized_matmul_cpu", "CPU quantized matmul")


@functools.cache
def _register() -> tuple[str | None, str]:
    """(FFI target name or None, why): builds, loads and registers the kernel once."""
    path, why, name = _build()
    if path is None:
        return None, why
    try:
        lib = ctypes.cdll.LoadLibrary(str(path))
        for suffix in ("", _RESIDUAL, _GLU):
            jax.ffi.register_ffi_target(name + suffix, jax.ffi.pycapsule(getattr(lib, _SYMBOL + suffix)),
                                        platform="cpu")
    except (OSError, AttributeError) as e:
        return None, f"loading the CPU quantized matmul {path} failed: {e}"
    return name, why


def isa() -> str:
    """The instruction set the native kernel was built for (builds it on first call)."""
    return instruction_set(_build()[0], _SYMBOL + "Isa")


def bf16_dot_products() -> bool:
    """Whether the built kernel runs many rows on bf16 dot-product instructions (AVX512-BF16:
    Zen 4 and later, Cooper Lake, Sapphire Rapids and later), twice the f32 FMA rate. Builds
    the kernel on first call."""
    return available()[0] and "avx512_bf16" in isa()


def packed_path() -> bool:
    """Whether the built kernel has its packed path for many rows (AVX2 + FMA or AVX-512):
    bf16 weights then multiply a prefill's rows at the f32 FMA rate or better (twice it with
    AVX512-BF16) while a decode step reads half the bytes of f32 weights. Without it (a
    build for another ISA: the portable loops) bf16 weights would be slower than XLA's f32
    dot from a few rows on. Builds the kernel on first call."""
    return available()[0] and isa().split("+")[0] in ("avx2", "avx512")


def available() -> tuple[bool, str]:
    """(whether the native kernel can run here, why). Builds it on first call."""
    name, why = _register()
    return name is not None, why


def status() -> tuple[bool | None, str]:
    """Like `available()`, without building: None while nobody has asked for the kernel yet
    (the engine builds it at start-up, `jaxserve.worker.kernel_choice.prepare_native_kernels`)."""
    if _register.cache_info().currsize == 0:
        return None, "not built yet (it is built on first use)"
    return available()


def supports(w_dtype) -> bool:
    """int8 (with a scale) or bf16 weights (float8 weights use the reference on CPU)."""
    return jnp.dtype(w_dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.bfloat16))


def quantized_matmul_cpu(
    x: jax.Array,  # [M, K] f32 / bf16
    w: jax.Array,  # [K, N] int8 / bf16, or [L, K, N] with `layer`
    scale: jax.Array | None,  # [N] f32, or [L, N]; None for bf16 weights (no scale)
    layer: jax.Array | int | None = None,
    *,
    precision: str = "highest",
    transposed: bool = False,  # w [N, K] (unstacked): a tied embedding as the LM head
    residual: jax.Array | None = None,  # [M, N], x.dtype: added to the result
    rows: jax.Array | int | None = None,  # int32 scalar: the live rows (None: all M)
    out_dtype: jnp.dtype | None = None,  # x.dtype, or float32 from bf16 x (None: x.dtype)
    glu: str | None = None,  # "silu": out [M, N / 2] = silu(y[:, :N/2]) * y[:, N/2:]
) -> jax.Array:  # [M, N] (or [M, N / 2] with glu), out_dtype
    """The reference's contract (reference.py), computed by the native kernel. With
    `transposed`, w is [N, K] (output channels as rows) and read in that layout.

    `rows`: only x's first `rows` rows are computed (clamped to [0, M]); the rest of the
    result is 0. A padded batch (a token bucket) pays for its live rows only, and a live row's
    bits are those of the full computation (the path still follows M).

    The stacked weight and the layer index are operands: the kernel reads layer `layer` in
    place. `layer` is clamped (negative counts from the end) as `dynamic_index_in_dim` does.
    precision "bf16" (x rounded to bf16 before the products) lets rows past 8 run on bf16
    dot-product instructions (AVX512-BF16) at twice the f32 FMA rate; bf16 x always does.
    With `residual`, the result is `residual + product` as that separate add gives it (same
    bits), written once instead of written, read back and added. With `glu`, the result is
    the reference's `gated(product, glu)` (the product rounded to out's dtype, the activation
    in f32, rounded once), computed from the f32 sums in one pass: the exponential is the
    kernel's own (~2 ulp), so a value may differ from XLA's in the last bit before rounding.
    """
    name, why = _register()
    if name is None:
        raise RuntimeError(why)
    if not supports(w.dtype):
        raise ValueError(f"the native CPU matmul takes int8 or bfloat16 weights, got {w.dtype}")
    if scale is None:
        if w.dtype != jnp.bfloat16:
            raise ValueError("int8 weights need their scale")
        scale = jnp.zeros((0,), jnp.float32)  # no scale
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    rows = jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32).reshape(())
    if transposed and w.ndim != 2:
        raise ValueError(f"transposed takes an unstacked w [N, K], got shape {w.shape}")
    n = w.shape[0] if transposed else w.shape[-1]
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (jnp.dtype(x.dtype), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be x's dtype ({x.dtype}) or float32, got {out_dtype}")
    attrs = {"bf16_products": precision == "bf16", "w_transposed": transposed}
    if glu is not None:
        check_glu(glu, n, residual, transposed)
        if out_dtype != x.dtype:
            raise ValueError(f"glu writes x's dtype ({x.dtype}), not {out_dtype}")
        out = jax.ShapeDtypeStruct((x.shape[0], n // 2), out_dtype)
        call = jax.ffi.ffi_call(name + _GLU, out, vmap_method="sequential")
        return call(x, w, scale, layer, rows, glu=_GLU_CODES[glu], **attrs)
    out = jax.ShapeDtypeStruct((x.shape[0], n), out_dtype)
    if residual is None:
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(x, w, scale, layer, rows, **attrs)
    if residual.shape != out.shape or residual.dtype != out_dtype:
        raise ValueError(f"residual must be {out.shape} {out_dtype}, got {residual.shape} {residual.dtype}")
    call = jax.ffi.ffi_call(name + _RESIDUAL, out, vmap_method="sequential")
    return call(x, w, scale, layer, rows, residual, **attrs)
