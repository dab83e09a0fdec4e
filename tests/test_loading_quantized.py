"""Quantized weights at load and as published: compressed-tensors 8-bit HF checkpoints, GGUF
Q8_0 kept as int8, full-precision checkpoints quantized at load, quantized orbax checkpoints.

Tiny random checkpoints are written by hand from the documented layouts (numpy + safetensors,
no torch), plus one made by the `compressed-tensors` package itself when it is installed.
"""

from __future__ import annotations

import json
import logging

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxserve.loading import load_model
from jaxserve.loading.errors import UnsupportedQuantizationError
from jaxserve.models.quantization import dequantize_weight, quantize_params, quantize_weight

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
L, V, E, I, HEADS, KV_HEADS, D = 2, 64, 64, 96, 4, 2, 16  # noqa: E741
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=V, hidden_size=E,
             intermediate_size=I, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
             max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
X, IM = 4, 32  # Qwen3-MoE experts and their width
QWEN3_MOE = dict(LLAMA, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=D, num_experts=X,
                 num_experts_per_tok=2, moe_intermediate_size=IM, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[])
ATTN = {"q_proj": (HEADS * D, E), "k_proj": (KV_HEADS * D, E), "v_proj": (KV_HEADS * D, E), "o_proj": (E, HEADS * D)}
MLP = {"gate_proj": (I, E), "up_proj": (I, E), "down_proj": (E, I)}
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _float_tensors(moe: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named f32 tensors of a tiny llama (or Qwen3-MoE) in HF layout ([out, in])."""
    rng = np.random.default_rng(seed)
    t = {"model.embed_tokens.weight": rng.normal(size=(V, E)), "model.norm.weight": 1 + 0.1 * rng.normal(size=E),
         "lm_head.weight": rng.normal(size=(V, E)) * 0.1}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=E)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=E)
        for name, shape in ATTN.items():
            t[f"{p}self_attn.{name}.weight"] = rng.normal(size=shape) * 0.1
        if moe:
            t[p + "self_attn.q_norm.weight"] = 1 + 0.1 * rng.normal(size=D)
            t[p + "self_attn.k_norm.weight"] = 1 + 0.1 * rng.normal(size=D)
            t[p + "mlp.gate.weight"] = rng.normal(size=(X, E)) * 0.1
            for j in range(X):
                for name, shape in {"gate_proj": (IM, E), "up_proj": (IM, E), "down_proj": (E, IM)}.items():
                    t[f"{p}mlp.experts.{j}.{name}.weight"] = rng.normal(size=shape) * 0.1
        else:
            for name, shape in MLP.items():
                t[f"{p}mlp.{name}.weight"] = rng.normal(size=shape) * 0.1
    return {k: v.astype(np.float32) for k, v in t.items()}


def _write_hf(path, tensors: dict[str, np.ndarray], config: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def _ct_config(kind: str = "int", strategy: str = "channel", fmt: str | None = None, ignore=("lm_head",),
               **weights) -> dict:
    fmt = fmt or ("int-quantized" if kind == "int" else "float-quantized")
    args = dict(num_bits=8, type=kind, strategy=strategy, symmetric=True, dynamic=False, group_size=None,
                block_structure=None, **weights)
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args, "input_activations": None}},
            "ignore": list(ignore)}


def _ct_tensors(tensors: dict[str, np.ndarray], kind: str, strategy: str, scale_dtype=np.float32,
                ignore=("lm_head",)) -> dict:
    """compressed-tensors' layout: every linear module but those in `ignore` as `weight`
    (int8 / fp8) and `weight_scale` ([out, 1] per channel, [1] per tensor); routers stay floats."""
    out = {}
    qmax = 127.0 if kind == "int" else 448.0
    for key, w in tensors.items():
        module = key.removesuffix(".weight")
        linear = key == "lm_head.weight" or (key.endswith("_proj.weight") and ".layers." in key)
        if not linear or module in ignore:
            out[key] = w
            continue
        amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max().reshape(1)
        scale = (amax / qmax).astype(scale_dtype)
        scaled = w / scale.astype(np.float32)
        out[key] = np.clip(np.rint(scaled), -127, 127).astype(np.int8) if kind == "int" else scaled.astype(FP8)
        out[module + ".weight_scale"] = scale
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    dense = _float_tensors()
    moe = _float_tensors(moe=True, seed=1)
    return {
        "float": _write_hf(root / "float", dense, LLAMA),
        "int8": _write_hf(root / "int8", _ct_tensors(dense, "int", "channel"), dict(LLAMA, quantization_config=_ct_config())),
        "fp8": _write_hf(root / "fp8", _ct_tensors(dense, "float", "channel"),
                         dict(LLAMA, quantization_config=_ct_config("float"))),
        "int8_tensor": _write_hf(root / "int8_tensor", _ct_tensors(dense, "int", "tensor", ml_dtypes.bfloat16),
                                 dict(LLAMA, quantization_config=_ct_config(strategy="tensor"))),
        "moe_float": _write_hf(root / "moe_float", moe, QWEN3_MOE),
        "moe_int8": _write_hf(root / "moe_int8", _ct_tensors(moe, "int", "channel"),
                              dict(QWEN3_MOE, quantization_config=_ct_config(ignore=["lm_head", "re:.*mlp.gate$"]))),
    }


@pytest.fixture(scope="module")
def float_params(dirs):
    return load_model(dirs["float"]).params


def _assert_within_one_step(got: dict, want: dict, method: str, scale_rtol: float = 1e-6) -> None:
    """Each quantized weight of `want` is in `got` with the same dtype; int8 values equal or
    one step apart, fp8 values within one fp8 step (relative 2^-3); scales close."""
    for name in [n for n in want if n.endswith("_scale")]:
        w = name.removesuffix("_scale")
        assert got[w].dtype == want[w].dtype, w
        np.testing.assert_allclose(got[name], want[name], rtol=scale_rtol, err_msg=name)
        assert got[name].dtype == np.float32
        a, b = got[w].astype(np.float32), want[w].astype(np.float32)
        if method == "int8":
            assert np.abs(a - b).max() <= 1, w
        else:
            np.testing.assert_allclose(a, b, rtol=2**-3, atol=2**-9, err_msg=w)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_compressed_tensors_channel_loads_as_quantize_params(dirs, float_params, method):
    loaded = load_model(dirs[method])  # quantization=None: the checkpoint's own scheme
    assert loaded.quantization == method
    want = quantize_params(float_params, method)
    _assert_within_one_step(loaded.params["layers"], want["layers"], method)
    assert loaded.params["layers"]["q_proj"].shape == (L, E, HEADS * D)
    assert loaded.params["layers"]["q_proj_scale"].shape == (L, HEADS * D)
    for name in ("input_norm", "post_norm"):
        np.testing.assert_array_equal(loaded.params["layers"][name], float_params["layers"][name])
    for name in ("embed", "final_norm", "lm_head"):  # lm_head is in `ignore`: plain floats
        assert loaded.params[name].dtype == np.float32
        np.testing.assert_array_equal(loaded.params[name], float_params[name])
    assert "lm_head_scale" not in loaded.params
    again = load_model(dirs[method], quantization=method)  # asking for the scheme it holds
    np.testing.assert_array_equal(again.params["layers"]["down_proj"], loaded.params["layers"]["down_proj"])


def test_compressed_tensors_tensor_strategy_broadcasts_the_scale(dirs, float_params):
    loaded = load_model(dirs["int8_tensor"], dtype="bfloat16")
    assert loaded.quantization == "int8"
    layers = loaded.params["layers"]
    for name in PROJ:
        scale = layers[name + "_scale"]
        assert scale.dtype == np.float32 and np.all(scale == scale[:, :1]), name  # one factor per tensor
        deq = dequantize_weight(layers[name], scale)
        step = scale[:, None, :]
        assert np.all(np.abs(deq - float_params["layers"][name]) <= step * 0.5 * (1 + 1e-3) + 1e-7), name
    assert str(loaded.params["embed"].dtype) == "bfloat16"


def test_compressed_tensors_quantized_head_and_an_ignored_layer(tmp_path, float_params):
    """A published quantized lm_head stays quantized; a projection the checkpoint left in
    floats (in `ignore`) is quantized at load like the others, so each stacked weight has one dtype."""
    ignore = ["model.layers.0.mlp.down_proj"]
    path = _write_hf(tmp_path / "m", _ct_tensors(_float_tensors(), "int", "channel", ignore=ignore),
                     dict(LLAMA, quantization_config=_ct_config(ignore=ignore)))
    params = load_model(path).params
    want = quantize_params(float_params, "int8", quantize_lm_head=True)
    assert params["lm_head"].dtype == np.int8 and params["lm_head_scale"].shape == (V,)
    np.testing.assert_array_equal(params["lm_head"], want["lm_head"])
    np.testing.assert_allclose(params["lm_head_scale"], want["lm_head_scale"], rtol=1e-6)
    for name in ("down_proj", "down_proj_scale"):
        np.testing.assert_array_equal(params["layers"][name][0], want["layers"][name][0])


def test_requested_method_must_match_a_prequantized_checkpoint(dirs):
    with pytest.raises(ValueError, match=r"int8.*quantization='fp8'"):
        load_model(dirs["int8"], quantization="fp8")
    with pytest.raises(ValueError, match=r"fp8.*quantization='int8'"):
        load_model(dirs["fp8"], quantization="int8")


def test_moe_compressed_tensors_experts(dirs):
    loaded = load_model(dirs["moe_int8"])
    want = quantize_params(load_model(dirs["moe_float"]).params, "int8")
    layers = loaded.params["layers"]
    assert layers["expert_gate"].shape == (L, X, E, IM) and layers["expert_gate_scale"].shape == (L, X, IM)
    assert layers["expert_down"].shape == (L, X, IM, E) and layers["expert_down_scale"].shape == (L, X, E)
    _assert_within_one_step(layers, want["layers"], "int8")
    assert layers["router"].dtype == np.float32 and "router_scale" not in layers
    np.testing.assert_array_equal(layers["router"], want["layers"]["router"])


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_full_precision_checkpoint_quantized_at_load(dirs, float_params, method):
    loaded = load_model(dirs["float"], quantization=method)
    assert loaded.quantization == method
    want = quantize_params(float_params, method)
    for name, arr in want["layers"].items():
        assert loaded.params["layers"][name].dtype == arr.dtype, name
        np.testing.assert_array_equal(loaded.params["layers"][name], arr, err_msg=name)
    assert loaded.params["lm_head"].dtype == np.float32
    head = load_model(dirs["float"], quantization=method, quantize_lm_head=True).params
    want_head = quantize_params(float_params, method, quantize_lm_head=True)
    np.testing.assert_array_equal(head["lm_head"], want_head["lm_head"])
    np.testing.assert_array_equal(head["lm_head_scale"], want_head["lm_head_scale"])
    assert load_model(dirs["float"]).quantization is None
    with pytest.raises(ValueError, match="quantize_lm_head"):
        load_model(dirs["float"], quantize_lm_head=True)


REFUSED = {
    "4-bit": dict(num_bits=4, fmt="pack-quantized"),
    "'group' strategy": dict(strategy="group", group_size=128),
    "'block' strategy": dict(strategy="block", block_structure=[128, 128]),
    "asymmetric": dict(symmetric=False),
    "format 'nvfp4-pack-quantized'": dict(fmt="nvfp4-pack-quantized"),
    "weight type 'bool'": dict(kind="bool"),
    "format 'dense'": dict(fmt="dense"),
}


@pytest.mark.parametrize("scheme", sorted(REFUSED))
def test_unsupported_compressed_tensors_schemes_are_refused(tmp_path, scheme):
    kw = dict(REFUSED[scheme])
    kind, strategy, fmt = kw.pop("kind", "int"), kw.pop("strategy", "channel"), kw.pop("fmt", None)
    qc = _ct_config(kind, strategy, fmt)
    qc["config_groups"]["group_0"]["weights"].update(kw)
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, quantization_config=qc)))
    with pytest.raises(UnsupportedQuantizationError, match=f"compressed-tensors .*{scheme}"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes", "fp8", "mxfp4"])
def test_other_quantization_methods_are_refused(tmp_path, method):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA, quantization_config={"quant_method": method})))
    with pytest.raises(UnsupportedQuantizationError, match=f"quantization method '{method}'"):
        load_model(str(tmp_path))


def test_int8_without_a_scale_is_not_read_as_floats(tmp_path, dirs):
    """A checkpoint holding int8 tensors but no quantization_config used to load raw integers."""
    from safetensors.numpy import load_file

    tensors = load_file(f"{dirs['int8']}/model.safetensors")
    tensors = {k: v for k, v in tensors.items() if not k.endswith("_scale")}
    path = _write_hf(tmp_path / "m", tensors, LLAMA)
    with pytest.raises(ValueError, match="stored as int8"):
        load_model(path)


# ----------------------------------------------------------------------------------- GGUF


def _write_gguf(path, tensors: dict[str, np.ndarray], qtype, tied: bool = False) -> None:
    """The tiny llama as llama.cpp lays it out (Q/K rows permuted), projections and the
    output head in `qtype`, norms and the embedding in F32 (tied: no output head, the
    embedding in `qtype`)."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    def permute(x, n):
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    def add(name, x, quantized=True):
        x = np.ascontiguousarray(x, np.float32)
        if not quantized or qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, x)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    w = GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(E)
    w.add_block_count(L)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"<t{i}>" for i in range(V)])
    add("token_embd.weight", tensors["model.embed_tokens.weight"], quantized=tied)
    add("output_norm.weight", tensors["model.norm.weight"], quantized=False)
    if not tied:
        add("output.weight", tensors["lm_head.weight"])
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for i in range(L):
        p = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", tensors[p + "input_layernorm.weight"], quantized=False)
        add(f"blk.{i}.ffn_norm.weight", tensors[p + "post_attention_layernorm.weight"], quantized=False)
        for hf, g in names.items():
            x = tensors[p + ("self_attn." if hf in ATTN else "mlp.") + hf + ".weight"]
            x = permute(x, HEADS) if hf == "q_proj" else permute(x, KV_HEADS) if hf == "k_proj" else x
            add(f"blk.{i}.{g}.weight", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    from gguf import GGMLQuantizationType

    root = tmp_path_factory.mktemp("gguf")
    tensors = _float_tensors()
    out = {}
    for qtype in ("Q8_0", "F16"):
        out[qtype] = str(root / f"m.{qtype}.gguf")
        _write_gguf(out[qtype], tensors, GGMLQuantizationType[qtype])
    out["Q8_0_tied"] = str(root / "m.Q8_0_tied.gguf")
    _write_gguf(out["Q8_0_tied"], tensors, GGMLQuantizationType.Q8_0, tied=True)
    return out


def test_q8_0_gguf_loads_int8_without_dequantizing(ggufs, float_params):
    from jaxserve.loading.gguf_loader import GGUFFile, gguf_config, load_gguf_params

    loaded = load_model(ggufs["Q8_0"])  # quantization=None: the file's own scheme
    assert loaded.quantization == "int8"
    gf = GGUFFile(ggufs["Q8_0"])
    gguf_own = load_gguf_params(gf, gguf_config(gf), np.float32)  # gguf's own dequantization, as before
    layers = loaded.params["layers"]
    for name in PROJ:
        q, scale = layers[name], layers[name + "_scale"]
        assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (L, q.shape[-1]), name
        err = np.abs(dequantize_weight(q, scale) - gguf_own["layers"][name])
        assert np.all(err <= scale[:, None, :] * 0.5 * (1 + 1e-6)), name  # re-rounded once: half a step
        # the same as quantizing the GGUF's dequantized values ourselves
        np.testing.assert_array_equal(q, quantize_weight(gguf_own["layers"][name], "int8")[0], err_msg=name)
    # within one step of quantize_params on the weights before they were written as Q8_0
    _assert_within_one_step(layers, quantize_params(float_params, "int8")["layers"], "int8", scale_rtol=2e-3)
    assert loaded.params["lm_head"].dtype == np.float32  # the head stays float unless asked
    np.testing.assert_array_equal(loaded.params["lm_head"], gguf_own["lm_head"])
    np.testing.assert_array_equal(loaded.params["embed"], gguf_own["embed"])

    head = load_model(ggufs["Q8_0"], quantize_lm_head=True).params
    assert head["lm_head"].dtype == np.int8 and head["lm_head_scale"].shape == (V,)
    np.testing.assert_array_equal(head["lm_head"], quantize_weight(gguf_own["lm_head"], "int8")[0])
    with pytest.raises(ValueError, match=r"int8.*quantization='fp8'"):
        load_model(ggufs["Q8_0"], quantization="fp8")


def test_q8_0_gguf_tied_embedding_as_the_quantized_head(ggufs):
    from jaxserve.loading.gguf_loader import GGUFFile, gguf_config, load_gguf_params

    gf = GGUFFile(ggufs["Q8_0_tied"])
    gguf_own = load_gguf_params(gf, gguf_config(gf), np.float32)
    plain = load_model(ggufs["Q8_0_tied"]).params
    assert "lm_head" not in plain and plain["embed"].dtype == np.float32
    np.testing.assert_array_equal(plain["embed"], gguf_own["embed"])
    head = load_model(ggufs["Q8_0_tied"], quantize_lm_head=True).params
    assert head["embed"].dtype == np.int8 and head["embed_scale"].shape == (V,)  # one scale per token row
    want, want_scale = quantize_weight(gguf_own["embed"], "int8", axis=-1)
    np.testing.assert_array_equal(head["embed"], want)
    np.testing.assert_array_equal(head["embed_scale"], want_scale)


def test_other_gguf_types_load_dequantized_or_quantized_by_us(ggufs):
    plain = load_model(ggufs["F16"])
    assert plain.quantization is None and plain.params["layers"]["q_proj"].dtype == np.float32
    for method in ("int8", "fp8"):
        loaded = load_model(ggufs["F16"], quantization=method)
        want = quantize_params(plain.params, method)
        for name in PROJ:
            np.testing.assert_array_equal(loaded.params["layers"][name], want["layers"][name], err_msg=name)
            np.testing.assert_array_equal(loaded.params["layers"][name + "_scale"], want["layers"][name + "_scale"])


# ---------------------------------------------------------------------------------- orbax


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield prefix + k, v


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_orbax_round_trip(dirs, tmp_path, method):
    from jaxserve.cli import main

    dst = str(tmp_path / "ckpt")
    assert main(["convert", dirs[method], dst]) == 0
    meta = json.load(open(f"{dst}/jaxserve_model.json"))
    assert meta["quantization"] == method and "layers.q_proj" in meta["quantized_weights"]
    src, restored = load_model(dirs[method]), load_model(dst)
    assert restored.quantization == method and restored.config == src.config
    flat_s, flat_r = dict(_flatten(src.params)), dict(_flatten(restored.params))
    assert flat_s.keys() == flat_r.keys()
    for name, arr in flat_s.items():
        got, want = np.ascontiguousarray(flat_r[name]), np.ascontiguousarray(arr)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=name)  # bit for bit
    bf16 = load_model(dst, dtype="bfloat16").params
    assert np.asarray(bf16["layers"]["q_proj"]).dtype == np.asarray(src.params["layers"]["q_proj"]).dtype
    assert np.asarray(bf16["layers"]["q_proj_scale"]).dtype == np.float32
    assert str(np.asarray(bf16["embed"]).dtype) == "bfloat16"
    other = "fp8" if method == "int8" else "int8"
    with pytest.raises(ValueError, match=f"{method}.*quantization='{other}'"):
        load_model(dst, quantization=other)


def test_full_precision_orbax_quantized_at_load(dirs, float_params, tmp_path):
    from jaxserve.cli import main

    dst = str(tmp_path / "ckpt")
    assert main(["convert", dirs["float"], dst]) == 0
    assert json.load(open(f"{dst}/jaxserve_model.json"))["quantization"] is None
    loaded = load_model(dst, quantization="int8")
    assert loaded.quantization == "int8"
    for name, arr in quantize_params(float_params, "int8")["layers"].items():
        np.testing.assert_array_equal(np.asarray(loaded.params["layers"][name]), arr, err_msg=name)


# ------------------------------------------------------ made by the compressed-tensors package


@pytest.fixture(scope="module")
def package_made(tmp_path_factory):
    """Two checkpoints the `compressed-tensors` package writes itself from a tiny transformers
    llama: W8A8 int8 (dynamic per-token activations: "int-quantized") and W8A16 int8
    (weight-only: "pack-quantized", 8-bit values packed in int32 words)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    del ct
    root = tmp_path_factory.mktemp("ct_package")
    out = {}
    for label, acts in (("w8a8", True), ("w8a16", False)):
        cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type")})
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
        (root / f"{label}_float").mkdir()
        model.save_pretrained(root / f"{label}_float")
        weights = QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True)
        act_args = QuantizationArgs(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True)
        scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=act_args if acts else None)
        apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
        for module in model.modules():
            if hasattr(module, "weight_scale"):  # what llm-compressor's min-max observer computes
                w = module.weight.data
                scale, _ = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), weights)
                module.weight_scale.data.copy_(scale)
        compressor = ModelCompressor.from_pretrained_model(model)
        compressor.compress_model(model)
        model.save_pretrained(root / label)
        compressor.update_config(str(root / label))
        out[label] = str(root / label)
    return out


@pytest.mark.parametrize("label", ["w8a8", "w8a16"])
def test_checkpoint_made_by_compressed_tensors(package_made, label, caplog):
    qc = json.load(open(f"{package_made[label]}/config.json"))["quantization_config"]
    assert qc["format"] == {"w8a8": "int-quantized", "w8a16": "pack-quantized"}[label]
    with caplog.at_level(logging.INFO, logger="jaxserve.loading"):
        loaded = load_model(package_made[label])
    assert ("weight-only" in caplog.text) == (label == "w8a8")
    assert loaded.quantization == "int8"
    float_params = load_model(package_made[label] + "_float").params
    # compressed-tensors' int8 scale is max|w| / 127.5 (values in [-128, 127]), ours max|w| / 127
    _assert_within_one_step(loaded.params["layers"], quantize_params(float_params, "int8")["layers"], "int8",
                            scale_rtol=5e-3)
    np.testing.assert_array_equal(loaded.params["lm_head"], float_params["lm_head"])
