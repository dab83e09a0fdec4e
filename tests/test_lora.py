"""Multi-LoRA serving against transformers + peft: base and adapter requests mixed in one batch
give peft's greedy tokens, with adapters loaded, evicted and unloaded and nothing compiled after
warmup; the prefix cache never crosses adapters; bad adapters are refused by name and change
nothing; tensor parallelism on virtual CPU devices gives the same tokens."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.lora import LoRARequest
from scheduler import SamplingParams

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[5, 9, 17, 3, 8, 1], list(range(40, 61)), [7, 7, 7]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
TINY = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_pages=96, page_size=4, max_model_len=64,
            structured_outputs=False, compilation_cache_dir=None, warmup_threads=1, max_logprobs=0)


def make_adapter(base: str, path, r: int, targets, seed: int, **lora_kw) -> str:
    """A random PEFT adapter of `base` (B random too, scaled so its delta moves greedy picks)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                    init_lora_weights=False, **lora_kw))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    pm.save_pretrained(path)
    return str(path)


def peft_greedy(base: str, adapter: str | None, prompts) -> list[list[int]]:
    import transformers
    from hf_reference import hf_greedy

    model = transformers.LlamaForCausalLM.from_pretrained(base)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    return [hf_greedy(model, p, GREEDY.max_tokens)[0] for p in prompts]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama, three adapters (all targets r=8; q/v r=4 rank-stabilised; MLP only r=2)
    and peft's greedy tokens for each (and the base)."""
    from hf_reference import save_tiny_llama

    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(root / "base", 2)
    adapters = {"A": make_adapter(base, root / "A", 8, ALL, 1),
                "B": make_adapter(base, root / "B", 4, ["q_proj", "v_proj"], 2, use_rslora=True),
                "C": make_adapter(base, root / "C", 2, ["gate_proj", "up_proj", "down_proj"], 3)}
    refs = {name: peft_greedy(base, path, PROMPTS) for name, path in [("base", None), *adapters.items()]}
    assert len({json.dumps(v) for v in refs.values()}) == 4  # every adapter changes the tokens
    return base, adapters, refs


def _run(engine, jobs):
    """jobs: [(key, prompt, LoRARequest | None)] all queued at once -> {key: tokens}."""
    ids = {engine.add_prompt(None, GREEDY, prompt_token_ids=p, lora_request=lr): key for key, p, lr in jobs}
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = list(out.outputs[0].token_ids)
    return done


def _requests(adapters):
    return {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}


def test_mixed_batch_matches_peft_with_eviction_and_nothing_compiled(tiny):
    from jaxserve.engine.llm_engine import Engine

    base, adapters, refs = tiny
    loras = _requests(adapters)
    # Two slots for three adapters: the scheduler passes over the third until a slot frees,
    # and the slots evict least recently used adapters.
    engine = Engine(EngineConfig(model=base, enable_lora=True, max_loras=2, max_lora_rank=8,
                                 strict_compile_guard=True, **TINY))
    engine.warmup()
    jobs = [((name, i), p, loras.get(name)) for name in ("base", "A", "B", "C") for i, p in enumerate(PROMPTS)]
    got = _run(engine, jobs)
    assert got == {(name, i): refs[name][i] for name in refs for i in range(len(PROMPTS))}
    assert engine.runner.lora.num_loads >= 3  # C waited for a slot and took one
    # Again in another order (the slots now hold other adapters): same tokens.
    got = _run(engine, [((name, i), p, loras.get(name)) for name in ("C", "B", "A") for i, p in enumerate(PROMPTS)])
    assert got == {(name, i): refs[name][i] for name in ("A", "B", "C") for i in range(len(PROMPTS))}
    assert engine.runner.guard.compiles_after_warmup == 0
    assert engine.scheduler.stats().num_used_blocks == 0
    assert engine.lora_stats["A"] == [6, 6 * GREEDY.max_tokens]
    # Unloaded, then loaded again from the same directory under a new id: same tokens.
    engine.unload_lora("A")
    assert [lr.lora_name for lr in engine.list_loras()] == ["B", "C"]
    again = LoRARequest("A", 9, adapters["A"])
    assert _run(engine, [(i, p, again) for i, p in enumerate(PROMPTS)]) == dict(enumerate(refs["A"]))
    assert engine.runner.guard.compiles_after_warmup == 0


def test_prefix_cache_never_crosses_adapters(tiny):
    from jaxserve.engine.llm_engine import Engine

    base, adapters, refs = tiny
    loras = _requests(adapters)
    engine = Engine(EngineConfig(model=base, enable_lora=True, max_loras=2, max_lora_rank=8, **TINY))
    prompt = PROMPTS[1]  # 21 tokens: 5 full pages

    def one(lr):
        rid = engine.add_prompt(None, GREEDY, prompt_token_ids=prompt, lora_request=lr)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    result = out
        return list(result.outputs[0].token_ids), result.usage.cached_tokens

    assert one(loras["A"]) == (refs["A"][1], 0)
    assert one(loras["B"]) == (refs["B"][1], 0)  # A's pages are not B's
    assert one(None) == (refs["base"][1], 0)  # nor the base model's
    toks, cached = one(loras["A"])
    assert toks == refs["A"][1] and cached >= 16  # A's own pages are reused


def test_bad_adapters_are_refused_by_name_and_change_nothing(tiny, tmp_path):
    from jaxserve.engine.llm_engine import Engine

    base, adapters, refs = tiny
    engine = Engine(EngineConfig(model=base, enable_lora=True, max_loras=1, max_lora_rank=4, **TINY))
    cases = {
        "big": (make_adapter(base, tmp_path / "big", 8, ["q_proj"], 4), "rank 8 is larger than max_lora_rank 4"),
        "head": (make_adapter(base, tmp_path / "head", 2, ["q_proj", "lm_head"], 5), "'lm_head' is not supported"),
        "gone": (str(tmp_path / "nowhere"), "no adapter_config.json"),
    }
    truncated = tmp_path / "cut"
    make_adapter(base, truncated, 2, ["q_proj"], 6)
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["cut"] = (str(truncated), "truncated")
    for i, (name, (path, why)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=why) as e:
            engine.add_prompt(None, GREEDY, prompt_token_ids=[1, 2], lora_request=LoRARequest(name, 10 + i, path))
        assert repr(name) in str(e.value)
    assert engine.list_loras() == [] and not engine.has_unfinished_requests()
    ok = LoRARequest("B", 1, adapters["B"])
    engine.load_lora(ok)
    with pytest.raises(ValueError, match="'B' is already loaded"):
        engine.load_lora(LoRARequest("B", 2, adapters["B"]))
    with pytest.raises(ValueError, match="lora_int_id 1 is already adapter 'B'"):
        engine.add_prompt(None, GREEDY, prompt_token_ids=[1, 2], lora_request=LoRARequest("other", 1, adapters["C"]))
    rid = engine.add_prompt(None, GREEDY, prompt_token_ids=PROMPTS[0], lora_request=ok)
    with pytest.raises(ValueError, match="'B' is in use by 1 request"):
        engine.unload_lora("B")
    with pytest.raises(KeyError, match="'nope' is not loaded"):
        engine.unload_lora("nope")
    out = {}
    while engine.has_unfinished_requests():
        out.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert out[rid] == refs["B"][0]
    engine.unload_lora("B")
    assert engine.list_loras() == [] and engine.scheduler.stats().num_used_blocks == 0
    plain = Engine(EngineConfig(model=base, **TINY))
    with pytest.raises(ValueError, match="enable_lora=False"):
        plain.add_prompt(None, GREEDY, prompt_token_ids=[1, 2], lora_request=ok)


_TP_CHILD = textwrap.dedent(r"""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine
    from jaxserve.lora import LoRARequest
    from scheduler import SamplingParams

    base, a, b, prompts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    # f32, as peft's reference tokens (the CPU default, bf16, meets a near-tie at base/0's
    # first token: f32 logits 2.455 vs 2.449)
    e = Engine(EngineConfig(model=base, dtype="float32", tensor_parallel_size=4, enable_lora=True, max_loras=2,
                            max_lora_rank=8, max_num_seqs=8, max_num_batched_tokens=64, num_pages=64, max_model_len=64,
                            max_logprobs=0, compilation_cache_dir=None, structured_outputs=False))
    loras = {"base": None, "A": LoRARequest("A", 1, a), "B": LoRARequest("B", 2, b)}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = {e.add_prompt(None, params, prompt_token_ids=p, lora_request=lr): f"{name}/{i}"
           for name, lr in loras.items() for i, p in enumerate(prompts)}
    done = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                done[ids[o.request_id]] = list(o.outputs[0].token_ids)
    # the collectives of the step with and without the adapters
    import dataclasses, re
    from jaxserve.worker.compile_plan import ShapeKey
    programs = e.runner.programs()
    collectives = []
    for p in (programs, dataclasses.replace(programs, lora=None)):
        hlo = p.lower(ShapeKey("backbone", 16), 8).as_text()
        collectives.append(len(re.findall(r" (?:all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\(",
                                          hlo)))
    done["collectives"] = collectives
    print(json.dumps(done))
""")


def test_tensor_parallel_adapters_match_peft(tiny):
    """TP=4 over 2 KV heads (replicated twice, and the adapters' k/v columns with them): B
    split with the output columns of q/k/v/gate/up, A with the input rows of o/down; the
    o/down partial products join the layer's own all-reduce (no extra collective)."""
    base, adapters, refs = tiny
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).parents[1]),
                                                          os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", _TP_CHILD, base, adapters["A"], adapters["B"], json.dumps(PROMPTS)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    done = json.loads(res.stdout.strip().splitlines()[-1])
    with_lora, without = done.pop("collectives")
    assert with_lora == without > 0
    assert done == {f"{name}/{i}": refs[name][i] for name in ("base", "A", "B") for i in range(len(PROMPTS))}


def test_scheduler_runs_at_most_max_loras_adapters_and_passes_over_the_rest():
    from scheduler import FinishReason, Request, Scheduler, SchedulerConfig

    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=8,
                                  max_num_batched_tokens=64, max_loras=1))
    for rid, lora in (("a1", 1), ("b1", 2), ("base", 0), ("a2", 1)):
        s.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), lora_id=lora))
    out = s.schedule()
    assert [sr.request_id for sr in out.scheduled] == ["a1", "base", "a2"]  # b1 waits for the slot
    assert [r.request_id for r in s.waiting] == ["b1"]  # and keeps its place
    s.finish_requests(["a1", "a2"], FinishReason.ABORT)
    out = s.schedule()
    assert "b1" in [sr.request_id for sr in out.scheduled]
    assert np.all([nr.lora_id == 2 for nr in out.new_requests])


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_lora_step_compiles_for_tpu_and_gpu_and_the_plan_counts_the_slots():
    """Llama-3.1-8B with max_loras=8, max_lora_rank=16 on compile-only devices: the backbone
    compiles, the plan adds the slots (bf16, every target, all layers) to the params, and
    the delta adds no per-token copy of adapter weights to the temporaries."""
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.loading import load_model_config

    cfg = load_model_config(str(pathlib.Path(__file__).parent / "data" / "llama3_8b_config.json"))
    E, Q, KV, I, L = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.num_layers  # noqa: E741
    slots = 2 * L * 8 * 16 * ((E + Q) * 2 + (E + KV) * 2 + (E + I) * 3)  # bf16 A and B of 7 targets

    def plan(target, lora, **kw):
        config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 64), max_model_len=8192,
                              dtype="bfloat16", enable_lora=lora, max_loras=8, max_lora_rank=16,
                              compilation_cache_dir=None, **kw)
        return compile_for_target(cfg, config, Target.parse(target), shapes=["backbone[T=64]"])

    tpu = plan("tpu:v5e-1", True, quantization="int8")
    assert tpu.all_compiled and tpu.fits, tpu.verdict()
    assert tpu.lora_bytes == slots and tpu.fingerprint["lora"] == [8, 16]
    table = tpu.table()
    assert "(LoRA slots 0.625 GiB) + KV cache 1.000 GiB (512 pages" in table and "{" not in table
    gpu, plain = plan("gpu:h200", True), plan("gpu:h200", False)
    assert gpu.all_compiled and gpu.fits, gpu.verdict()
    assert gpu.params_bytes - plain.params_bytes == slots == gpu.lora_bytes
    # [64 tokens, 4096, 8 x 16] of one target's A gathered per token would be 64 MiB
    assert gpu.temp_bytes - plain.temp_bytes < 8 * 2**20


def test_an_adapter_waiting_for_a_slot_is_not_starved():
    """One slot, adapter 1 busy with a new request every step: after LORA_STARVATION_STEPS
    passes, adapter 1 stops admitting, its running requests drain, and adapter 2 runs."""
    from scheduler import Request, Scheduler, SchedulerConfig
    from scheduler.scheduler import LORA_STARVATION_STEPS

    s = Scheduler(SchedulerConfig(block_size=4, num_blocks=256, max_model_len=64, max_num_seqs=8,
                                  max_num_batched_tokens=64, max_loras=1))
    s.add_request(Request("a0", [1, 2, 3], SamplingParams(max_tokens=4), lora_id=1))
    s.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=4), lora_id=2))
    for step in range(3 * LORA_STARVATION_STEPS):
        s.add_request(Request(f"a{step + 1}", [1, 2, 3], SamplingParams(max_tokens=4), lora_id=1))
        s.add_request(Request(f"base{step}", [4, 5], SamplingParams(max_tokens=1)))
        out = s.schedule()
        if "b" in [sr.request_id for sr in out.scheduled]:
            break
        s.update_from_output(out, {sr.request_id: [7] for sr in out.scheduled if sr.samples})
    else:
        raise AssertionError("adapter 2 never got the slot")
    assert LORA_STARVATION_STEPS < step < LORA_STARVATION_STEPS + 8  # a's running requests drained
    assert {s.get_request(sr.request_id).lora_id for sr in out.scheduled} <= {0, 2}
