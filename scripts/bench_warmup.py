"""Cold versus warm startup of the compile plan on the embedded model.

Runs `jaxserve warmup` twice in fresh processes against a new, empty compilation cache: the
first compiles every planned shape, the second loads them all from the persistent cache.
Prints the number of shapes, both warmup times (model load excluded) and their ratio.

    .venv/bin/python scripts/bench_warmup.py [--max-num-seqs 64 --max-num-batched-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile


def run_warmup(cache: str, manifest: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "jaxserve.cli", "warmup", "--quiet", "--compilation-cache-dir", cache,
           "--manifest", manifest, *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(manifest) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-num-seqs", default="64")
    ap.add_argument("--max-num-batched-tokens", default="512")
    args, rest = ap.parse_known_args()
    extra = ["--max-num-seqs", args.max_num_seqs, "--max-num-batched-tokens", args.max_num_batched_tokens, *rest]
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "xla")
        cold = run_warmup(cache, os.path.join(tmp, "cold.json"), extra)
        warm = run_warmup(cache, os.path.join(tmp, "warm.json"), extra)
    print(f"shapes: {cold['num_shapes']} (token buckets {cold['plan']['token_buckets']}, "
          f"request buckets {cold['plan']['request_buckets']})")
    print(f"cold warmup: {cold['wall_seconds']:.1f} s ({cold['cache_misses']} compiled)")
    print(f"warm startup: {warm['wall_seconds']:.1f} s ({warm['cache_hits']} cache hits, "
          f"{warm['cache_misses']} misses)")
    print(f"warm / cold: {warm['wall_seconds'] / cold['wall_seconds']:.1%}")
    slowest = sorted(cold["shapes"], key=lambda s: -s["seconds"])[:3]
    print("slowest cold shapes: " + ", ".join(f"{s['name']} {s['seconds']:.1f} s" for s in slowest))


if __name__ == "__main__":
    main()
