"""The fast loader's pieces: transposing/casting host copies (native and numpy agree with numpy's
own), native GGUF block dequantization against gguf's, the safetensors reader's checks on
damaged files, and the layout that lets the weights exist once (fused without a copy,
read-only, shared with the CPU device)."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from jaxserve.loading import CheckpointError, ModelFileNotFoundError, host_copy, load_model
from jaxserve.loading.safetensors_file import SafetensorsFile

BF16 = ml_dtypes.bfloat16


@pytest.mark.parametrize("src_dtype,dst_dtype", [(BF16, BF16), (BF16, np.float32), (np.float32, BF16),
                                                 (np.float16, np.float32), (np.float32, np.float32),
                                                 (np.float16, BF16)])
@pytest.mark.parametrize("shape", [(130, 77), (8, 8), (5, 300)])
@pytest.mark.parametrize("native", [True, False])
def test_transposing_copies_equal_numpy(src_dtype, dst_dtype, shape, native, monkeypatch):
    if not native:
        monkeypatch.setattr(host_copy, "_library", lambda: (None, "off for this test"))
    elif not host_copy.native_available()[0]:
        pytest.skip("no C++ compiler here")
    rng = np.random.default_rng(0)
    src = (rng.standard_normal(shape) * 100).astype(src_dtype)
    src.reshape(-1)[:3] = [np.inf, -np.inf, 1e-6]
    padded = np.zeros((shape[1], shape[0] + 5), dst_dtype)  # a column slice, as a fused q/k/v part is
    dst = padded[:, 2:2 + shape[0]]
    host_copy.copy_into(src, dst, transpose=True)
    np.testing.assert_array_equal(dst, src.T.astype(np.float32).astype(dst_dtype))
    assert not padded[:, :2].any() and not padded[:, 2 + shape[0]:].any()
    same = np.zeros(shape, dst_dtype)
    host_copy.copy_into(src, same)
    np.testing.assert_array_equal(same, src.astype(np.float32).astype(dst_dtype))


def test_bf16_rounding_is_to_nearest_even_and_keeps_nan():
    if not host_copy.native_available()[0]:
        pytest.skip("no C++ compiler here")
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x7FC00001, 0xFF800000] * 1024, np.uint32)
    src = bits.view(np.float32).reshape(64, 80)
    dst = np.empty((80, 64), BF16)
    host_copy.copy_into(src, dst, transpose=True)
    want = src.T.astype(BF16)
    same = (dst.view(np.uint16) == want.view(np.uint16)) | (np.isnan(dst.astype(np.float32)) & np.isnan(want))
    assert same.all()


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_native_gguf_dequantization_equals_ggufs(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    if not host_copy.native_available()[0]:
        pytest.skip("no C++ compiler here")
    t = GGMLQuantizationType[qtype]
    raw = quantize(np.random.default_rng(1).standard_normal((48, 256)).astype(np.float32), t)
    got = host_copy.dequantize_gguf(int(t), raw)
    np.testing.assert_array_equal(got.reshape(48, 256), dequantize(raw, t))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    """A tiny Llama checkpoint in two safetensors shards with an index, as hubs publish them."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("sharded")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="40KB")
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 2
    return path, model


def test_sharded_bf16_checkpoint_loads_exactly_and_fuses_without_copies(sharded_dir):
    from jaxserve.models.fused import fuse_projections
    from jaxserve.worker.runner import host_to_device

    path, model = sharded_dir
    loaded = load_model(str(path), dtype="bfloat16")
    layers = loaded.params["layers"]
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(layers["k_proj"][1].astype(np.float32), sd["model.layers.1.self_attn.k_proj.weight"].T)
    np.testing.assert_array_equal(loaded.params["lm_head"].astype(np.float32), sd["lm_head.weight"].T)
    assert all(not a.flags.writeable for a in layers.values())
    fused = fuse_projections(layers)
    assert np.shares_memory(fused["qkv_proj"], layers["v_proj"]) and np.shares_memory(fused["gate_up_proj"],
                                                                                        layers["up_proj"])
    np.testing.assert_array_equal(fused["qkv_proj"][..., :32], layers["q_proj"])
    on_device = host_to_device(fused["gate_up_proj"])  # read-only and aligned: shared, not copied
    assert on_device.unsafe_buffer_pointer() == fused["gate_up_proj"].ctypes.data
    f32 = load_model(str(path), dtype="float32")
    np.testing.assert_array_equal(f32.params["layers"]["down_proj"][0], sd["model.layers.0.mlp.down_proj.weight"].T)


def test_a_missing_shard_is_named(sharded_dir, tmp_path):
    path, _ = sharded_dir
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = sorted(f for f in os.listdir(copy) if f.endswith(".safetensors"))[-1]
    os.remove(copy / shard)
    with pytest.raises(ModelFileNotFoundError, match=f"shards that are missing: {shard}"):
        load_model(str(copy))


def test_a_truncated_shard_is_named_before_anything_loads(sharded_dir, tmp_path):
    path, _ = sharded_dir
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    shard = copy / sorted(f for f in os.listdir(copy) if f.endswith(".safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{shard.name} is truncated: tensor '.*' ends at byte"):
        load_model(str(copy))


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:5], "not a safetensors file or is truncated"),
    (lambda b: (20).to_bytes(8, "little") + b"{not json" + b" " * 40, "header is not valid JSON"),
    (lambda b: _with_header(b, lambda h: {k: {**v, "dtype": "Q4"} for k, v in h.items()}), "dtype 'Q4'"),
    (lambda b: _with_header(b, lambda h: {k: {**v, "shape": [3, 3]} for k, v in h.items()}), "need 18"),
])
def test_damaged_safetensors_files_are_named(tmp_path, damage, message):
    good = tmp_path / "good.safetensors"
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]}}).encode()
    good.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    SafetensorsFile(str(good)).read("w")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(damage(good.read_bytes()))
    with pytest.raises(CheckpointError, match=message):
        SafetensorsFile(str(bad))


def _with_header(blob: bytes, change) -> bytes:
    n = int.from_bytes(blob[:8], "little")
    header = json.dumps(change(json.loads(blob[8:8 + n]))).encode()
    return len(header).to_bytes(8, "little") + header + blob[8 + n:]
