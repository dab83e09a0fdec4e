"""Compile-only TPU checks: XLA:TPU and Mosaic (libtpu) run here on abstract TPU devices.

`backend="auto"` must pick the Mosaic kernel when the program is compiled for a TPU, even
from this CPU host, and the reference where the kernel does not support the layout.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import pallas_kernels as pk
from jaxserve.compilation.targets import Target
from pallas_kernels.kv_layout import lanes_width
from pallas_kernels.ragged_paged_attention.ops import attention_implementation

T, R, MAX_PAGES, PAGES, PAGE = 64, 8, 16, 128, 16
KERNEL = "tpu_custom_call"


pytestmark = pytest.mark.usefixtures("no_persistent_cache_writes")


@functools.cache
def tpu_device(topology: str):
    return topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]


def compiled_hlo(fn, args, device) -> str:
    """The optimized HLO of `jax.jit(fn)` compiled for `device` (a TPU or the host CPU)."""
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with jax.default_device(device):  # Pallas reads the chip generation from it
        return jax.jit(fn).lower(*sds).compile().as_text()


def attention_args(dtype, hq, hkv, d, layout="lanes"):
    """Pages in the layout the engine allocates on TPU for these heads (`kv_cache_layout`)."""
    S = jax.ShapeDtypeStruct
    page = S((PAGES, PAGE, lanes_width(hkv, d)) if layout == "lanes" else (PAGES, PAGE, hkv, d), dtype)
    return (S((T, hq, d), dtype), page, page, S((R,), jnp.int32), S((R, MAX_PAGES), jnp.int32),
            S((R + 1,), jnp.int32), S((1,), jnp.int32))


ATTENTION = functools.partial(pk.ragged_paged_attention, sm_scale=0.125)
KERNEL_CASES = [  # (dtype, (Hq, Hkv, D)) the Mosaic kernel compiles for
    (jnp.bfloat16, (9, 3, 64)),  # SmolLM2's layout
    (jnp.bfloat16, (32, 8, 128)),  # Llama-3-8B's
    (jnp.bfloat16, (16, 16, 64)),
    (jnp.bfloat16, (8, 1, 256)),
    (jnp.float32, (9, 3, 64)),
    (jnp.float32, (16, 4, 256)),
]


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("dtype,heads", KERNEL_CASES, ids=lambda x: getattr(x, "__name__", str(x)))
def test_auto_compiles_the_mosaic_kernel_for_tpu(topology, dtype, heads):
    hq, hkv, d = heads
    assert attention_implementation("tpu", hkv, d, dtype)[0] == "pallas"
    assert pk.kv_cache_layout("tpu") == "lanes"
    fn = functools.partial(ATTENTION, num_kv_heads=hkv)
    hlo = compiled_hlo(fn, attention_args(dtype, *heads), tpu_device(topology))
    assert KERNEL in hlo and "ragged_paged_attention_tpu" in hlo


def test_window_and_soft_cap_compile_in_bf16():
    fn = functools.partial(ATTENTION, num_kv_heads=3, sliding_window=128, soft_cap=30.0)
    assert KERNEL in compiled_hlo(fn, attention_args(jnp.bfloat16, 9, 3, 64), tpu_device("v5e:2x2"))


def window_and_global_layers(num_kv_heads):
    """Two layers in one scan over their windows (data: Gemma 2/3 interleave a window and
    global attention), the last argument, [L] int32; soft cap as Gemma 2's."""
    def layers(*args):
        *attn_args, windows = args

        def body(_, w):
            return None, ATTENTION(*attn_args, num_kv_heads=num_kv_heads, sliding_window=w, soft_cap=50.0)

        return jax.lax.scan(body, None, windows)[1]

    return layers


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_a_traced_per_layer_window_compiles_in_bf16(topology):
    """Gemma-like heads (Hq=8, Hkv=4, D=256): the window reaches the Mosaic kernel by scalar
    prefetch, so the scan body's one kernel serves window and global layers."""
    args = (*attention_args(jnp.bfloat16, 8, 4, 256), jax.ShapeDtypeStruct((2,), jnp.int32))
    hlo = compiled_hlo(window_and_global_layers(4), args, tpu_device(topology))
    assert KERNEL in hlo and "ragged_paged_attention_tpu" in hlo


def test_attend_until_compiles_the_mosaic_kernel_on_gemma3_shapes():
    """Gemma 3's image tokens (attend_until [T] int32, data) on its heads (Hq=8, Hkv=4, D=256),
    bf16, in a scan over a window layer and a global one: the limits reach the Mosaic kernel
    as an input block, so the kernel (not the reference) serves both layers."""
    def layers(*args):
        *attn_args, windows, until = args

        def body(_, w):
            return None, ATTENTION(*attn_args, num_kv_heads=4, sliding_window=w, soft_cap=50.0, attend_until=until)

        return jax.lax.scan(body, None, windows)[1]

    S = jax.ShapeDtypeStruct
    args = (*attention_args(jnp.bfloat16, 8, 4, 256), S((2,), jnp.int32), S((T,), jnp.int32))
    hlo = compiled_hlo(layers, args, tpu_device("v5e:2x2"))
    assert KERNEL in hlo and "ragged_paged_attention_tpu" in hlo


def test_the_block_table_limit_is_what_the_kernel_holds_in_smem():
    """The kernel holds the whole [R, M] table in SMEM: a table of exactly the limit compiles
    (64 sequences of a 128k context in pages of 64 fit in it); one page more per sequence is
    refused by name before Mosaic runs, where XLA:TPU would stop with RESOURCE_EXHAUSTED."""
    from pallas_kernels.ragged_paged_attention.tpu import max_table_entries

    S = jax.ShapeDtypeStruct
    rows = 64
    width = max_table_entries() // rows
    assert width * rows == max_table_entries() and width >= 131072 // 64
    q, k, v, _, _, _, n = attention_args(jnp.bfloat16, 32, 8, 128)
    args = (q, k, v, S((rows,), jnp.int32), S((rows, width), jnp.int32), S((rows + 1,), jnp.int32), n)
    fn = functools.partial(ATTENTION, num_kv_heads=8)
    assert KERNEL in compiled_hlo(fn, args, tpu_device("v6e:2x2"))
    too_wide = (*args[:4], S((rows, width + 1), jnp.int32), *args[5:])
    with pytest.raises(ValueError, match=r"block_tables \[64, 4033\] .* SMEM"):
        compiled_hlo(fn, too_wide, tpu_device("v6e:2x2"))


def test_auto_falls_back_to_the_reference_where_the_kernel_cannot():
    impl, why = attention_implementation("tpu", 2, 96, jnp.bfloat16)
    assert impl == "reference" and "D=96" in why
    fn = functools.partial(ATTENTION, num_kv_heads=2)  # the reference reads D=96 heads in 256 lanes
    hlo = compiled_hlo(fn, attention_args(jnp.bfloat16, 4, 2, 96), tpu_device("v5e:2x2"))
    assert "ragged_paged_attention_tpu" not in hlo


def test_auto_on_the_host_cpu_is_the_native_cpu_kernel():
    assert attention_implementation("cpu", 3, 64, jnp.float32, num_q_heads=9)[0] == "native"
    assert pk.kv_cache_layout("cpu") == "heads"
    hlo = compiled_hlo(ATTENTION, attention_args(jnp.float32, 9, 3, 64, "heads"), jax.devices("cpu")[0])
    assert KERNEL not in hlo and "ragged_paged_attention_tpu" not in hlo and "triton" not in hlo
    assert "jaxserve_ragged_paged_attention_cpu_" in hlo


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_auto_kv_update_compiles_the_kernel_for_tpu(dtype):
    S = jax.ShapeDtypeStruct
    page = S((PAGES, PAGE, 3, 64), dtype)
    args = (S((T, 3, 64), dtype), S((T, 3, 64), dtype), page, page, S((T,), jnp.int32))
    hlo = compiled_hlo(pk.update_kv_cache, args, tpu_device("v5e:2x2"))
    assert KERNEL in hlo and "update_kv_cache_tpu" in hlo


def test_lanes_kv_update_is_xla_scatter_in_place():
    """A [S, C] page's rows are not tile aligned for a one-row DMA: the lanes layout's update
    is XLA's scatter, on the donated cache, with no copy of it."""
    S = jax.ShapeDtypeStruct
    page = S((PAGES, PAGE, lanes_width(3, 64)), jnp.bfloat16)
    args = (S((T, 3, 64), jnp.bfloat16), S((T, 3, 64), jnp.bfloat16), page, page, S((T,), jnp.int32))
    device = tpu_device("v5e:2x2")
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with jax.default_device(device):
        compiled = jax.jit(pk.update_kv_cache, donate_argnums=(2, 3)).lower(*sds).compile()
    hlo = compiled.as_text()
    assert "update_kv_cache_tpu" not in hlo and "scatter" in hlo
    assert compiled.memory_analysis().temp_size_in_bytes < PAGES * PAGE * 256 * 2 // 8


# ---------------------------------------------------------------------- the whole serving step
LLAMA_8B = pathlib.Path(__file__).parent / "data" / "llama3_8b_config.json"
STEP_SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(64,), num_pages=256,
                     max_model_len=2048, dtype="bfloat16")
STEP_SHAPES = ["backbone[T=64]", "logits[R=8]", "head[R=8,greedy]"]


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("model,chips", [("smollm2", 1), ("llama-3-8b", 1), ("llama-3-8b", 4)])
def test_the_serving_step_compiles_with_the_kernel_and_fits(chip, model, chips):
    """Backbone (Mosaic attention and KV update), logits and sampler of the real engine plan,
    bf16, abstract weights, TP over the target's chips (`jaxserve compile`'s own path)."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(None if model == "smollm2" else str(LLAMA_8B))
    report = compile_for_target(mc, EngineConfig(**STEP_SETTINGS), Target.parse(f"tpu:{chip}-{chips}"),
                                shapes=STEP_SHAPES)
    assert [s.name for s in report.shapes if s.compiled] == STEP_SHAPES, report.verdict()
    backbone = report.shapes[0]
    assert backbone.attention == "pallas" and report.attention[0] == "pallas"
    assert report.fits and report.max_num_pages >= STEP_SETTINGS["num_pages"], report.verdict()
    assert report.fingerprint["kv_layout"] == "lanes"
    assert backbone.cache_copies == 0  # the cache is read and written in place: no relayout copy
    assert backbone.weight_copies == 0  # layer weights are read in place from the stacked params


def test_an_8b_model_on_one_v5e_does_not_fit_and_says_why():
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    report = compile_for_target(load_model_config(str(LLAMA_8B)), EngineConfig(**{**STEP_SETTINGS, "num_pages": 2048}),
                                Target.parse("tpu:v5e-1"), shapes=["logits[R=8]"])
    assert not report.fits
    assert report.params_bytes > 14.9 * 2**30  # 8.0 B bf16 params on one chip
    assert "does not fit" in report.verdict() and "--num-pages" in report.verdict()
    assert 0 < report.max_num_pages < 2048


@pytest.mark.parametrize("target,quantization,fits", [("tpu:v5e-8", None, False), ("tpu:v5e-8", "int8", True),
                                                     ("tpu:v6e-8", None, True)])
def test_a_70b_model_on_eight_chips(target, quantization, fits):
    """A Llama-3-70B shape at TP=8: in bf16 its 16.4 GiB of params per chip overflow a v5e
    (15.75 GiB) and fit a v6e; int8 weights fit a v5e-8 (the logits program: the plan's
    params and cache, one small program compiled)."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    mc = load_model_config(str(LLAMA_8B.parent / "llama3_70b_config.json"))
    report = compile_for_target(mc, EngineConfig(**{**STEP_SETTINGS, "quantization": quantization}),
                                Target.parse(target), shapes=["logits[R=8]"])
    assert report.shapes[0].compiled, report.shapes[0].error
    assert report.fits is fits, report.verdict()
    per_chip = report.params_bytes / 2**30
    assert (16.0 < per_chip < 16.8) if quantization is None else (8.0 < per_chip < 9.0)


def test_the_compile_command_writes_the_manifest_and_fails_when_the_plan_does_not_fit(tmp_path, capsys):
    """In process: only one process at a time may hold libtpu, and this one already does."""
    import json

    from jaxserve.cli import main

    manifest = tmp_path / "m.json"
    rc = main(["compile", "--target", "tpu:v5e-1", "--model-config", str(LLAMA_8B), "--shapes",
               "logits[R=8];head[R=8,greedy]", "--manifest", str(manifest), "--quiet", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "64", "--max-model-len", "2048"])
    out = capsys.readouterr().out
    assert rc == 4, out  # 1 GiB of KV cache does not fit beside 15 GiB of params
    assert "does not fit" in out and "--num-pages" in out
    m = json.loads(manifest.read_text())
    assert (m["target"], m["device_kind"], m["num_devices"], m["fits"]) == ("tpu:v5e-1", "TPU v5 lite", 1, False)
    assert 0 < m["max_num_pages"] < m["num_pages"] and m["hbm_per_device"]["capacity_bytes"] > 15 * 2**30
    assert [s["name"] for s in m["shapes"]] == ["logits[R=8]", "head[R=8,greedy]"]
    assert all(s["compiled"] and s["seconds"] >= 0 and s["hbm_bytes"] > 0 for s in m["shapes"])
    assert m["versions"]["libtpu"] != "unknown" and m["program"]["kv_layout"] == "lanes"


def test_the_reference_fallback_fits_the_default_config_without_cache_sized_temporaries():
    """SmolLM2's default engine config on one v5e with attention_backend='reference', at the
    largest token bucket: temporaries bounded by a KV chunk per query block, no cache copy
    (the reference once needed 7.9 GB of temporaries at T=16 and ran out of HBM at T=512)."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    report = compile_for_target(load_model_config(None), EngineConfig(attention_backend="reference"),
                                Target.parse("tpu:v5e-1"), shapes=["backbone[T=512]"])
    backbone = report.shapes[0]
    assert backbone.compiled and backbone.attention == "reference" and report.fits
    assert backbone.cache_copies == 0 and backbone.temp_bytes < report.kv_cache_bytes / 64


def test_tune_target_dry_run_says_which_candidates_fit(capsys, tmp_path):
    """`jaxserve tune --target`: each candidate's bounding shapes compiled for the TPU, a cache
    far past the chip's HBM reported as not fitting (in process: libtpu is held here)."""
    import json

    from jaxserve.cli import main

    out_json = tmp_path / "fits.json"
    rc = main(["tune", "--target", "tpu:v5e-1", "--max-num-batched-tokens-values", "64",
               "--max-num-seqs-values", "8", "--num-pages-values", "64,4000000", "--max-model-len", "512",
               "--max-logprobs", "0", "--no-structured-outputs", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 4, out
    assert "1 of 2 candidates fit tpu:v5e-1" in out
    small, huge = json.loads(out_json.read_text())
    assert small["fits"] and small["settings"] == {"max_num_batched_tokens": 64, "max_num_seqs": 8, "num_pages": 64}
    assert not huge["fits"] and "does not fit" in huge["verdict"]
    assert small["max_num_pages"] > 64 and small["total_bytes"] < small["capacity_bytes"]


def test_batch_invariant_matmuls_compile_row_tiled_for_tpu():
    """By construction on TPU (not run on one): the tiled LM head's dots all take 16 rows,
    inside a loop; the plain product takes all 64. (The attention kernel is unchanged.)"""
    from test_gpu_compile import row_tiled_dots

    from jaxserve.models.layers import tiled_matmul

    args = (jax.ShapeDtypeStruct((64, 576), jnp.bfloat16), jax.ShapeDtypeStruct((49152, 576), jnp.bfloat16))
    tiled = compiled_hlo(functools.partial(tiled_matmul, row_tile=16, transposed=True), args, tpu_device("v5e:2x2"))
    plain = compiled_hlo(functools.partial(tiled_matmul, row_tile=0, transposed=True), args, tpu_device("v5e:2x2"))
    assert "while" in tiled and row_tiled_dots(tiled) and not row_tiled_dots(plain)


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int8])
def test_latent_attention_compiles_the_mosaic_kernel_on_deepseek_shapes(topology, dtype):
    """DeepSeek-V3's absorbed MLA on one chip: 128 query heads over 576-wide latent rows in
    640-lane pages (bf16, and int8 with per-token scales): the Mosaic kernel, not the reference."""
    from pallas_kernels.mla_attention.ops import mla_paged_attention

    S = jax.ShapeDtypeStruct
    scales = (S(pk.kv_scales_shape(PAGES, PAGE, 1, "lanes"), jnp.float32),) if dtype == jnp.int8 else ()
    args = (S((T, 128, 576), jnp.bfloat16), S((PAGES, PAGE, 640), dtype), S((R,), jnp.int32),
            S((R, MAX_PAGES), jnp.int32), S((R + 1,), jnp.int32), S((1,), jnp.int32), *scales)

    def fn(q, pages, *rest):
        return mla_paged_attention(q, pages, *rest[:4], sm_scale=0.1, latent_dim=512,
                                   scales=rest[4] if len(rest) > 4 else None)

    hlo = compiled_hlo(fn, args, tpu_device(topology))
    assert KERNEL in hlo and "ragged_paged_attention_tpu" in hlo


def sink_and_window_layers(num_kv_heads):
    """gpt-oss's layer pair in one scan: a 128-token window then full attention (windows as
    data), each with its own [Hq] sinks (data too)."""
    def layers(*args):
        *attn_args, windows, sinks = args

        def body(_, xs):
            w, s = xs
            return None, ATTENTION(*attn_args, num_kv_heads=num_kv_heads, sliding_window=w, sinks=s)

        return jax.lax.scan(body, None, (windows, sinks))[1]

    return layers


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_sinks_compile_the_mosaic_kernel_on_gpt_oss_shapes(topology):
    """64 query heads, 8 KV heads of 64 (gpt-oss), bf16: the sinks reach the Mosaic kernel
    as an input block, so the kernel (not the reference) serves both layers."""
    S = jax.ShapeDtypeStruct
    args = (*attention_args(jnp.bfloat16, 64, 8, 64), S((2,), jnp.int32), S((2, 64), jnp.float32))
    hlo = compiled_hlo(sink_and_window_layers(8), args, tpu_device(topology))
    assert KERNEL in hlo and "ragged_paged_attention_tpu" in hlo


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_chunked_attention_compiles_the_mosaic_kernel_on_llama4_shapes(topology):
    """Llama 4 Scout's heads (40 q, 8 KV, D 128), bf16: chunked layers and a NoPE global one in
    one scan, the chunk size as data ([L] int32, 0: none), so one kernel serves both."""
    def layers(*args):
        *attn_args, chunks = args

        def body(_, c):
            return None, ATTENTION(*attn_args, num_kv_heads=8, attention_chunk=c)

        return jax.lax.scan(body, None, chunks)[1]

    args = (*attention_args(jnp.bfloat16, 40, 8, 128), jax.ShapeDtypeStruct((2,), jnp.int32))
    hlo = compiled_hlo(layers, args, tpu_device(topology))
    assert KERNEL in hlo and "ragged_paged_attention_tpu" in hlo


@pytest.mark.parametrize("topology,heads", [("v5e:2x2", (16, 32)), ("v6e:2x2", (16, 64))],
                         ids=["v5e-qwen3-next", "v6e-qwen3.5-397b"])
def test_the_delta_rule_compiles_the_mosaic_kernel_on_qwen3_next_shapes(topology, heads):
    """The chunked delta rule on real linear-attention heads (d_k = d_v = 128; 16 query/key
    heads over 32 value heads for Qwen3-Next-80B, 64 for Qwen3.5-397B), chunks of 64: the
    Mosaic kernel, not the jnp loop."""
    from pallas_kernels.gated_delta_rule.ops import chunked_delta_rule

    hk, h = heads
    S = jax.ShapeDtypeStruct
    nc, c, d, rows = 12, 64, 128, R + 1
    args = (S((nc, c, hk, d), jnp.float32), S((nc, c, hk, d), jnp.float32), S((nc, c, h, d), jnp.float32),
            S((nc, c, h), jnp.float32), S((nc, c, h), jnp.float32), S((rows, h, d, d), jnp.float32),
            S((nc,), jnp.int32), S((1,), jnp.int32))
    hlo = compiled_hlo(chunked_delta_rule, args, tpu_device(topology))
    assert KERNEL in hlo and "chunked_delta_rule_tpu" in hlo
