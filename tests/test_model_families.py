"""The families beyond Llama served end to end: `LLM(model=<HF dir>)` gives transformers'
greedy tokens for Qwen3-MoE, Mixtral, Gemma 2 and Gemma 3 with chunked prefill and prefix-cache
hits in play; tensor and expert parallelism on 8 virtual CPU devices give TP=1's tokens.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_reference import FAMILY_CONFIGS, hf_greedy, save_tiny_family  # noqa: E402
from logprob_checks import check_greedy_close, check_runs_close, top_from_array, top_k_of  # noqa: E402

SHARED = [(7 * i + 3) % 128 for i in range(26)]  # a shared 26-token prefix
PROMPTS = [SHARED + [5, 9, 11], SHARED + [60, 2], [17, 4, 99]]
MAX_NEW = 12
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), num_pages=96, page_size=4, max_model_len=128,
              max_logprobs=5, structured_outputs=False, compilation_cache_dir=None)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: (str(root / f), save_tiny_family(root / f, f)) for f in FAMILY_CONFIGS}


@pytest.mark.parametrize("family", sorted(FAMILY_CONFIGS))
def test_llm_greedy_matches_transformers(family_dirs, family):
    from jaxserve import LLM, SamplingParams

    path, hf = family_dirs[family]
    llm = LLM(model=path, dtype="float32", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)  # 29 tokens: two prefill chunks
    rest = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params)
    outs = first + rest
    assert outs[1].usage.cached_tokens >= 24, "the shared prefix was not served from the prefix cache"
    for prompt, out in zip(PROMPTS, outs):
        want, want_logp = hf_greedy(hf, prompt, MAX_NEW)  # equal up to a near-tie (vLLM's rule)
        got, name = out.outputs[0].token_ids, f"{family}: prompt of {len(prompt)} tokens"
        at = check_greedy_close(want, top_from_array(want_logp), got, top_k_of(out.outputs[0].logprobs), name=name,
                                top_k=5)
        # Up to any divergence both sides saw the same tokens: each chosen token's logprob agrees.
        same = len(got) if at is None else at + 1
        got_logp = [entry[t].logprob for t, entry in zip(got[:same], out.outputs[0].logprobs)]
        np.testing.assert_allclose(got_logp, want_logp[np.arange(same), got[:same]], atol=2e-3, err_msg=name)
    assert llm.engine.scheduler.stats().num_used_blocks == 0
    assert llm.engine.compiles_after_warmup == 0
    bounded = {"gpt_oss": ("window", 8), "gemma2": ("window", 8), "gemma3": ("window", 8), "llama4": ("chunk", 8)}
    if family in bounded:  # windowed / chunked layers beside full ones: their old pages handed back
        assert bounded[family] in llm.engine.scheduler_config.kv_groups
        assert llm.engine.scheduler.kv.num_released_blocks > 0


_CHILD = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    sys.path.insert(0, TESTS_DIR)
    from jaxserve.loading import load_model
    from tp_greedy import greedy

    prompts = [[5, 9, 13, 2, 7], list(range(3, 40)), [1]]
    result = {}
    for arg in sys.argv[1:]:
        path, layouts = arg.split("=")
        loaded = load_model(path, "float32")
        for layout in ["tp1", *layouts.split(",")]:
            quant, _, split = layout.rpartition(":")
            tp, ep = int(split[2:]), split.startswith("ep")
            result[f"{path}-{layout}"] = greedy(loaded, tp, prompts, token_buckets=(16,), enable_expert_parallel=ep,
                                                quantization=quant or None)
    print(json.dumps(result))
""").replace("TESTS_DIR", repr(str(pathlib.Path(__file__).parent)))

# tpN: tensor parallelism over N devices (inside the experts for MoE); epN: expert parallelism;
# "int8:" int8 weights (the quantized experts' scales split like their weights), against int8 tp1;
# an int8 width split of routed experts: DeepSeek-V3's and Gemma 4's int8:tp2; int8 whole experts:
# gpt-oss's int8:ep2 (Qwen3-MoE's int8 runs took the same paths and were dropped; GLM-4.5 MoE's
# expert split is DeepSeek-V3's ep2). The windowed / chunked families' layer groups (gpt-oss,
# Llama 4) are split by head like a plain cache, the groups' tables replicated.
# Mixtral's experts take the same path as Qwen3-MoE's; Gemma 3's per-layer window entering the
# per-shard attention is tests/test_gemma3_vl.py's TP check (with images), KV heads replicated
# 2x tests/test_lora.py's and GLM-4.5 MoE's here; DeepSeek-V3 its query
# heads split over a latent cache every rank holds whole, its experts split whole (ep2) and its
# int8 projections read by layer index from their stacks; GLM-4.5 MoE its 2 KV heads replicated
# at tp4 beside the shared expert's split. gpt-oss its sinks split by head and its expert biases
# (down's added on one width shard only; whole experts' under ep2). Llama 4 its per-layer chunk
# entering the per-shard attention, its dense / MoE groups and input-scaled experts. Gemma 4 its
# two attention kinds' stacks and K/V pools split by head (at tp4 both kinds' 2 KV heads replicated
# up to 4, as 26B-A4B's 2 full-attention KV heads are on 4 chips), and its MoE block (int8 too); E2B's
# features (per-layer inputs, layers reading earlier K/V, double-wide MLPs) split by head too.
LAYOUTS = {"qwen3_moe": ("tp2", "ep8"),
           "deepseek_v3": ("tp2", "ep2", "int8:tp1", "int8:tp2"), "glm4_moe": ("tp4",),
           "gpt_oss": ("tp2", "ep2", "int8:tp1", "int8:ep2"), "llama4": ("tp2", "ep2"),
           "gemma4": ("tp2", "tp4", "ep2", "int8:tp1", "int8:tp2"), "gemma4_e": ("tp2",)}


def test_tensor_and_expert_parallel_match_single_device(family_dirs):
    args = [f"{family_dirs[f][0]}={','.join(layouts)}" for f, layouts in LAYOUTS.items()]
    res = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    for family, layouts in LAYOUTS.items():
        path = family_dirs[family][0]
        for layout in layouts:
            base = result[f"{path}-{layout.rpartition(':')[0] + ':' if ':' in layout else ''}tp1"]
            got = result[f"{path}-{layout}"]
            check_runs_close(base, got, name=f"{family} {layout}")  # equal up to a near-tie
            assert got[2] == 0, f"{family} {layout}: {got[2]} compilations after warmup"


def test_expert_parallel_needs_experts_that_divide(family_dirs):
    from jaxserve.loading import load_model
    from jaxserve.worker.parallel import tp_model_config

    cfg = dataclasses.replace(load_model(family_dirs["qwen3_moe"][0], "float32").config, num_experts=6)
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        tp_model_config(cfg, 4, expert_parallel=True)
    assert tp_model_config(cfg, 4).num_experts == 6  # a width slice of each expert still works
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        tp_model_config(load_model(family_dirs["gemma2"][0], "float32").config, 2, expert_parallel=True)


@pytest.mark.parametrize("num_shards", [1, 2, 4])
def test_expert_shards_sum_to_all_experts(num_shards):
    """Each device's share (its whole experts) summed over devices is the full MoE output."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxserve.models.config import ModelConfig
    from jaxserve.models.moe import experts_forward, route

    cfg = ModelConfig("qwen3_moe", vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=8)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((11, 16)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((8, 16, 16)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((8, 8, 16)), jnp.float32)
    weights, experts = route(x, router, cfg)
    full = experts_forward(x, weights, experts, gate_up, down, 0, activation=jax.nn.silu)
    # The oracle: each token's k experts run one by one.
    want = np.zeros((11, 16), np.float32)
    for t in range(11):
        for j in range(3):
            e = int(experts[t, j])
            g, u = np.split(np.asarray(x[t] @ gate_up[e]), 2)
            want[t] += float(weights[t, j]) * (np.asarray(jax.nn.silu(g)) * u) @ np.asarray(down[e])
    np.testing.assert_allclose(np.asarray(full), want, rtol=1e-4, atol=1e-4)
    n = 8 // num_shards
    parts = [experts_forward(x, weights, experts, gate_up[r * n:(r + 1) * n], down[r * n:(r + 1) * n], r * n,
                             activation=jax.nn.silu) for r in range(num_shards)]
    np.testing.assert_allclose(np.asarray(sum(parts)), want, rtol=1e-4, atol=1e-4)


def _write_moe_gguf(path, hf_dir: str, family: str) -> None:
    """The HF checkpoint as llama.cpp's converter lays it out: experts stacked per layer
    (`ffn_*_exps`), the router as `ffn_gate_inp`, Mixtral as a "llama" with Q/K rows permuted."""
    import glob

    import numpy as np
    from gguf import GGUFWriter
    from safetensors.numpy import load_file

    t = load_file(glob.glob(f"{hf_dir}/*.safetensors")[0])
    cfg = json.load(open(f"{hf_dir}/config.json"))
    arch = "llama" if family == "mixtral" else "qwen3moe"
    heads, kv_heads, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    w = GGUFWriter(str(path), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    width = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
    w.add_feed_forward_length(width)
    if family == "qwen3_moe":
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_expert_feed_forward_length(width)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(cfg["vocab_size"])])

    def permute(x, n):  # llama.cpp's rotate-half -> interleaved pair order for Q/K rows
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    w.add_tensor("token_embd.weight", t["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", t["model.norm.weight"])
    w.add_tensor("output.weight", t["lm_head.weight"])
    moe, e_names = (("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral"
                    else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    for i in range(layers):
        p = f"model.layers.{i}."
        q, k = t[p + "self_attn.q_proj.weight"], t[p + "self_attn.k_proj.weight"]
        if family == "mixtral":
            q, k = permute(q, heads), permute(k, kv_heads)
        for name, x in [("attn_norm", t[p + "input_layernorm.weight"]), ("attn_q", q), ("attn_k", k),
                        ("attn_v", t[p + "self_attn.v_proj.weight"]), ("attn_output", t[p + "self_attn.o_proj.weight"]),
                        ("ffn_norm", t[p + "post_attention_layernorm.weight"]),
                        ("ffn_gate_inp", t[p + f"{moe}.gate.weight"])]:
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(x))
        if family == "qwen3_moe":
            w.add_tensor(f"blk.{i}.attn_q_norm.weight", t[p + "self_attn.q_norm.weight"])
            w.add_tensor(f"blk.{i}.attn_k_norm.weight", t[p + "self_attn.k_norm.weight"])
        for gname, hname in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), e_names):
            stacked = np.stack([t[f"{p}{moe}.experts.{j}.{hname}.weight"] for j in range(experts)])
            w.add_tensor(f"blk.{i}.{gname}.weight", stacked)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_gguf_loads_the_same_params_as_safetensors(family_dirs, tmp_path, family):
    import numpy as np

    from jaxserve.loading import load_model

    hf_dir = family_dirs[family][0]
    _write_moe_gguf(tmp_path / "m.gguf", hf_dir, family)
    from_gguf, from_hf = load_model(str(tmp_path / "m.gguf"), "float32"), load_model(hf_dir, "float32")
    for field in ("architecture", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "qk_norm", "num_kv_heads", "head_dim"):
        assert getattr(from_gguf.config, field) == getattr(from_hf.config, field), field
    flat_g, flat_h = dict(_flatten(from_gguf.params)), dict(_flatten(from_hf.params))
    assert flat_g.keys() == flat_h.keys()
    for name, arr in flat_h.items():
        np.testing.assert_array_equal(flat_g[name], arr, err_msg=name)


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield prefix + k, v


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3", "deepseek_v3", "glm4_moe", "gpt_oss", "llama4", "gemma4",
                                    "gemma4_e"])
def test_converted_checkpoint_restores_config_and_params(family_dirs, tmp_path, family):
    """`jaxserve convert` keeps what makes each family: the experts, Gemma's per-layer windows,
    DeepSeek's latent attention and stacks, gpt-oss's sinks and biases, Llama 4's per-layer
    RoPE and chunks."""
    import numpy as np

    from jaxserve.cli import main
    from jaxserve.loading import load_model

    src = family_dirs[family][0]
    assert main(["convert", src, str(tmp_path / "ckpt")]) == 0
    restored, original = load_model(str(tmp_path / "ckpt"), "float32"), load_model(src, "float32")
    assert restored.config == original.config
    for name, arr in _flatten(original.params):
        np.testing.assert_array_equal(dict(_flatten(restored.params))[name], arr, err_msg=name)


@pytest.mark.parametrize("name", ["silu", "gelu_tanh"])
def test_gated_activation_rounds_once(name):
    """act(gate) * up in f32, rounded once: f32 inputs give the plain expression's bits, bf16
    inputs a result within one bf16 rounding (2^-8 relative) of the exact product, up to f32's
    own error."""
    import jax.numpy as jnp

    from jaxserve.models.layers import ACTIVATIONS, gated_activation

    rng = np.random.default_rng(0)
    g, u = (rng.standard_normal((64, 384)).astype(np.float32) * 4 for _ in range(2))
    f32 = gated_activation(name, jnp.asarray(g), jnp.asarray(u))
    assert np.array_equal(np.asarray(f32), np.asarray(ACTIVATIONS[name](jnp.asarray(g)) * jnp.asarray(u)))
    gb, ub = jnp.asarray(g, jnp.bfloat16), jnp.asarray(u, jnp.bfloat16)
    got = gated_activation(name, gb, ub)
    assert got.dtype == jnp.bfloat16
    g64, u64 = np.asarray(gb, np.float64), np.asarray(ub, np.float64)
    act = g64 / (1 + np.exp(-g64)) if name == "silu" else \
        0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3)))
    want = act * u64
    # plus f32's own error, relative to |gate * up| (gelu's 1 + tanh cancels in its far tail)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= 2.0 ** -8 * np.abs(want) + 2.0 ** -20 * np.abs(g64 * u64))
