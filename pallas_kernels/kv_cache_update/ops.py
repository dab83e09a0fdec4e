"""Public entry point for the KV-cache write: validate, then dispatch by backend."""

from __future__ import annotations

import jax

from pallas_kernels import kv_quant
from pallas_kernels._dispatch import by_target_platform, resolve_backend
from pallas_kernels._validate import (
    check_float,
    check_int32,
    check_kv_dtypes,
    check_scales,
    check_shape,
)
from pallas_kernels.kv_cache_update.reference import quantize_new_rows, update_kv_cache_reference
from pallas_kernels.kv_layout import lanes_width, layout_of, to_lanes
from pallas_kernels.ragged_paged_attention.gpu import supports as gpu_supports


def _validate(k_new, v_new, k_pages, v_pages, slot_mapping, k_scales, v_scales) -> None:
    check_shape("k_new", k_new, (None, None, None), "[T, Hkv, D]")
    num_tokens, num_kv_heads, head_dim = k_new.shape
    check_shape("v_new", v_new, (num_tokens, num_kv_heads, head_dim), "[T, Hkv, D]")
    if k_pages.ndim == 3:  # lanes layout
        width = lanes_width(num_kv_heads, head_dim)
        check_shape("k_pages", k_pages, (None, None, width), f"[num_pages, page_size, C={width}] (lanes layout)")
    else:
        check_shape("k_pages", k_pages, (None, None, num_kv_heads, head_dim), "[num_pages, page_size, Hkv, D]")
    check_shape("v_pages", v_pages, tuple(k_pages.shape), "like k_pages")
    check_shape("slot_mapping", slot_mapping, (num_tokens,), "[T]")
    check_int32("slot_mapping", slot_mapping)
    check_float("k_new", k_new)
    check_float("v_new", v_new)
    check_kv_dtypes(k_pages, v_pages)
    check_scales(k_pages, k_scales, v_scales, num_kv_heads)


def update_kv_cache(
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D] or [num_pages, page_size, C]
    v_pages: jax.Array,  # like k_pages
    slot_mapping: jax.Array,  # [T] int32
    *,
    k_scales: jax.Array | None = None,  # quantized pages only: kv_layout.kv_scales_shape(...) f32
    v_scales: jax.Array | None = None,
    backend: str = "auto",
    interpret: bool | object = False,
):
    """Write the step's new K/V rows into their slots (page * page_size + offset).

    `k_pages` in either layout (`pallas_kernels.kv_layout`): `[P, S, Hkv, D]`, or `[P, S, C]`
    (the new rows are then laid out in C lanes first). Padding tokens must point at slots of
    the null page 0. Same backends as attention (the GPU kernel writes the heads layout).
    Returns (k_pages, v_pages).

    Quantized pages (int8, float8_e4m3fn, float8_e5m2; `pallas_kernels.kv_quant`) need
    `k_scales` / `v_scales` (f32, `kv_layout.kv_scales_shape(num_pages, page_size, Hkv,
    layout)`): each new row is quantized per token and KV head (scale = max|x| / qmax) and
    values and scales are written to its slot; returns (k_pages, v_pages, k_scales, v_scales).
    """
    _validate(k_new, v_new, k_pages, v_pages, slot_mapping, k_scales, v_scales)
    head_dim = k_new.shape[2]
    lanes = k_pages.ndim == 3
    quantized = k_scales is not None
    if quantized:
        # The same quantization for every backend (kv_quant), then the kernels write rows.
        kq, vq, ks, vs = quantize_new_rows(k_new, v_new, k_pages)
        args = (k_new, v_new, k_pages, v_pages, slot_mapping, k_scales, v_scales)
        kernel_args = (kq, vq, k_pages, v_pages, slot_mapping, k_scales, v_scales, ks, vs)
    else:
        if lanes:
            k_new, v_new = to_lanes(k_new, k_pages.shape[2]), to_lanes(v_new, k_pages.shape[2])
        args = kernel_args = (k_new, v_new, k_pages, v_pages, slot_mapping)
    gpu_ok = not lanes and gpu_supports(head_dim)
    if backend == "auto" and not interpret:  # the target platform's kernel (see _dispatch)
        from pallas_kernels.kv_cache_update.gpu import update_kv_cache_gpu
        from pallas_kernels.kv_cache_update.tpu import update_kv_cache_tpu

        # Lanes pages take XLA's scatter on TPU too: a single-row DMA into a page is not
        # tile aligned there (S is the second-minor, tiled, dimension of a [S, C] page).
        # The kernels get rows already quantized, so every branch takes the kernel's args.
        return by_target_platform(kernel_args, reference=_written(layout_of(k_pages)) if quantized
                                  else update_kv_cache_reference,
                                  tpu=None if lanes else update_kv_cache_tpu,
                                  gpu=update_kv_cache_gpu if gpu_ok else None,
                                  cpu=_native_cpu_write() if not quantized and k_pages.dtype.itemsize == 2 else None)
    impl = resolve_backend(backend, interpret)
    if impl == "gpu" and not gpu_ok:
        raise ValueError(f"the gpu KV-update kernel needs the heads layout and D a multiple of 16 up to 256, "
                         f"got D={head_dim}"
                         + (" in the lanes layout" if lanes else ""))
    if impl == "reference":
        return update_kv_cache_reference(*args)
    if impl == "tpu":
        from pallas_kernels.kv_cache_update.tpu import update_kv_cache_tpu

        return update_kv_cache_tpu(*kernel_args, interpret=interpret)
    from pallas_kernels.kv_cache_update.gpu import update_kv_cache_gpu

    return update_kv_cache_gpu(*kernel_args, interpret=bool(interpret))


def _native_cpu_write():
    """The native CPU row write for 16-bit float pages (XLA:CPU upcasts a bf16 scatter to f32
    over the whole pool), where this process compiles for its own CPU and could build it."""
    if jax.default_backend() != "cpu":
        return None
    from pallas_kernels.kv_cache_update import cpu

    return cpu.update_kv_cache_cpu if cpu.available()[0] else None


def _written(layout):
    """The reference's scatter for rows already quantized (`auto`'s fallback branch)."""
    def write(kq, vq, k_pages, v_pages, slots, k_scales, v_scales, ks, vs):
        k_pages, v_pages = update_kv_cache_reference(kq, vq, k_pages, v_pages, slots)
        return (k_pages, v_pages, kv_quant.write_scales(k_scales, slots, ks, layout),
                kv_quant.write_scales(v_scales, slots, vs, layout))

    return write
