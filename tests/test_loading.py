"""Model loading: clear errors for broken inputs, orbax round trip, no torch at run time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxserve.loading import CheckpointError, MissingTensorError, ModelFileNotFoundError, load_model
from jaxserve.models.config import UnsupportedModelError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_missing_path(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_directory_without_model(tmp_path):
    with pytest.raises(ModelFileNotFoundError, match="neither a GGUF file"):
        load_model(str(tmp_path))


def test_unsupported_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path):
    from gguf import GGUFWriter

    path = str(tmp_path / "falcon.gguf")
    w = GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load_model(path)


def test_truncated_gguf(tmp_path, smollm_path):
    path = tmp_path / "truncated.gguf"
    with open(smollm_path, "rb") as f:
        path.write_bytes(f.read(3_000_000))
    with pytest.raises(CheckpointError, match="truncated|corrupt"):
        load_model(str(path))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(str(path))


def test_safetensors_missing_tensor(tmp_path, tiny_hf_dir):
    from safetensors.numpy import load_file, save_file

    for name in ("config.json",):
        (tmp_path / name).write_text(open(os.path.join(tiny_hf_dir, name)).read())
    tensors = load_file(os.path.join(tiny_hf_dir, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(tmp_path))


def test_convert_and_restore_orbax(tmp_path, tiny_hf_dir, capsys):
    from jaxserve.cli import main

    dst = str(tmp_path / "ckpt")
    assert main(["convert", tiny_hf_dir, dst]) == 0
    printed = capsys.readouterr().out
    assert "load+convert" in printed and "restore" in printed
    src, restored = load_model(tiny_hf_dir), load_model(dst)
    assert restored.source == "orbax" and restored.config == src.config
    np.testing.assert_array_equal(restored.params["layers"]["q_proj"], src.params["layers"]["q_proj"])
    np.testing.assert_array_equal(restored.params["embed"], src.params["embed"])
    bf16 = load_model(dst, dtype="bfloat16")
    assert str(bf16.params["embed"].dtype) == "bfloat16"


def test_convert_refuses_existing_checkpoint(tmp_path, tiny_hf_dir):
    from jaxserve.cli import main

    dst = str(tmp_path / "ckpt")
    assert main(["convert", tiny_hf_dir, dst]) == 0
    with pytest.raises(FileExistsError):
        main(["convert", tiny_hf_dir, dst])


def test_no_torch_at_run_time():
    code = (
        "import sys\n"
        "from jaxserve import LLM, SamplingParams\n"
        "llm = LLM(warmup=False, max_num_seqs=2, max_num_batched_tokens=32, num_pages=16)\n"
        "out = llm.generate('Hello', SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 2\n"
        "print('torch' in sys.modules)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "False", "torch was imported at run time"


def test_fast_gguf_header_reader_equals_ggufs_own(smollm_path):
    """The header reader every load uses gives gguf.GGUFReader's metadata and tensor views."""
    from gguf import GGUFReader

    from jaxserve.loading.gguf_reader import read_gguf

    meta, tensors = read_gguf(smollm_path)
    reader = GGUFReader(smollm_path)
    assert meta == {k: f.contents() for k, f in reader.fields.items()}
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert sorted(tensors) == sorted(t.name for t in reader.tensors)
    for t in reader.tensors:
        mine = tensors[t.name]
        assert mine.tensor_type == t.tensor_type and mine.shape == tuple(int(d) for d in t.shape)
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape
        np.testing.assert_array_equal(mine.data, t.data)
