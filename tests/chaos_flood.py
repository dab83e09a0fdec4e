"""A tokenization flood from its own process (so that its client work is not the server's):
`concurrency` callers send 16k-character Tokenize calls, and every fourth caller 16k-character
Generate prompts that are too long for the model (refused after tokenizing), back to back
for `seconds`. Prints the count of each status as one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import grpc

from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc

TEXT = ("The quick brown fox jumps over the lazy dog. " * 360)[:16000]


async def main(address: str, key: str, seconds: float, concurrency: int) -> dict[str, int]:
    md = (("authorization", f"Bearer {key}"),)
    counts: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.JaxServeStub(ch)
        await ch.channel_ready()
        print("flooding", flush=True)
        end = time.monotonic() + seconds

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

        await asyncio.gather(*(caller(i) for i in range(concurrency)))
    return counts


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("key")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=24)
    ns = ap.parse_args()
    print(json.dumps(asyncio.run(main(ns.address, ns.key, ns.seconds, ns.concurrency))), flush=True)
