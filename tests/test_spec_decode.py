"""Speculative decoding (n-gram): the config, the proposer, and outputs equal to the plain
engine's, token for token, on a tiny random model and on the embedded one.

The scheduler side (room for drafts, rollback, no leaks, no hash over a rejected draft) is
property-tested in test_scheduler_properties.py with a fake runner.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.config.engine_config import EngineConfig
from jaxserve.spec_decode import SpeculativeConfig
from jaxserve.spec_decode.ngram import NgramProposer
from scheduler import DraftCandidate, SamplingParams

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def test_the_config_names_what_is_wrong():
    assert SpeculativeConfig.parse(NGRAM) == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1)
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config == SpeculativeConfig()
    assert SpeculativeConfig().batch_size_limit("cpu") == 16 and SpeculativeConfig().batch_size_limit("tpu") is None
    assert SpeculativeConfig(disable_by_batch_size=None).batch_size_limit("cpu") is None
    for bad, why in (({"method": "eagle"}, "unknown method 'eagle'"), ({"k": 3}, r"unknown keys \['k'\]"),
                     ({"num_speculative_tokens": 0}, "num_speculative_tokens must be"),
                     ({"prompt_lookup_min": 5}, "prompt_lookup_min .5. is larger"), ("{", "not a JSON object"),
                     ("[1]", "must be a JSON object"), ({"disable_by_batch_size": True}, "disable_by_batch_size")):
        with pytest.raises(ValueError, match=why):
            EngineConfig(speculative_config=bad)


def _propose(p: NgramProposer, ids: list[int], max_drafts: int = 9, rid: str = "a") -> list[int]:
    return p.propose([DraftCandidate(rid, ids, max_drafts)]).get(rid, [])


def test_ngram_takes_the_longest_most_recent_suffix():
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    #          suffix [7, 8] occurs twice; the most recent occurrence is followed by 5, 6, 1
    ids = [7, 8, 9, 9, 7, 8, 5, 6, 1, 2, 7, 8]
    assert _propose(p, ids) == [5, 6, 1]
    assert _propose(p, ids, max_drafts=2) == [5, 6]
    ids += [5]  # the history grows in place: [8, 5] recurs, followed by 6, 1, 2
    assert _propose(p, ids) == [6, 1, 2]
    assert _propose(p, [1, 2, 3, 4], rid="b") == []  # nothing recurs
    long = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=3)
    assert _propose(long, [1, 2, 9, 4, 2, 9]) == []  # [2, 9] recurs, but 3 tokens are asked for
    # a match at the very end is followed by the suffix itself: [4, 4] -> 4
    assert _propose(p, [1, 4, 4, 4], rid="c") == [4]


def test_ngram_ignores_byte_matches_that_straddle_two_tokens():
    p = NgramProposer(num_speculative_tokens=2, prompt_lookup_min=1, prompt_lookup_max=1)
    # 0x01000000 then 0x00000002: their bytes (little-endian 00 00 00 01 02 00 00 00) hold
    # 0x00000201 = 513 straddling them; 513 itself never occurred before the suffix.
    assert _propose(p, [0x01000000, 0x00000002, 7, 513]) == []
    assert _propose(p, [513, 9, 0x01000000, 0x00000002, 7, 513], rid="b") == [9, 0x01000000]


def test_ngram_stays_fast_at_64_sequences():
    """Not a timing assertion (the bench script prints figures): each call's work is a few
    substring searches, so 64 long histories must not need per-token Python loops."""
    rng = np.random.default_rng(0)
    p = NgramProposer(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)
    cands = [DraftCandidate(f"r{i}", rng.integers(0, 50, 2000).tolist(), 4) for i in range(64)]
    out = p.propose(cands)
    assert out and all(1 <= len(d) <= 4 for d in out.values())
    p.propose(cands[:3])
    assert len(p._histories) == 3  # the others were dropped


# ---------------------------------------------------------------------- engine, tiny model
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_reference import save_tiny_llama

    from jaxserve.loading import load_model

    return load_model(save_tiny_llama(tmp_path_factory.mktemp("tiny_spec"), 2), "float32")


TINY = dict(max_num_seqs=8, max_num_batched_tokens=32, num_pages=24, page_size=4, max_model_len=96,
            max_logprobs=2, structured_outputs=False, compilation_cache_dir=None, warmup_threads=1)


def _run(engine, requests) -> dict[str, list]:
    ids = [engine.add_prompt(None, params, prompt_token_ids=prompt) for prompt, params in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.finish_reason, [(t, round(e[t].logprob, 3))
                                                                        for t, e in zip(c.token_ids, c.logprobs or ())])
                                        for c in out.outputs]
    assert engine.scheduler.stats().num_used_blocks == 0, "KV blocks leaked"
    return [done[i] for i in ids]


def test_outputs_equal_the_plain_engine_across_features(tiny):
    """Greedy and seeded sampling, penalties, logprobs, min_tokens, stop ids, n > 1, chunked
    prefill (prompts past the 32-token budget), prefix hits (a repeated prompt) and
    preemption (24 pages of 4 tokens for 8 sequences): the same tokens and logprobs, with
    drafts kept along the way and nothing compiled after warmup."""
    from jaxserve.engine.llm_engine import Engine

    rng = np.random.default_rng(1)
    loop = [5, 9, 17, 5, 9, 17, 5, 9]  # a repetitive prompt: the tiny model tends to loop on
    prompts = [loop * 2, rng.integers(0, 128, 40).tolist(), loop + [3, 4], rng.integers(0, 128, 6).tolist()]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.9, top_k=20, seed=7, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.2, frequency_penalty=0.3,
                             min_tokens=6, stop_token_ids=[17], logit_bias={5: 2.0}, ignore_eos=True),
              SamplingParams(n=2, max_tokens=16, temperature=1.0, seed=11, ignore_eos=True)]
    requests = [(p, sp) for p, sp in zip(prompts, params)] + [(prompts[0], params[0]), (prompts[1], params[1])]
    plain = _run(Engine(EngineConfig(**TINY), loaded=tiny), requests)
    spec_engine = Engine(EngineConfig(**TINY, speculative_config=NGRAM, strict_compile_guard=True), loaded=tiny)
    spec_engine.warmup()
    spec = _run(spec_engine, requests)
    assert spec == plain
    counts = spec_engine.spec_decode
    assert counts.num_accepted_tokens > 0 and counts.num_draft_tokens > counts.num_accepted_tokens
    assert counts.accepted_per_position[0] >= counts.accepted_per_position[-1]
    assert spec_engine.scheduler.stats().num_preemptions > 0  # the pool was tight enough
    assert spec_engine.runner.guard.compiles_after_warmup == 0


def _sample_many(engine, prompt: list[int], seeds: range, wave: int = 16) -> list[tuple[int, ...]]:
    """Outputs of one seeded request per seed, sent a wave at a time so the step keeps rows
    free for drafts (a step samples at most max_num_seqs rows, drafts included)."""
    out: list[tuple[int, ...]] = []
    bias = {5: 4.0, 9: 4.0, 17: 4.0}  # top-3 is almost always {5, 9, 17}: few outcomes, many drafts
    for start in range(seeds.start, seeds.stop, wave):
        params = [SamplingParams(max_tokens=4, temperature=1.0, top_k=3, logit_bias=bias, seed=s, ignore_eos=True)
                  for s in range(start, min(start + wave, seeds.stop))]
        out += [tuple(r[0][0]) for r in _run(engine, [(prompt, sp) for sp in params])]
    return out


def _chi_square_p(a: list[tuple[int, ...]], b: list[tuple[int, ...]]) -> float:
    """Two-sample chi-square test of the outcomes' frequencies (outcomes seen fewer than 10
    times in all are pooled into one cell)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    common = [k for k in set(ca) | set(cb) if ca[k] + cb[k] >= 10]
    table = [[c[k] for k in common] + [sum(v for k, v in c.items() if k not in common)] for c in (ca, cb)]
    table = np.array([col for col in zip(*table) if sum(col)]).T
    return float(chi2_contingency(table)[1])


def test_sampling_with_drafts_keeps_the_targets_distribution(tiny, monkeypatch):
    """400 seeded samples with n-gram drafts against 400 plain ones on other seeds (so the
    two are independent draws, not the same stream): the frequencies of the three tokens
    after the first (the positions drafts can fill) pass a chi-square test, while a broken
    acceptance rule that keeps every draft fails it by far."""
    import jaxserve.worker.runner as runner_module
    from jaxserve.engine.llm_engine import Engine

    cfg = dict(TINY, max_num_seqs=64, max_num_batched_tokens=256, num_pages=256)
    prompt = [5, 9, 17] * 8  # drafts continue the cycle; the target keeps about one in eight
    spec = dict(json.loads(NGRAM), disable_by_batch_size=None)
    plain = _sample_many(Engine(EngineConfig(**cfg), loaded=tiny), prompt, range(0, 400))
    engine = Engine(EngineConfig(**cfg, speculative_config=spec), loaded=tiny)
    drafted = _sample_many(engine, prompt, range(400, 800))
    assert engine.spec_decode.num_accepted_tokens >= 50, engine.spec_decode
    tail = [x[1:] for x in plain]
    assert _chi_square_p(tail, [x[1:] for x in drafted]) > 1e-3
    monkeypatch.setattr(runner_module, "num_drafts_kept", lambda drafts, targets: len(drafts))
    broken = _sample_many(engine, prompt, range(400, 800))
    assert _chi_square_p(tail, [x[1:] for x in broken]) < 1e-6


# ---------------------------------------------------------------------- engine, embedded model
# Run in a child process: late in a full-suite run (many engines, torch, servers before it),
# loading this engine's executables from the persistent cache crashed the test process twice
# inside JAX's deserialize_executable (SIGSEGV, then SIGABRT), with one or two warmup threads;
# the same tests alone pass. A fresh process keeps the suite's state out of it.
_EMBEDDED_CHILD = r"""
import json, sys
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine
from jaxserve.loading import load_model
from scheduler import SamplingParams

spec = sys.argv[1]
loaded = load_model(None, "float32")
small = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=64, max_model_len=256)
text = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
copy = f"Repeat this code exactly.\n{text}\nHere it is again:\n"
batch = [
    (copy, SamplingParams(max_tokens=40, temperature=0)),
    (copy, SamplingParams(max_tokens=40, temperature=0, stop=["sub"])),
    ("List the numbers from one to twenty: one, two, three,",
     SamplingParams(max_tokens=30, temperature=0.7, seed=5, logprobs=3, stop=[" fifteen"])),
    (f"{text}\nThe phone number is", SamplingParams(max_tokens=12, temperature=0,
                                                   structured_outputs={"regex": r" \d{3}-\d{4}"})),
]
alone = [("Say hello six times:", SamplingParams(max_tokens=30, temperature=0,
                                                structured_outputs={"regex": "( hello){6}"}))]

def collect(e, requests):
    ids = [e.add_prompt(p, sp) for p, sp in requests]
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = [c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                        [round(e[t].logprob, 3) for t, e in zip(c.token_ids, c.logprobs or ())]]
    assert e.scheduler.stats().num_used_blocks == 0
    return [done[i] for i in ids]

result = {}
for name, cfg in (("plain", None), ("spec", spec)):
    e = Engine(EngineConfig(**small, speculative_config=cfg), loaded=loaded)
    result[name] = collect(e, batch)
    accepted = e.spec_decode.num_accepted_tokens
    result[name + "_alone"] = collect(e, alone)
    result[name + "_accepted"] = [accepted, e.spec_decode.num_accepted_tokens - accepted]
print(json.dumps(result))
"""


def test_embedded_model_copy_stop_strings_and_logprobs():
    """The real model and tokenizer: text, token ids, logprobs and finish reasons equal the
    plain engine's (a structured-output request among them), a stop string inside a run of
    kept drafts ends the output where it would have token by token, copying a prompt keeps
    drafts, and a structured-output request alone gets drafts from its repeats, checked
    against the grammar (cut where it says no: after the sixth word only the end is allowed)."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _EMBEDDED_CHILD, NGRAM], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["spec"] == out["plain"]
    copy, stopped = out["plain"][0], out["plain"][1]
    assert stopped[2] == "stop" and stopped[3] == "sub" and len(stopped[1]) < len(copy[1])
    assert out["spec_alone"] == out["plain_alone"] and out["plain_alone"][0][0] == " hello" * 6
    batch_kept, alone_kept = out["spec_accepted"]
    assert batch_kept >= 10 and alone_kept > 0, out["spec_accepted"]


def test_the_flag_reaches_the_engine_config():
    import argparse

    from jaxserve.config.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config_from_args(p.parse_args(["--speculative-config", json.dumps({"method": "ngram"})]))
    assert cfg.speculative_config == SpeculativeConfig()


def test_metrics_and_log_line_use_the_counters():
    from prometheus_client import CollectorRegistry, generate_latest

    from jaxserve.worker.runner_output import SpecDecodeCounts
    from scheduler import SchedulerStats
    from server.engine_loop import EngineSnapshot
    from server.metrics import _SnapshotCollector
    from server.status_log import spec_line

    stats = SchedulerStats(0, 0, 0, 0, 0, 1, 1, 0, 0, {"recompute": 0, "swap": 0}, 0, 0, {})
    counts = SpecDecodeCounts.zero(3)
    counts.add(3, 2)
    counts.add(2, 0)
    snap = EngineSnapshot(0.0, stats, 0, 5, 0, 0, 0, 0, 0.0, 0.0, spec_decode=counts)
    reg = CollectorRegistry()
    reg.register(_SnapshotCollector(lambda: snap))
    text = generate_latest(reg).decode()
    for line in ("jaxserve:spec_decode_num_drafts_total 2.0", "jaxserve:spec_decode_num_draft_tokens_total 5.0",
                 "jaxserve:spec_decode_num_accepted_tokens_total 2.0",
                 'jaxserve:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0'):
        assert line in text, text
    assert spec_line(counts, SpecDecodeCounts.zero()) == (
        "acceptance 40.0% (2 of 5 drafts), mean accepted length 2.00 over 2 drafted steps")


def test_a_draft_model_gives_the_plain_engines_outputs(tiny, tmp_path):
    """The target as its own draft: a greedy request keeps every draft (the draft cache's
    catch-up, chunked past the budget, and its rollback must be right for that), a sampled
    one rejects some; outputs equal the plain engine's, the draft's pages are all freed when
    the engine is idle, nothing compiles after warmup."""
    from jaxserve.engine.llm_engine import Engine

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, n).tolist() for n in (5, 40, 12)]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True),
              SamplingParams(n=2, max_tokens=12, temperature=0, ignore_eos=True)]
    requests = list(zip(prompts, params))
    plain = _run(Engine(EngineConfig(**TINY), loaded=tiny), requests)
    from hf_reference import save_tiny_llama

    spec = {"model": save_tiny_llama(tmp_path, 2), "num_speculative_tokens": 3}  # the `tiny` weights
    engine = Engine(EngineConfig(**TINY, speculative_config=json.dumps(spec), strict_compile_guard=True), loaded=tiny)
    engine.warmup()
    assert _run(engine, requests) == plain
    from jaxserve.worker.runner_output import SpecDecodeCounts

    counts = engine.spec_decode
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens  # the sampled request rejected some
    engine.spec_decode = SpecDecodeCounts.zero()
    _run(engine, [(prompts[1], params[0])])
    assert 0 < engine.spec_decode.num_accepted_tokens == engine.spec_decode.num_draft_tokens, engine.spec_decode
    assert engine.proposer.num_used_pages == 0  # freed once no sequence decodes
    assert engine.runner.guard.compiles_after_warmup == 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny, tmp_path):
    pytest.importorskip("torch")
    import transformers

    from jaxserve.engine.llm_engine import Engine

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 96 tokens, the target 128"):
        Engine(EngineConfig(**TINY, speculative_config={"model": str(tmp_path)}), loaded=tiny)


def test_a_failing_proposer_turns_speculation_off_and_requests_go_on(tiny):
    from jaxserve.engine.llm_engine import Engine

    engine = Engine(EngineConfig(**TINY, speculative_config=NGRAM), loaded=tiny)
    want = _run(Engine(EngineConfig(**TINY), loaded=tiny), [([5, 9, 5, 9, 5], SamplingParams(max_tokens=8, temperature=0))])

    def broken(candidates):
        raise RuntimeError("proposer exploded")

    engine.proposer.propose = broken
    assert _run(engine, [([5, 9, 5, 9, 5], SamplingParams(max_tokens=8, temperature=0))]) == want
    assert engine.proposer is None


def test_compile_plans_the_same_shapes_for_ngram_and_adds_a_draft_models(tmp_path):
    """n-gram: the plan is the plain one. A draft model: its greedy programs are compiled for
    the target too, and its params and pages are in the same HBM table."""
    pytest.importorskip("torch")
    from hf_reference import save_tiny_llama

    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.loading import load_model_config
    from jaxserve.worker.compile_plan import CompilePlan

    assert (CompilePlan.from_config(EngineConfig(**TINY, speculative_config=NGRAM), swap_enabled=False)
            == CompilePlan.from_config(EngineConfig(**TINY), swap_enabled=False))
    path = save_tiny_llama(tmp_path / "m", 2)
    cfg = dict(TINY, max_num_seqs=2, max_num_batched_tokens=8, dtype="float32")
    target = load_model_config(path)
    plain = compile_for_target(target, EngineConfig(**cfg), Target.parse("cpu"))
    both = compile_for_target(target, EngineConfig(**cfg, speculative_config={"model": path}), Target.parse("cpu"))
    draft = [s for s in both.shapes if s.name.startswith("draft ")]
    assert all(s.compiled for s in both.shapes) and {s.kind for s in draft} == {"backbone", "logits", "head"}
    assert [s.name for s in draft if s.kind == "head"] == [f"draft head[R={r},greedy]" for r in (1, 2)]
    assert both.params_bytes == 2 * plain.params_bytes and both.kv_cache_bytes == 2 * plain.kv_cache_bytes
    with pytest.raises(ValueError, match="not serialized yet"):
        compile_for_target(target, EngineConfig(**cfg, speculative_config={"model": path}), Target.parse("cpu"),
                           out_dir=str(tmp_path / "out"))
