"""Grouped matmul (MoE experts) on Qwen3-30B-A3B's expert shapes: the Triton kernel against
`jax.lax.ragged_dot`, which XLA:GPU (jax 0.10) expands densely (every row times every expert).

For M in {64, 512, 4096} rows (tokens x top-8) and the gate+up / down projections, unsharded
(tp=1: [128, 2048, 1536] and [128, 768, 2048]) and at tensor parallel 8 ([128, 2048, 192],
[128, 96, 2048]), it prints:

- FLOPs of the grouped product (2 M K N, arithmetic) and of the dense expansion (2 M G K N),
  plus XLA's cost analysis of `ragged_dot` lowered for an H200 (no GPU needed), which
  confirms the expansion;
- compiled for an H200 (compile-only on a CPU host, for the GPU itself on a GPU host): whether `grouped_matmul(backend="auto")` compiles to the Triton
  kernel and holds no dense operand;
- on a GPU (jax.devices()[0].platform == "gpu"): device time per call of `auto` (the kernel)
  and of `jax.lax.ragged_dot` in the same run (a jitted loop of dependent calls, median of
  several loops), the kernel's TFLOP/s and weight bandwidth (G K N bf16 bytes / time), and the
  largest difference between the two; the kernel is asserted against the f32 reference
  (bf16 tolerance). On a CPU host it says no GPU is present and prints the rest.

    python scripts/bench_grouped_matmul.py [--reps 7] [--calls 20] [--no-compile-check]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# No NVIDIA device here: compile-only GPU targets need JAX_PLATFORMS=cpu before jax is imported
# (else the CUDA plugin looks for a driver) and the plugin from .venv/accel/cuda, if installed.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    accel = os.path.join(ROOT, ".venv", "accel", "cuda")
    if os.path.isdir(accel):
        sys.path.append(accel)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 128, 8, 2048, 768  # Qwen3-30B-A3B
ROWS = (64, 512, 4096)


def shapes(tp: int) -> dict[str, tuple[int, int]]:
    """(K, N) of the two expert matmuls with the intermediate width split over `tp` devices."""
    inter = INTERMEDIATE // tp
    return {"gate_up": (HIDDEN, 2 * inter), "down": (inter, HIDDEN)}


def routed_group_sizes(m: int, rng) -> np.ndarray:
    """Rows per expert as top-k routing of m / TOP_K tokens gives them: uneven, some empty."""
    weights = rng.gamma(0.5, size=EXPERTS)
    return rng.multinomial(m, weights / weights.sum()).astype(np.int32)


def lower_for_gpu(fn, args, on_gpu: bool):
    """Lowered for this host's GPU, or without one for a compile-only H200."""
    if on_gpu:
        return jax.jit(fn).lower(*args)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jaxserve.targets import Target

    device = Target.parse("gpu:h200").devices()[0]
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    return jax.jit(fn).lower(*sds)


def largest_activation(hlo: str, k: int, n: int) -> int:
    """Elements of the largest array in `hlo` other than the weights (G x K x N elements)."""
    sizes = [int(np.prod([int(d) for d in dims.split(",")]))
             for dims in re.findall(r"\b(?:bf16|f16|f32)\[([0-9,]+)\]", hlo)]
    return max((x for x in sizes if x != EXPERTS * k * n), default=0)


def flops_table(compile_check: bool, on_gpu: bool) -> None:
    print(f"Qwen3-30B-A3B experts: G={EXPERTS}, hidden {HIDDEN}, intermediate {INTERMEDIATE}, bf16")
    print("FLOPs: grouped = 2 M K N; dense = 2 M G K N, what ragged_dot's dense expansion computes (arithmetic).")
    cols = "tp  proj     M     K     N   grouped GFLOP   dense GFLOP   dense/grouped"
    if compile_check:
        where = "this GPU" if on_gpu else "an H200 (compile-only)"
        print(f"Compiled for {where}: the largest non-weight array of ragged_dot's and of auto's program, in units "
              "of M*G*K elements (>= 1: the masked lhs of a dense expansion); auto's Triton custom call present?")
        cols += "   ragged_dot big   Triton   auto big"
    print(cols)
    for tp in (1, 8):
        for proj, (k, n) in shapes(tp).items():
            for m in ROWS:
                grouped = 2 * m * k * n
                dense = grouped * EXPERTS
                line = f"{tp:>2}  {proj:<7} {m:>5} {k:>5} {n:>5} {grouped / 1e9:>15.3f} {dense / 1e9:>13.1f} " \
                       f"{dense / grouped:>15.0f}"
                if compile_check:
                    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                            jax.ShapeDtypeStruct((EXPERTS, k, n), jnp.bfloat16),
                            jax.ShapeDtypeStruct((EXPERTS,), jnp.int32))
                    try:
                        xla = lower_for_gpu(jax.lax.ragged_dot, args, on_gpu).compile().as_text()
                        hlo = lower_for_gpu(pk.grouped_matmul, args, on_gpu).compile().as_text()
                        triton = "__gpu$xla.gpu.triton" in hlo and "grouped_matmul_gpu" in hlo
                        line += f" {largest_activation(xla, k, n) / (m * EXPERTS * k):>13.2f}"
                        line += f"   {'yes' if triton else 'NO':>6} {largest_activation(hlo, k, n) / (m * EXPERTS * k):>12.4f}"
                    except Exception as e:  # no CUDA plugin: say so, keep the arithmetic
                        line += f"   (compile-only check unavailable: {type(e).__name__}: {str(e)[:80]})"
                        compile_check = False
                print(line)


def per_call_seconds(fn, lhs, rhs, sizes, calls: int, reps: int) -> float:
    """Device time of one call: a jitted loop of `calls` dependent calls (each perturbs one
    element of the next call's lhs by a negligible amount, so XLA cannot hoist or merge
    them), timed `reps` times after a warm-up; the median divided by `calls`."""
    def loop(lhs, rhs, sizes):
        def body(_, x):
            out = fn(x, rhs, sizes)
            return x.at[0, 0].add((out[0, 0].astype(jnp.float32) * 1e-30).astype(x.dtype))

        return jax.lax.fori_loop(0, calls, body, lhs)

    loop = jax.jit(loop)
    loop(lhs, rhs, sizes).block_until_ready()  # compile, warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        loop(lhs, rhs, sizes).block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls


def time_on_gpu(reps: int, calls: int) -> None:
    rng = np.random.default_rng(0)
    print(f"\nmeasured on {jax.devices()[0].device_kind}: device time per call from a jitted loop of {calls} "
          f"dependent calls, median of {reps} loops, kernel and ragged_dot in the same run; group sizes "
          "routed-like (uneven, some experts empty)")
    print("tp  proj     M     K     N   kernel us   ragged_dot us   speedup   kernel TFLOP/s   weights GB/s   max |diff|")
    for tp in (1, 8):
        for proj, (k, n) in shapes(tp).items():
            for m in ROWS:
                lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
                rhs = jnp.asarray(rng.standard_normal((EXPERTS, k, n)) / np.sqrt(k), jnp.bfloat16)
                sizes = jnp.asarray(routed_group_sizes(m, rng))
                got = jax.jit(pk.grouped_matmul)(lhs, rhs, sizes).astype(jnp.float32)
                want = jax.jit(jax.lax.ragged_dot)(lhs, rhs, sizes).astype(jnp.float32)
                ref = pk.grouped_matmul(lhs, rhs, sizes, backend="reference").astype(jnp.float32)
                diff = float(jnp.max(jnp.abs(got - want)))
                err = float(jnp.max(jnp.abs(got - ref)))
                scale = float(jnp.max(jnp.abs(ref)))
                assert err <= 2e-2 * max(scale, 1.0), f"kernel vs reference: {err} (scale {scale})"
                tk = per_call_seconds(pk.grouped_matmul, lhs, rhs, sizes, calls, reps)
                tx = per_call_seconds(jax.lax.ragged_dot, lhs, rhs, sizes, calls, reps)
                flops, weight_bytes = 2 * m * k * n, EXPERTS * k * n * 2
                print(f"{tp:>2}  {proj:<7} {m:>5} {k:>5} {n:>5} {tk * 1e6:>11.1f} {tx * 1e6:>15.1f} "
                      f"{tx / tk:>9.1f} {flops / tk / 1e12:>16.1f} {weight_bytes / tk / 1e9:>14.0f} {diff:>12.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="timed loops per case (the median is kept)")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--no-compile-check", action="store_true", help="skip the compile-only H200 columns")
    args = parser.parse_args()
    platform = jax.devices()[0].platform
    on_gpu = platform == "gpu"
    flops_table(compile_check=not args.no_compile_check, on_gpu=on_gpu)
    if on_gpu:
        time_on_gpu(args.reps, args.calls)
    else:
        print(f"\nNo GPU present (platform {platform!r}): nothing timed; the figures above are arithmetic "
              "and compile-only.")


if __name__ == "__main__":
    main()
