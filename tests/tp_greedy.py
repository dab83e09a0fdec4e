"""The engine run both multi-device test children share (tests/test_tensor_parallel.py and
tests/test_model_families.py): greedy tokens of a few prompts and the compilations after
warmup. Imported in the child process, after `jax_num_cpu_devices` is set."""

from __future__ import annotations

from jaxserve.config import EngineConfig
from jaxserve.engine import Engine
from scheduler import SamplingParams


def greedy(loaded, tp: int, prompts: list[list[int]], **engine_kwargs) -> list:
    """[tokens of each prompt (10 greedy tokens), compilations after warmup]."""
    e = Engine(EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, num_pages=64, max_model_len=128,
                            tensor_parallel_size=tp, max_logprobs=0, compilation_cache_dir=None,
                            structured_outputs=False, **engine_kwargs), loaded=loaded)
    e.warmup(progress=False)
    for i, ids in enumerate(prompts):
        e.add_prompt(None, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                      prompt_token_ids=ids, request_id=str(i))
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return [[outs[str(i)] for i in range(len(prompts))], e.compiles_after_warmup]
