"""Compile-only: a Qwen3-30B-A3B-shaped MoE (expert parallel) and a Gemma-3-27B-shaped model on
tpu:v6e-4 (how they are deployed), bf16 with abstract weights (and gpt-oss-120b in int8 on v6e-4,
Llama 4 Scout on v6e-8), through `jaxserve compile`'s own path:
the Mosaic attention kernel is selected (Gemma's per-layer windows reach it as data) and the
plan fits; on 8 H200s the MoE's experts run as the Triton grouped matmul. The full HBM tables
are in docs/benchmarks.md.
"""

from __future__ import annotations

import pathlib

import pytest

pytestmark = pytest.mark.usefixtures("no_persistent_cache_writes")

DATA = pathlib.Path(__file__).parent / "data"
SETTINGS = dict(max_num_seqs=16, max_num_batched_tokens=64, token_buckets=(16,), num_pages=512,
                max_model_len=4096, dtype="bfloat16")


@pytest.mark.parametrize("config,target,ep,quantization,params_gib", [
    ("qwen3_30b_a3b_config.json", "tpu:v6e-4", True, None, (14.0, 14.6)),  # 30.5 B params / 4 chips
    ("gemma3_27b_config.json", "tpu:v6e-4", False, None, (12.2, 12.8)),  # 27.0 B params / 4 chips
    # sinks and per-layer windows into the Mosaic kernel; 117 B params at a byte / 4 chips
    ("gpt_oss_120b_config.json", "tpu:v6e-4", True, "int8", (27.3, 27.9)),
    # per-layer chunks into the Mosaic kernel; 108 B params in bf16 / 8 chips
    ("llama4_scout_config.json", "tpu:v6e-8", False, None, (24.8, 25.4)),
])
def test_family_flagship_compiles_on_tpu_with_the_kernel_and_fits(config, target, ep, quantization, params_gib):
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(str(DATA / config))
    report = compile_for_target(mc, EngineConfig(**SETTINGS, enable_expert_parallel=ep, quantization=quantization),
                                Target.parse(target), shapes=["backbone[T=16]"])
    backbone = report.shapes[0]
    assert backbone.compiled, backbone.error
    assert backbone.attention == "pallas" and report.attention[0] == "pallas"
    assert params_gib[0] < report.params_bytes / 2**30 < params_gib[1]
    assert report.fits and report.max_num_pages > SETTINGS["num_pages"], report.verdict()
    assert backbone.cache_copies == 0
    assert backbone.weight_copies == 0  # every layer's weights, experts included, read in place
    if mc.is_moe:  # XLA:TPU's own ragged dot
        assert backbone.experts == "xla" and report.experts[0] == "xla"


@pytest.mark.parametrize("target,quantization,mtp,params_gib", [
    # 671 B params at a byte each over 8 chips, plus the 11.5 B of the MTP layer on TPU
    ("tpu:v5p-8", "int8", True, (80.4, 81.4)),
    ("gpu:h200x8", "fp8", False, (79.0, 80.0)),
])
def test_deepseek_v3_plans_on_the_smallest_targets_that_hold_it(target, quantization, mtp, params_gib):
    """DeepSeek-V3 as published (61 layers, 128 heads, 256 experts), abstract weights: its step
    compiles with the latent cache read in place (no relayout copy: lanes pages on TPU, read by
    the Mosaic kernel), and the plan fits with room for more than 100k cached tokens per device.
    On TPU with its MTP layer drafting: its pass compiles too, reading the same cache in place."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(str(DATA / "deepseek_v3_config.json"))
    settings = {**SETTINGS, "num_pages": 64}
    spec = {"method": "mtp", "num_speculative_tokens": 1} if mtp else None
    report = compile_for_target(mc, EngineConfig(**settings, enable_expert_parallel=True, quantization=quantization,
                                                 speculative_config=spec),
                                Target.parse(target), shapes=["backbone[T=16]"] + (["mtp[T=16]"] if mtp else []))
    backbone = report.shapes[0]
    assert backbone.compiled, backbone.error
    for shape in report.shapes[1:]:  # the MTP pass
        assert shape.compiled and shape.cache_copies == 0, (shape.name, shape.error)
    assert "latent attention over 576-wide rows" in report.attention[1]
    # the Mosaic kernel over 640-lane latent rows on TPU, the Triton one over 16 heads per GPU
    assert backbone.attention == "pallas" and report.attention[0] == "pallas"
    assert params_gib[0] < report.params_bytes / 2**30 < params_gib[1], report.params_bytes / 2**30
    assert report.fits and report.max_num_pages * report.fingerprint["page_size"] > 100_000, report.verdict()
    assert backbone.cache_copies == 0


def test_moe_width_split_that_is_not_lane_aligned_is_reported_on_tpu():
    """Qwen3-30B-A3B's experts split by width over 8 chips are 96 columns wide: XLA:TPU then
    keeps the stacked gate/up weights in a transposed tiling and copies each layer's experts
    back every step. `jaxserve compile` reports it; expert parallelism has no such copy."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(str(DATA / "qwen3_30b_a3b_config.json"))
    report = compile_for_target(mc, EngineConfig(**SETTINGS), Target.parse("tpu:v5e-8"), shapes=["backbone[T=16]"])
    backbone = report.shapes[0]
    assert backbone.compiled and backbone.attention == "pallas"
    assert backbone.weight_copies >= 1 and "weight slices per layer" in report.table()
    assert backbone.temp_bytes > 96 * 2**20  # at least one layer's gate/up experts: 128 x 2048 x 192 bf16


@pytest.mark.parametrize("ep", [True, False])
def test_moe_flagship_compiles_on_gpus_with_the_grouped_matmul_kernel(ep):
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(str(DATA / "qwen3_30b_a3b_config.json"))
    report = compile_for_target(mc, EngineConfig(**SETTINGS, enable_expert_parallel=ep), Target.parse("gpu:h200x8"),
                                shapes=["backbone[T=16]"])
    backbone = report.shapes[0]
    assert backbone.compiled, backbone.error
    assert backbone.attention == "pallas" and backbone.experts == "pallas", report.table()
    assert report.experts[0] == "pallas" and report.fits


def test_qwen2_5_vl_7b_plans_on_one_v5e_with_its_image_encoder():
    """Qwen2.5-VL-7B in int8 on tpu:v5e-1: the decoder's step with the Mosaic attention kernel
    and the image encoder's largest program (128 windows: an image at the processor's default
    1280-token limit) compile, the encoder's params are counted with the model's, its output
    cache in host memory, and the plan fits (v6e-1 in bf16: docs/benchmarks.md)."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(str(DATA / "qwen2_5_vl_7b_config.json"))
    assert mc.vision is not None and mc.mrope_section == (16, 24, 24)
    report = compile_for_target(mc, EngineConfig(**SETTINGS, quantization="int8"), Target.parse("tpu:v5e-1"),
                                shapes=["backbone[T=16]", "vision[windows=128]"])
    backbone, vision = report.shapes
    assert backbone.compiled and vision.compiled, (backbone.error, vision.error)
    assert backbone.attention == "pallas" and backbone.cache_copies == 0
    assert 1.2 < report.vision_bytes / 2**30 < 1.3  # 676 M encoder params in bf16
    assert report.encoder_cache_host_bytes == 2**29
    assert report.fits and report.max_num_pages > SETTINGS["num_pages"], report.verdict()
