"""Paged attention, KV-cache update and grouped matmul: Pallas kernels (TPU, GPU) and pure-jnp
references.

Use the public ops; each validates shapes at trace time and picks an implementation by
platform and `backend` ("auto" | "pallas" | "reference").
"""

from pallas_kernels.grouped_matmul.ops import grouped_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.kv_cache_update.ops import update_kv_cache
from pallas_kernels.kv_cache_update.reference import update_kv_cache_reference
from pallas_kernels.kv_layout import KVLayout
from pallas_kernels.ragged_paged_attention.ops import kv_cache_layout, ragged_paged_attention
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

__all__ = [
    "KVLayout",
    "grouped_matmul",
    "grouped_matmul_reference",
    "kv_cache_layout",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "update_kv_cache",
    "update_kv_cache_reference",
]
