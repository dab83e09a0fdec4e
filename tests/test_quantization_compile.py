"""Quantized serving compiled for TPUs and GPUs (compile-only devices, as `jaxserve compile`
plans them): the models that did not fit in bf16 fit with int8 weights, a quantized KV cache
doubles the pages that fit, the weights reach the dots as int8 / fp8 with no dequantized
copy of a layer's weights, and fp8 is refused where the chip has no fp8 arithmetic."""

from __future__ import annotations

import pathlib
import re

import pytest

pytestmark = pytest.mark.usefixtures("no_persistent_cache_writes")

DATA = pathlib.Path(__file__).parent / "data"
LLAMA_8B, LLAMA_70B = DATA / "llama3_8b_config.json", DATA / "llama3_70b_config.json"
SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64), max_model_len=8192,
                dtype="bfloat16")
GIB = 2**30


def _plan(config_path, target: str, shapes: list[str], **settings):
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    return compile_for_target(load_model_config(str(config_path)), EngineConfig(**{**SETTINGS, **settings}),
                              Target.parse(target), shapes=shapes)


@pytest.mark.parametrize("config_path,target,params_gib", [(LLAMA_8B, "tpu:v5e-1", 8.6), (LLAMA_70B, "tpu:v5e-8", 8.6)])
def test_int8_weights_fit_llama_where_bf16_does_not(config_path, target, params_gib):
    """bf16: 14.96 GiB of params for 8B on one v5e and 16.43 GiB per chip for 70B on a v5e-8
    (neither fits, tests/test_tpu_compile.py). int8: the layers at one byte per weight."""
    report = _plan(config_path, target, ["logits[R=8]"], quantization="int8")
    assert report.fits, report.verdict()
    assert report.params_bytes < params_gib * GIB
    assert report.max_num_pages * 16 >= 50_000  # tokens of KV cache left beside the weights
    assert report.fingerprint["quantization"] == "int8"


def test_a_quantized_kv_cache_doubles_the_pages_that_fit():
    plain = _plan(LLAMA_8B, "tpu:v5e-1", ["logits[R=8]"], quantization="int8")
    fp8 = _plan(LLAMA_8B, "tpu:v5e-1", ["logits[R=8]"], quantization="int8", kv_cache_dtype="fp8")
    # one byte per value instead of two, plus one f32 scale per token and KV head (D = 128)
    assert 1.85 < fp8.max_num_pages / plain.max_num_pages <= 2.0
    assert fp8.fingerprint["kv_cache_dtype"] == "float8_e4m3fn"


def _backbone_hlo(config_path, target_name: str, T: int, **settings):
    import jax

    from jaxserve.compilation.aot import abstract_programs
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config
    from jaxserve.worker.compile_plan import ShapeKey

    target = Target.parse(target_name)
    config = EngineConfig(**{**SETTINGS, **settings})
    programs, _ = abstract_programs(load_model_config(str(config_path)), config, target)
    with jax.default_device(target.devices()[0]):
        compiled = programs.lower(ShapeKey("backbone", T), config.max_num_seqs)
    return compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes


def test_tpu_dots_take_the_int8_weights_with_no_dequantized_copy():
    hlo, temp = _backbone_hlo(LLAMA_8B, "tpu:v5e-1", 16, quantization="int8")
    # each projection's dot (a convolution on TPU) reads an s8 operand of the layer's weight shape
    weights = set(re.findall(r"= s8\[(\d+,\d+)\]\S* fusion\(", hlo))
    assert {"4096,6144", "4096,4096", "4096,28672", "14336,4096"} <= weights, weights
    assert "bf16[4096,28672]" not in hlo and "f32[4096,28672]" not in hlo
    assert temp < 4 * 2**20  # a layer's gate/up dequantized to bf16 would be 224 MiB


def test_h100_gemms_convert_fp8_weights_inside_the_fusion():
    hlo, temp = _backbone_hlo(LLAMA_8B, "gpu:h100", 16, quantization="fp8")
    gemms = re.findall(r"%gemm_fusion[\w.]*_computation \(([^)]*)\)", hlo)
    assert any("f8e4m3fn[4096,28672]" in g for g in gemms), gemms
    # no dequantized weight leaves a fusion: only the fp8 layer slice XLA:GPU copies (the
    # weight-copy count of `jaxserve compile`) is as large as a layer's weights
    assert not re.search(r"= bf16\[4096,28672\]\S* fusion\(", hlo)
    assert temp < 200 * 2**20


def test_fp8_is_refused_for_a_tpu_target_naming_it():
    with pytest.raises(ValueError, match=r"tpu:v5e-1.*fp8.*v5e.*use 'int8'"):
        _plan(LLAMA_8B, "tpu:v5e-1", ["logits[R=8]"], quantization="fp8")
