"""jaxserve.worker.kernel_choice: what each program runs, asked without building anything; the native
CPU kernels built as an explicit start-up step."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp

from jaxserve.models.config import ModelConfig
from jaxserve.worker.kernel_choice import choose_kernels
from jaxserve.worker.parallel import tp_model_config
from pallas_kernels.ragged_paged_attention import ops

DATA = pathlib.Path(__file__).parent / "data"


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_config(json.loads((DATA / name).read_text()))


def test_asking_builds_nothing_and_start_up_builds_what_the_engine_uses():
    code = textwrap.dedent("""
        import jax.numpy as jnp
        from jaxserve.worker.kernel_choice import prepare_native_kernels
        from pallas_kernels.quantized_matmul import cpu as qmm
        from pallas_kernels.quantized_matmul.ops import quantized_matmul_implementation
        from pallas_kernels.ragged_paged_attention import cpu as attn
        from pallas_kernels.ragged_paged_attention.ops import attention_implementation
        impl, why = attention_implementation("cpu", 3, 64, jnp.float32, 9)
        assert impl == "native" and "not built yet" in why, (impl, why)
        assert quantized_matmul_implementation("cpu").startswith("native: not built yet")
        assert attn._register.cache_info().currsize == 0 and qmm._register.cache_info().currsize == 0
        built = prepare_native_kernels("cpu")
        assert set(built) == {"attention", "kv_write"} and built["attention"][0] and built["kv_write"][0], built
        assert qmm._register.cache_info().currsize == 0  # f32 weights: not needed, not built
        assert attention_implementation("cpu", 3, 64, jnp.float32, 9) == ("native", built["attention"][1])
        assert prepare_native_kernels("cpu", quantized_weights=True)["matmul"][0]
        assert prepare_native_kernels("cpu", bf16_weights=True)["matmul"][0]
        assert prepare_native_kernels("tpu") == {}
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_choice_is_per_device_shard_and_cache(monkeypatch):
    llama = _config("llama3_8b_config.json")  # 32 query heads, 8 KV heads, D 128
    one = choose_kernels("tpu", llama, dtype=jnp.bfloat16)
    assert one.attention[0] == "pallas" and one.experts is None and one.quantized_matmul is None
    four = choose_kernels("tpu", tp_model_config(llama, 4), num_devices=4, dtype=jnp.bfloat16,
                          weights_dtype=jnp.int8)
    assert four.attention[0] == "pallas" and four.quantized_matmul.startswith("reference: XLA dot")
    # the cache's own dtype decides too (a GPU without fp8 conversions cannot read fp8 pages)
    monkeypatch.setattr(ops, "_gpu_compute_capability", lambda: 8.0)
    fp8 = choose_kernels("gpu", llama, dtype=jnp.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert fp8.attention[0] == "reference" and "float8_e4m3fn" in fp8.attention[1]
    assert choose_kernels("gpu", llama, dtype=jnp.bfloat16, kv_cache_dtype="int8").attention[0] == "pallas"
    assert choose_kernels("tpu", llama, dtype=jnp.bfloat16, attention_backend="reference").attention == (
        "reference", "attention_backend='reference'")
    moe = _config("qwen3_30b_a3b_config.json")
    assert choose_kernels("gpu", moe, dtype=jnp.bfloat16).experts[0] == "pallas"
    assert choose_kernels("cpu", moe, dtype=jnp.float32).experts[0] == "cpu"
