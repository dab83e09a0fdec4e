"""A process of a multi-host test group (run by tests/test_multihost.py, not by pytest).

    python multihost_child.py MODEL COORDINATOR NUM_PROCESSES PROCESS_ID MODE [SECOND_MODEL]
MODE "generate": the leader generates and prints JSON tokens; followers run the leader's steps.
MODE "update": the same, then the leader is refused `sleep`, updates the weights to
SECOND_MODEL (after a path that does not exist, which every process must refuse) and
generates again.
MODE "watch": everyone prints READY once the engine is built (the peer monitor runs from then
on; nothing is compiled); the leader then polls its health and prints UNHEALTHY when a peer is
lost.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.llm_engine import Engine
from jaxserve.worker.distributed import exit_follower
from scheduler import SamplingParams

PROMPTS = [[5, 9, 13, 2, 7], list(range(3, 40)), [1]]


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("jaxserve.loading.hf_loader").setLevel(logging.INFO)  # what each process read
    model, coordinator, n, pid, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    dist = dict(coordinator=coordinator, num_processes=n, process_id=pid, tensor_parallel_size=n,
                heartbeat_timeout_s=2.0) if n > 1 else {}
    # f32: the processes' programs differ (a mesh, or none) and must give the same tokens. The
    # single-process runs (two checkpoints of one shape) may share a compilation cache
    # (MULTIHOST_TEST_CACHE); a group's processes compile at the same time and keep none.
    cache = os.environ.get("MULTIHOST_TEST_CACHE") if n == 1 else None
    engine = Engine(EngineConfig(model=model, dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, num_pages=64,
                                 max_model_len=128, compilation_cache_dir=cache, strict_compile_guard=True,
                                 max_logprobs=0, structured_outputs=False, **dist))
    if mode != "watch":
        engine.warmup()
    if mode == "watch":
        print("READY", flush=True)
        t0 = time.time()
        while time.time() - t0 < 60:
            if not engine.healthy:
                print("UNHEALTHY", engine.unhealthy_reason, flush=True)
                return
            time.sleep(0.1)
        return
    if not engine.is_leader:
        engine.run_follower()
        engine.close()
        print("FOLLOWER DONE", flush=True)
        exit_follower(0)
    result = {"tokens": generate(engine)}
    if mode == "update":
        try:
            engine.sleep(1)
        except ValueError as e:
            result["sleep_refused"] = str(e)
        try:
            engine.update_weights("/no/such/weights")
        except ValueError as e:
            result["refused"] = str(e)
        result["version"] = engine.update_weights(sys.argv[6])
        result["tokens_after_update"] = generate(engine)
    engine.close()
    print(json.dumps({**result, "compiles_after_warmup": engine.compiles_after_warmup}), flush=True)


def generate(engine) -> list[list[int]]:
    for i, ids in enumerate(PROMPTS):
        # The second request needs the full sampler variant: its penalty history and logit-bias
        # rows travel in the step's second payload.
        full = dict(repetition_penalty=1.3, logit_bias={7: 4.0, 11: -100.0}) if i == 1 else {}
        engine.add_prompt(None, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **full),
                           prompt_token_ids=ids, request_id=str(i))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return [outs[str(i)] for i in range(len(PROMPTS))]


if __name__ == "__main__":
    main()
