"""Hostile clients in their own process (so that their CPU work is not counted as the
server's), for the chaos tests and `scripts/bench_chaos.py`:

- `flood ADDRESS KEY`: `concurrency` callers send 16k-character Tokenize calls, and every
  fourth caller 16k-character Generate prompts too long for the model (refused after
  tokenizing), back to back for `seconds`;
- `streams ADDRESS KEY --streams N`: N concurrent Generate streams of `--max-tokens` tokens
  over `--connections` connections.

Prints "ready" once connected, then the count of each final status as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc

TEXT = ("The quick brown fox jumps over the lazy dog. " * 360)[:16000]


async def _channels(address: str, k: int) -> list[grpc.aio.Channel]:
    chans = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(k)]
    for c in chans:
        await c.channel_ready()
    return chans


async def flood(ns: argparse.Namespace, md: tuple) -> dict[str, int]:
    counts: dict[str, int] = {}
    (ch,) = await _channels(ns.address, 1)
    stub = pb_grpc.JaxServeStub(ch)
    print("ready", flush=True)
    end = time.monotonic() + ns.seconds

    async def caller(i: int) -> None:
        while time.monotonic() < end:
            try:
                if i % 4 == 0:
                    await stub.Generate(pb.GenerateRequest(text=TEXT), metadata=md).read()
                else:
                    await stub.Tokenize(pb.TokenizeRequest(text=TEXT), metadata=md)
                k = "OK"
            except grpc.aio.AioRpcError as e:
                k = e.code().name
            counts[k] = counts.get(k, 0) + 1

    await asyncio.gather(*(caller(i) for i in range(ns.concurrency)))
    await ch.close()
    return counts


async def streams(ns: argparse.Namespace, md: tuple) -> dict[str, int]:
    chans = await _channels(ns.address, ns.connections)
    stubs = [pb_grpc.JaxServeStub(c) for c in chans]
    print("ready", flush=True)

    async def one(i: int) -> str:
        call = stubs[i % len(stubs)].Generate(pb.GenerateRequest(
            text=f"#{i} hi", sampling_params=pb.SamplingParams(max_tokens=ns.max_tokens, ignore_eos=True)),
            metadata=md)
        n = 0
        try:
            async for resp in call:
                n += sum(len(d.token_ids) for d in resp.outputs)
        except grpc.aio.AioRpcError as e:
            return e.code().name
        return "OK" if n == ns.max_tokens else f"SHORT_{n}"

    out = await asyncio.gather(*(one(i) for i in range(ns.streams)))
    for c in chans:
        await c.close()
    return {k: out.count(k) for k in set(out)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["flood", "streams"])
    ap.add_argument("address")
    ap.add_argument("key")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--connections", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=2)
    ns = ap.parse_args()
    md = (("authorization", f"Bearer {ns.key}"),)
    print(json.dumps(asyncio.run(flood(ns, md) if ns.mode == "flood" else streams(ns, md))), flush=True)
