"""A gated MLP on CPU: silu(gate) * up in the native matmul's epilogue against the plain
matmul followed by the separate activation (what the model ran before).

Both run as the model calls them: a `lax.scan` over L layers of the MLP (gate_up [L, K, 2I]
and down [L, I, K] stacked, the layer index traced; L chosen so that the stacks do not sit in
the last-level cache), bf16 activations, bf16 or int8 weights. The activation feeds the down
projection (a native call, as in the model), so XLA cannot fuse the separate activation into
its consumer. The two programs alternate inside each repeat (one process, two executables,
so the machine's drift hits both alike); reported per layer: median microseconds of the
whole MLP and separate / fused.

    .venv/bin/python scripts/bench_glu.py [--m 1,4,64,512,2048] [--k 576] [--n 3072] [--reps 9]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.quantized_matmul import cpu  # noqa: E402
from pallas_kernels.quantized_matmul.dense import dense_matmul  # noqa: E402
from pallas_kernels.quantized_matmul.ops import quantized_matmul  # noqa: E402
from pallas_kernels.quantized_matmul.reference import gated  # noqa: E402


def program(weights: str, fused: bool, num_layers: int):
    def mm(x, w, s, layer, glu=None):
        return (dense_matmul(x, w, layer=layer, glu=glu) if weights == "bf16"
                else quantized_matmul(x, w, s, layer=layer, glu=glu))

    def f(x, w, s, wd, sd):
        def body(h, layer):
            act = mm(h, w, s, layer, "silu") if fused else gated(mm(h, w, s, layer), "silu")
            return mm(act, wd, sd, layer), None  # [M, K]: the next layer's input

        return jax.lax.scan(body, x, jnp.arange(num_layers, dtype=jnp.int32))[0]

    return jax.jit(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default="1,4,64,512,2048")
    ap.add_argument("--k", type=int, default=576)
    ap.add_argument("--n", type=int, default=3072, help="2I: gate and up side by side")
    ap.add_argument("--weights", default="bf16,int8")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    assert cpu.available()[0], cpu.available()[1]
    print(f"native matmul {cpu.isa()}; jax {jax.__version__}; K {args.k}, N {args.n}")
    rng = np.random.default_rng(0)
    print(f"{'weights':8s} {'M':>5s} {'L':>3s} {'fused us':>10s} {'separate us':>12s} {'separate/fused':>15s}")
    for weights in args.weights.split(","):
        for m in (int(v) for v in args.m.split(",")):
            nbytes = args.k * args.n * 3 // 2 * (2 if weights == "bf16" else 1)
            layers = max(2, min(30, math.ceil((48e6 if m <= 64 else 12e6) / nbytes)))
            x = jnp.asarray(rng.standard_normal((m, args.k)), jnp.bfloat16)
            half = args.n // 2
            if weights == "bf16":
                w = jnp.asarray(rng.standard_normal((layers, args.k, args.n)) * 0.05, jnp.bfloat16)
                wd = jnp.asarray(rng.standard_normal((layers, half, args.k)) * 0.05, jnp.bfloat16)
                s = sd = jnp.zeros((0,), jnp.float32)
            else:
                w = jnp.asarray(rng.integers(-127, 128, (layers, args.k, args.n), dtype=np.int8))
                wd = jnp.asarray(rng.integers(-127, 128, (layers, half, args.k), dtype=np.int8))
                s = jnp.asarray(rng.uniform(0.5, 1.5, (layers, args.n)).astype(np.float32) / 127 / 8)
                sd = jnp.asarray(rng.uniform(0.5, 1.5, (layers, args.k)).astype(np.float32) / 127 / 8)
            progs = {True: program(weights, True, layers), False: program(weights, False, layers)}
            for p in progs.values():
                p(x, w, s, wd, sd).block_until_ready()
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.reps):
                for fused, p in progs.items():
                    t = time.perf_counter()
                    p(x, w, s, wd, sd).block_until_ready()
                    times[fused].append((time.perf_counter() - t) / layers * 1e6)
            f, sep = statistics.median(times[True]), statistics.median(times[False])
            print(f"{weights:8s} {m:5d} {layers:3d} {f:10.1f} {sep:12.1f} {sep / f:15.2f}", flush=True)


if __name__ == "__main__":
    main()
