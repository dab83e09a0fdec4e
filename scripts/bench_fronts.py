#!/usr/bin/env python
"""What the OpenAI HTTP front costs next to gRPC: one `jaxserve serve` process (both fronts on
one engine), the same bench_serving.py workload sent over gRPC, /v1/completions (the same
token-id prompts) and /v1/chat/completions, in alternating rounds so that drift on a noisy
machine hits every backend alike. Every run sends the same prompts (one seed) under its own
prefix-cache salt, so no run is served from the cache an earlier run filled. Prints per-round figures, the median over rounds and the
HTTP / gRPC ratios.

    python scripts/bench_fronts.py --rounds 3 --num-prompts 48 --request-rate 2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ("total_input_tokens", "output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms",
          "median_tpot_ms", "median_e2el_ms", "server_cpu_s_per_1k_tokens", "client_cpu_s_per_1k_tokens")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, log_path: str) -> tuple[subprocess.Popen, int, int]:
    http_port = _free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--http-port", str(http_port), "--metrics-port", "-1", "--log-interval", "0", *args.serve_args]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        text = open(log_path).read()
        if "serving " in text:
            port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", text).group(1))
            return proc, port, http_port
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{text[-3000:]}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start in 900 s")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(args, backend: str, port: int, http_port: int, out: str, server_pid: int | None = None) -> dict:
    """One bench_serving.py run; adds the CPU seconds the server and the client spent per
    1000 output tokens (what each front costs, apart from the load the client puts on the
    machine)."""
    cmd = ["nice", "-n", str(args.client_nice), sys.executable, os.path.join(ROOT, "scripts", "bench_serving.py"),
           "--backend", backend,
           "--address", f"127.0.0.1:{port}", "--base-url", f"http://127.0.0.1:{http_port}",
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--seed", str(args.seed), "--result-file", out, "--cache-salt", os.path.basename(out)]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    server0 = _cpu_s(server_pid) if server_pid else 0.0
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out) as f:
        res = json.load(f)
    k = max(res["total_output_tokens"], 1) / 1000
    res["server_cpu_s_per_1k_tokens"] = ((_cpu_s(server_pid) - server0) / k) if server_pid else 0.0
    res["client_cpu_s_per_1k_tokens"] = (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / k
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backends", default="grpc,openai,openai-chat")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--request-rate", type=float, default=2.0)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-nice", type=int, default=0,
                   help="nice level of the benchmark client (19: it takes CPU only when the server leaves some)")
    p.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for `jaxserve serve` (last on the line)")
    args = p.parse_args(argv)
    backends = args.backends.split(",")
    tmp = tempfile.mkdtemp(prefix="bench_fronts_")
    proc, port, http_port = start_server(args, os.path.join(tmp, "server.log"))
    results: dict[str, list[dict]] = {b: [] for b in backends}
    try:
        bench(args, "grpc", port, http_port, os.path.join(tmp, "warm.json"))  # not counted: first-run effects
        for r in range(args.rounds):
            order = backends if r % 2 == 0 else backends[::-1]
            for b in order:
                res = bench(args, b, port, http_port, os.path.join(tmp, f"{b}_{r}.json"), proc.pid)
                if res["failed"]:
                    raise SystemExit(f"{b} round {r}: {res['failed']} failed: {res['errors']}")
                results[b].append(res)
                print(f"round {r} {b:12s} " + "  ".join(f"{k} {res[k]:.2f}" for k in FIELDS), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(f"\nmedians over {args.rounds} rounds ({args.num_prompts} prompts at {args.request_rate} req/s, "
          f"{args.input_len} in / {args.output_len} out, client nice {args.client_nice}):")
    med = {b: {k: statistics.median(x[k] for x in results[b]) for k in FIELDS} for b in backends}
    for b in backends:
        print(f"  {b:12s} " + "  ".join(f"{k} {med[b][k]:.2f}" for k in FIELDS))
    if "grpc" in med:
        g = med["grpc"]
        for b in backends:
            if b == "grpc":
                continue
            m = med[b]
            print(f"  {b} / grpc: output throughput x{m['output_throughput'] / g['output_throughput']:.3f}, "
                  f"median TTFT {m['median_ttft_ms'] - g['median_ttft_ms']:+.1f} ms, "
                  f"median ITL {m['median_itl_ms'] - g['median_itl_ms']:+.1f} ms, server CPU per token "
                  f"x{m['server_cpu_s_per_1k_tokens'] / g['server_cpu_s_per_1k_tokens']:.3f}, client CPU per token "
                  f"x{m['client_cpu_s_per_1k_tokens'] / g['client_cpu_s_per_1k_tokens']:.3f}")
    compiles = {b: [x["server_compilations_after_warmup"] for x in results[b]] for b in backends}
    print(f"  compilations after warmup (per run, cumulative): {compiles}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
