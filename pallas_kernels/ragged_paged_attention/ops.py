"""Public entry point for ragged paged attention: validate, then dispatch by backend."""

from __future__ import annotations

import functools

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
from pallas_kernels.kv_layout import KVLayout, lanes_width, layout_of
from pallas_kernels.ragged_paged_attention import cpu as native_cpu
from pallas_kernels.ragged_paged_attention import window
from pallas_kernels.ragged_paged_attention.cpu import ragged_paged_attention_cpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference


def _validate(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sliding_window, soft_cap, num_kv_heads,
    k_scales=None, v_scales=None,
) -> int:
    """Checks every argument; returns the number of KV heads."""
    check_shape("q", q, (None, None, None), "[T, Hq, D]")
    num_tokens, num_q_heads, head_dim = q.shape
    if k_pages.ndim == 3:  # lanes layout: the head count is not in the shape
        if num_kv_heads is None:
            raise ValueError("num_kv_heads is required with lanes-layout pages [num_pages, page_size, C]")
        width = lanes_width(num_kv_heads, head_dim)
        check_shape("k_pages", k_pages, (None, None, width), f"[num_pages, page_size, C={width}] (lanes layout)")
    else:
        check_shape("k_pages", k_pages, (None, None, None, head_dim), "[num_pages, page_size, Hkv, D]")
        if num_kv_heads is not None and num_kv_heads != k_pages.shape[2]:
            raise ValueError(f"num_kv_heads {num_kv_heads} differs from k_pages' {k_pages.shape[2]} heads")
        num_kv_heads = k_pages.shape[2]
    check_shape("v_pages", v_pages, tuple(k_pages.shape), "like k_pages")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of the KV heads ({num_kv_heads})"
        )
    check_shape("kv_lens", kv_lens, (None,), "[R]")
    num_rows = kv_lens.shape[0]
    check_shape("block_tables", block_tables, (num_rows, None), "[R, max_pages_per_seq]")
    check_shape("cu_q_lens", cu_q_lens, (num_rows + 1,), "[R+1]")
    check_shape("num_seqs", num_seqs, (1,), "[1]")
    for name, x in (
        ("kv_lens", kv_lens),
        ("block_tables", block_tables),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        check_int32(name, x)
    check_float("q", q)
    check_kv_dtypes(k_pages, v_pages)
    check_scales(k_pages, k_scales, v_scales, num_kv_heads)
    _check_window(sliding_window)
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap}")
    return num_kv_heads


def _check_window(value, name: str = "sliding_window") -> None:
    """A static window (or attention chunk) is a positive Python int or None; a per-layer one
    an int32 array of shape [] or [1] (any value, concrete or traced: the kernels read it as
    data, <= 0 meaning none)."""
    if window.is_static(value):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be a positive int or None, got {value}")
        return
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise ValueError(f"{name} must be a positive int, None or an int32 array of shape [] or [1], "
                         f"got {type(value).__name__}")
    if tuple(value.shape) not in ((), (1,)):
        raise ValueError(f"{name} as an array must have shape [] or [1], got {list(value.shape)}")
    check_int32(name, value)


def _check_attend_until(value, num_tokens: int) -> None:
    """attend_until is an int32 array [T], one key limit per query token."""
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise ValueError(f"attend_until must be an int32 array of shape [T={num_tokens}] or None, "
                         f"got {type(value).__name__}")
    if tuple(value.shape) != (num_tokens,):
        raise ValueError(f"attend_until must have shape [T={num_tokens}] (one per query token), "
                         f"got {list(value.shape)}")
    check_int32("attend_until", value)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D], or [num_pages, page_size, C] (lanes)
    v_pages: jax.Array,  # like k_pages
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [R+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    num_kv_heads: int | None = None,
    sliding_window: int | jax.Array | None = None,
    soft_cap: float | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    sinks: jax.Array | None = None,
    attention_chunk: int | jax.Array | None = None,
    attend_until: jax.Array | None = None,
    backend: str = "auto",
    interpret: bool | object = False,
    batch_invariant: bool = False,
) -> jax.Array:  # [T, Hq, D], dtype of q
    """Attention of a flat ragged batch over the paged cache (docs/architecture.md contract).

    Pages in either layout of `pallas_kernels.kv_layout`; the TPU kernel reads the lanes
    layout, the GPU kernel the heads layout, the reference both. `num_kv_heads` is required
    with lanes pages.
    backend: "auto" (the kernel of the platform compiled for: TPU or GPU where it supports
    the layout, the native CPU kernel (cpu.py) where it could be built, else the reference:
    see `attention_implementation`), "pallas" (the host
    platform's kernel; on CPU only with interpret=True), "reference", or
    "pallas_tpu"/"pallas_gpu" to force one kernel.
    interpret: run the kernel in Pallas interpret mode (CPU); for the TPU kernel it may be a
    `pltpu.InterpretParams()`. "pallas" raises when the kernel does not support the layout.
    sliding_window: a positive int or None (static), or an int32 array of shape [] or [1]
    (per-layer data, e.g. `windows[layer]` inside a `lax.scan` over layers) where <= 0 means
    no window. Position p sees key k iff p - k < window. `soft_cap` is always static.
    k_scales, v_scales: required iff the pages are quantized (int8, float8_e4m3fn,
    float8_e5m2; `pallas_kernels.kv_quant`): f32 of `kv_layout.kv_scales_shape(num_pages,
    page_size, Hkv, layout)`, one per token and KV head. Keys and values are read as
    `value * scale`; the output is in q's dtype.
    sinks: [Hq] f32 learned logits (gpt-oss's attention sinks), each a softmax entry of its head
    with no value; every kernel takes them (the GPU one where its split partials merge).
    attention_chunk: Llama 4's chunked local attention, like `sliding_window` a static int or
    int32 data ([] or [1], <= 0: none): position p sees only keys k >= p - p % C.
    attend_until: [T] int32, one per query token, or None (plain causal, the code of before).
    Token t at position p sees key k iff k <= min(max(p, attend_until[t]), kv_len - 1) (its
    sequence's kv_len), besides the window's and the attention chunk's lower bounds, which
    still follow from p. A value <= p (0, -1) is plain causal; padding tokens ignore it.
    Gemma 3's image tokens set it to their image's last position, so an image's tokens
    attend to each other both ways. Every backend takes it.
    batch_invariant: the GPU kernel runs one block shape and no KV split (a row's result then
    never depends on the batch); the native CPU kernel already sums each row alone; the TPU
    kernel is unchanged (not verified invariant).
    """
    num_kv_heads = _validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sliding_window,
                             soft_cap, num_kv_heads, k_scales, v_scales)
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if k_scales is not None:
        kw.update(k_scales=k_scales, v_scales=v_scales)
    if attention_chunk is not None:
        _check_window(attention_chunk, "attention_chunk")
        kw["attention_chunk"] = attention_chunk
    if sinks is not None:
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"sinks must be [Hq={q.shape[1]}] (one logit per query head), got {tuple(sinks.shape)}")
        kw["sinks"] = sinks
    if attend_until is not None:
        _check_attend_until(attend_until, q.shape[0])
        kw["attend_until"] = attend_until
    layout = layout_of(k_pages)
    head_dim = q.shape[2]
    if backend == "auto" and not interpret:
        from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu
        from pallas_kernels.ragged_paged_attention.tpu import scales_page_size_ok as tpu_scales_ok

        fits = functools.partial(_kernel_supports, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 dtype=k_pages.dtype, layout=layout)
        tpu_kind = _tpu_device_kind()
        return by_target_platform(
            args,
            reference=functools.partial(ragged_paged_attention_reference, num_kv_heads=num_kv_heads, **kw),
            cpu=functools.partial(ragged_paged_attention_cpu, **kw)
            if _native_cpu_choice(layout, q.shape[1], k_pages.dtype)[0] else None,
            tpu=functools.partial(ragged_paged_attention_tpu, num_kv_heads=num_kv_heads, **kw)
            if fits("tpu", device_kind=tpu_kind) and (k_scales is None or tpu_scales_ok(k_pages.shape[1])) else None,
            gpu=functools.partial(ragged_paged_attention_gpu, **kw, batch_invariant=batch_invariant)
            if fits("gpu") else None,
        )
    impl = resolve_backend(backend, interpret)
    if impl != "reference" and layout != _KERNEL_LAYOUT[impl]:
        raise ValueError(f"the {impl} kernel reads the {_KERNEL_LAYOUT[impl]} layout; got {layout}-layout pages")
    # Interpret mode has no tiling limits; the check guards the compiled kernels only.
    # A dtype the kernel's code reads, and, compiled for a TPU, its generation too.
    kind = _tpu_device_kind() if impl == "tpu" and not interpret else None
    if impl != "reference" and not _kernel_reads_dtype(impl, k_pages.dtype, kind):
        raise ValueError(_dtype_refusal(impl, k_pages.dtype, kind))
    if impl != "reference" and not interpret and not _kernel_supports(impl, num_kv_heads, head_dim, k_pages.dtype,
                                                                       layout):
        raise ValueError(f"the {impl} kernel does not support Hkv={num_kv_heads}, D={head_dim} "
                         f"in {k_pages.dtype}; use backend='auto' or 'reference'")
    if impl == "reference":
        return ragged_paged_attention_reference(*args, num_kv_heads=num_kv_heads, **kw)
    if impl == "tpu":
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, num_kv_heads=num_kv_heads, **kw, interpret=interpret)
    from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(*args, **kw, interpret=bool(interpret), batch_invariant=batch_invariant)


def attention_implementation(platform: str, num_kv_heads: int, head_dim: int, dtype,
                             num_q_heads: int | None = None, *, kv_cache_dtype=None,
                             device_kind: str | None = None) -> tuple[str, str]:
    """What `backend="auto"` runs on `platform` ("cpu" | "tpu" | "gpu" | "cuda") for a cache in
    that platform's layout (`kv_cache_layout`): ("pallas" | "native" | "reference", why).

    `dtype` is the model's (and, unless `kv_cache_dtype` says otherwise, the pages') dtype;
    `kv_cache_dtype` the pages' ("int8", "fp8_e4m3", "fp8_e5m2" or a dtype) for a quantized
    cache. `device_kind` (e.g. "TPU v5 lite") matters where a kernel reads a dtype on some
    chip generations only."""
    page_dtype = kv_quant.kv_cache_dtype(dtype if kv_cache_dtype is None else kv_cache_dtype)
    if platform == "cpu":  # asks, never builds (the dispatch builds on first use)
        ok, why = _native_cpu_choice("heads", num_q_heads or num_kv_heads, page_dtype, build=False)
        return ("native" if ok or ok is None else "reference"), why
    impl = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}.get(platform)
    if impl is None:
        return "reference", f"no Pallas kernel on {platform}"
    if not _kernel_reads_dtype(impl, page_dtype, device_kind):
        return "reference", _dtype_refusal(impl, page_dtype, device_kind)
    if not _kernel_supports(impl, num_kv_heads, head_dim, page_dtype, _KERNEL_LAYOUT[impl], device_kind):
        return "reference", (f"the {impl} kernel does not support Hkv={num_kv_heads}, D={head_dim} "
                             f"in {page_dtype.name}")
    return "pallas", f"the {impl} kernel" + (f" on {page_dtype.name} pages" if kv_quant.is_quantized(page_dtype)
                                             else "")


def _native_cpu_choice(layout: KVLayout, num_q_heads: int, page_dtype=None,
                       build: bool = True) -> tuple[bool | None, str]:
    """(whether `auto` may lower the native CPU kernel, why). Only where this process compiles
    for its own CPU (a TPU/GPU host never builds it; a CPU host compiling for one traces it,
    which is harmless), only where it was built, and only for what it supports. With
    `build=False` nothing is built: None while the kernel has not been asked for yet."""
    if jax.default_backend() != "cpu":
        return False, "the native CPU kernel is built only where the CPU is the default backend"
    ok, why = native_cpu.available() if build else native_cpu.status()
    if ok is not False and not native_cpu.supports(layout, num_q_heads):
        return False, f"the native CPU kernel takes heads-layout pages and at most 256 query heads, got {num_q_heads}"
    if ok is not False and page_dtype is not None and not _kernel_reads_dtype("cpu", page_dtype):
        return False, _dtype_refusal("cpu", page_dtype)
    return ok, why


def _kernel_quantized_dtypes(impl: str, device_kind: str | None = None) -> tuple:
    """Quantized page dtypes a kernel reads (on `device_kind`, where the generation matters;
    None: what the kernel's code reads, as in interpret mode)."""
    if impl == "cpu":
        return native_cpu.QUANTIZED_DTYPES
    if impl == "gpu":
        from pallas_kernels.ragged_paged_attention.gpu import quantized_dtypes as gpu_dtypes

        return gpu_dtypes(_gpu_compute_capability())
    from pallas_kernels.ragged_paged_attention.tpu import quantized_dtypes

    return quantized_dtypes(device_kind)


def _kernel_reads_dtype(impl: str, dtype, device_kind: str | None = None) -> bool:
    dtype = jax.numpy.dtype(dtype)
    if impl == "cpu" and not kv_quant.is_quantized(dtype):
        return dtype in (jax.numpy.float32, jax.numpy.bfloat16)
    return not kv_quant.is_quantized(dtype) or dtype in _kernel_quantized_dtypes(impl, device_kind)


def _dtype_refusal(impl: str, dtype, device_kind: str | None = None) -> str:
    name = {"cpu": "native CPU", "gpu": "gpu (Triton)", "tpu": "tpu (Mosaic)"}[impl]
    on = f" on {device_kind}" if device_kind else ""
    floats = "float32 and bfloat16" if impl == "cpu" else "float"
    quantized = [jax.numpy.dtype(d).name for d in _kernel_quantized_dtypes(impl, device_kind)]
    return (f"the {name} attention kernel cannot read {jax.numpy.dtype(dtype).name} pages{on}; "
            f"it reads {floats} pages" + (f" and {', '.join(quantized)}" if quantized else " (no quantized dtype)"))


def _gpu_compute_capability() -> float | None:
    """The compute capability of the GPU programs are compiled for here, where known: the
    default device's (`jax.default_device`) or the first GPU's; None otherwise."""
    device = jax.config.jax_default_device
    if device is None or getattr(device, "platform", None) != "gpu":
        if jax.default_backend() != "gpu":
            return None
        device = jax.devices()[0]
    try:
        return float(device.compute_capability)
    except (AttributeError, TypeError, ValueError):
        return None


def _tpu_device_kind() -> str | None:
    """The TPU generation Pallas compiles for here: the default device's (set by
    `jax.default_device`, as for compile-only targets) or the first TPU's; None if neither."""
    device = jax.config.jax_default_device
    if device is not None and getattr(device, "platform", None) == "tpu":
        return device.device_kind
    if jax.default_backend() == "tpu":
        return jax.devices()[0].device_kind
    return None


def block_table_entries_limit(platform: str) -> int | None:
    """The most block-table entries (sequences x pages per sequence) the attention kernel on
    `platform` holds; None: no limit (the CPU and GPU kernels read the table from memory, the
    TPU kernel holds it in SMEM: `tpu.max_table_entries`)."""
    if platform != "tpu":
        return None
    from pallas_kernels.ragged_paged_attention.tpu import max_table_entries

    return max_table_entries()


def kv_cache_layout(platform: str) -> KVLayout:
    """The page layout a cache on `platform` is allocated in: lanes on TPU, where XLA keeps
    `[S, C]` pages row-major and unpadded so neither the Mosaic kernel nor the reference (the
    fallback, which reads any D in that layout) pays a relayout copy; heads elsewhere."""
    return "lanes" if platform == "tpu" else "heads"


_KERNEL_LAYOUT = {"tpu": "lanes", "gpu": "heads"}


def _kernel_supports(impl: str, num_kv_heads: int, head_dim: int, dtype, layout: KVLayout,
                     device_kind: str | None = None) -> bool:
    """Shapes and page dtypes each kernel handles (Triton: heads layout, D a multiple of 16 up
    to 256, see gpu.supports; Mosaic: lanes layout, see tpu.supports; page dtypes: each
    kernel's KV_DTYPES / tpu.kv_dtypes(device_kind))."""
    if layout != _KERNEL_LAYOUT[impl] or not _kernel_reads_dtype(impl, dtype, device_kind):
        return False
    if impl == "gpu":
        from pallas_kernels.ragged_paged_attention.gpu import supports as gpu_supports

        return gpu_supports(head_dim)
    from pallas_kernels.ragged_paged_attention.tpu import supports

    return supports(num_kv_heads, head_dim, dtype)
