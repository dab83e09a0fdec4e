"""A multi-host process reads only the slices of an HF checkpoint that its devices hold
(`jaxserve.loading.part`); what it places on them equals what a whole load places.

The two-process engine test (test_multihost.py) runs the same path end to end."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.loading.hf_loader import _SafetensorsIndex, hf_config, load_hf_params
from jaxserve.loading.safetensors_file import SafetensorsFile
from jaxserve.models.fused import fuse_projections
from jaxserve.worker.parallel import (
    MODEL_AXIS,
    expand_kv_heads,
    param_specs,
    process_load_part,
    tp_model_config,
)

TP = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama with fewer KV heads (2) than ranks (4), so KV heads are replicated, and
    untied embeddings, saved as bf16 safetensors."""
    import torch
    import transformers

    path = tmp_path_factory.mktemp("part")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, torch_dtype="bfloat16",
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return str(path)


def _serving(params, cfg):
    """The params as a TP runner places them (KV heads expanded, projections interleaved)."""
    tcfg = tp_model_config(cfg, TP)
    params = expand_kv_heads(params, cfg, tcfg.num_kv_heads)
    return {**params, "layers": fuse_projections(params["layers"], TP, TP)}, tcfg


def _rank_slices(params, cfg, ranks):
    """(name, rank, that rank's slice) of every serving tensor, as its sharding splits it."""
    specs = param_specs(params, cfg, TP)
    flat = {**{k: v for k, v in params.items() if k != "layers"}, **params["layers"]}
    flat_specs = {**{k: v for k, v in specs.items() if k != "layers"}, **specs["layers"]}
    for name, x in flat.items():
        axes = tuple(flat_specs[name])
        for r in ranks:
            index = [slice(None)] * x.ndim
            if MODEL_AXIS in axes:
                a = axes.index(MODEL_AXIS)
                w = x.shape[a] // TP
                index[a] = slice(r * w, (r + 1) * w)
            yield name, r, x[tuple(index)]


@pytest.mark.parametrize("ranks", [[1, 2], [3], [0, 1, 2, 3]])
def test_a_process_reads_its_slices_and_places_what_a_whole_load_places(checkpoint, ranks):
    cfg = hf_config(checkpoint)
    whole_index = _SafetensorsIndex(checkpoint)
    whole = load_hf_params(checkpoint, cfg, np.float32, index=whole_index)
    part = process_load_part(cfg, TP, ranks)
    assert (part is None) == (len(ranks) == TP)
    index = _SafetensorsIndex(checkpoint)
    loaded = load_hf_params(checkpoint, cfg, np.float32, index=index, part=part)
    served_whole, tcfg = _serving(whole, cfg)
    served_part, _ = _serving(loaded, cfg)
    expected = {(n, r): x for n, r, x in _rank_slices(served_whole, tcfg, ranks)}
    for name, r, x in _rank_slices(served_part, tcfg, ranks):
        np.testing.assert_array_equal(x, expected[name, r], err_msg=f"{name} of rank {r}")
    total = whole_index.nbytes
    assert whole_index.bytes_read == total
    # Norms are read whole; every projection and the vocabulary in proportion to the ranks
    # (a rank's replicated KV head is one of the 2: half of k/v for one rank).
    if len(ranks) < TP:
        assert index.bytes_read < total * (len(ranks) / TP + 0.2), (index.bytes_read, total)


def test_column_and_row_ranges_read_the_right_bytes(tmp_path):
    from safetensors.numpy import save_file

    a = np.arange(6 * 10, dtype=np.float32).reshape(6, 10)
    save_file({"a": a}, str(tmp_path / "x.safetensors"))
    f = SafetensorsFile(str(tmp_path / "x.safetensors"))
    np.testing.assert_array_equal(f.read_columns("a", 3, 7, np.empty(24, np.float32)), a[:, 3:7])
    np.testing.assert_array_equal(f.read_rows("a", 2, 5, np.empty(30, np.float32)), a[2:5])
    assert f.bytes_read == (24 + 30) * 4
    with pytest.raises(ValueError, match="outside"):
        f.read_rows("a", 4, 7, np.empty(30, np.float32))
