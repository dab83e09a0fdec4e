"""gpt-oss's released MXFP4 experts: decoded bitwise as transformers decodes them, loaded into the
same params as a float checkpoint of the same values, and a malformed tensor named at load.
(Greedy parity with transformers, chunked prefill, prefix hits and TP/EP: test_model_families.)
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_reference import save_tiny_family  # noqa: E402

from jaxserve.loading.errors import CheckpointError  # noqa: E402
from jaxserve.loading.mxfp4 import dequantize_mxfp4  # noqa: E402


def _random_mxfp4(rng, lead: tuple[int, ...], rows: int, inputs: int) -> tuple[np.ndarray, np.ndarray]:
    """Random blocks [*lead, rows, inputs/32, 16] (every nibble, signed zeros included) and
    scales spanning 2^-17 .. 2^12."""
    blocks = rng.integers(0, 256, (*lead, rows, inputs // 32, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (*lead, rows, inputs // 32), dtype=np.uint8)
    return blocks, scales


def test_mxfp4_decode_is_transformers_decode_bitwise():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4(np.random.default_rng(0), (3,), 8, 128)
    ours = dequantize_mxfp4(blocks, scales)  # [3, 8, 128]
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
        theirs = theirs.transpose(1, 2).float().numpy()  # transformers returns [X, in, out]
        want = ours if dtype == torch.float32 else torch.from_numpy(ours).bfloat16().float().numpy()
        assert np.array_equal(want.view(np.uint32), theirs.view(np.uint32)), dtype  # -0.0 too
    assert np.array_equal(ours.astype(np.float32), torch.from_numpy(ours).bfloat16().float().numpy()), \
        "an MXFP4 value is exact in bf16"


@pytest.fixture(scope="module")
def float_and_mxfp4_dirs(tmp_path_factory):
    """A tiny gpt-oss saved twice: with its experts as MXFP4 blocks and scales (the released
    format), and with those same values decoded to floats."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("gpt_oss")
    float_dir, mx_dir = root / "float", root / "mxfp4"
    save_tiny_family(float_dir, "gpt_oss")
    tensors = load_file(str(float_dir / "model.safetensors"))
    rng = np.random.default_rng(1)
    mx = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        X, inputs, rows = tensors[name].shape  # stored [X, in, out]
        blocks, scales = _random_mxfp4(rng, (X,), rows, inputs)
        scales = np.minimum(scales, 126)  # weights of at most 6 * 2^-1: sane activations
        tensors[name] = np.ascontiguousarray(np.swapaxes(dequantize_mxfp4(blocks, scales), 1, 2))
        mx[name + "_blocks"], mx[name + "_scales"] = blocks, scales
    save_file(tensors, str(float_dir / "model.safetensors"))
    mx_dir.mkdir()
    plain = {k: v for k, v in tensors.items() if k + "_blocks" not in mx}
    save_file({**plain, **mx}, str(mx_dir / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mx_dir / "config.json").write_text(json.dumps(config))
    return float_dir, mx_dir


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: np.asarray(v)})
    return out


def test_mxfp4_checkpoint_loads_the_params_of_its_float_twin(float_and_mxfp4_dirs):
    from jaxserve.loading import load_model

    float_dir, mx_dir = float_and_mxfp4_dirs
    for dtype in ("float32", "bfloat16"):
        want, got = _flat(load_model(str(float_dir), dtype).params), _flat(load_model(str(mx_dir), dtype).params)
        assert sorted(want) == sorted(got)
        for name in want:
            assert np.array_equal(want[name], got[name]), f"{dtype} {name}"
    # int8: the decoded experts quantized again per output channel, as a float checkpoint's are
    want = _flat(load_model(str(float_dir), "float32", quantization="int8").params)
    got = _flat(load_model(str(mx_dir), "float32", quantization="int8").params)
    assert got["layers.expert_down"].dtype == np.int8
    for name in want:
        assert np.array_equal(want[name], got[name]), f"int8 {name}"


@pytest.mark.parametrize("fields, shape, message", [
    (("blocks",), lambda b: (*b.shape[:-1], 8), r"blocks have shape .*expected \[\.\.\., N, K/32, 16\]"),
    (("scales",), lambda s: (*s.shape[:-1], s.shape[-1] + 1), "scales have shape"),
    (("blocks", "scales"), lambda t: (t.shape[0], t.shape[1] // 2, *t.shape[2:]),
     r"hold a \[32, 64\] weight, expected \[64, 64\]"),
])
def test_mxfp4_tensor_of_the_wrong_shape_is_named_at_load(float_and_mxfp4_dirs, tmp_path, fields, shape, message):
    from safetensors.numpy import load_file, save_file

    from jaxserve.loading import load_model

    _, mx_dir = float_and_mxfp4_dirs
    tensors = load_file(str(mx_dir / "model.safetensors"))
    for field in fields:
        name = f"model.layers.1.mlp.experts.gate_up_proj_{field}"
        tensors[name] = np.zeros(shape(tensors[name]), np.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((mx_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(str(tmp_path), "float32")
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" in str(err.value)


def test_gpt_oss_config_from_a_published_config():
    from jaxserve.models.config import ModelConfig

    raw = json.loads((pathlib.Path(__file__).parent / "data" / "gpt_oss_120b_config.json").read_text())
    cfg = ModelConfig.from_hf_config(raw)
    assert (cfg.architecture, cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok) == ("gpt_oss", 36, 128, 4)
    assert cfg.windows()[:4] == (128, 0, 128, 0) and cfg.attention_sinks and cfg.expert_bias
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.factor == 32.0 and not cfg.rope_scaling.truncate
