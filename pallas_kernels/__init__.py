"""Paged attention, KV-cache update and grouped matmul: Pallas kernels (TPU, GPU) and pure-jnp
references. KV pages may be quantized (int8 / fp8 values + per-token f32 scales: `kv_quant`).

Use the public ops; each validates shapes at trace time and picks an implementation by
platform and `backend` ("auto" | "pallas" | "reference").
"""

from pallas_kernels.grouped_matmul.ops import grouped_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.kv_cache_update.ops import update_kv_cache
from pallas_kernels.kv_cache_update.reference import update_kv_cache_reference
from pallas_kernels.kv_layout import KVLayout, kv_scales_axis_of_heads, kv_scales_shape
from pallas_kernels.kv_quant import KV_CACHE_DTYPES, kv_cache_dtype
from pallas_kernels.ragged_paged_attention.ops import (
    block_table_entries_limit,
    kv_cache_layout,
    ragged_paged_attention,
)
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

__all__ = [
    "KVLayout",
    "KV_CACHE_DTYPES",
    "block_table_entries_limit",
    "grouped_matmul",
    "grouped_matmul_reference",
    "kv_cache_dtype",
    "kv_cache_layout",
    "kv_scales_axis_of_heads",
    "kv_scales_shape",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "update_kv_cache",
    "update_kv_cache_reference",
]
