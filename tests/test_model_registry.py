"""The model registry: a family is added from one module without touching the engine, and an
architecture nobody registered is refused at load, naming those supported.

The toy family below lives in this test module only. Its checkpoints use their own tensor names
and its own `architectures` entry; the engine finds its config parser, model class, weight names,
KV cache and sharding rules through the registry alone, and serves it token for token as the
Llama it is built from."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from hf_reference import save_tiny_llama  # noqa: E402

from jaxserve.models import llama  # noqa: E402
from jaxserve.models.config import UnsupportedModelError, llama_config_from_hf  # noqa: E402
from jaxserve.models.llama_family import LAYER_SHARDING, hf_weight_names  # noqa: E402
from jaxserve.models.registry import (  # noqa: E402
    KVCacheSpec,
    ModelFamily,
    ModelSupport,
    WeightNames,
    family_of,
    register,
    supported_architectures,
    unregister,
)

ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,), num_pages=32, page_size=4,
              max_model_len=64, structured_outputs=False, compilation_cache_dir=None, warmup=False, dtype="float32")
PROMPTS = [[3, 17, 42, 99, 5, 8], [77, 1, 2]]


def _llama_layer_names() -> dict[str, str]:
    """HF Llama's tensor names of one layer (jaxserve name -> checkpoint name)."""
    cfg = llama_config_from_hf({"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 8,
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1})
    return dict(hf_weight_names(cfg).layers)


# The toy's own names for a layer's tensors: HF Llama's, renamed.
TOY_LAYER_NAMES = {k: v.replace("self_attn.", "attn.").replace("mlp.", "ffn.") for k, v in _llama_layer_names().items()}


class ToyForCausalLM(llama.LlamaForCausalLM):
    """The toy's model class: Llama's, counting how often the engine builds it."""

    built = 0

    def __init__(self, *args, **kwargs):
        type(self).built += 1
        super().__init__(*args, **kwargs)


def _toy_config(hf: dict) -> object:
    return dataclasses.replace(llama_config_from_hf({**hf, "architectures": ["LlamaForCausalLM"]}), architecture="toy")


TOY = ModelFamily(
    name="toy",
    architectures=("toy",),
    hf_architectures={"ToyForCausalLM": "toy"},
    config_from_hf=_toy_config,
    model_class=ToyForCausalLM,
    param_shapes=llama.expected_param_shapes,
    hf_weight_names=lambda cfg: WeightNames(hf_weight_names(cfg).globals, TOY_LAYER_NAMES),
    kv_cache=KVCacheSpec(shape=llama.kv_cache_shape, scales_shape=llama.kv_scales_pool_shape,
                         bytes_per_page=llama.kv_cache_bytes_per_page, init=llama.init_kv_cache),
    layer_sharding=LAYER_SHARDING,
    support=ModelSupport(lora=False),
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny random Llama, and the same weights as a toy checkpoint (renamed tensors)."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("registry")
    llama_dir = save_tiny_llama(root / "llama", num_kv_heads=2)
    toy_dir = root / "toy"
    toy_dir.mkdir()
    llama_names = {v: TOY_LAYER_NAMES[k] for k, v in _llama_layer_names().items()}
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    renamed = {}
    for name, t in tensors.items():
        for old, new in llama_names.items():
            if name.endswith("." + old):
                name = name[: -len(old)] + new
                break
        renamed[name] = np.ascontiguousarray(t)
    assert set(renamed) != set(tensors)  # the toy's names are its own
    save_file(renamed, str(toy_dir / "model.safetensors"))
    config = json.loads((root / "llama" / "config.json").read_text())
    (toy_dir / "config.json").write_text(json.dumps({**config, "architectures": ["ToyForCausalLM"],
                                                     "model_type": "toy"}))
    return llama_dir, str(toy_dir)


def _greedy(llm) -> list[list[int]]:
    from jaxserve import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=6, temperature=0.0))
    return [list(o.outputs[0].token_ids) for o in outs]


def test_a_family_registered_from_a_test_module_is_served(dirs):
    from jaxserve import LLM

    llama_dir, toy_dir = dirs
    with pytest.raises(UnsupportedModelError, match=r"ToyForCausalLM.*supported: \[.*LlamaForCausalLM"):
        LLM(model=toy_dir, **ENGINE)  # not registered yet

    register(TOY)
    try:
        assert "toy" in supported_architectures() and family_of("toy") is TOY
        with pytest.raises(ValueError, match="already belong"):
            register(dataclasses.replace(TOY, name="toy2"))
        ToyForCausalLM.built = 0
        toy = LLM(model=toy_dir, **ENGINE)
        assert toy.engine.model_config.architecture == "toy" and ToyForCausalLM.built >= 1
        want = _greedy(LLM(model=llama_dir, **ENGINE))
        assert _greedy(toy) == want
        with pytest.raises(UnsupportedModelError, match="toy.*does not support lora"):
            LLM(model=toy_dir, enable_lora=True, **ENGINE)
    finally:
        unregister("toy")
    assert "toy" not in supported_architectures()
