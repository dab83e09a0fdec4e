"""EngineConfig: one validation of the scheduling fields, resolution against the model once."""

from __future__ import annotations

import dataclasses

import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.models.config import ModelConfig, RopeScaling

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048)


@pytest.mark.parametrize("field,value,message", [
    ("page_size", 0, "page_size must be an integer >= 1"),
    ("num_pages", 1, "num_pages must be an integer >= 2"),
    ("num_host_pages", -1, "num_host_pages must be an integer >= 0"),
    ("scheduling_policy", "lifo", "scheduling_policy must be 'fcfs' or 'priority'"),
    ("preemption_mode", "drop", "preemption_mode must be 'recompute' or 'swap'"),
    ("max_num_seqs", 0, "max_num_seqs must be an integer >= 1"),
    ("long_prefill_token_threshold", -1, "long_prefill_token_threshold must be an integer >= 0"),
])
def test_scheduling_fields_are_checked_once_under_the_engine_names(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**{field: value})


def test_resolve_derives_everything_once():
    cfg = EngineConfig(page_size=16, kv_cache_memory_gb=0.001, preemption_mode="swap", max_num_seqs=8,
                       max_num_batched_tokens=64, min_token_bucket=4, dtype="float32")
    r = cfg.resolve(TINY)
    per_page = 2 * 2 * 16 * 2 * 16 * 4  # K and V x layers x page x Hkv x D x f32
    assert r.num_pages == int(0.001 * 2**30) // per_page and r.num_host_pages == r.num_pages
    assert r.max_model_len == 2048 and r.scheduler.max_blocks_per_seq == 128
    assert r.scheduler.block_size == 16 and r.scheduler.policy == "fcfs" and r.dtype == "float32"
    assert r.plan.token_buckets[0] == 4 and r.plan.token_buckets[-1] == 64 and r.plan.swap_sizes


def test_max_model_len_past_the_model_context_names_both_numbers():
    with pytest.raises(ValueError, match="max_model_len 4096 .* context of 2048 tokens"):
        EngineConfig(max_model_len=4096, num_pages=16).resolve(TINY)
    scaled = dataclasses.replace(TINY, rope_scaling=RopeScaling(kind="linear", factor=2.0))
    assert EngineConfig(max_model_len=4096, num_pages=16).resolve(scaled).max_model_len == 4096
    assert EngineConfig(num_pages=16).resolve(dataclasses.replace(TINY, max_position_embeddings=512)).max_model_len == 512


def test_unset_scheduling_limits_take_the_platforms_defaults():
    from jaxserve.config.engine_config import SCHEDULING_DEFAULTS

    cfg = EngineConfig()
    assert cfg.max_num_batched_tokens is None and cfg.max_num_seqs is None
    assert cfg.with_platform_defaults("cpu").max_num_batched_tokens == SCHEDULING_DEFAULTS["cpu"][0]
    assert cfg.with_platform_defaults("cuda").max_num_seqs == SCHEDULING_DEFAULTS["gpu"][1]
    # a small token budget caps the default sequence count; what the user set is kept
    assert EngineConfig(max_num_batched_tokens=16).with_platform_defaults("cpu").max_num_seqs == 16
    assert EngineConfig(max_num_seqs=3).with_platform_defaults("tpu").max_num_seqs == 3
    with pytest.raises(ValueError, match="max_num_batched_tokens must be"):
        EngineConfig(max_num_batched_tokens=0)


def test_tpu_pages_grow_until_the_block_table_fits_the_kernel():
    """The TPU kernel holds [max_num_seqs, pages per sequence] in SMEM: an unset page size is
    the smallest power of two from 16 that fits there (CPU and GPU read the table from memory:
    16 whatever the context); a set one that does not fit is refused naming one that does."""
    from pallas_kernels import block_table_entries_limit

    limit = block_table_entries_limit("tpu")
    assert EngineConfig().with_platform_defaults("tpu").page_size == 16
    for platform in ("cpu", "gpu"):
        assert EngineConfig(max_model_len=131072).with_platform_defaults(platform).page_size == 16
    long = EngineConfig(max_model_len=131072).with_platform_defaults("tpu")
    assert long.max_num_seqs == 64 and long.page_size == 64
    assert 64 * 131072 // 64 <= limit < 64 * 131072 // 32
    assert EngineConfig(max_model_len=131072, max_num_seqs=16).with_platform_defaults("tpu").page_size == 16
    assert EngineConfig(max_model_len=131072, page_size=128).with_platform_defaults("tpu").page_size == 128
    with pytest.raises(ValueError, match="page_size 16: max_num_seqs 64 x 8192 pages .* use page_size 64"):
        EngineConfig(max_model_len=131072, page_size=16).with_platform_defaults("tpu")
    model = dataclasses.replace(TINY, max_position_embeddings=131072)
    resolved = EngineConfig(max_model_len=131072, num_pages=16).resolve(model, platform="tpu")
    assert resolved.scheduler.block_size == 64 and resolved.scheduler.max_blocks_per_seq == 2048
