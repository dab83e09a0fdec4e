"""Tuning the scheduler on the user's own traffic (`jaxserve tune`).

`workload` reads a JSONL trace of requests (or makes the random shapes `vllm bench serve`
uses), `replay` runs it against an engine in this process and measures TTFT / TPOT / E2E,
throughput, preemptions and prefix hits, `search` varies the knobs (token budget, prefill
chunk, rows per step, KV cache) one at a time within a time budget and picks the setting
that meets the user's goal, and `command` is the CLI; `plot` draws the trade-off.
"""
