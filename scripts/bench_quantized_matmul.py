"""Weight-only int8 matmul on CPU: f32 `x @ w`, the jnp reference and the native kernel.

Each case runs as the model calls it: a `lax.scan` over L stacked layers ([L, K, N] weights,
the layer index traced), L chosen so that the int8 stack (~48 MB) does not sit in the last
level cache, capped for large M. f32 activations. Reported per layer: median ms over
interleaved repeats (the implementations alternate inside each repeat), the GB/s of the
weight bytes as stored (f32: 4 bytes per weight, int8: 1), and f32 ms / ms ratios.
Implementations: f32 (`x @ w[l]`, f32 weights), ref (the jnp reference on int8), native (the
kernel, f32 products), nat-bf16 (the kernel with precision="bf16": for M > 4 bf16 dot
products; for M <= 4 the same path as native, so not run).

    .venv/bin/python scripts/bench_quantized_matmul.py [--m 1,4,64,512] [--shapes qkv,o] [--reps 7]
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_matmul import cpu
from pallas_kernels.quantized_matmul.reference import quantized_matmul_reference

SHAPES = {  # name: (K, N); SmolLM2-135M's projections, its logits, and an 8B MLP's
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
    "8b_up": (4096, 14336),
}


def layers_for(k: int, n: int, m: int) -> int:
    """Enough layers for ~48 MB of int8 weights, fewer for large M (compute-bound there)."""
    budget = 48e6 if m <= 64 else 12e6
    return max(2, min(64, math.ceil(budget / (k * n))))


def scanned(matmul, num_layers):
    def f(x, w, s):
        def body(acc, layer):
            return acc + matmul(x, w, s, layer).astype(jnp.float32), None

        acc = jnp.zeros((x.shape[0], w.shape[-1]), jnp.float32)
        return jax.lax.scan(body, acc, jnp.arange(num_layers, dtype=jnp.int32))[0]

    return jax.jit(f)


def f32_matmul(x, w, s, layer):
    return x @ jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,4,64,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    ok, why = cpu.available()
    if not ok:
        raise SystemExit(f"native kernel unavailable: {why}")
    rng = np.random.default_rng(0)
    print(f"jax {jax.__version__}, {why}; load average at start {os.getloadavg()}")
    print(f"{'shape':8s} {'K':>5s} {'N':>6s} {'M':>4s} {'L':>3s} | {'f32 ms':>8s} {'GB/s':>5s} | "
          f"{'ref ms':>8s} {'GB/s':>5s} | {'native ms':>9s} {'GB/s':>5s} | {'nat-bf16':>8s} | "
          f"{'f32/ref':>7s} {'f32/nat':>7s} {'f32/bf16':>8s} | load")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        for m in (int(v) for v in args.m.split(",")):
            if k * n > 20e6 and m > 64:
                continue  # the 8B shape at 512 rows: seconds per repeat, compute-bound anyway
            num_layers = layers_for(k, n, m)
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            w8 = jnp.asarray(rng.integers(-127, 128, (num_layers, k, n), dtype=np.int8))
            s = jnp.asarray(rng.random((num_layers, n), dtype=np.float32) / 127)
            w32 = (w8.astype(jnp.float32) * s[:, None, :]).block_until_ready()
            runs = [(scanned(f32_matmul, num_layers), (x, w32, s)),
                    (scanned(quantized_matmul_reference, num_layers), (x, w8, s)),
                    (scanned(cpu.quantized_matmul_cpu, num_layers), (x, w8, s))]
            if m > 4:
                bf16 = functools.partial(cpu.quantized_matmul_cpu, precision="bf16")
                runs.append((scanned(bf16, num_layers), (x, w8, s)))
            for f, a in runs:
                jax.block_until_ready(f(*a))
            times: list[list[float]] = [[] for _ in runs]
            for _ in range(args.reps):
                for i, (f, a) in enumerate(runs):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*a))
                    times[i].append((time.perf_counter() - t0) / num_layers)
            ms = [statistics.median(t) * 1e3 for t in times]
            gbs = [4 * k * n / ms[0] / 1e6, k * n / ms[1] / 1e6, k * n / ms[2] / 1e6]
            load = os.getloadavg()[0]
            bf16_ms, bf16_ratio = ((f"{ms[3]:8.3f}", f"{ms[0] / ms[3]:8.2f}") if len(ms) > 3
                                   else ("", ""))
            print(f"{name:8s} {k:5d} {n:6d} {m:4d} {num_layers:3d} | {ms[0]:8.3f} {gbs[0]:5.1f} | "
                  f"{ms[1]:8.3f} {gbs[1]:5.1f} | {ms[2]:9.3f} {gbs[2]:5.1f} | {bf16_ms:>8s} | "
                  f"{ms[0] / ms[1]:7.2f} {ms[0] / ms[2]:7.2f} {bf16_ratio:>8s} | {load:.2f}",
                  flush=True)
            del runs, w8, w32
    print(f"load average at end {os.getloadavg()}")


if __name__ == "__main__":
    main()
