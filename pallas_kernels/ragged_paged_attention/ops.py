"""Public entry point for ragged paged attention: validate, then dispatch by backend."""

from __future__ import annotations

import warnings

import jax

from pallas_kernels._dispatch import resolve_backend
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

    backend: "auto" (kernel on TPU/GPU, reference on CPU), "pallas" (kernel; on CPU only with
    interpret=True), "reference", or "pallas_tpu"/"pallas_gpu" to force one kernel.
    interpret: run the kernel in Pallas interpret mode (CPU); for the TPU kernel it may be a
    `pltpu.InterpretParams()`. "auto" falls back to the reference (with a warning) when the
    platform's kernel does not support the head layout; "pallas" raises instead.
    """
    _validate(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, sliding_window, soft_cap
    )
    impl = resolve_backend(backend, interpret)
    num_kv_heads, head_dim = k_pages.shape[2], k_pages.shape[3]
    # Interpret mode has no tiling limits; the check guards the compiled kernels only.
    compiled = not interpret
    if impl != "reference" and compiled and not _kernel_supports(impl, num_kv_heads, head_dim):
        msg = f"the {impl} kernel does not support Hkv={num_kv_heads}, D={head_dim}"
        if backend == "auto":
            warnings.warn(f"{msg}; using the reference attention", stacklevel=2)
            impl = "reference"
        else:
            raise ValueError(msg)
    args = (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    if impl == "reference":
        return ragged_paged_attention_reference(*args, **kw)
    if impl == "tpu":
        from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

        return ragged_paged_attention_tpu(*args, **kw, interpret=interpret)
    from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    return ragged_paged_attention_gpu(*args, **kw, interpret=bool(interpret))


def _kernel_supports(impl: str, num_kv_heads: int, head_dim: int) -> bool:
    """Shapes each kernel handles (Triton: power-of-two D; Mosaic: see tpu.supports)."""
    if impl == "gpu":
        return head_dim >= 16 and head_dim & (head_dim - 1) == 0
    from pallas_kernels.ragged_paged_attention.tpu import supports

    return supports(num_kv_heads, head_dim)
