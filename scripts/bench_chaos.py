"""Figures for the server under hostile load, on the embedded model, loopback only.

A server runs in this process; the hostile clients run in their own processes
(`tests/chaos_clients.py`), so this process's memory is the server's own. Prints:

- 1000 concurrent streams over 10 connections, twice: wall time, the server's RSS before /
  peak / after, KV blocks in use after (must be 0);
- a well-behaved greedy stream's inter-token gaps (p50 / p99, medians over `--reps` runs)
  alone and under another tenant's tokenization flood, with the flood client at nice 19
  (standing in for a remote client) and at nice 0 (its CPU taken from this 2-core machine),
  and their ratios to the idle run;
- the engine thread's output processing (detokenization, stop strings) per step, against
  the step time, at 32 running streams.

    python scripts/bench_chaos.py [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import grpc  # noqa: E402
from server_harness import ServerThread, percentile, read_stream, rss_mib, wait_until  # noqa: E402

from jaxserve.config.engine_config import EngineConfig  # noqa: E402
from server.app import ServerOptions  # noqa: E402
from server.proto import jaxserve_pb2 as pb  # noqa: E402
from server.proto import jaxserve_pb2_grpc as pb_grpc  # noqa: E402
from server.tenants import parse_api_keys  # noqa: E402

CFG = EngineConfig(max_num_seqs=32, max_num_batched_tokens=128, num_pages=256, max_model_len=512)
KEYS = {"alice": "alice-key-0123456789", "bob": "bob-key-0123456789"}


def clients(mode: str, address: str, key: str, *args: str, nice: int = 0) -> subprocess.Popen:
    p = subprocess.Popen(["nice", "-n", str(nice), sys.executable, str(ROOT / "tests" / "chaos_clients.py"), mode,
                          address, key, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def good_stream(address: str):
    async def body():
        async with grpc.aio.insecure_channel(address) as ch:
            return await read_stream(pb_grpc.JaxServeStub(ch).Generate(pb.GenerateRequest(
                text="Write a poem about the sea.",
                sampling_params=pb.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)),
                metadata=(("authorization", f"Bearer {KEYS['alice']}"),)))

    return asyncio.run(body())


def bench_streams(srv: ServerThread, round_: int) -> None:
    before = rss_mib()
    peak = [before]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.1)

    w = threading.Thread(target=watch)
    w.start()
    t0 = time.perf_counter()
    p = clients("streams", srv.address, KEYS["bob"], "--streams", "1000", "--connections", "10")
    counts = json.loads(p.stdout.readline())
    p.wait()
    dt = time.perf_counter() - t0
    wait_until(lambda: srv.server.num_in_flight == 0 and srv.server.num_streams == 0, timeout=30)
    stop.set()
    w.join()
    used = srv.server.loop_runner.snapshot.stats.num_used_blocks
    print(f"1000 concurrent streams, 10 connections (round {round_}): {dt:.1f} s, statuses {counts}; server RSS "
          f"{before:.0f} -> peak {peak[0]:.0f} -> after {rss_mib():.0f} MiB; KV blocks in use after: {used}")


def bench_flood(srv: ServerThread, reps: int) -> None:
    good_stream(srv.address)  # warm
    runs: dict[str, list[tuple[float, float]]] = {"idle": [], "flood, client nice 19": [], "flood, client nice 0": []}
    for _ in range(reps):
        for name in runs:
            p = None
            if name != "idle":
                p = clients("flood", srv.address, KEYS["bob"], "--seconds", "120", nice=19 if "19" in name else 0)
            try:
                r = good_stream(srv.address)
            finally:
                if p is not None:
                    p.terminate()
                    p.wait()
            assert r.code == grpc.StatusCode.OK and len(r.token_ids) == 48, (r.code, r.details)
            runs[name].append((percentile(r.gaps, 50), percentile(r.gaps, 99)))
    idle50 = statistics.median(x for x, _ in runs["idle"])
    idle99 = statistics.median(y for _, y in runs["idle"])
    print(f"\ninter-token gaps of a greedy 48-token stream, medians of {reps} runs (ms):")
    print(f"{'condition':<24}{'p50':>8}{'p99':>8}{'p50 / idle':>12}{'p99 / idle':>12}")
    for name, xs in runs.items():
        p50, p99 = statistics.median(x for x, _ in xs), statistics.median(y for _, y in xs)
        print(f"{name:<24}{1e3 * p50:>8.1f}{1e3 * p99:>8.1f}{p50 / idle50:>12.2f}{p99 / idle99:>12.2f}")


def bench_output_processing(srv: ServerThread) -> None:
    engine = srv.server.engine
    real = engine.outputs.process
    times: list[float] = []
    steps: list[float] = []

    def process(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        times.append(time.perf_counter() - t)
        return out

    real_step = engine.step

    def step():
        t = time.perf_counter()
        out = real_step()
        steps.append(time.perf_counter() - t)
        return out

    engine.outputs.process, engine.step = process, step
    try:
        async def body():
            async with grpc.aio.insecure_channel(srv.address) as ch:
                stub = pb_grpc.JaxServeStub(ch)
                md = (("authorization", f"Bearer {KEYS['alice']}"),)
                await asyncio.gather(*(read_stream(stub.Generate(pb.GenerateRequest(
                    text=f"Tell me a long story number {i}.",
                    sampling_params=pb.SamplingParams(max_tokens=64, ignore_eos=True)), metadata=md))
                    for i in range(32)))

        asyncio.run(body())
    finally:
        engine.outputs.process, engine.step = real, real_step
    tail = slice(len(times) // 2, None)  # decode steps with all 32 running
    p, s = statistics.median(times[tail]), statistics.median(steps[tail])
    print(f"\nengine-thread output processing (detokenization, stop strings) at 32 streams: "
          f"{1e3 * p:.2f} ms of a {1e3 * s:.1f} ms step ({100 * p / s:.1f}%), medians")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ns = ap.parse_args()
    tenants = parse_api_keys([f"{k} {v}" for k, v in KEYS.items()])
    srv = ServerThread(CFG, ServerOptions(host="127.0.0.1", port=0, metrics_port=-1, http_port=-1, log_interval=0,
                                          tenants=tuple(tenants), max_queued_requests=1100,
                                          tokenizer_backlog_chars=64_000))
    try:
        print(f"server: {CFG.max_num_seqs} seqs, {CFG.max_num_batched_tokens} tokens per step, "
              f"frontend threads {srv.server.frontend._pool._max_workers}")
        for round_ in (1, 2):  # the second round shows whether memory keeps growing
            bench_streams(srv, round_)
        bench_flood(srv, ns.reps)
        bench_output_processing(srv)
    finally:
        srv.close()


if __name__ == "__main__":
    main()
