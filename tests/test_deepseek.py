"""DeepSeek-V3 (multi-head latent attention): the published config parsed as transformers
reads it, the latent cache's size, the absorbed attention against the expanded one, an int8
latent cache under swap preemption against transformers' greedy tokens, and checkpoints with
missing or misshapen MLA tensors refused by name. Greedy parity with chunked prefill and
prefix-cache hits, and TP=2 / EP=2, run with the other families (tests/test_model_families.py).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.models.config import ModelConfig, UnsupportedModelError
from pallas_kernels.mla_attention.ops import (
    mla_attention_expanded,
    mla_paged_attention,
    update_latent_cache,
)

DATA = pathlib.Path(__file__).parent / "data"


def _published() -> dict:
    return json.loads((DATA / "deepseek_v3_config.json").read_text())


def test_published_config_reads_as_transformers_does():
    cfg = ModelConfig.from_hf_config(_published())
    m = cfg.mla
    assert (m.kv_lora_rank, m.qk_rope_head_dim, m.latent_width, m.q_lora_rank) == (512, 64, 576, 1536)
    assert (cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.router_scoring) == (256, 8, 4, "sigmoid")
    assert (cfg.first_k_dense_replace, cfg.shared_expert_intermediate_size) == (3, 2048)
    # transformers: scaling = qk_head_dim^-0.5 * mscale(40, mscale_all_dim=1)^2
    mscale = 0.1 * math.log(40) + 1
    assert cfg.sm_scale == pytest.approx(192 ** -0.5 * mscale * mscale)
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxserve.models.rope import rope_attention_factor, rope_inv_freq

    hf_cfg = transformers.DeepseekV3Config(**{k: v for k, v in _published().items() if k != "quantization_config"})
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    np.testing.assert_allclose(rope_inv_freq(cfg), inv.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(factor)


@pytest.mark.parametrize("change,match", [
    ({"attention_bias": True}, "attention_bias"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"n_group": 3}, "n_group"),
])
def test_unsupported_configs_are_refused_by_name(change, match):
    with pytest.raises((UnsupportedModelError, ValueError), match=match):
        ModelConfig.from_hf_config({**_published(), **change})


def test_latent_pages_fit_many_times_more_tokens_than_gqa_pages():
    """The same memory budget holds W / (2 Hkv D) times the pages of a GQA model of the same
    width, heads and depth: 576 lanes per token and layer against 2 x 8 KV heads x 128."""
    ds = ModelConfig.from_hf_config(_published())
    gqa = ModelConfig(architecture="llama", vocab_size=ds.vocab_size, hidden_size=ds.hidden_size,
                      intermediate_size=ds.intermediate_size, num_layers=ds.num_layers, num_heads=128,
                      num_kv_heads=8, head_dim=128)
    engine = EngineConfig(kv_cache_memory_gb=64.0, page_size=16, dtype="bfloat16", max_num_seqs=8,
                          max_num_batched_tokens=512, max_model_len=4096)
    pages = {name: engine.resolve(c, platform="cpu").scheduler.num_blocks for name, c in (("mla", ds), ("gqa", gqa))}
    assert pages["mla"] / pages["gqa"] == pytest.approx(2 * 8 * 128 / 576, rel=1e-3)
    # the latent is replicated over tensor-parallel ranks: tp=4 holds a quarter of the pages
    tp4 = EngineConfig(kv_cache_memory_gb=64.0, page_size=16, dtype="bfloat16", max_num_seqs=8,
                       max_num_batched_tokens=512, max_model_len=4096, tensor_parallel_size=4)
    assert tp4.resolve(ds, platform="cpu").scheduler.num_blocks == pytest.approx(pages["mla"] / 4, abs=1)


def _paged(latent: np.ndarray, page_size: int, num_pages: int, dtype, layout: str, rng) -> tuple:
    """One sequence's latent rows scattered over shuffled pages: (pages, scales, block table)."""
    from pallas_kernels.kv_layout import kv_scales_shape, lanes_width

    C, W = latent.shape
    row = (lanes_width(1, W),) if layout == "lanes" else (1, W)
    pages = jnp.zeros((num_pages, page_size, *row), dtype)
    scales = (jnp.zeros(kv_scales_shape(num_pages, page_size, 1, layout), jnp.float32)
              if jnp.dtype(dtype).itemsize == 1 else None)
    table = rng.permutation(np.arange(1, num_pages))[: -(-C // page_size)].astype(np.int32)
    slots = jnp.asarray(table[np.arange(C) // page_size] * page_size + np.arange(C) % page_size, jnp.int32)
    out = update_latent_cache(jnp.asarray(latent), pages, slots, scales)
    return out[0], (out[1] if len(out) > 1 else None), table


@pytest.mark.parametrize("layout", ["heads", "lanes"])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.int8, 3e-2)])
def test_absorbed_paged_attention_equals_the_expanded_form(dtype, tol, layout):
    """softmax(q_lat . c_kv + q_rope . k_rope) . c_kv . W_UV over latent pages equals attention
    with the latent expanded to per-head keys and values (transformers' form): a 3-token chunk
    at the end of a 13-token context, pages of 4 in shuffled order, in both page layouts (lanes:
the 40-lane rows padded to 128, as on TPU)."""
    rng = np.random.default_rng(0)
    H, dn, dr, dv, Dl, C, T = 4, 16, 8, 16, 32, 13, 3
    c_kv, k_rope = rng.standard_normal((C, Dl)).astype(np.float32), rng.standard_normal((C, dr)).astype(np.float32)
    q_nope, q_rope = rng.standard_normal((T, H, dn)).astype(np.float32), rng.standard_normal((T, H, dr)).astype(np.float32)
    kv_b = (rng.standard_normal((Dl, H, dn + dv)) / np.sqrt(Dl)).astype(np.float32)
    want = mla_attention_expanded(jnp.asarray(q_nope), jnp.asarray(q_rope), jnp.asarray(c_kv), jnp.asarray(k_rope),
                                  jnp.asarray(kv_b), sm_scale=0.2)
    pages, scales, table = _paged(np.concatenate([c_kv, k_rope], -1), 4, 8, dtype, layout, rng)
    q_lat = np.einsum("thd,lhd->thl", q_nope, kv_b[..., :dn])
    o_lat = mla_paged_attention(jnp.asarray(np.concatenate([q_lat, q_rope], -1)), pages, jnp.asarray([C, 0], jnp.int32),
                                jnp.asarray(np.stack([np.pad(table, (0, 4 - len(table)))] * 2)),
                                jnp.asarray([0, T, T], jnp.int32), jnp.asarray([1], jnp.int32), sm_scale=0.2,
                                latent_dim=Dl, scales=scales)
    got = np.einsum("thl,lhv->thv", np.asarray(o_lat), kv_b[..., dn:])
    np.testing.assert_allclose(got, np.asarray(want), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernel,dtype", [("pallas_tpu", jnp.float32), ("pallas_tpu", jnp.int8),
                                          ("pallas_gpu", jnp.float32)])
def test_latent_attention_kernels_equal_the_reference(kernel, dtype):
    """The TPU path (interpret mode): 48-lane latent rows in 128-lane pages, the query padded
    to them; the GPU path: the Triton kernel over [P, S, 1, 48] pages (32 + 16 lane pieces, as
    576 is 512 + 64). Three sequences (a chunk, a decode, a whole prefill)."""
    from pallas_kernels.kv_layout import kv_scales_shape, lanes_width

    rng = np.random.default_rng(1)
    H, W, Dl, S, P = 4, 48, 32, 8, 12
    lanes = kernel == "pallas_tpu"
    lens, q_lens = [13, 5, 9], [3, 1, 9]
    tables, slots, page = np.zeros((3, 4), np.int32), [], 1
    for r, n in enumerate(lens):
        for j in range(-(-n // S)):
            tables[r, j], page = page, page + 1
        slots += [int(tables[r, t // S]) * S + t % S for t in range(n)]
    pages = jnp.zeros((P, S, lanes_width(1, W)) if lanes else (P, S, 1, W), dtype)
    layout = "lanes" if lanes else "heads"
    scales = jnp.zeros(kv_scales_shape(P, S, 1, layout), jnp.float32) if dtype == jnp.int8 else None
    out = update_latent_cache(jnp.asarray(rng.standard_normal((len(slots), W)), jnp.float32), pages,
                              jnp.asarray(slots, jnp.int32), scales)
    args = (jnp.asarray(rng.standard_normal((16, H, W)), jnp.float32), out[0], jnp.asarray(lens, jnp.int32),
            jnp.asarray(tables), jnp.asarray(np.cumsum([0] + q_lens), jnp.int32), jnp.asarray([3], jnp.int32))
    kw = dict(sm_scale=0.3, latent_dim=Dl, scales=out[1] if len(out) > 1 else None)
    want = mla_paged_attention(*args, **kw, backend="reference")[: sum(q_lens)]
    got = mla_paged_attention(*args, **kw, backend=kernel, interpret=True)[: sum(q_lens)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_int8_latent_cache_under_swap_preemption_matches_transformers(tmp_path):
    """An int8 latent cache, pages so few that requests are swapped out and back in: greedy
    tokens equal transformers' (vLLM's near-tie rule), nothing compiles after warmup, no page
    is left held."""
    pytest.importorskip("torch")
    from hf_reference import hf_greedy, save_tiny_family
    from logprob_checks import check_greedy_close, top_from_array, top_k_of

    from jaxserve import LLM, SamplingParams

    hf = save_tiny_family(tmp_path / "ds", "deepseek_v3")
    llm = LLM(model=str(tmp_path / "ds"), dtype="float32", kv_cache_dtype="int8", preemption_mode="swap",
              num_pages=14, page_size=4, max_num_seqs=3, max_num_batched_tokens=16, token_buckets=(16,),
              max_model_len=64, max_logprobs=5, structured_outputs=False, compilation_cache_dir=None)
    prompts = [[1 + (5 * i + 7 * j) % 127 for j in range(9 + 3 * i)] for i in range(3)]  # no 0: the reference pads with it
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5))
    stats = llm.engine.scheduler.stats()
    assert sum(stats.preemptions.values()) > 0, "no request was preempted: the test proves nothing about swap"
    for p, out in zip(prompts, outs):
        want, want_logp = hf_greedy(hf, p, 10)
        check_greedy_close(want, top_from_array(want_logp), out.outputs[0].token_ids,
                           top_k_of(out.outputs[0].logprobs), name=f"int8 latent, {len(p)} tokens", top_k=5)
    assert llm.engine.compiles_after_warmup == 0
    assert stats.num_used_blocks == 0


@pytest.mark.parametrize("fault", ["missing", "misshapen"])
def test_checkpoint_with_a_bad_mla_tensor_is_refused_by_name(tmp_path, fault):
    pytest.importorskip("torch")
    from hf_reference import save_tiny_family
    from safetensors.numpy import load_file, save_file

    from jaxserve.loading import load_model
    from jaxserve.loading.errors import CheckpointError

    save_tiny_family(tmp_path / "ds", "deepseek_v3")
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "ds", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    if fault == "missing":
        del tensors[name]
    else:
        tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    shapes = "has shape (256, 31), expected (256, 32)" if fault == "misshapen" else ""  # both shapes named
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}.*{re.escape(shapes)}"):
        load_model(str(broken), "float32")



def test_block_scaled_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path):
    """DeepSeek's published format (HF `quant_method: "fp8"`, e4m3 weights with one
    `weight_scale_inv` per block; 16x16 blocks here, so the 24- and 40-row projections end in
    partial blocks): every projection loads as value x its block's scale, exactly the params of
    a float checkpoint holding those products, and `quantization="int8"` requantizes them."""
    pytest.importorskip("torch")
    import ml_dtypes
    from hf_reference import save_tiny_family
    from safetensors.numpy import load_file, save_file

    from jaxserve.loading import load_model
    from jaxserve.loading.errors import UnsupportedQuantizationError

    save_tiny_family(tmp_path / "ds", "deepseek_v3")
    rng = np.random.default_rng(0)
    tensors = load_file(str(tmp_path / "ds" / "model.safetensors"))
    fp8, dequantized = dict(tensors), dict(tensors)
    for name, w in tensors.items():
        if not name.endswith(("proj.weight", "proj_with_mqa.weight")):  # the linear layers (not the router)
            continue
        rows, cols = -(-w.shape[0] // 16), -(-w.shape[1] // 16)
        scale_inv = rng.uniform(0.01, 0.1, (rows, cols)).astype(np.float32)
        full = np.kron(scale_inv, np.ones((16, 16), np.float32))[: w.shape[0], : w.shape[1]]
        values = (w / full).astype(ml_dtypes.float8_e4m3fn)
        fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = values, scale_inv
        dequantized[name] = values.astype(np.float32) * full
    assert sum(n.endswith("weight_scale_inv") for n in fp8) > 20  # q/kv/o, dense, experts, shared
    for name, data in (("fp8", fp8), ("float", dequantized)):
        shutil.copytree(tmp_path / "ds", tmp_path / name)
        save_file(data, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    got, want = load_model(str(tmp_path / "fp8"), "float32").params, load_model(str(tmp_path / "float"), "float32").params
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    int8 = load_model(str(tmp_path / "fp8"), "float32", quantization="int8").params["layers"]
    assert int8["kv_a_proj"].dtype == np.int8 and int8["expert_gate"].dtype == np.int8
    config["quantization_config"]["weight_block_size"] = [96, 96]  # blocks the loader would not infer
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match=r"weight_block_size \[96, 96\]"):
        load_model(str(tmp_path / "fp8"), "float32")


def test_features_the_latent_family_lacks_are_refused_by_name():
    from jaxserve.models.registry import check_support

    with pytest.raises(UnsupportedModelError, match=r"deepseek_v3 \(model family 'deepseek'\) does not support lora"):
        check_support(ModelConfig.from_hf_config(_published()), lora=True)
    check_support(ModelConfig.from_hf_config(_published()), quantized_kv=True, tensor_parallel=True,
                  expert_parallel=True, spec_decode=True)  # these it serves
