"""The engine run both multi-device test children share (tests/test_tensor_parallel.py and
tests/test_model_families.py): greedy tokens of a few prompts and the compilations after
warmup. Imported in the child process, after `jax_num_cpu_devices` is set.

The engines of one child share a persistent compilation cache (a directory of its own, removed
at exit): the sampler programs ([R, V] logits on the same mesh) are the same for every tiny
model of one vocabulary, and were a large part of each engine's warmup compiled again."""

from __future__ import annotations

import atexit
import shutil
import tempfile

from logprob_checks import top_k_of

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine
from scheduler import SamplingParams

_CACHE_DIR = tempfile.mkdtemp(prefix="tp_greedy_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)


def greedy(loaded, tp: int, prompts: list[list[int]], **engine_kwargs) -> list:
    """[tokens of each prompt (10 greedy tokens), their top-3 logprobs per position ({id: logprob}),
    compilations after warmup]: layouts differ in summation order, so callers compare by
    `logprob_checks.check_greedy_close`."""
    e = Engine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, num_pages=64, max_model_len=128,
                            tensor_parallel_size=tp, max_logprobs=3, compilation_cache_dir=_CACHE_DIR,
                            structured_outputs=False, **engine_kwargs), loaded=loaded)
    e.warmup(progress=False)
    for i, ids in enumerate(prompts):
        e.add_prompt(None, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3),
                      prompt_token_ids=ids, request_id=str(i))
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    done = [outs[str(i)] for i in range(len(prompts))]
    return [[list(c.token_ids) for c in done], [top_k_of(c.logprobs) for c in done], e.compiles_after_warmup]
