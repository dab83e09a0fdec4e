"""Qwen3-Next and Qwen3.5 (hybrid Gated DeltaNet): greedy parity with transformers through the
engine (chunked prefill, prefix hits restoring the linear layers' states, batches of different
lengths, preemption by recompute and by swap), the state slots and snapshots in the scheduler,
and what is refused by name. (The delta rule and conv against transformers' torch paths:
test_gated_delta.)"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from hf_reference import hf_greedy  # noqa: E402
from logprob_checks import check_greedy_close, top_from_array, top_k_of  # noqa: E402

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

SHARED = [(7 * i + 3) % 128 for i in range(26)]
PROMPTS = [SHARED + [5, 9, 11], SHARED + [60, 2], [17, 4, 99], list(range(40, 75))]
MAX_NEW = 12
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), page_size=4, max_model_len=128,
              max_logprobs=5, structured_outputs=False, compilation_cache_dir=None, dtype="float32")
TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, max_position_embeddings=512)
FAMILIES = {"qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=96)),
            "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {})}


def _save(path, family: str):
    cfg_cls, model_cls, extra = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**TINY, **extra)
    cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    model = getattr(transformers, model_cls)(cfg).eval().float()
    with torch.no_grad():  # sharp logits: greedy picks are not near-ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.mul_(4.0)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    out = {}
    for family in FAMILIES:
        hf = _save(root / family, family)
        refs = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
        out[family] = (str(root / family), refs)
    return out


def _check(outs, refs, name: str) -> None:
    for prompt, out, (want, want_logp) in zip(PROMPTS, outs, refs):
        got, label = out.outputs[0].token_ids, f"{name}: prompt of {len(prompt)} tokens"
        at = check_greedy_close(want, top_from_array(want_logp), got, top_k_of(out.outputs[0].logprobs), name=label,
                                top_k=5)
        same = len(got) if at is None else at + 1
        got_logp = [entry[t].logprob for t, entry in zip(got[:same], out.outputs[0].logprobs)]
        np.testing.assert_allclose(got_logp, want_logp[np.arange(same), got[:same]], atol=2e-3, err_msg=label)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers_with_chunks_prefix_hits_and_mixed_lengths(checkpoints, family):
    from jaxserve import LLM, SamplingParams

    path, refs = checkpoints[family]
    llm = LLM(model=path, num_pages=96, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params)  # 29 tokens: chunks of 16 then 12 + 1
    rest = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params)  # 28, 3 and 35 tokens together
    # The second prompt resumes from the state snapshot at the first's chunk boundary (16 tokens).
    assert rest[0].usage.cached_tokens == 16, "no state snapshot restored for the shared prefix"
    _check(first + rest, refs, family)
    sched = llm.engine.scheduler
    assert sched.stats().num_used_blocks == 0 and sched.kv.host_states.num_free_blocks == 0
    assert len(sched.kv.snapshots) <= sched.config.num_state_snapshots
    assert llm.engine.compiles_after_warmup == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_restores_or_rebuilds_the_states(checkpoints, mode):
    """Four sequences of ~40 tokens in 24 pages of 4: the newest are preempted and come back
    (swap: their pages and state slots from the host; recompute: states rebuilt from zero)."""
    from jaxserve import LLM, SamplingParams

    path, refs = checkpoints["qwen3_next"]
    extra = {"num_host_pages": 64} if mode == "swap" else {}
    llm = LLM(model=path, num_pages=24, preemption_mode=mode, enable_prefix_caching=False, **extra, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    stats = llm.engine.scheduler.stats()
    assert stats.preemptions[mode] > 0, stats.preemptions
    _check(outs, refs, f"qwen3_next, {mode} preemption")
    assert stats.num_used_blocks == 0 and llm.engine.scheduler.kv.host_states.num_free_blocks == \
        llm.engine.scheduler.kv.host_states.num_blocks
    assert llm.engine.compiles_after_warmup == 0


def test_scheduler_state_slots_and_snapshots_never_collide():
    """Random arrivals, lengths and aborts through a hybrid scheduler: running requests hold
    distinct state slots in 1..max_num_seqs, restores read live snapshots, a snapshot is
    taken only at a block boundary its request computed, and nothing is left held at the end."""
    from scheduler import Scheduler, SchedulerConfig
    from scheduler.request import Request, SamplingParams

    cfg = SchedulerConfig(block_size=4, num_blocks=40, max_model_len=96, max_num_seqs=3, max_num_batched_tokens=16,
                          num_host_blocks=32, preemption_mode="swap", recurrent_state=True, num_state_snapshots=2)
    s = Scheduler(cfg)
    rng = np.random.default_rng(0)
    shared = list(rng.integers(0, 100, 20))
    n = 0
    for _ in range(400):
        if n < 40 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + list(rng.integers(0, 100, int(rng.integers(1, 30))))
            s.add_request(Request(f"r{n}", prompt, SamplingParams(max_tokens=int(rng.integers(1, 12)))))
            n += 1
        so = s.schedule()
        slots = [sr.state_slot for sr in so.scheduled]
        assert len(set(slots)) == len(slots) and all(1 <= x <= cfg.max_num_seqs for x in slots)
        first_snapshot = cfg.max_num_seqs + 1
        for src, dst in so.state_restores:
            assert first_snapshot <= src < first_snapshot + 2 and dst in slots
        for src, dst in so.state_saves:
            assert 1 <= src <= cfg.max_num_seqs and first_snapshot <= dst < first_snapshot + 2
        if rng.random() < 0.05 and s.running:
            s.abort_requests([s.running[-1].request_id])
        s.update_from_output(so, {sr.request_id: [int(rng.integers(0, 100))] for sr in so.scheduled if sr.samples})
        if not s.has_unfinished_requests() and n >= 40:
            break
    assert not s.has_unfinished_requests()
    assert s.stats().num_used_blocks == 0 and s.kv.host_states.num_free_blocks == cfg.max_num_seqs


def test_what_hybrid_models_do_not_serve_is_refused_by_name(checkpoints):
    from jaxserve import LLM
    from jaxserve.models.config import ModelConfig, UnsupportedModelError

    path, _ = checkpoints["qwen3_next"]
    with pytest.raises(UnsupportedModelError, match="does not support spec_decode"):
        LLM(model=path, num_pages=32, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **ENGINE)
    hf = transformers.Qwen3NextConfig(**TINY, layer_types=["linear_attention", "full_attention"] * 2).to_dict()
    hf["architectures"] = ["Qwen3NextForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="must repeat 3 linear_attention layers"):
        ModelConfig.from_hf_config(hf)


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_hybrid_step_compiles_for_tpu(tmp_path):
    """Qwen3-Next's real layer shapes (16 key / 32 value heads of 128 in the linear layers,
    16 query / 2 KV heads of 256 in the full ones; 4 layers, 32 experts to stay small) compiled
    for one v6e in bf16: the chunked delta rule as its Mosaic kernel beside the Mosaic attention
    kernel; the conv, the recurrent step and the state pools through XLA:TPU."""
    import json

    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.loading import load_model_config

    hf = transformers.Qwen3NextConfig(num_hidden_layers=4, num_experts=32).to_dict()
    hf["architectures"] = ["Qwen3NextForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    mc = load_model_config(str(tmp_path))
    settings = dict(max_num_seqs=8, max_num_batched_tokens=128, token_buckets=(128,), num_pages=256,
                    max_model_len=2048, dtype="bfloat16")
    report = compile_for_target(mc, EngineConfig(**settings), Target.parse("tpu:v6e-1"),
                                shapes=["backbone[T=128]", "states[8]"])
    for shape in report.shapes:
        assert shape.compiled, shape.error
    assert report.shapes[0].attention == "pallas"
    assert report.shapes[0].delta_rule == "pallas"
    assert report.fits, report.verdict()
