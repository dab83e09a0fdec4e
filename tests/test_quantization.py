"""Weight-only quantization: the per-channel math, fusion and sharding of scales, the quantized
model against the same model with the dequantized weights, and the configuration errors."""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxserve.models.fused import fuse_projections, fused_layer_shapes
from jaxserve.models.quantization import (
    dequantize_weight,
    params_quantization,
    quantize_params,
    quantize_weight,
    scale_shape,
    with_scale_shapes,
)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_per_channel_round_trip_is_within_half_a_step(method):
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 40, 7)).astype(np.float32) * np.array([1e-3, 1, 30, 1, 1, 1, 5], np.float32)
    w[:, :, 3] = 0.0  # an all-zero output channel
    q, s = quantize_weight(w, method)
    assert q.shape == w.shape and s.shape == (3, 7) and s.dtype == np.float32
    assert s[0, 3] == 1.0 and not q[:, :, 3].any()
    back = dequantize_weight(q, s)
    if method == "int8":
        assert q.dtype == np.int8 and np.abs(q).max() <= 127
        assert np.all(np.abs(back - w) <= s[:, None, :] / 2 + 1e-7)
        # the channel's largest magnitude is exact (it defines the scale)
        np.testing.assert_allclose(np.abs(back).max(axis=1), np.abs(w).max(axis=1), rtol=1e-6)
    else:
        assert q.dtype == ml_dtypes.float8_e4m3fn
        # e4m3: 3 mantissa bits, so half an ulp is 2^-4 relative (normals; subnormals absolute)
        tol = np.maximum(np.abs(w) * 2.0**-4, s[:, None, :] * 2.0**-10)
        assert np.all(np.abs(back - w) <= tol + 1e-9)


def test_embedding_rows_have_one_scale_each():
    w = np.random.default_rng(1).normal(size=(11, 6)).astype(np.float32)
    q, s = quantize_weight(w, "int8", axis=-1)
    assert s.shape == (11,) == scale_shape("embed", w.shape)
    assert np.all(np.abs(dequantize_weight(q, s, axis=-1) - w) <= s[:, None] / 2 + 1e-7)


@pytest.mark.parametrize("shards", [1, 2])
def test_fusing_quantized_projections_equals_quantizing_fused_ones(shards):
    """Per-output-channel scales commute with concatenating (and interleaving) columns."""
    rng = np.random.default_rng(shards)
    L, E, q, kv, inter = 2, 16, 8, 4, 6
    layers = {"q_proj": rng.normal(size=(L, E, q)), "k_proj": rng.normal(size=(L, E, kv)),
              "v_proj": rng.normal(size=(L, E, kv)), "o_proj": rng.normal(size=(L, q, E)),
              "gate_proj": rng.normal(size=(L, E, inter)), "up_proj": rng.normal(size=(L, E, inter)),
              "down_proj": rng.normal(size=(L, inter, E)), "input_norm": np.ones((L, E))}
    params = {"embed": np.zeros((5, E)), "final_norm": np.ones(E), "layers": layers}
    quant = quantize_params(params, "int8")
    assert params_quantization(quant) == "int8" and params_quantization(params) is None
    assert quant["layers"]["input_norm"] is layers["input_norm"] and "embed_scale" not in quant
    fused_q = fuse_projections(quant["layers"], shards)
    plain = fuse_projections(layers, shards)
    for name in ("qkv_proj", "gate_up_proj", "o_proj", "down_proj"):
        want_q, want_s = quantize_weight(plain[name], "int8")
        np.testing.assert_array_equal(fused_q[name], want_q)
        np.testing.assert_array_equal(fused_q[name + "_scale"], want_s)
    shapes = {k: v.shape for k, v in quant["layers"].items()}
    assert fused_layer_shapes(shapes) == {k: v.shape for k, v in fused_q.items()}
    expected = with_scale_shapes({"embed": (5, E), "final_norm": (E,), "layers": {
        k: v.shape for k, v in layers.items()}}, "int8")
    assert expected["layers"] == shapes


def test_scales_shard_with_their_output_channels():
    from jax.sharding import PartitionSpec as P

    from jaxserve.models.config import ModelConfig
    from jaxserve.worker.parallel import param_specs

    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=8, num_layers=1,
                      num_heads=4, num_kv_heads=2, head_dim=4)
    names = ["qkv_proj", "qkv_proj_scale", "o_proj", "o_proj_scale", "gate_up_proj", "gate_up_proj_scale",
             "down_proj", "down_proj_scale"]
    specs = param_specs({"embed": 0, "final_norm": 0, "lm_head": 0, "lm_head_scale": 0,
                         "layers": dict.fromkeys(names, 0)}, cfg, 2)
    layer = specs["layers"]
    assert layer["qkv_proj"] == P(None, None, "model") and layer["qkv_proj_scale"] == P(None, "model")
    assert layer["o_proj"] == P(None, "model", None) and layer["o_proj_scale"] == P(None, None)
    assert layer["down_proj_scale"] == P(None, None) and layer["gate_up_proj_scale"] == P(None, "model")
    assert specs["lm_head_scale"] == P("model")


def _tiny_loaded(tmp_path):
    pytest.importorskip("torch")
    from hf_reference import save_tiny_llama

    from jaxserve.loading import load_model

    return load_model(save_tiny_llama(tmp_path / "tiny", 2), "float32")


def _greedy_logprobs(loaded, **settings):
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine
    from scheduler import SamplingParams

    e = Engine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, num_pages=32, max_model_len=64,
                            compilation_cache_dir=None, structured_outputs=False, **settings), loaded=loaded)
    prompts = [[5, 9, 13, 2, 7], list(range(3, 23))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    for i, ids in enumerate(prompts):
        e.add_prompt(None, params, prompt_token_ids=ids, request_id=str(i))
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    e.close()
    return [(list(c.token_ids), [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)])
            for c in (outs[str(i)] for i in range(2))]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_engine_equals_the_engine_on_dequantized_weights(tmp_path, method):
    """The quantized matmuls compute exactly the model whose weights are the dequantized
    values: same greedy tokens, logprobs equal to f32 rounding."""
    loaded = _tiny_loaded(tmp_path)
    quant = quantize_params(loaded.params, method, quantize_lm_head=True)
    deq = dict(quant)
    deq["layers"] = {k: v for k, v in quant["layers"].items() if not k.endswith("_scale")}
    for name in [k for k in deq["layers"] if k + "_scale" in quant["layers"]]:
        deq["layers"][name] = dequantize_weight(quant["layers"][name], quant["layers"][name + "_scale"])
    head = "lm_head" if "lm_head_scale" in quant else "embed"
    deq[head] = dequantize_weight(quant[head], quant[head + "_scale"], axis=-2 if head == "lm_head" else -1)
    del deq[head + "_scale"]
    got = _greedy_logprobs(dataclasses.replace(loaded, params=quant), quantized_matmul_precision="highest")
    want = _greedy_logprobs(dataclasses.replace(loaded, params=deq))
    for (gt, glp), (wt, wlp) in zip(got, want):
        assert gt == wt
        np.testing.assert_allclose(glp, wlp, atol=2e-4)


def _logprobs_patched(quant, monkeypatch, obj, name, fn):
    """`_greedy_logprobs(quant)` of a fresh engine with `obj.name` patched to `fn`. jax's trace
    cache is cleared first: otherwise the engine is handed a program an earlier engine traced
    (equal graphdefs), and the patch never runs."""
    monkeypatch.setattr(obj, name, fn)
    jax.clear_caches()
    return _greedy_logprobs(quant)


def test_skip_connections_added_in_the_matmul_epilogue_keep_the_bits(tmp_path, monkeypatch):
    """o_proj and down_proj add the residual stream in the native kernel's epilogue: the same
    tokens and logprobs, bit for bit, as the model adding it after the matmul."""
    from jaxserve.models import llama
    from pallas_kernels.quantized_matmul import cpu as native_cpu

    loaded = _tiny_loaded(tmp_path)
    quant = dataclasses.replace(loaded, params=quantize_params(loaded.params, "int8"))
    kernel, fused_calls = native_cpu.quantized_matmul_cpu, []

    def counting(*args, residual=None, **kw):
        fused_calls.append(residual is not None)
        return kernel(*args, residual=residual, **kw)

    fused = _logprobs_patched(quant, monkeypatch, native_cpu, "quantized_matmul_cpu", counting)
    assert any(fused_calls), "no projection took the residual"

    def added_after(self, x, name, residual=None):
        y = self.plus_lora(self.matmul(x, name), x, name)
        return y if residual is None else residual + y

    fused_calls.clear()
    assert _logprobs_patched(quant, monkeypatch, llama._LayerWeights, "project", added_after) == fused
    assert fused_calls and not any(fused_calls)


def test_padded_rows_skipped_by_the_quantized_matmuls_keep_the_bits(tmp_path, monkeypatch):
    """The model passes each step's count of real tokens (and the logits their real rows) to
    the quantized matmuls, which skip the padding: the same tokens and logprobs, bit for bit,
    as computing every padded row (decode steps here run 2 rows in a bucket of 4)."""
    from jaxserve.models import llama

    loaded = _tiny_loaded(tmp_path)
    quant = dataclasses.replace(loaded, params=quantize_params(loaded.params, "int8"))
    matmul, counted = llama.quantized_matmul, []

    def counting(*args, rows=None, **kw):
        counted.append(rows is not None)
        return matmul(*args, rows=rows, **kw)

    def every_row(*args, rows=None, **kw):
        counted.append(False)
        return matmul(*args, **kw)

    skipped = _logprobs_patched(quant, monkeypatch, llama, "quantized_matmul", counting)
    assert counted and all(counted), "a quantized projection was not given the live rows"
    counted.clear()
    assert _logprobs_patched(quant, monkeypatch, llama, "quantized_matmul", every_row) == skipped
    assert counted and not any(counted)


def test_configuration_errors_name_the_value():
    from jaxserve.config.engine_config import EngineConfig

    with pytest.raises(ValueError, match=r"quantization must be one of \('int8', 'fp8'\).*'int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*'fp16'"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="quantize_lm_head needs quantization"):
        EngineConfig(quantize_lm_head=True)


def test_fp8_is_refused_on_targets_without_fp8_arithmetic():
    from jaxserve.compilation.targets import fp8_weights_unsupported

    assert fp8_weights_unsupported("gpu", "h100") is None and fp8_weights_unsupported("gpu", "h200") is None
    assert fp8_weights_unsupported("cpu") is None
    assert "v5e" in fp8_weights_unsupported("tpu", "v5e") and "int8" in fp8_weights_unsupported("tpu", "v6e")
    assert "compute capability" in fp8_weights_unsupported("gpu", compute_capability=(8, 0))


def test_convert_stores_a_quantized_checkpoint_that_restores_quantized(tmp_path, capsys):
    pytest.importorskip("torch")
    from hf_reference import save_tiny_llama

    from jaxserve.cli import main
    from jaxserve.loading import load_model

    src = save_tiny_llama(tmp_path / "tiny", 2)
    assert main(["convert", str(src), str(tmp_path / "ckpt"), "--quantization", "int8"]) == 0
    assert "converted" in capsys.readouterr().out
    restored = load_model(str(tmp_path / "ckpt"), "float32")
    want = quantize_params(load_model(str(src), "float32").params, "int8")
    assert restored.quantization == "int8" and params_quantization(restored.params) == "int8"
    for name in ("q_proj", "q_proj_scale", "down_proj", "down_proj_scale"):
        np.testing.assert_array_equal(restored.params["layers"][name], want["layers"][name])


def test_a_quantized_kv_cache_survives_swap_and_prefix_hits(smollm):
    """int8 pages and their scales served from the prefix cache and swapped out and back give
    the greedy tokens of an unpressured engine without prefix caching, up to a near-tie: a
    token's K/V computed in another batch shape may round to another int8 step, so at the first
    difference each side's token must be in the other's top 3 (vLLM's check_logprobs_close), and
    logprobs before it stay within 0.1. A swap round trip copies pages and scales bit for bit."""
    from hf_reference import PROMPTS
    from logprob_checks import check_outputs_close, sampled_logprobs

    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine
    from scheduler import SamplingParams

    system = "You are a careful assistant. Answer briefly and precisely, and never invent facts.\n\n"
    prompts = [smollm.tokenizer(system + p)["input_ids"] for p in PROMPTS[:6]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def run(**cfg):
        e = Engine(EngineConfig(max_num_seqs=6, max_num_batched_tokens=64, token_buckets=(8, 64),
                                kv_cache_dtype="int8", compilation_cache_dir=None, structured_outputs=False,
                                **cfg), loaded=smollm)
        e.add_prompt(None, params, prompt_token_ids=prompts[0], request_id="0")
        outs = {o.request_id: o for o in e.step()}  # the shared prefix is computed first
        for i, ids in enumerate(prompts[1:], 1):
            e.add_prompt(None, params, prompt_token_ids=ids, request_id=str(i))
        while e.has_unfinished_requests():
            outs.update({o.request_id: o for o in e.step() if o.finished})
        stats = e.scheduler.stats()
        if cfg.get("preemption_mode") == "swap":  # pages 1, 2 -> host 0, 1 -> pages 5, 6
            before = [np.asarray(x) for x in e.runner.kv_cache]
            e.runner.swap_out([(1, 0), (2, 1)])
            e.runner.swap_in([(0, 5), (1, 6)])
            after = [np.asarray(x) for x in e.runner.kv_cache]
            L, P = before[0].shape[:2]
            for x, y in zip(before, after):  # K, V [L, P, ...]; scales [L * P, S, Hkv]
                x, y = x.reshape(L, P, -1), y.reshape(L, P, -1)
                np.testing.assert_array_equal(y[:, 5:7], x[:, 1:3])
        e.close()
        return [outs[str(i)] for i in range(len(prompts))], stats

    want, _ = run(num_pages=128, enable_prefix_caching=False)
    got, stats = run(num_pages=9, preemption_mode="swap", num_host_pages=64)
    assert stats.preemptions["swap"] > 0 and stats.num_used_blocks == 0
    assert sum(o.usage.cached_tokens for o in got[1:]) > 0
    diverged = check_outputs_close([w.outputs[0] for w in want], [g.outputs[0] for g in got])
    for g, w, d in zip(got, want, diverged):
        n = len(g.outputs[0].token_ids) if d is None else d
        np.testing.assert_allclose(sampled_logprobs(g.outputs[0])[:n], sampled_logprobs(w.outputs[0])[:n], atol=0.1)


@pytest.mark.parametrize("layout", ["heads", "lanes"])
def test_swap_views_of_the_scales_pool_address_each_page(layout):
    """The swap copies see a scales pool (either layout) as [L, P, S, Hkv] pages: slot
    (l * P + p) * S + o of head h, written and read back at the right place."""
    import jax.numpy as jnp

    from jaxserve.worker.step_programs import _scale_pages, _set_scale_pages
    from pallas_kernels.kv_layout import kv_scales_shape

    L, P, S, H = 3, 5, 16, 2
    shape = kv_scales_shape(L * P, S, H, layout)
    slots = np.arange(L * P * S)
    value = {(h, t): 1000.0 * h + t for h in range(H) for t in slots}
    pool = np.full(shape, -1.0, np.float32)
    for (h, t), v in value.items():
        pool[(t // S, t % S, h) if layout == "heads" else (h, t // 128, t % 128)] = v
    view = np.asarray(_scale_pages(jnp.asarray(pool), L, P, S))
    want = np.array([[[[value[h, (l * P + p) * S + o] for h in range(H)] for o in range(S)] for p in range(P)]
                     for l in range(L)])  # noqa: E741
    np.testing.assert_array_equal(view, want)
    new = np.random.default_rng(0).normal(size=(L, 2, S, H)).astype(np.float32)
    ids = jnp.asarray([4, 1], jnp.int32)
    out = np.asarray(_set_scale_pages(jnp.asarray(pool), L, P, S, ids, jnp.asarray(new)))
    assert out.shape == pool.shape
    back = np.asarray(_scale_pages(jnp.asarray(out), L, P, S))
    np.testing.assert_array_equal(back[:, [4, 1]], new)
    np.testing.assert_array_equal(back[:, [0, 2, 3]], want[:, [0, 2, 3]])


def test_quantized_tied_head_is_served_column_major_on_cpu(tmp_path):
    """On one CPU device the runner holds a quantized tied embedding as [E, V] (the int8 head
    kernel reads [K, N] faster than [N, K]): lookups and logits are those of the [V, E]
    layout, and a weight update in the canonical layout lands transposed."""
    import jax
    import jax.numpy as jnp

    from jaxserve.models.llama import LlamaForCausalLM
    from jaxserve.worker.runner import ModelRunner

    loaded = _tiny_loaded(tmp_path)
    canonical = {k: v for k, v in loaded.params.items() if k != "lm_head"}
    tied = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, tie_word_embeddings=True),
                               params=quantize_params(canonical, "int8", quantize_lm_head=True))
    V, E = tied.params["embed"].shape
    runner = ModelRunner(tied, num_pages=8, page_size=16, attention_backend="reference")
    assert runner.embed_columns and runner.state["embed"].shape == (E, V)

    serving = {**tied.params, "layers": fuse_projections(tied.params["layers"])}
    rows = LlamaForCausalLM(tied.config, serving)
    cols = LlamaForCausalLM(tied.config, {**serving, "embed": np.ascontiguousarray(serving["embed"].T)},
                            embed_columns=True)
    ids = jnp.array([0, 5, V - 1, 5], jnp.int32)
    np.testing.assert_array_equal(cols._embed(ids, jnp.float32), rows._embed(ids, jnp.float32))
    h = jax.random.normal(jax.random.key(0), (6, E), jnp.float32)  # 6 rows: the packed path
    np.testing.assert_array_equal(cols.compute_logits(h), rows.compute_logits(h))

    before = np.asarray(runner.state["embed"])
    runner.replace_params(tied.params, tied.config)
    np.testing.assert_array_equal(np.asarray(runner.state["embed"]), before)
