"""KV layer groups (`models/kv_groups.py`): how windowed layers beside full ones split the cache,
and what that does to a page's size. The scheduler's side (release, prefix hits, swap, drafts)
is `test_scheduler_properties.py`'s; greedy parity with groups on is `test_model_families.py`'s
(gpt-oss, Gemma 2, Gemma 3)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from jaxserve.models import registry
from jaxserve.models.kv_groups import plan_layer_groups
from jaxserve.models.llama import kv_cache_bytes_per_page, kv_cache_shape

DATA = pathlib.Path(__file__).parent / "data"


def _config(name: str):
    return registry.config_from_hf(json.loads((DATA / f"{name}_config.json").read_text()))


def test_gpt_oss_alternating_windows_make_two_groups_of_half_the_layers():
    cfg = _config("gpt_oss_20b")
    groups = cfg.kv_layer_groups
    assert (groups.group_size, groups.kinds) == (12, (("full", 0), ("window", 128)))
    windows = cfg.windows()
    for layer, (g, slot) in enumerate(zip(groups.layer_group, groups.layer_slot)):
        assert groups.kinds[g] == (("window", 128) if windows[layer] else ("full", 0))
        assert slot == layer // 2  # the kinds alternate: each kind's layers fill its group in order
    # a page holds one group's 12 layers: half a plain page, for the same tokens per page
    plain = dataclasses.replace(cfg, bounded_window_kv=False)
    assert plain.kv_layer_groups is None
    assert kv_cache_shape(cfg, 10, 16)[0] == 12 and kv_cache_shape(plain, 10, 16)[0] == 24
    for dtype in (np.float32, np.int8):
        assert 2 * kv_cache_bytes_per_page(cfg, 16, dtype) == kv_cache_bytes_per_page(plain, 16, dtype)


def test_gemma3_five_to_one_pattern_groups_by_its_full_layers():
    cfg = _config("gemma3_27b")
    groups = cfg.kv_layer_groups
    full = [i for i, w in enumerate(cfg.windows()) if not w]
    assert groups.group_size == len(full) == 10
    assert groups.kinds == (("full", 0),) + (("window", 1024),) * 6  # 52 windowed layers in 6 groups
    assert [groups.layer_slot[i] for i in full] == list(range(10)) and {groups.layer_group[i] for i in full} == {0}
    slots = {(groups.layer_group[i], groups.layer_slot[i]) for i in range(cfg.num_layers)}
    assert len(slots) == cfg.num_layers  # no two layers share a slot of one group's pages


@pytest.mark.parametrize("kinds, want", [
    ((("window", 4),) * 3, (3, (("window", 4),))),  # every layer windowed: one bounded group
    ((("full", 0),) * 4, None),  # nothing bounded: one plain cache
    ((("chunk", 8),) * 3 + (("full", 0),), (1, (("full", 0),) + (("chunk", 8),) * 3)),  # Llama 4's 3:1
])
def test_layer_groups_of_other_patterns(kinds, want):
    groups = plan_layer_groups(kinds)
    assert (groups and (groups.group_size, groups.kinds)) == want


def test_llama4_chunked_layers_group_beside_its_global_ones():
    cfg = _config("llama4_scout")  # 36 chunked layers (8192 tokens) and 12 global NoPE ones
    groups = cfg.kv_layer_groups
    assert (groups.group_size, groups.kinds) == (12, (("full", 0),) + (("chunk", 8192),) * 3)
    assert cfg.num_cache_layers == 12


def test_gemma4_keeps_one_pool_per_attention_kind():
    # Gemma 4's two attention kinds have their own head widths: a pool each on shared page
    # ids, not layer groups (yet), so its windows bound nothing.
    cfg = _config("gemma4_31b")
    assert cfg.kv_layer_groups is None and cfg.num_cache_layers == cfg.num_stacked_layers


def test_grouped_step_arrays_reach_a_follower_whole(monkeypatch):
    """A step of a cache in two layer groups: each token gets a slot in each group's pages (from
    the group's part of its table row), and the multi-host broadcast carries all of them."""
    from jaxserve.worker import distributed
    from jaxserve.worker.batch import BatchBuilder, SequenceSpan
    from jaxserve.worker.compile_plan import sampler_variants
    from jaxserve.worker.input_batch import STOP_ID_WIDTH
    from jaxserve.worker.sampler import SamplingTensors

    S, W, T, R = 4, 3, 16, 4
    row = np.array([5, 6, 7, 0, 9, 2], np.int32)  # group 0: pages 5 6 7; group 1: its first block released
    arrays = BatchBuilder(T, R, 2 * W, S, num_kv_groups=2).build(
        [SequenceSpan(np.arange(1, 4, dtype=np.int32), 6, row)], T, R)  # positions 6, 7, 8
    assert arrays.slot_mapping.shape == (2 * T,)
    assert arrays.slot_mapping[:3].tolist() == [6 * S + 2, 6 * S + 3, 7 * S + 0]
    assert arrays.slot_mapping[T:T + 3].tolist() == [9 * S + 2, 9 * S + 3, 2 * S + 0]
    assert (arrays.slot_mapping[3:T] < S).all() and (arrays.slot_mapping[T + 3:] < S).all()  # padding: null page

    sent: list[np.ndarray] = []
    monkeypatch.setattr(distributed, "_broadcast", lambda x: sent.append(x.copy()) or x)
    variants = sampler_variants(0)
    ch = distributed.StepChannel(T, R, 2 * W, STOP_ID_WIDTH, 32, variants, num_kv_groups=2)
    flags = next(f for f in variants if f.all_greedy and not f.use_bitmask and not f.use_penalties)
    ch.send_step(arrays, SamplingTensors.neutral(R, STOP_ID_WIDTH, 32, vocab_size=100), R, flags)
    replay = iter(sent[1:])
    monkeypatch.setattr(distributed, "_broadcast", lambda x: next(replay))
    got, _, _, _ = ch.recv_step(sent[0], {R: SamplingTensors.neutral(R, STOP_ID_WIDTH, 32, vocab_size=100)})
    for name in ("token_ids", "positions", "slot_mapping", "cu_q_lens", "kv_lens", "block_tables"):
        np.testing.assert_array_equal(getattr(got, name), getattr(arrays, name), err_msg=name)
