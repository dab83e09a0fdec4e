"""Public entry point for ragged paged attention: validate, then dispatch by backend."""

from __future__ import annotations

import functools

import jax

from pallas_kernels._dispatch import by_target_platform, resolve_backend
from pallas_kernels._validate import check_float, check_int32, check_shape
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference


def _validate(
    q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sliding_window, soft_cap
) -> None:
    check_shape("q", q, (None, None, None), "[T, Hq, D]")
    num_tokens, num_q_heads, head_dim = q.shape
    check_shape("k_pages", k_pages, (None, None, None, head_dim), "[num_pages, page_size, Hkv, D]")
    check_shape("v_pages", v_pages, tuple(k_pages.shape), "like k_pages")
    num_kv_heads = k_pages.shape[2]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q heads ({num_q_heads}) must be a multiple of k_pages heads ({num_kv_heads})"
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
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        check_float(name, x)
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages and v_pages dtypes differ: {k_pages.dtype} vs {v_pages.dtype}")
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap}")


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    kv_lens: jax.Array,  # [R] int32
    block_tables: jax.Array,  # [R, max_pages_per_seq] int32
    cu_q_lens: jax.Array,  # [R+1] int32
    num_seqs: jax.Array,  # [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    backend: str = "auto",
    interpret: bool | object = False,
) -> jax.Array:  # [T, Hq, D], dtype of q
    """Attention of a flat ragged batch over the paged cache (docs/architecture.md contract).

    backend: "auto" (the kernel of the platform compiled for, TPU or GPU, where it supports
    the layout, else the reference: see `attention_implementation`), "pallas" (the host
    platform's kernel; on CPU only with interpret=True), "reference", or
    "pallas_tpu"/"pallas_gpu" to force one kernel.
    interpret: run the kernel in Pallas interpret mode (CPU); for the TPU kernel it may be a
    `pltpu.InterpretParams()`. "pallas" raises when the kernel does not support the layout.
    """
    _validate(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sliding_window, soft_cap
    )
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if backend == "auto" and not interpret:
        from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

        layout = (k_pages.shape[2], k_pages.shape[3], k_pages.dtype)
        return by_target_platform(
            args,
            reference=functools.partial(ragged_paged_attention_reference, **kw),
            tpu=functools.partial(ragged_paged_attention_tpu, **kw) if _kernel_supports("tpu", *layout) else None,
            gpu=functools.partial(ragged_paged_attention_gpu, **kw) if _kernel_supports("gpu", *layout) else None,
        )
    impl = resolve_backend(backend, interpret)
    num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    # Interpret mode has no tiling limits; the check guards the compiled kernels only.
    compiled = not interpret
    if impl != "reference" and compiled and not _kernel_supports(impl, num_kv_heads, head_dim, k_pages.dtype):
        raise ValueError(f"the {impl} kernel does not support Hkv={num_kv_heads}, D={head_dim} "
                         f"in {k_pages.dtype}; use backend='auto' or 'reference'")
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **kw)
    if impl == "tpu":
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, **kw, interpret=interpret)
    from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(*args, **kw, interpret=bool(interpret))


def attention_implementation(platform: str, num_kv_heads: int, head_dim: int, dtype) -> tuple[str, str]:
    """What `backend="auto"` runs on `platform` ("cpu" | "tpu" | "gpu" | "cuda") for this
    cache layout: ("pallas" | "reference", why)."""
    impl = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu"}.get(platform)
    if impl is None:
        return "reference", f"no Pallas kernel on {platform}"
    if not _kernel_supports(impl, num_kv_heads, head_dim, dtype):
        return "reference", (f"the {impl} kernel does not support Hkv={num_kv_heads}, D={head_dim} "
                             f"in {jax.numpy.dtype(dtype).name}")
    return "pallas", f"the {impl} kernel"


def _kernel_supports(impl: str, num_kv_heads: int, head_dim: int, dtype) -> bool:
    """Shapes each kernel handles (Triton: power-of-two D; Mosaic: see tpu.supports)."""
    if impl == "gpu":
        return head_dim >= 16 and head_dim & (head_dim - 1) == 0
    from pallas_kernels.ragged_paged_attention.tpu import supports

    return supports(num_kv_heads, head_dim, dtype)
