"""`jaxserve compile --target cpu --out DIR` and `--compiled DIR`: the host-CPU round trip.

Executables compiled over abstract params are serialized, loaded by a fresh process and
served: nothing compiles there and the greedy tokens equal an engine that compiled its own.
A directory built for other settings or software is refused, naming the difference.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from jaxserve.compilation.aot import CompiledMismatchError
from jaxserve.compilation.targets import Target
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine

SETTINGS = dict(max_num_seqs=2, max_num_batched_tokens=16, token_buckets=(16,), num_pages=32, max_model_len=128,
                max_logprobs=1)
FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "16", "--token-buckets", "16", "--num-pages", "32",
         "--max-model-len", "128", "--max-logprobs", "1"]
PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 28, 216, 34, 28, 216, 35, 28]]

SERVE_FROM_DIR = """
import json, sys
from jaxserve.worker.compile_cache import EVENTS
from jaxserve.engine.llm_engine import Engine
from jaxserve.config.engine_config import EngineConfig
from scheduler import SamplingParams
engine = Engine(EngineConfig(compiled_dir=sys.argv[1], compilation_cache_dir=None, **json.loads(sys.argv[2])))
before = EVENTS.compiles
report = engine.warmup()
during = EVENTS.compiles - before
for i, p in enumerate(json.loads(sys.argv[3])):
    engine.add_prompt(prompt_token_ids=p, params=SamplingParams(max_tokens=8, temperature=0.0), request_id=str(i))
tokens = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            tokens[out.request_id] = out.outputs[0].token_ids
print(json.dumps({"loaded": sum(r.cache == "loaded" for r in report.records), "shapes": report.num_shapes,
                  "compiles_during_load": during, "compiles_after": engine.compiles_after_warmup,
                  "tokens": [tokens[str(i)] for i in range(len(tokens))]}))
"""


@pytest.fixture(scope="module")
def compiled_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    run = subprocess.run([sys.executable, "-m", "jaxserve.cli", "compile", "--target", "cpu", "--out", str(out),
                          "--quiet", *FLAGS], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "compiled for cpu" in run.stdout
    return out


def greedy_tokens(engine: Engine) -> list[list[int]]:
    from scheduler import SamplingParams

    for i, p in enumerate(PROMPTS):
        engine.add_prompt(prompt_token_ids=p, params=SamplingParams(max_tokens=8, temperature=0.0),
                           request_id=f"ref{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"ref{i}"] for i in range(len(PROMPTS))]


def test_manifest_describes_every_planned_shape(compiled_dir):
    m = json.loads((compiled_dir / "manifest.json").read_text())
    assert m["target"] == "cpu" and m["num_devices"] == 1 and m["fits"] is True
    assert m["max_num_pages"] is None  # host memory: no HBM bound
    names = [s["name"] for s in m["shapes"]]
    assert names == m["program"]["shapes"] and "backbone[T=16]" in names and "head[R=2,greedy]" in names
    for s in m["shapes"]:
        assert s["compiled"] and s["hbm_bytes"] > 0 and (compiled_dir / s["file"]).stat().st_size > 0
    backbone = next(s for s in m["shapes"] if s["kind"] == "backbone")
    assert backbone["attention"] == "reference"  # no Pallas kernel on the CPU


def test_a_fresh_process_serves_the_executables_without_compiling(compiled_dir, smollm):
    run = subprocess.run([sys.executable, "-c", SERVE_FROM_DIR, str(compiled_dir), json.dumps(SETTINGS),
                          json.dumps(PROMPTS)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["loaded"] == got["shapes"] > 0
    assert got["compiles_during_load"] == 0 and got["compiles_after"] == 0
    assert [len(t) for t in got["tokens"]] == [8, 8]
    reference = Engine(EngineConfig(compilation_cache_dir=None, **SETTINGS), loaded=smollm)  # compiles on demand
    assert got["tokens"] == greedy_tokens(reference)


def test_other_engine_settings_are_refused(compiled_dir, smollm):
    config = EngineConfig(compiled_dir=str(compiled_dir), **{**SETTINGS, "max_num_seqs": 4})
    with pytest.raises(CompiledMismatchError, match=r"max_num_seqs 2 \(compiled\) vs 4 \(here\)"):
        Engine(config, loaded=smollm)


def test_other_software_versions_are_refused(compiled_dir, smollm, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(compiled_dir, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["versions"]["jaxlib"] = "0.0.1"
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CompiledMismatchError, match=r"jaxlib 0\.0\.1 \(compiled\)"):
        Engine(EngineConfig(compiled_dir=str(copy), **SETTINGS), loaded=smollm)


def test_a_directory_without_a_manifest_is_named(smollm, tmp_path):
    with pytest.raises(FileNotFoundError, match="manifest.json not found"):
        Engine(EngineConfig(compiled_dir=str(tmp_path), **SETTINGS), loaded=smollm)


@pytest.mark.parametrize("text,name", [("tpu:v5e-1", "tpu:v5e-1"), ("tpu:v6e-8", "tpu:v6e-8"), ("cpu", "cpu"),
                                       ("cpu-4", "cpu-4")])
def test_target_names(text, name):
    assert Target.parse(text).name == name


@pytest.mark.parametrize("text,message", [
    ("tpu:v5e-3", "power of two"), ("tpu:v9x-4", "unknown TPU chip"), ("gpu", "unknown target"),
    ("tpu-v5e-4", "unknown target"),
])
def test_bad_targets_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        Target.parse(text)


def test_a_directory_missing_planned_executables_is_refused(compiled_dir, smollm, tmp_path):
    copy = tmp_path / "partial"
    shutil.copytree(compiled_dir, copy)
    m = json.loads((copy / "manifest.json").read_text())
    m["shapes"] = [s for s in m["shapes"] if s["name"] != "head[R=2,full]"]  # as `--shapes` would leave it
    (copy / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CompiledMismatchError, match=r"1 planned shapes have no executable \(first: head\[R=2,full\]\)"):
        Engine(EngineConfig(compiled_dir=str(copy), **SETTINGS), loaded=smollm)
