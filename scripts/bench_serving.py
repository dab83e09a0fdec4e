#!/usr/bin/env python
"""Serving benchmark over gRPC or the OpenAI HTTP API, shaped like vLLM's `vllm bench serve`.

Drives a running `jaxserve serve` (`--backend grpc`, the default; `openai` for
/v1/completions with the same token-id prompts; `openai-chat` for /v1/chat/completions with
the prompts decoded to text, so its prompt lengths are approximate) with requests that arrive as a Poisson process (or a gamma
process with `--burstiness`), at `--request-rate` requests/s (inf: all at once) and/or at
most `--max-concurrency` in flight, from one of two workloads:

  random             random token ids, `--random-input-len` in, `--random-output-len` out
  prefix-repetition  `--prefix-repetition-num-prefixes` shared prefixes + random suffixes

Prints vLLM's summary and writes JSON with vLLM's field names (completed, failed,
request_throughput, output_throughput, mean/median/std/pNN of ttft/tpot/itl/e2el in ms,
request_goodput for `--goodput` SLOs) and a PNG (latency CDFs and throughput over time).

    python scripts/bench_serving.py --address 127.0.0.1:50051 --num-prompts 200 \
        --request-rate 4 --random-input-len 128 --random-output-len 64 \
        --result-file bench.json --plot bench.png
    python scripts/bench_serving.py --backend openai --base-url http://127.0.0.1:8000 ...

HTTP streams ask for `stream_options.continuous_usage_stats`, so every chunk says how many
tokens it carries (a chunk may carry several when the client reads slower than the engine
steps), and the token counts match the gRPC backend's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import ssl
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc  # noqa: E402

from jaxserve.tuning.plot import write_png  # noqa: E402
from server.proto import jaxserve_pb2 as pb  # noqa: E402
from server.proto import jaxserve_pb2_grpc as pb_grpc  # noqa: E402


@dataclasses.dataclass
class Req:
    prompt_ids: list[int]
    output_len: int
    text: str | None = None  # the prompt decoded (openai-chat)


@dataclasses.dataclass
class Result:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    start: float = 0.0  # seconds since the benchmark started
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    token_times: list[float] = dataclasses.field(default_factory=list)  # absolute (bench clock)
    _last: float = 0.0

    def tokens_arrived(self, n: int, start: float, t0: float) -> None:
        """`n` tokens arrived now; `start`: the request's send time, `t0`: the bench's."""
        now = time.perf_counter()
        if not self.token_times:
            self.ttft = now - start
        else:
            self.itl.append(now - self._last)
        self._last = now
        self.token_times.extend([now - t0] * n)


# ---------------------------------------------------------------------------- workloads
def _lens(rng, mean: int, ratio: float, n: int) -> np.ndarray:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, n) if hi > lo else np.full(n, mean)


def random_workload(args, vocab: int, rng) -> list[Req]:
    ins = _lens(rng, args.random_input_len, args.random_range_ratio, args.num_prompts)
    outs = _lens(rng, args.random_output_len, args.random_range_ratio, args.num_prompts)
    lo = min(1000, vocab // 4)  # stay clear of the special tokens at the start of the vocabulary
    return [Req(rng.integers(lo, vocab - 1, int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


def prefix_repetition_workload(args, vocab: int, rng) -> list[Req]:
    lo = min(1000, vocab // 4)
    prefixes = [rng.integers(lo, vocab - 1, args.prefix_repetition_prefix_len).tolist()
                for _ in range(args.prefix_repetition_num_prefixes)]
    reqs = []
    for i in range(args.num_prompts):
        suffix = rng.integers(lo, vocab - 1, args.prefix_repetition_suffix_len).tolist()
        reqs.append(Req(prefixes[i % len(prefixes)] + suffix, args.prefix_repetition_output_len))
    rng.shuffle(reqs)
    return reqs


# ---------------------------------------------------------------------------- client
async def arrivals(n: int, rate: float, burstiness: float, rng):
    """Yields request indices with gamma-distributed gaps (shape = burstiness, mean = 1/rate);
    burstiness 1 is a Poisson process, lower is burstier, higher is more regular."""
    for i in range(n):
        yield i
        if math.isinf(rate) or i == n - 1:
            continue
        theta = 1.0 / (rate * burstiness)
        await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=theta)))


async def one_request(stub, req: Req, args, t0: float, md) -> Result:
    r = Result(prompt_len=len(req.prompt_ids))
    params = pb.SamplingParams(max_tokens=req.output_len, temperature=args.temperature,
                               ignore_eos=not args.no_ignore_eos)
    if args.cache_salt:
        params.cache_salt = args.cache_salt
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=req.prompt_ids), sampling_params=params)
    start = time.perf_counter()
    r.start = start - t0
    try:
        async for resp in stub.Generate(msg, metadata=md, timeout=args.request_timeout):
            n = sum(len(d.token_ids) for d in resp.outputs)
            if n:
                r.tokens_arrived(n, start, t0)
            if resp.finished:
                r.output_len = resp.usage.completion_tokens
                r.cached_tokens = resp.usage.cached_tokens
        r.latency = time.perf_counter() - start
        r.success = True
    except grpc.aio.AioRpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    return r


# ---------------------------------------------------------------------------- HTTP client
class HttpBackend:
    """The OpenAI API over one pooled httpx client; SSE read line by line."""

    def __init__(self, args):
        import httpx

        headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        conns = (args.max_concurrency or args.num_prompts) + 8
        self.args = args
        self.chat = args.backend == "openai-chat"
        self.client = httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers,
                                        timeout=args.request_timeout,
                                        verify=ssl.create_default_context(cafile=args.tls_ca_file)
                                        if args.tls_ca_file else True,
                                        limits=httpx.Limits(max_connections=conns, max_keepalive_connections=conns))
        self.model = ""

    async def info(self) -> tuple[str, int, int]:
        r = await self.client.get("/v1/models")
        r.raise_for_status()
        card = r.json()["data"][0]
        self.model = card["id"]
        return card["id"], card["vocab_size"], card["max_model_len"]

    async def body(self, req: Req) -> tuple[str, dict]:
        a = self.args
        common = {"model": self.model, "max_tokens": req.output_len, "temperature": a.temperature,
                  "ignore_eos": not a.no_ignore_eos, "stream": True,
                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        if a.cache_salt:
            common["cache_salt"] = a.cache_salt
        if not self.chat:
            return "/v1/completions", {**common, "prompt": req.prompt_ids}
        if req.text is None:
            r = await self.client.post("/detokenize", json={"tokens": req.prompt_ids})
            r.raise_for_status()
            req.text = r.json()["prompt"]
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": req.text}]}

    async def one_request(self, req: Req, t0: float) -> Result:
        r = Result(prompt_len=len(req.prompt_ids))
        path, body = await self.body(req)
        start = time.perf_counter()
        r.start = start - t0
        seen = 0
        try:
            async with self.client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    err = json.loads(await resp.aread()).get("error", {})
                    r.error = f"HTTP {resp.status_code}: {err.get('message', '')}"
                    return r
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    ev = json.loads(line[6:])
                    if "error" in ev:
                        r.error = f"stream error: {ev['error'].get('message')}"
                        return r
                    usage = ev.get("usage")
                    if usage is None:
                        continue
                    n = usage["completion_tokens"] - seen
                    if n > 0:
                        r.tokens_arrived(n, start, t0)
                        seen = usage["completion_tokens"]
                    if not ev["choices"]:  # the final usage chunk
                        r.output_len = usage["completion_tokens"]
                        r.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                        if self.chat:
                            r.prompt_len = usage["prompt_tokens"]
            r.latency = time.perf_counter() - start
            r.success = True
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            r.error = f"{type(e).__name__}: {e}"
        return r

    async def server_stats(self) -> dict:
        r = await self.client.get("/metrics")
        vals: dict[str, float] = {}
        for line in r.text.splitlines() if r.status_code == 200 else []:
            if line and not line.startswith("#"):
                name, _, v = line.rpartition(" ")
                base = name.split("{", 1)[0]
                vals[base] = vals.get(base, 0.0) + float(v)
        return {"num_preemptions": int(vals.get("jaxserve:num_preemptions_total", 0)),
                "prefix_cache_hits": vals.get("jaxserve:prefix_cache_hits_total", 0.0),
                "prefix_cache_queries": vals.get("jaxserve:prefix_cache_queries_total", 0.0),
                "compilations_after_warmup": int(vals.get("jaxserve:compilations_after_warmup_total", 0))}


async def run_http(args) -> dict:
    rng = np.random.default_rng(args.seed)
    backend = HttpBackend(args)
    async with backend.client:
        model, vocab, max_len = await backend.info()
        reqs = _workload(args, vocab, max_len, rng, model)
        if args.warmup_requests:
            await asyncio.gather(*(backend.one_request(Req(r.prompt_ids[:8], 4), time.perf_counter())
                                   for r in reqs[: args.warmup_requests]))
        results, duration = await _drive(reqs, args, rng, backend.one_request)
        stats = await backend.server_stats()
    return summarize(args, results, duration, dataclasses.make_dataclass("S", list(stats))(**stats))


def _workload(args, vocab: int, max_model_len: int, rng, model: str) -> list[Req]:
    make = random_workload if args.dataset == "random" else prefix_repetition_workload
    reqs = make(args, vocab, rng)
    too_long = [r for r in reqs if len(r.prompt_ids) + r.output_len > max_model_len]
    if too_long:
        raise SystemExit(f"{len(too_long)} requests exceed max_model_len {max_model_len}")
    print(f"{args.dataset}: {len(reqs)} requests over {args.backend}, rate {args.request_rate}, burstiness "
          f"{args.burstiness}, max concurrency {args.max_concurrency}, model {model}")
    return reqs


async def _drive(reqs: list[Req], args, rng, send) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def limited(req: Req, t0: float) -> Result:
        if sem is None:
            return await send(req, t0)
        async with sem:
            return await send(req, t0)

    t0 = time.perf_counter()
    tasks = []
    async for i in arrivals(len(reqs), args.request_rate, args.burstiness, rng):
        tasks.append(asyncio.create_task(limited(reqs[i], t0)))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - t0


async def run(args) -> dict:
    if args.backend != "grpc":
        return await run_http(args)
    rng = np.random.default_rng(args.seed)
    md = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else None
    opts = [("grpc.max_receive_message_length", 64 * 2**20)]
    if args.tls_ca_file:
        with open(args.tls_ca_file, "rb") as f:
            creds = grpc.ssl_channel_credentials(f.read())
        channel = grpc.aio.secure_channel(args.address, creds, options=opts)
    else:
        channel = grpc.aio.insecure_channel(args.address, options=opts)
    async with channel:
        stub = pb_grpc.JaxServeStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30)
        reqs = _workload(args, info.vocab_size, info.max_model_len, rng, info.model)
        if args.warmup_requests:
            await asyncio.gather(*(one_request(stub, Req(r.prompt_ids[:8], 4), args, time.perf_counter(), md)
                                   for r in reqs[: args.warmup_requests]))
        results, duration = await _drive(reqs, args, rng, lambda req, t0: one_request(stub, req, args, t0, md))
        server = await stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=md, timeout=30)
    return summarize(args, results, duration, server)


# ---------------------------------------------------------------------------- report
def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict:
    v = np.asarray(values_s, dtype=np.float64) * 1000.0 if values_s else np.zeros(1)
    out = {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(v.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(v, p))
    return out


def summarize(args, results: list[Result], duration: float, server) -> dict:
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    pcts = [float(p) for p in args.metric_percentiles.split(",")]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    res = {
        "backend": f"jaxserve-{args.backend}", "dataset_name": args.dataset, "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "cached_tokens": sum(r.cached_tokens for r in ok),
    }
    res.update(_stats("ttft", [r.ttft for r in ok], pcts))
    res.update(_stats("tpot", tpots, pcts))
    res.update(_stats("itl", [x for r in ok for x in r.itl], pcts))
    res.update(_stats("e2el", [r.latency for r in ok], pcts))
    if args.goodput:
        slo = dict(kv.split(":") for kv in args.goodput)
        good = 0
        for r in ok:
            tp = (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0
            good += all((
                "ttft" not in slo or r.ttft * 1000 <= float(slo["ttft"]),
                "tpot" not in slo or tp * 1000 <= float(slo["tpot"]),
                "e2el" not in slo or r.latency * 1000 <= float(slo["e2el"]),
            ))
        res["request_goodput"] = good / duration
        res["goodput_slos_ms"] = {k: float(v) for k, v in slo.items()}
    res["server_num_preemptions"] = server.num_preemptions
    res["server_prefix_cache_hit_rate"] = (server.prefix_cache_hits / server.prefix_cache_queries
                                           if server.prefix_cache_queries else 0.0)
    res["server_compilations_after_warmup"] = server.compilations_after_warmup
    res["errors"] = sorted({r.error for r in results if not r.success})[:10]
    res["input_lens"] = [r.prompt_len for r in results]
    res["output_lens"] = [r.output_len for r in results]
    res["ttfts"] = [r.ttft for r in results]
    res["itls"] = [r.itl for r in results]
    res["e2els"] = [r.latency for r in results]
    res["start_times"] = [r.start for r in results]
    res["token_times"] = sorted(t for r in ok for t in r.token_times)
    return res


def print_summary(res: dict) -> None:
    w = 50
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="="))
    rows = [("Successful requests:", res["completed"]), ("Failed requests:", res["failed"]),
            ("Benchmark duration (s):", f"{res['duration']:.2f}"),
            ("Total input tokens:", res["total_input_tokens"]),
            ("Total generated tokens:", res["total_output_tokens"]),
            ("Request throughput (req/s):", f"{res['request_throughput']:.2f}")]
    if "request_goodput" in res:
        rows.append(("Request goodput (req/s):", f"{res['request_goodput']:.2f}"))
    rows += [("Output token throughput (tok/s):", f"{res['output_throughput']:.2f}"),
             ("Total token throughput (tok/s):", f"{res['total_token_throughput']:.2f}"),
             ("Prefix cache hit rate (server):", f"{100 * res['server_prefix_cache_hit_rate']:.1f}%"),
             ("Preemptions (server, total):", res["server_num_preemptions"])]
    for k, v in rows:
        print(f"{k:<40}{v:<10}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        for k in sorted(k for k in res if k.endswith(f"_{name}_ms") and not k.startswith("std")):
            label = k.split("_")[0].capitalize()
            print(f"{label + ' ' + name.upper() + ' (ms):':<40}{res[k]:<10.2f}")
    if res["errors"]:
        print("errors:", *res["errors"], sep="\n  ")
    print("=" * w)


# ---------------------------------------------------------------------------- plot
def save_plot(res: dict, path: str) -> None:
    """Latency CDFs (TTFT, ITL, E2EL) and output tokens/s over time."""
    ttft = [t for t, n in zip(res["ttfts"], res["output_lens"]) if n]
    itl = [x for r in res["itls"] for x in r]
    e2el = [t for t, n in zip(res["e2els"], res["output_lens"]) if n]
    times = np.asarray(res["token_times"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _save_plot_plain(ttft, itl, e2el, times, path)
        print(f"plot: {path} (matplotlib not installed: unlabelled plot; pip install matplotlib)")
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for vals, label in ((ttft, "TTFT"), (itl, "ITL"), (e2el, "E2EL")):
        if vals:
            v = np.sort(np.asarray(vals) * 1000)
            a.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
    a.set_xscale("log")
    a.set_xlabel("latency (ms)")
    a.set_ylabel("CDF")
    a.grid(alpha=0.3)
    a.legend()
    a.set_title("latency CDFs")
    if len(times):
        bins = np.arange(0, times.max() + 1.0, 1.0)
        counts, edges = np.histogram(times, bins=bins)
        b.plot(edges[:-1], counts, drawstyle="steps-post")
    b.set_xlabel("time (s)")
    b.set_ylabel("output tokens/s")
    b.grid(alpha=0.3)
    b.set_title(f"throughput (rate {res['request_rate']}, {res['completed']} ok, {res['failed']} failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def _save_plot_plain(ttft, itl, e2el, times, path: str, w: int = 800, h: int = 300) -> None:
    """Dependency-free fallback: left half TTFT (blue), ITL (red), E2EL (orange) CDFs on a log axis, right
    half output tokens/s per second (green). No text."""
    img = np.full((h, w, 3), 255, np.uint8)
    pad, half = 10, w // 2

    def polyline(xs, ys, x0, x1, color):
        px = (x0 + pad + np.asarray(xs) * (x1 - x0 - 2 * pad)).astype(int)
        py = (h - pad - np.asarray(ys) * (h - 2 * pad)).astype(int)
        for i in range(len(px) - 1):
            n = max(abs(px[i + 1] - px[i]), abs(py[i + 1] - py[i]), 1)
            xx = np.linspace(px[i], px[i + 1], n + 1).astype(int).clip(0, w - 1)
            yy = np.linspace(py[i], py[i + 1], n + 1).astype(int).clip(0, h - 1)
            img[yy, xx] = color

    img[:, half] = 0
    vals = [np.log10(np.maximum(np.asarray(v) * 1000, 1e-3)) for v in (ttft, itl, e2el) if v]
    if vals:
        lo, hi = min(v.min() for v in vals), max(v.max() for v in vals) + 1e-9
        for v, color in zip(vals, ((31, 119, 180), (214, 39, 40), (255, 127, 14))):
            v = np.sort(v)
            polyline((v - lo) / (hi - lo), np.arange(1, len(v) + 1) / len(v), 0, half, color)
    if len(times):
        counts, _ = np.histogram(times, bins=np.arange(0, times.max() + 1.0, 1.0))
        if len(counts) > 1:
            polyline(np.arange(len(counts)) / (len(counts) - 1), counts / max(counts.max(), 1), half, w,
                     (44, 160, 44))
    write_png(path, img)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["grpc", "openai", "openai-chat"], default="grpc")
    p.add_argument("--address", default="127.0.0.1:50051", help="gRPC address (--backend grpc)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="HTTP API (--backend openai*)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--tls-ca-file", default=None)
    p.add_argument("--dataset", choices=["random", "prefix-repetition"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 = Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=32)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=4)
    p.add_argument("--prefix-repetition-output-len", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--cache-salt", default=None,
                   help="prefix-cache salt of every request: a fresh one keeps earlier runs' prompts from hitting")
    p.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests early")
    p.add_argument("--goodput", nargs="*", default=None, help="SLOs in ms, e.g. ttft:2000 tpot:200")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--warmup-requests", type=int, default=0, help="short requests sent first, not measured")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the JSON result here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--label", default=None, help="free-form tag stored in the JSON")
    args = p.parse_args(argv)
    res = asyncio.run(run(args))
    if args.label:
        res["label"] = args.label
    print_summary(res)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(res, f, indent=1)
        print(f"results: {args.result_file}")
    if args.plot:
        save_plot(res, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
