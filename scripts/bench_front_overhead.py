#!/usr/bin/env python
"""The CPU each front spends per streamed token, with the model taken out.

A real server's CPU per token is dominated by the model (~18 ms per token for SmolLM2 on a
2-core machine), which buries the fronts' own cost in run-to-run noise. Here the server runs
in a child process on a stub engine whose step sleeps `--step-ms` (no CPU) and emits one token
per request, so the child's CPU time is the front (gRPC or HTTP: parsing, admission, stream
buffers, encoding, the socket writes) plus the engine-thread bridge, per token. The clients
(grpc.aio, and httpx for /v1/completions and /v1/chat/completions) run in this process;
rounds alternate the backends.

    python scripts/bench_front_overhead.py --streams 16 --tokens 200 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------------------- the child: a server on a stub engine
class StubTokenizer:
    """Enough of a tokenizer for chat requests: the template yields three fixed ids."""

    chat_template = "stub"

    def apply_chat_template(self, messages, **kwargs):
        return [1, 2, 3]

    def decode(self, ids, **kwargs):
        return " tok" * len(ids)


class StubEngine:
    """One token per request per step; the step sleeps (a device step that costs no host CPU)."""

    def __init__(self, step_s: float, vocab: int = 1000):
        from jaxserve.config.engine_config import EngineConfig
        from jaxserve.engine.input_processor import InputLimits, InputProcessor
        from jaxserve.worker.runner_output import StepTiming
        from scheduler.stats import SchedulerStats

        self.step_s = step_s
        self.config = EngineConfig(max_num_seqs=256).with_platform_defaults("cpu")  # the engine's resolved config
        self.reqs: dict[str, list] = {}
        self.tokenizer = StubTokenizer()
        self.max_model_len = 100_000
        self.num_pages = 100_000
        self.eos_token_id = None
        self.dtype = "float32"
        self.model_config = types.SimpleNamespace(architecture="llama", vocab_size=vocab, num_layers=0, hidden_size=0)
        self.last_step = StepTiming()
        self.scheduler = types.SimpleNamespace(stats=lambda: SchedulerStats(
            len(self.reqs), 0, 0, len(self.reqs), 0, 100_000, 100_000, 0, 0))
        # The real checks and preparation run in the server, as they would on a real engine.
        self.input_processor = InputProcessor(InputLimits(vocab, self.max_model_len, 20, 128), self.tokenizer)
        # The rest of `ServingEngine`'s state: healthy and awake, no LoRA, no speculative decoding.
        self.healthy, self.unhealthy_reason, self.sleep_level = True, None, 0
        self.attention = ("stub", "the step sleeps")
        self.proposer = self.lora_registry = None

    def add_request(self, request, *, request_id=None, arrival_time=None, output_kind=None):
        self.reqs[request_id] = [request.params.max_tokens, 0, arrival_time or time.monotonic(),
                                 len(request.prompt_token_ids)]
        return request_id

    def abort(self, request_id):
        return self.reqs.pop(request_id, None) is not None

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def step(self):
        from jaxserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, Usage
        from jaxserve.worker.runner_output import StepTiming

        time.sleep(self.step_s)
        now = time.monotonic()
        outs = []
        for rid, st in list(self.reqs.items()):
            st[1] += 1
            done = st[1] >= st[0]
            if done:
                del self.reqs[rid]
            comp = CompletionOutput(0, delta_token_ids=[7 + st[1] % 100], delta_text=" tok",
                                    finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, None, [], [comp], done, Usage(st[3], st[1], 0),
                                      RequestMetrics(st[2], st[2], st[2], now if done else None)))
        self.last_step = StepTiming(num_tokens=len(outs), padded_tokens=len(outs), num_decode_tokens=len(outs))
        return outs


def serve_child(step_ms: float) -> None:
    from jaxserve.config.engine_config import EngineConfig
    from server.app import JaxServeServer, ServerOptions

    async def main():
        srv = JaxServeServer(EngineConfig(max_num_seqs=256), ServerOptions(
            host="127.0.0.1", port=0, http_port=0, metrics_port=-1, log_interval=0, warmup=False),
            engine=StubEngine(step_ms / 1000))
        await srv.start()
        await srv.load()
        print(json.dumps({"grpc": srv.port, "http": srv.http_port}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes it
        await srv.stop(0.5)

    asyncio.run(main())


# ---------------------------------------------------------------------------- the parent: clients
async def grpc_streams(port: int, streams: int, tokens: int) -> list[tuple[int, float]]:
    import grpc

    from server.proto import jaxserve_pb2 as pb
    from server.proto import jaxserve_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.JaxServeStub(ch)

        async def one() -> tuple[int, float]:
            n, t0, ttft = 0, time.perf_counter(), 0.0
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                     sampling_params=pb.SamplingParams(max_tokens=tokens))
            async for resp in stub.Generate(req):
                n += sum(len(d.token_ids) for d in resp.outputs)
                ttft = ttft or (time.perf_counter() - t0) * (n > 0)
            return n, ttft

        return await asyncio.gather(*(one() for _ in range(streams)))


async def http_streams(port: int, streams: int, tokens: int, chat: bool) -> list[tuple[int, float]]:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                 limits=httpx.Limits(max_connections=streams + 4)) as c:
        async def one() -> tuple[int, float]:
            body = {"max_tokens": tokens, "stream": True}
            if chat:
                path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "x"}]}
            else:
                path, body = "/v1/completions", {**body, "prompt": [1, 2, 3]}
            n, t0, ttft = 0, time.perf_counter(), 0.0
            async with c.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200, await resp.aread()
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        ev = json.loads(line[6:])
                        n += sum(1 for ch in ev["choices"] if ch.get("text") or ch.get("delta", {}).get("content"))
                        ttft = ttft or (time.perf_counter() - t0) * (n > 0)
            return n, ttft

        return await asyncio.gather(*(one() for _ in range(streams)))


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--step-ms", type=float, default=20.0, help="the stub engine's step time")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backends", default="grpc,openai,openai-chat")
    args = p.parse_args(argv)
    if args.serve:
        serve_child(args.step_ms)
        return 0
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", "--step-ms", str(args.step_ms)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    ports = json.loads(child.stdout.readline())
    backends = args.backends.split(",")
    per_token: dict[str, list[float]] = {b: [] for b in backends}
    ttfts: dict[str, list[float]] = {b: [] for b in backends}
    run = {"grpc": lambda: grpc_streams(ports["grpc"], args.streams, args.tokens),
           "openai": lambda: http_streams(ports["http"], args.streams, args.tokens, False),
           "openai-chat": lambda: http_streams(ports["http"], args.streams, args.tokens, True)}
    try:
        for b in backends:  # warm every path once
            asyncio.run(run[b]())
        for r in range(args.rounds):
            for b in backends if r % 2 == 0 else backends[::-1]:
                c0, t0 = cpu_s(child.pid), time.perf_counter()
                got = asyncio.run(run[b]())
                dt, used = time.perf_counter() - t0, cpu_s(child.pid) - c0
                n = sum(k for k, _ in got)
                assert n == args.streams * args.tokens, (b, n)
                per_token[b].append(1e6 * used / n)
                ttfts[b].append(1e3 * statistics.median(t for _, t in got))
                print(f"round {r} {b:12s} {n} tokens in {dt:.2f} s: server {1e6 * used / n:.0f} us CPU per token, "
                      f"median TTFT {ttfts[b][-1]:.1f} ms", flush=True)
    finally:
        child.stdin.close()
        child.wait(30)
    print(f"\nserver CPU per streamed token, median of {args.rounds} rounds ({args.streams} streams x "
          f"{args.tokens} tokens, stub step {args.step_ms:g} ms):")
    med = {b: statistics.median(v) for b, v in per_token.items()}
    ttft = {b: statistics.median(v) for b, v in ttfts.items()}
    for b in backends:
        extra = (f"  (x{med[b] / med['grpc']:.2f} gRPC's; median TTFT {ttft[b] - ttft['grpc']:+.1f} ms)"
                 if "grpc" in med and b != "grpc" else "")
        print(f"  {b:12s} {med[b]:.0f} us CPU per token, median TTFT {ttft[b]:.1f} ms{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
