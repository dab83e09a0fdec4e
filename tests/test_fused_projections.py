"""Fused QKV and gate+up projections: the same products as the separate weights, and each
tensor-parallel shard's columns are its own heads and halves."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.models.config import ModelConfig
from jaxserve.models.fused import fuse_projections, fused_layer_shapes, split_gate_up, split_qkv


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_fused_products_equal_the_separate_ones(shards):
    rng = np.random.default_rng(shards)
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2,
                      num_heads=8, num_kv_heads=4, head_dim=4, attention_bias=True)
    L, E, q, kv, inter = 2, 16, 32, 16, 24
    layers = {"q_proj": rng.normal(size=(L, E, q)), "k_proj": rng.normal(size=(L, E, kv)),
              "v_proj": rng.normal(size=(L, E, kv)), "q_bias": rng.normal(size=(L, q)),
              "k_bias": rng.normal(size=(L, kv)), "v_bias": rng.normal(size=(L, kv)),
              "gate_proj": rng.normal(size=(L, E, inter)), "up_proj": rng.normal(size=(L, E, inter)),
              "o_proj": rng.normal(size=(L, q, E))}
    fused = fuse_projections(layers, shards)
    assert set(fused) == {"qkv_proj", "qkv_bias", "gate_up_proj", "o_proj"}
    assert {k: v.shape for k, v in fused.items()} == fused_layer_shapes({k: v.shape for k, v in layers.items()})
    x = rng.normal(size=(5, E))
    for layer in range(L):
        qkv = x @ fused["qkv_proj"][layer] + fused["qkv_bias"][layer]
        got = split_qkv(qkv, cfg, shards)
        for g, name in zip(got, ("q", "k", "v")):
            want = x @ layers[f"{name}_proj"][layer] + layers[f"{name}_bias"][layer]
            np.testing.assert_allclose(g, want, rtol=1e-12)
        gate, up = split_gate_up(x @ fused["gate_up_proj"][layer], shards)
        np.testing.assert_allclose(gate, x @ layers["gate_proj"][layer], rtol=1e-12)
        np.testing.assert_allclose(up, x @ layers["up_proj"][layer], rtol=1e-12)
    # shard j's contiguous column block is [q_j | k_j | v_j]: the column split of TP
    w = fused["qkv_proj"].shape[-1] // shards
    for j in range(shards):
        block = fused["qkv_proj"][..., j * w:(j + 1) * w]
        parts = [layers[n][..., j * (s // shards):(j + 1) * (s // shards)]
                 for n, s in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))]
        np.testing.assert_array_equal(block, np.concatenate(parts, axis=-1))
