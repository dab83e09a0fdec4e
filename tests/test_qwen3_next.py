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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_int8_weights_compute_the_model_of_their_dequantized_values(checkpoints, family):
    """The wide projections of both layer kinds are int8 (Qwen3.5's q/k/v projection with its
    scales regrouped per key head like its columns): the int8 engine gives the tokens and the
    logprobs (to f32 rounding) of the float engine on the dequantized weights."""
    import dataclasses

    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine
    from jaxserve.loading import load_model
    from jaxserve.models.quantization import dequantize_weight, quantize_params
    from scheduler import SamplingParams

    loaded = load_model(checkpoints[family][0], "float32")
    quant = quantize_params(loaded.params, "int8")
    fused = "lin_qkvz_scale" if family == "qwen3_next" else "lin_qkv_scale"
    assert {"attn_q_scale", "attn_o_scale", "lin_out_scale", fused} <= set(quant["layers"])
    deq = dict(quant)
    deq["layers"] = {k: v for k, v in quant["layers"].items() if not k.endswith("_scale")}
    for name in [k for k in deq["layers"] if k + "_scale" in quant["layers"]]:
        deq["layers"][name] = dequantize_weight(quant["layers"][name], quant["layers"][name + "_scale"])

    def run(params, **settings):
        e = Engine(EngineConfig(num_pages=64, **{**ENGINE, "max_logprobs": 0}, **settings),
                   loaded=dataclasses.replace(loaded, params=params))
        for i, ids in enumerate(PROMPTS[2:]):
            e.add_prompt(None, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0),
                         prompt_token_ids=ids, request_id=str(i))
        outs = {}
        while e.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0] for o in e.step() if o.finished})
        e.close()
        return [(list(c.token_ids), [x[t].logprob for t, x in zip(c.token_ids, c.logprobs)])
                for c in (outs[k] for k in sorted(outs))]

    got, want = run(quant, quantized_matmul_precision="highest"), run(deq)
    for (gt, glp), (wt, wlp) in zip(got, want):
        assert gt == wt
        np.testing.assert_allclose(glp, wlp, atol=2e-4)


_TP_CHILD = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, TESTS_DIR)
from jaxserve.loading import load_model
from tp_greedy import greedy

result = {}
prompts = [[5, 9, 13, 2, 7], list(range(3, 40)), [1]]
for arg in sys.argv[1:]:
    path, layouts = arg.split("=")
    loaded = load_model(path, "float32")
    for layout in ["tp1", *layouts.split(",")]:
        result[f"{path}-{layout}"] = greedy(loaded, int(layout[2:]), prompts, token_buckets=(16,), page_size=4,
                                            enable_expert_parallel=layout.startswith("ep"))
print(json.dumps(result))
""".replace("TESTS_DIR", repr(str(pathlib.Path(__file__).parent)))


def test_tensor_and_expert_parallel_give_one_devices_tokens(checkpoints):
    """Two virtual CPU devices: Qwen3-Next at TP=2 (each device its key heads' conv channels,
    delta rule and state slots, its query heads, the 2 KV heads split) and Qwen3.5-MoE with
    whole experts per device (EP=2) give TP=1's greedy tokens (vLLM's near-tie rule), with
    nothing compiled after warmup."""
    import json
    import subprocess

    from logprob_checks import check_runs_close

    layouts = {"qwen3_next": "tp2", "qwen3_5_moe": "ep2"}
    args = [f"{checkpoints[f][0]}={layouts[f]}" for f in layouts]
    res = subprocess.run([sys.executable, "-c", _TP_CHILD, *args], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    for family, layout in layouts.items():
        path = checkpoints[family][0]
        check_runs_close(result[f"{path}-tp1"], result[f"{path}-{layout}"], name=f"{family} {layout}")
    assert all(compiles == 0 for *_, compiles in result.values())


# (config, target, quantization, fits, params GiB per device); experts split whole (EP).
PLANS = [
    ("qwen3_next_80b_a3b_config.json", "tpu:v6e-4", "int8", True, (18.6, 19.1)),
    ("qwen3_next_80b_a3b_config.json", "tpu:v6e-8", None, True, (18.4, 18.9)),
    ("qwen3_5_397b_a17b_config.json", "tpu:v6e-16", "int8", True, (23.2, 23.8)),
    ("qwen3_5_397b_a17b_config.json", "tpu:v6e-8", "int8", False, (46.4, 47.0)),
]


@pytest.mark.usefixtures("no_persistent_cache_writes")
@pytest.mark.parametrize("config,target,quantization,fits,params_gib", PLANS,
                         ids=[f"{c.split('_config')[0]}-{t}-{q or 'bf16'}" for c, t, q, *_ in PLANS])
def test_published_hybrids_plan_on_tpu(config, target, quantization, fits, params_gib):
    """The published configs (tests/data; abstract weights), bf16 activations, 16 sequences:
    Qwen3-Next-80B-A3B fits one v6e-4 in int8 and a v6e-8 in bf16; Qwen3.5-397B-A17B needs a
    v6e-16 (four hosts) in int8, as a v6e-8 holds 47 GiB of its params per chip. Where it fits,
    the step compiles with the Mosaic attention and delta-rule kernels, and the state slots
    (one per sequence and as many snapshots, split by head) are counted beside the pages."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_config import EngineConfig, state_bytes_per_slot
    from jaxserve.loading import load_model_config

    data = pathlib.Path(__file__).parent / "data"
    mc = load_model_config(str(data / config))
    settings = dict(max_num_seqs=16, max_num_batched_tokens=64, token_buckets=(16,), num_pages=512,
                    max_model_len=4096, dtype="bfloat16", quantization=quantization, enable_expert_parallel=True)
    report = compile_for_target(mc, EngineConfig(**settings), Target.parse(target), shapes=["backbone[T=16]"])
    assert params_gib[0] < report.params_bytes / 2**30 < params_gib[1]
    assert report.fits == fits, report.verdict()
    if not fits:
        return
    backbone = report.shapes[0]
    assert backbone.attention == "pallas" and backbone.delta_rule == "pallas" and backbone.cache_copies == 0
    per_slot = state_bytes_per_slot(mc, Target.parse(target).num_devices)
    assert report.state_bytes == 2 * 16 * per_slot + per_slot  # running, snapshots, the null slot
    assert report.max_num_pages > settings["num_pages"]
