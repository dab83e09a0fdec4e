"""The compile plan, ahead-of-time warmup, the persistent cache across processes and the guard."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from logprob_checks import check_outputs_close

from jaxserve.config.engine_config import EngineConfig
from jaxserve.worker.buckets import token_buckets
from jaxserve.worker.compile_plan import (
    CompilePlan,
    derive_token_buckets,
    padding_fraction,
    read_traffic_log,
)


def test_plan_is_m_plus_n_shapes():
    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, max_logprobs=20, min_token_bucket=16,
                       midpoint_buckets_from=0)
    plan = CompilePlan.from_config(cfg, swap_enabled=True)
    assert plan.token_buckets == (16, 32, 64, 128, 256, 512)
    assert plan.request_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert len(plan.sampler_variants) == 10  # 3 modes + 2 masked ones, each with logprobs off / on
    assert len(plan.shapes()) == len(plan) == 6 * 2 + 7 * (1 + 10) + 3  # backbone and prompt logprobs per T
    assert len({s.name for s in plan.shapes()}) == len(plan)
    unmasked = CompilePlan.from_config(dataclasses.replace(cfg, structured_outputs=False), swap_enabled=True)
    assert len(unmasked.sampler_variants) == 6 and not any(f.use_bitmask for f in unmasked.sampler_variants)


def test_cpu_default_adds_small_decode_buckets_and_midpoints():
    plan = CompilePlan.from_config(EngineConfig(max_num_batched_tokens=64), swap_enabled=False)
    assert plan.token_buckets == (4, 8, 16, 24, 32, 48, 64)  # this suite runs on CPU
    with pytest.raises(ValueError, match="min_token_bucket"):
        EngineConfig(min_token_bucket=1)
    cfg = EngineConfig(max_num_seqs=64, max_num_batched_tokens=512)
    cpu = CompilePlan.from_config(cfg, platform="cpu", swap_enabled=False)
    assert cpu.token_buckets == (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)  # none past the gap
    assert cpu.request_buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    tpu = CompilePlan.from_config(cfg, platform="tpu", swap_enabled=False)
    assert tpu.token_buckets == (16, 32, 64, 128, 256, 512) and tpu.request_buckets == (1, 2, 4, 8, 16, 32, 64)
    late = CompilePlan.from_config(dataclasses.replace(cfg, midpoint_buckets_from=64), platform="tpu",
                                   swap_enabled=False)
    assert late.token_buckets == (16, 32, 64, 96, 128, 192, 256, 512) and late.request_buckets[-2:] == (32, 64)
    with pytest.raises(ValueError, match="midpoint_buckets_from"):
        EngineConfig(midpoint_buckets_from=-1)


def test_token_buckets_powers_then_linear_and_exact_budget():
    assert token_buckets(1000, 16, 256) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert token_buckets(48, 16, 256) == [16, 32, 48]
    assert token_buckets(100, 16, 256, extra=[24, 5000]) == [16, 24, 32, 64, 100]


def test_explicit_and_invalid_buckets(tmp_path):
    cfg = EngineConfig(max_num_batched_tokens=256, token_buckets=(8, 100))
    assert CompilePlan.from_config(cfg, swap_enabled=False).token_buckets == (8, 100, 256)
    with pytest.raises(ValueError, match="token_buckets"):
        CompilePlan.from_config(EngineConfig(max_num_batched_tokens=64, token_buckets=(128,)), swap_enabled=False)
    log = tmp_path / "bad.log"
    log.write_text("12\nthirteen\n")
    with pytest.raises(ValueError, match="bad.log:2"):
        read_traffic_log(str(log))


def _synthetic_traffic(seed=0):
    rng = np.random.default_rng(seed)
    decodes = rng.integers(1, 40, 4000)  # decode-heavy steps
    mixed = rng.integers(280, 512, 600)  # steps with a prefill chunk
    return np.concatenate([decodes, mixed, np.full(300, 512)])


def test_traffic_derived_buckets_pad_less_than_default(tmp_path):
    counts = _synthetic_traffic()
    log = tmp_path / "traffic.log"
    log.write_text("# step token counts\n" + "\n".join(map(str, counts)) + "\n")
    default = token_buckets(512)
    cfg = EngineConfig(max_num_batched_tokens=512, traffic_log=str(log), max_token_buckets=len(default))
    derived = CompilePlan.from_config(cfg, swap_enabled=False).token_buckets
    assert len(derived) <= len(default) and derived[-1] == 512
    pad_default, pad_derived = padding_fraction(counts, default), padding_fraction(counts, derived)
    print(f"padding: default buckets {pad_default:.1%}, traffic-derived {pad_derived:.1%}")
    assert pad_derived < pad_default


def test_derived_buckets_are_optimal_on_small_case():
    counts = [3, 3, 5, 9, 9, 9, 14, 20, 20, 31, 32]
    best = derive_token_buckets(counts, 32, 3)
    values = sorted(set(counts) - {32})
    brute = min(padding_fraction(counts, [*c, 32]) for c in itertools.combinations(values, 2))
    assert padding_fraction(counts, best) == pytest.approx(brute)


_CHILD = textwrap.dedent("""
    import json, logging, random, sys, time
    import jax
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine
    from scheduler import SamplingParams
    logging.basicConfig(level=logging.INFO)
    cache, page, budget, workload = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
    engine = Engine(EngineConfig(max_num_seqs=4, max_num_batched_tokens=budget, num_pages=64, page_size=page,
                                 max_model_len=256, compilation_cache_dir=cache, strict_compile_guard=True,
                                 structured_outputs=False))
    events = {"/jax/core/compile/jaxpr_trace_duration": "traces",
              "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings"}
    counts = dict.fromkeys(events.values(), 0)
    jax.monitoring.register_event_duration_secs_listener(
        lambda e, d, **kw: counts.__setitem__(events[e], counts[events[e]] + 1) if e in events else None)
    rep = engine.warmup()
    during_warmup = dict(counts)
    done = aborted = 0
    if workload:
        rng = random.Random(3)
        for i in range(50):
            ids = [rng.randrange(49152) for _ in range(rng.choice([1, 5, 30, 70, 120]))]
            p = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]),
                               top_p=rng.choice([1.0, 0.9]), logprobs=rng.choice([None, 2]), seed=i)
            engine.add_prompt(None, p, prompt_token_ids=ids, request_id=str(i))
            if i % 5 == 4:
                done += sum(o.finished for o in engine.step())
            if i % 13 == 12:
                aborted += engine.abort(str(i - 1))
        while engine.has_unfinished_requests():
            done += sum(o.finished for o in engine.step())
    print(json.dumps({"shapes": rep.num_shapes, "hits": rep.num_hits, "misses": rep.num_misses,
                      "loaded": sum(r.cache == "loaded" for r in rep.records), **during_warmup,
                      "seconds": rep.wall_seconds, "compiles_after_warmup": engine.compiles_after_warmup,
                      "finished": done, "aborted": aborted}))
""")


def _run_child(cache, page=16, budget=32, workload=False):
    res = subprocess.run([sys.executable, "-c", _CHILD, str(cache), str(page), str(budget), "1" if workload else "0"],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return {**json.loads(res.stdout.strip().splitlines()[-1]), "log": res.stderr}


def test_restarts_reuse_executables_and_fall_back_to_the_persistent_cache(tmp_path):
    """A restart with the same settings loads the saved executables and traces nothing; a
    damaged entry falls back to the persistent cache (every shape a hit)."""
    cache = tmp_path / "xla"
    cold = _run_child(cache)
    assert cold["misses"] == cold["shapes"] and cold["hits"] == 0 and cold["traces"] >= cold["shapes"]
    assert "executables saved for the next start" in cold["log"]
    warm = _run_child(cache, workload=True)
    print(f"startup compile: cold {cold['seconds']:.1f} s, warm {warm['seconds']:.1f} s "
          f"({warm['seconds'] / cold['seconds']:.0%}) for {cold['shapes']} shapes")
    assert warm["loaded"] == warm["shapes"] == cold["shapes"] and warm["hits"] == warm["misses"] == 0
    assert warm["traces"] == 0 and warm["lowerings"] == 0
    assert warm["compiles_after_warmup"] == 0 and warm["finished"] + warm["aborted"] == 50

    [entry] = (cache / next(p.name for p in cache.iterdir()) / "executables").iterdir()
    victim = next((entry / "executables").iterdir())
    victim.write_bytes(victim.read_bytes()[:100])  # a truncated file
    damaged = _run_child(cache, workload=True)
    assert "are not usable" in damaged["log"] and victim.name in damaged["log"]
    assert damaged["hits"] == damaged["shapes"] and damaged["misses"] == 0 and damaged["loaded"] == 0
    assert damaged["finished"] + damaged["aborted"] == 50 and "engine step failed" not in damaged["log"]
    # Executables loaded from the persistent cache lack their machine code when serialized
    # again, so nothing is saved (an entry of them failed every step of those shapes at the
    # next start) and the next start loads from the persistent cache as this one did.
    assert "executables not saved" in damaged["log"] and "came from the persistent compilation cache" in damaged["log"]
    assert not entry.exists() and not any((entry.parent).iterdir())


def test_a_start_with_other_settings_names_what_differs_from_the_saved_executables(tmp_path, caplog):
    """No entry for this identity: `load` returns None (the engine compiles) and the log names
    the difference from the entry saved last."""
    import dataclasses

    from jaxserve.compilation.executable_store import ExecutableStore, Identity

    saved = Identity.of("cpu", 1, "cpu", {"max_num_batched_tokens": 32, "shapes": ["backbone[T=32]"]},
                        {"attention": ["native", "why"]})
    entry = tmp_path / "executables" / saved.digest()
    entry.mkdir(parents=True)
    manifest = {**dataclasses.asdict(saved), "shapes": [{"name": "backbone[T=32]", "file": "x.xla"}]}
    (entry / "manifest.json").write_text(json.dumps(manifest))
    here = Identity.of("cpu", 1, "cpu", {"max_num_batched_tokens": 48, "shapes": ["backbone[T=48]"]},
                       {"attention": ["native", "why"]})
    with caplog.at_level("INFO"):
        assert ExecutableStore(str(tmp_path), here).load(runner=None, keys=[]) is None
    assert "the last saved entry differs: max_num_batched_tokens 32 (compiled) vs 48 (here)" in caplog.text
    assert "1 planned shapes have no executable (first: backbone[T=48])" in caplog.text


def test_executables_saved_by_other_source_code_are_not_loaded(tmp_path, monkeypatch):
    """The store's identity carries a digest of the sources that build the programs: equal
    settings under changed code give another entry, so a start never runs an old program."""
    from jaxserve.compilation import executable_store

    settings = ("cpu", 1, "cpu", {"shapes": ["backbone[T=8]"]}, {})
    before = executable_store.Identity.of(*settings)
    assert before.program["source"] == executable_store.source_digest()
    assert executable_store.Identity.of(*settings).digest() == before.digest()
    monkeypatch.setattr(executable_store, "source_digest", lambda: "other code")
    after = executable_store.Identity.of(*settings)
    assert after.digest() != before.digest()
    assert any("source" in d for d in after.differences(dataclasses.asdict(before)))


def test_a_full_disk_while_saving_executables_is_logged_and_leaves_nothing(tmp_path, caplog, monkeypatch):
    import errno
    import types

    from jaxserve.compilation import executable_store
    from jaxserve.worker.compile_plan import ShapeKey

    def no_space(directory, key, exe):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(executable_store, "_serialize", no_space)
    identity = executable_store.Identity.of("cpu", 1, "cpu", {"shapes": ["backbone[T=8]"]}, {})
    store = executable_store.ExecutableStore(str(tmp_path), identity)
    key = ShapeKey("backbone", 8)
    with caplog.at_level("WARNING"):
        assert store.save(types.SimpleNamespace(executables={key: object()}), [key]) is False
    assert "could not save the executables" in caplog.text and "No space left on device" in caplog.text
    assert os.listdir(tmp_path / "executables") == []  # no half-written entry, no temporary


def test_strict_guard_names_an_unplanned_shape(smollm):
    from jaxserve.engine.llm_engine import Engine
    from jaxserve.worker.compile_cache import UnplannedCompilationError
    from jaxserve.worker.compile_plan import ShapeKey
    from scheduler import SamplingParams

    engine = Engine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=24, num_pages=32, max_model_len=128,
                                 strict_compile_guard=True, compilation_cache_dir=None), loaded=smollm)
    engine.warmup()
    # Another engine in the process builds and warms up: its compiles are not this one's.
    other = Engine(EngineConfig(max_num_seqs=1, max_num_batched_tokens=8, num_pages=8, max_model_len=64,
                                max_logprobs=0, structured_outputs=False, compilation_cache_dir=None),
                   loaded=smollm)
    other.warmup()
    other.close()
    engine.add_prompt(None, SamplingParams(max_tokens=2), prompt_token_ids=[1, 2, 3], request_id="a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.compiles_after_warmup == 0
    del engine.runner.executables[ShapeKey("backbone", 24)]  # pretend the plan missed it
    engine.add_prompt(None, SamplingParams(max_tokens=2), prompt_token_ids=list(range(1, 21)))
    with pytest.raises(UnplannedCompilationError, match=r"backbone\[T=24\]"):
        engine.step()


def test_the_persistent_cache_is_keyed_by_the_host_cpu(monkeypatch):
    """XLA:CPU executables target the host CPU and JAX's cache key does not say which: another
    CPU (a shared home directory) gets its own subdirectory."""
    import pallas_kernels._native_cpu as native
    from jaxserve.worker.compile_cache import host_cpu_key

    here = host_cpu_key()
    monkeypatch.setattr(native, "cpu_features", lambda: "flags : sse2 avx2")
    other = host_cpu_key()
    monkeypatch.setattr(native, "cpu_features", lambda: "flags : sse2 avx2 avx512f")
    assert len({here, other, host_cpu_key()}) == 3 and here.startswith("host-")


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}])
def test_tiers_hold_every_shape_once_in_serving_order(spec):
    plan = CompilePlan.from_config(EngineConfig(max_num_seqs=64, max_num_batched_tokens=512, speculative_config=spec),
                                   swap_enabled=True, platform="cpu")
    tiers = plan.tiers()
    names = [k.name for t in tiers for k in t.shapes]
    assert sorted(names) == sorted(k.name for k in plan.shapes()) and len(set(names)) == len(names) == len(plan)
    if spec is not None:  # an MTP pass per token bucket, a chained one for each bucket 64 sequences reach
        kinds = [k for k in plan.shapes() if k.kind.startswith("mtp")]
        assert {k.size for k in kinds if k.kind == "mtp"} == set(plan.token_buckets)
        assert {k.size for k in kinds if k.kind == "mtp_chain"} == {t for t in plan.token_buckets if t <= 64}
        assert {k.size for k in kinds if k.kind == "mtp_draft"} == set(plan.request_buckets)
    assert [t.max_tokens for t in tiers] == list(plan.token_buckets)
    assert [t.max_seqs for t in tiers] == [min(t, 64) for t in plan.token_buckets]  # one row per token at most
    for i, tier in enumerate(tiers):
        sizes = {k.kind: k.size for k in tier.shapes}
        assert sizes["backbone"] == tier.max_tokens
        seen = {k.size for t in tiers[:i + 1] for k in t.shapes if k.kind == "head"}
        assert seen == {r for r in plan.request_buckets if r <= tier.max_seqs}
    assert any(k.kind == "swap" for k in tiers[0].shapes)


def test_serving_while_compiling_steps_within_the_compiled_shapes(smollm):
    """With `serve_while_compiling` the engine serves after the first tier, every step runs a
    shape already compiled (steps are limited to it), the tokens are those of the fully
    compiled engine, and the limits rise when the background compile ends."""
    import threading

    from jaxserve.engine.llm_engine import Engine
    from scheduler import SamplingParams

    class Recording(dict):
        misses: list = []

        def get(self, key, default=None):
            if key not in self:
                self.misses.append(key.name)
            return super().get(key, default)

    engine = Engine(EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 16), num_pages=32,
                                 max_model_len=128, max_logprobs=3, structured_outputs=False,
                                 compilation_cache_dir=None, serve_while_compiling=True), loaded=smollm)
    engine.runner.executables = Recording()
    release = threading.Event()
    compile_now = engine._compile

    def held(keys, progress):  # the background tiers wait until the test lets them go
        if threading.current_thread().name.startswith("jaxserve-background"):
            release.wait(300)
        return compile_now(keys, progress)

    engine._compile = held
    engine.warmup()
    assert engine.compiling_in_background and (engine.scheduler.step_tokens, engine.scheduler.step_seqs) == (8, 4)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 28, 216, 34, 28, 216, 35, 28], [1, 2, 3]]

    def run(tag):
        for i, p in enumerate(prompts):
            engine.add_prompt(prompt_token_ids=p, params=SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
                              request_id=f"{tag}{i}")
        done = {}
        while engine.has_unfinished_requests():
            done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
        return [done[f"{tag}{i}"] for i in range(len(prompts))]

    early = run("early")
    assert engine.compiling_in_background and engine.runner.executables.misses == []
    release.set()
    engine._background.thread.join(300)
    assert not engine.compiling_in_background and len(engine.runner.executables) == len(engine.plan.shapes())
    late = run("late")
    assert engine.scheduler.step_tokens == 32 and engine.runner.executables.misses == []
    # other step limits chunk the prompts otherwise: equal tokens up to a near-tie
    check_outputs_close(early, late)
    assert all(len(c.token_ids) == 6 for c in early)
    assert engine.compiles_after_warmup == 0 and engine.warmup_report.num_shapes == len(engine.plan.shapes())
