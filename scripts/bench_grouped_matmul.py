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

With `--cpu` it instead times, on this host's CPU, `grouped_matmul(backend="auto")` (the CPU
path of `grouped_matmul/cpu.py`) against `backend="xla"` (`jax.lax.ragged_dot`, which XLA:CPU
runs densely), f32, interleaved in one run (each repetition times both, alternating which
goes first; medians), on Qwen3-30B-A3B-like expert shapes cut so the dense ragged_dot stays
affordable on two cores: G=128 with the TP=8 slices (gate+up K=2048 N=192, down K=96 N=2048),
G=64 (K=2048 N=192, top-8) and G=8 (K=2048 N=192, top-2 as Mixtral routes), for decode-like
M = T x k with T in {1, 8, 64} (each token's k experts drawn uniformly at random, distinct)
and a prefill-like M=4096 (fewer repetitions where a dense call takes seconds; skipped where
the dense expansion's masked lhs would exceed --max-dense-gib). Both results are checked
against the reference. It prints the load average before and after (other work on the host
slows both sides).

    python scripts/bench_grouped_matmul.py [--reps 7] [--calls 20] [--no-compile-check]
    python scripts/bench_grouped_matmul.py --cpu [--reps 9] [--max-dense-gib 5]
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

    from jaxserve.compilation.targets import Target

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


# (name, G, K, N, top-k) for --cpu
CPU_CASES = (
    ("gate_up/8", EXPERTS, HIDDEN, 2 * INTERMEDIATE // 8, TOP_K),
    ("down/8", EXPERTS, INTERMEDIATE // 8, HIDDEN, TOP_K),
    ("G64", 64, HIDDEN, 2 * INTERMEDIATE // 8, TOP_K),
    ("G8top2", 8, HIDDEN, 2 * INTERMEDIATE // 8, 2),
)
CPU_TOKENS = (1, 8, 64)
PREFILL_ROWS = 4096


def random_routing(tokens: int, num_groups: int, top_k: int, rng) -> np.ndarray:
    """Rows per group when each of `tokens` tokens picks `top_k` distinct groups uniformly."""
    picks = np.stack([rng.choice(num_groups, top_k, replace=False) for _ in range(tokens)])
    return np.bincount(picks.ravel(), minlength=num_groups).astype(np.int32)


def time_on_cpu(reps: int, max_dense_gib: float) -> None:
    rng = np.random.default_rng(0)
    auto = jax.jit(pk.grouped_matmul)
    xla = jax.jit(lambda lhs, rhs, sizes: pk.grouped_matmul(lhs, rhs, sizes, backend="xla"))
    load = os.getloadavg()
    print(f"CPU: {os.cpu_count()} cores ({jax.devices()[0].device_kind}), jax {jax.__version__}, f32; "
          f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("wall time per call of the jitted op, median of the repetitions, auto and xla interleaved; "
          "touched: non-empty groups; auto GB/s: the touched groups' weights / auto's time")
    print("case          G     K     N  k     T     M  touched   auto ms    xla ms   xla/auto   auto GB/s  reps")
    for name, g, k, n, top_k in CPU_CASES:
        rhs = jnp.asarray(rng.standard_normal((g, k, n)) / np.sqrt(k), jnp.float32)
        for tokens in CPU_TOKENS + (PREFILL_ROWS // top_k,):
            m = tokens * top_k
            dense_gib = m * g * k * 4 / 2**30  # XLA:CPU's masked lhs, [M, G*K] f32
            if dense_gib > max_dense_gib:
                print(f"{name:<10} {g:>4} {k:>5} {n:>5} {top_k:>2} {tokens:>5} {m:>5}  skipped: the dense "
                      f"expansion would hold {dense_gib:.1f} GiB (> --max-dense-gib {max_dense_gib:g})")
                continue
            sizes_np = random_routing(tokens, g, top_k, rng)
            lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
            sizes = jnp.asarray(sizes_np)
            ref = np.asarray(pk.grouped_matmul(lhs, rhs, sizes, backend="reference"))
            scale = max(float(np.abs(ref).max()), 1.0)
            t0 = time.perf_counter()
            got_x = np.asarray(xla(lhs, rhs, sizes))  # compile + first call
            first_x = time.perf_counter() - t0
            got_a = np.asarray(auto(lhs, rhs, sizes))
            for what, got in (("auto", got_a), ("xla", got_x)):
                err = float(np.abs(got - ref).max())
                assert err <= 1e-4 * scale, f"{name} M={m}: {what} vs reference: {err} (scale {scale})"
            n_reps = reps if first_x < 2.0 else max(3, reps // 3)  # dense calls of seconds: fewer
            times = {"auto": [], "xla": []}
            for r in range(n_reps):
                order = (("auto", auto), ("xla", xla)) if r % 2 == 0 else (("xla", xla), ("auto", auto))
                for what, fn in order:
                    t0 = time.perf_counter()
                    fn(lhs, rhs, sizes).block_until_ready()
                    times[what].append(time.perf_counter() - t0)
            ta, tx = statistics.median(times["auto"]), statistics.median(times["xla"])
            touched = int((sizes_np > 0).sum())
            print(f"{name:<10} {g:>4} {k:>5} {n:>5} {top_k:>2} {tokens:>5} {m:>5} {touched:>8} {ta * 1e3:>9.2f} "
                  f"{tx * 1e3:>9.1f} {tx / ta:>10.1f} {touched * k * n * 4 / ta / 1e9:>11.1f} {n_reps:>5}",
                  flush=True)
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7, help="timed loops per case (the median is kept)")
    parser.add_argument("--calls", type=int, default=20, help="calls per timed loop")
    parser.add_argument("--no-compile-check", action="store_true", help="skip the compile-only H200 columns")
    parser.add_argument("--cpu", action="store_true",
                        help="time the CPU path against XLA:CPU's ragged_dot on this host instead")
    parser.add_argument("--max-dense-gib", type=float, default=5.0,
                        help="--cpu: skip cases whose dense ragged_dot would hold a larger masked lhs")
    args = parser.parse_args()
    if args.cpu:
        time_on_cpu(args.reps, args.max_dense_gib)
        return
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
