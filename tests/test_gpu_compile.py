"""Compile-only NVIDIA GPU checks: XLA:GPU and Triton (the CUDA plugin) run here for H100/H200
devices described by `jaxserve.compilation.gpu_specs`; nothing executes.

`backend="auto"` must pick the Triton kernel when the program is compiled for a GPU, even
from this CPU host, for every head layout the engine serves, and the whole serving step of
the real engine plan must compile with it, unsharded and over 8 GPUs.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_kernels as pk
from jaxserve.compilation.targets import Target
from pallas_kernels.ragged_paged_attention.ops import attention_implementation

TRITON = "__gpu$xla.gpu.triton"  # a Pallas Triton kernel in compiled HLO (XLA's own GEMMs say __triton)
R, MAX_PAGES, PAGES, PAGE = 8, 16, 128, 16


pytestmark = pytest.mark.usefixtures("no_persistent_cache_writes")


@functools.cache
def gpu_device(part: str = "h200"):
    return Target.parse(f"gpu:{part}").devices()[0]


def compiled_hlo(fn, args, device) -> str:
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    return jax.jit(fn).lower(*sds).compile().as_text()


def attention_args(dtype, hq, hkv, d, num_tokens):
    S = jax.ShapeDtypeStruct
    page = S((PAGES, PAGE, hkv, d), dtype)  # the heads layout the engine allocates on GPU
    return (S((num_tokens, hq, d), dtype), page, page, S((R,), jnp.int32), S((R, MAX_PAGES), jnp.int32),
            S((R + 1,), jnp.int32), S((1,), jnp.int32))


ATTENTION = functools.partial(pk.ragged_paged_attention, sm_scale=0.125)


def test_gpu_targets_parse_and_describe_their_devices():
    t = Target.parse("gpu:h100x8")
    assert (t.platform, t.chip, t.num_devices, t.name) == ("gpu", "h100", 8, "gpu:h100x8")
    devices = t.devices()
    assert len(devices) == 8 and devices[0].device_kind == "NVIDIA H100 80GB HBM3"
    h200 = Target.parse("gpu:h200")
    assert h200.name == "gpu:h200" and gpu_device("h200").device_kind == "NVIDIA H200"
    assert h200.hbm_bytes() == int(0.75 * 151_397_597_184)  # JAX's default preallocation
    assert h200.versions()["jax-cuda12-plugin"] == jax.__version__
    for bad, why in (("gpu:a100", "unknown GPU"), ("gpu:h100x16", "1 to 8"), ("gpu", "unknown target")):
        with pytest.raises(ValueError, match=why):
            Target.parse(bad)


# (dtype, (Hq, Hkv, D), tokens): SmolLM2, Llama-3-8B, Qwen-like GQA 8, MQA; 80/96/256 heads run
# as column pieces. 16 tokens from 8 sequences take the split-KV path, 64 the unsplit one.
KERNEL_CASES = [
    (jnp.bfloat16, (9, 3, 64), 16),
    (jnp.bfloat16, (32, 8, 128), 16),
    (jnp.bfloat16, (32, 8, 128), 64),
    (jnp.bfloat16, (16, 2, 64), 64),
    (jnp.bfloat16, (8, 1, 128), 16),
    (jnp.bfloat16, (16, 4, 80), 16),
    (jnp.bfloat16, (8, 2, 96), 64),
    (jnp.bfloat16, (8, 4, 256), 16),
    (jnp.float32, (9, 3, 64), 64),
    (jnp.float32, (32, 8, 128), 16),
]


@pytest.mark.parametrize("dtype,heads,tokens", KERNEL_CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_auto_compiles_the_triton_kernel_for_an_h200(dtype, heads, tokens):
    hq, hkv, d = heads
    assert attention_implementation("gpu", hkv, d, dtype)[0] == "pallas"
    assert pk.kv_cache_layout("gpu") == "heads"
    hlo = compiled_hlo(ATTENTION, attention_args(dtype, *heads, tokens), gpu_device())
    assert TRITON in hlo and "ragged_paged_attention_gpu" in hlo


def test_window_and_soft_cap_compile_for_an_h100():
    fn = functools.partial(ATTENTION, sliding_window=128, soft_cap=30.0)
    assert TRITON in compiled_hlo(fn, attention_args(jnp.bfloat16, 9, 3, 64, 16), gpu_device("h100"))


def test_a_traced_per_layer_window_compiles_for_an_h200():
    """Windows [L] int32 as data in a scan over two layers (Gemma 2/3 interleave a window and
    global attention): the window is a kernel input, read as a scalar by the Triton kernel."""
    def layers(*args):
        *attn_args, windows = args

        def body(_, w):
            return None, ATTENTION(*attn_args, sliding_window=w, soft_cap=50.0)

        return jax.lax.scan(body, None, windows)[1]

    args = (*attention_args(jnp.bfloat16, 16, 8, 128, 16), jax.ShapeDtypeStruct((2,), jnp.int32))
    hlo = compiled_hlo(layers, args, gpu_device())
    assert TRITON in hlo and "ragged_paged_attention_gpu" in hlo


@pytest.mark.parametrize("tokens", [16, 64])
def test_attend_until_compiles_the_triton_kernel_on_gemma3_shapes(tokens):
    """Gemma 3's image tokens (attend_until [T] int32, data) on its heads (Hq=8, Hkv=4, D=256),
    bf16, decode-sized (split) and prefill-sized, in a scan over a window layer and a global one, on an H100: the
    limits are one more Triton kernel input (the aliased output's operand index moves)."""
    def layers(*args):
        *attn_args, windows, until = args

        def body(_, w):
            return None, ATTENTION(*attn_args, sliding_window=w, soft_cap=50.0, attend_until=until)

        return jax.lax.scan(body, None, windows)[1]

    S = jax.ShapeDtypeStruct
    args = (*attention_args(jnp.bfloat16, 8, 4, 256, tokens), S((2,), jnp.int32), S((tokens,), jnp.int32))
    hlo = compiled_hlo(layers, args, gpu_device("h100"))
    assert TRITON in hlo and "ragged_paged_attention_gpu" in hlo


@pytest.mark.parametrize("head_dim", [64, 80])
def test_auto_kv_update_compiles_the_kernel_for_gpu(head_dim):
    S = jax.ShapeDtypeStruct
    page = S((PAGES, PAGE, 3, head_dim), jnp.bfloat16)
    new = S((64, 3, head_dim), jnp.bfloat16)
    hlo = compiled_hlo(pk.update_kv_cache, (new, new, page, page, S((64,), jnp.int32)), gpu_device())
    assert TRITON in hlo and "update_kv_cache_gpu" in hlo


def test_head_dims_the_gpu_kernel_cannot_take_fall_back_to_the_reference():
    impl, why = attention_implementation("gpu", 2, 72, jnp.bfloat16)
    assert impl == "reference" and "D=72" in why
    hlo = compiled_hlo(ATTENTION, attention_args(jnp.bfloat16, 4, 2, 72, 16), gpu_device())
    assert "ragged_paged_attention_gpu" not in hlo


# ---------------------------------------------------------------------- the whole serving step
LLAMA_8B = pathlib.Path(__file__).parent / "data" / "llama3_8b_config.json"
STEP_SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64), num_pages=256,
                     max_model_len=2048, dtype="bfloat16")
STEP_SHAPES = ["backbone[T=16]", "backbone[T=64]", "logits[R=1]", "logits[R=8]", "head[R=8,greedy]"]


@pytest.mark.parametrize("model,target", [("smollm2", "gpu:h200"), ("llama-3-8b", "gpu:h200"),
                                          ("llama-3-8b", "gpu:h200x8")])
def test_the_serving_step_compiles_with_the_triton_kernel_and_fits(model, target):
    """Backbone (Triton attention, split and unsplit, and KV update), logits and sampler of the
    real engine plan in bf16 over abstract weights, TP over the target's GPUs."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(None if model == "smollm2" else str(LLAMA_8B))
    report = compile_for_target(mc, EngineConfig(**STEP_SETTINGS), Target.parse(target), shapes=STEP_SHAPES)
    assert [s.name for s in report.shapes if s.compiled] == STEP_SHAPES, report.verdict()
    assert all(s.attention == "pallas" for s in report.shapes if s.kind == "backbone")
    assert report.attention[0] == "pallas" and report.fingerprint["kv_layout"] == "heads"
    assert report.fits and report.max_num_pages >= STEP_SETTINGS["num_pages"], report.verdict()
    assert all(s.cache_copies == 0 for s in report.shapes if s.kind == "backbone")
    # Known cost, reported: XLA:GPU copies each layer's qkv/o/gate_up/down slices out of the
    # stacked params in the layer scan (XLA:TPU reads them in place: 0 in test_tpu_compile).
    assert all(s.weight_copies == 4 for s in report.shapes if s.kind == "backbone")
    assert report.device_kind == "NVIDIA H200"


def test_the_compile_command_writes_gpu_executables_that_a_cpu_server_refuses(tmp_path, capsys):
    from jaxserve.cli import main
    from jaxserve.compilation.aot import CompiledMismatchError
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine

    out = tmp_path / "exe"
    rc = main(["compile", "--target", "gpu:h100", "--shapes", "logits[R=8];head[R=8,greedy]", "--out", str(out),
               "--quiet", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "2048"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "75% of 79.1 GiB" in text  # where the capacity comes from
    m = json.loads((out / "manifest.json").read_text())
    assert (m["target"], m["platform"], m["device_kind"]) == ("gpu:h100", "gpu", "NVIDIA H100 80GB HBM3")
    assert m["program"]["kv_layout"] == "heads" and m["versions"]["jax-cuda12-pjrt"] == jax.__version__
    assert all((out / s["file"]).stat().st_size > 0 for s in m["shapes"])
    with pytest.raises(CompiledMismatchError, match="gpu:h100 .compiled. vs 1 cpu device"):
        Engine(EngineConfig(compiled_dir=str(out), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=2048))


def test_a_70b_model_needs_eight_h100s():
    """A Llama-3-70B shape in bf16: 141 GB of params do not fit one H100's 59 GiB; over eight
    (TP=8, KV heads split one per GPU) they do, with room for a cache."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(str(LLAMA_8B.parent / "llama3_70b_config.json"))
    settings = EngineConfig(**{**STEP_SETTINGS, "num_pages": 4096})
    one = compile_for_target(mc, settings, Target.parse("gpu:h100"), shapes=["logits[R=8]"])
    assert not one.fits and one.params_bytes > 130 * 2**30 and "use more chips" in one.verdict()
    eight = compile_for_target(mc, settings, Target.parse("gpu:h100x8"), shapes=["logits[R=8]"])
    assert eight.fits and 16 * 2**30 < eight.params_bytes < 18 * 2**30, eight.verdict()
    assert eight.max_num_pages > 4096


def test_batch_invariant_mode_compiles_unsplit_attention_and_row_tiled_matmuls():
    """By construction on GPU (not run on one): the decode-shaped attention that splits the
    keys by default (f32 partials [splits, Hkv, ...]) has no split in batch-invariant mode,
    and the tiled LM head's dots all take 16 rows, inside a loop."""
    from jaxserve.models.layers import tiled_matmul
    from pallas_kernels.ragged_paged_attention.gpu import default_max_splits

    splits = default_max_splits(16, R)
    args = attention_args(jnp.bfloat16, 9, 3, 64, 16)
    assert f"f32[{splits},3," in compiled_hlo(ATTENTION, args, gpu_device())
    hlo = compiled_hlo(functools.partial(ATTENTION, batch_invariant=True), args, gpu_device())
    assert TRITON in hlo and f"f32[{splits},3," not in hlo
    head = functools.partial(tiled_matmul, row_tile=16, transposed=True)
    hlo = compiled_hlo(head, (jax.ShapeDtypeStruct((64, 576), jnp.bfloat16),
                              jax.ShapeDtypeStruct((49152, 576), jnp.bfloat16)), gpu_device())
    assert "while" in hlo and row_tiled_dots(hlo)


def row_tiled_dots(hlo: str) -> bool:
    """Every dot (a convolution on TPU) of the optimized HLO has a 16-row side (XLA may swap
    the operands)."""
    dots = re.findall(r"= \w+\[([\d,]+)\]\S* (?:dot|convolution)\(", hlo)
    return bool(dots) and all(16 in (int(d) for d in shape.split(",")) for shape in dots)


@pytest.mark.parametrize("part", ["h100", "h200"])
def test_latent_attention_compiles_the_triton_kernel_for_a_tensor_parallel_shard(part):
    """DeepSeek-V3's absorbed MLA with 16 query heads per GPU (128 over 8): one KV head of 576
    lanes (pieces of 512 and 64) through the Triton kernel, decode- and prefill-sized; all 128
    heads on one GPU would ask more shared memory than an H100/H200 has, so the reference runs."""
    from pallas_kernels.mla_attention.ops import mla_paged_attention

    S = jax.ShapeDtypeStruct

    def args(heads, tokens):
        return (S((tokens, heads, 576), jnp.bfloat16), S((PAGES, PAGE, 1, 576), jnp.bfloat16), S((R,), jnp.int32),
                S((R, MAX_PAGES), jnp.int32), S((R + 1,), jnp.int32), S((1,), jnp.int32))

    def fn(*a):
        return mla_paged_attention(*a, sm_scale=0.1, latent_dim=512)

    for tokens in (16, 64):
        assert TRITON in compiled_hlo(fn, args(16, tokens), gpu_device(part))
    assert TRITON not in compiled_hlo(fn, args(128, 16), gpu_device(part))


@pytest.mark.parametrize("part,tokens", [("h100", 16), ("h200", 64)])
def test_sinks_compile_the_triton_kernel_on_gpt_oss_shapes(part, tokens):
    """64 query heads, 8 KV heads of 64 (gpt-oss), bf16, a 128-token window layer and a full
    one in one scan with their own sinks: the Triton kernel serves both (the sinks enter where
    its split partials merge), decode-sized and prefill-sized."""
    def layers(*args):
        *attn_args, windows, sinks = args

        def body(_, xs):
            w, s = xs
            return None, ATTENTION(*attn_args, sliding_window=w, sinks=s)

        return jax.lax.scan(body, None, (windows, sinks))[1]

    S = jax.ShapeDtypeStruct
    args = (*attention_args(jnp.bfloat16, 64, 8, 64, tokens), S((2,), jnp.int32), S((2, 64), jnp.float32))
    hlo = compiled_hlo(layers, args, gpu_device(part))
    assert TRITON in hlo and "ragged_paged_attention_gpu" in hlo


@pytest.mark.parametrize("tokens", [16, 64])
def test_chunked_attention_compiles_the_triton_kernel_on_llama4_shapes(tokens):
    """Llama 4 Scout's heads (40 q, 8 KV, D 128), bf16, on an H100: chunked and global layers
    in one scan with the chunk size as data, decode-sized (split) and prefill-sized."""
    def layers(*args):
        *attn_args, chunks = args

        def body(_, c):
            return None, ATTENTION(*attn_args, attention_chunk=c)

        return jax.lax.scan(body, None, chunks)[1]

    args = (*attention_args(jnp.bfloat16, 40, 8, 128, tokens), jax.ShapeDtypeStruct((2,), jnp.int32))
    hlo = compiled_hlo(layers, args, gpu_device("h100"))
    assert TRITON in hlo and "ragged_paged_attention_gpu" in hlo
