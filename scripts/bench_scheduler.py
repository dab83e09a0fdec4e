"""Cost of one scheduler step: schedule() + update_from_output(), no model.

256 requests decoding under a 2048-token budget (the steady state of a busy server). The
sampled tokens are prepared outside the timed region, so only scheduler work is measured.

    .venv/bin/python scripts/bench_scheduler.py [--steps N] [--requests R] [--kv-groups gemma3]

`--kv-groups gemma3`: the cache in Gemma 3 27B's layer groups (one full group, six groups with a
1024-token window; docs/architecture.md), `gpt-oss` gpt-oss's (one full, one 128-token window):
the per-group tables and the windowed groups' hand-backs on top of the plain step.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler import Request, SamplingParams, Scheduler, SchedulerConfig  # noqa: E402

KV_GROUPS = {"none": (), "gemma3": (("full", 0),) + (("window", 1024),) * 6,
             "gpt-oss": (("full", 0), ("window", 128))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--kv-groups", choices=sorted(KV_GROUPS), default="none")
    args = ap.parse_args()

    r, bs = args.requests, args.block_size
    max_len = args.prompt_len + args.steps + 128
    blocks_per_req = -(-max_len // bs)
    cfg = SchedulerConfig(
        block_size=bs,
        num_blocks=r * blocks_per_req * max(1, len(KV_GROUPS[args.kv_groups])) + 1,
        max_model_len=max_len,
        max_num_seqs=r,
        max_num_batched_tokens=2048,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_groups=KV_GROUPS[args.kv_groups],
    )
    s = Scheduler(cfg)
    sp = SamplingParams(max_tokens=args.steps + 100, ignore_eos=True)
    for i in range(r):
        prompt = [(i * 7919 + j) % 30000 + 1 for j in range(args.prompt_len)]
        s.add_request(Request(f"req-{i}", prompt, sp, eos_token_id=2, arrival_time=float(i)))

    # Prefill until every request is decoding.
    while True:
        out = s.schedule()
        sampled = {sr.request_id: [5] for sr in out.scheduled if sr.samples}
        s.update_from_output(out, sampled)
        if all(sr.num_tokens == 1 for sr in out.scheduled) and len(out.scheduled) == r:
            break

    tokens = {f"req-{i}": [(i + 3) % 30000 + 1] for i in range(r)}
    wall, cpu = [], []
    gc.collect()
    for _ in range(args.steps):
        c0 = time.thread_time()
        t0 = time.perf_counter()
        out = s.schedule()
        s.update_from_output(out, tokens)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
        assert len(out.scheduled) == r

    print(
        f"scheduler step: {r} decoding requests, budget 2048, block_size {bs}, prefix caching "
        f"{'off' if args.no_prefix_caching else 'on'}, layer groups {args.kv_groups}, {args.steps} steps"
    )
    # Wall time includes waits for the CPU on a shared machine; thread CPU time does not.
    for name, xs in (("wall", wall), ("thread cpu", cpu)):
        us = sorted(t * 1e6 for t in xs)
        p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
        med = statistics.median(us)
        print(f"  {name:>10}: median {med:.0f} us, p99 {p99:.0f} us ({med / r:.2f} us/request)")


if __name__ == "__main__":
    main()
