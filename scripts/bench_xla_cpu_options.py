"""XLA:CPU compiler options on the shapes the CPU engine runs, measured in one run.

Part 1, the step programs: the SmolLM2-135M backbone of a 64-row decode step (context 160)
and its 64-row logits, each compiled with every option set below (`compile(compiler_options=)`,
so nothing global changes), run interleaved; median and min ms.
Part 2, single GEMMs of the model's shapes at 1 and 64 rows, in GFLOP/s: f32 weights, bf16
weights widened to f32 before the dot ("mix"), and bf16 x bf16 with f32 accumulation.

    PYTHONPATH=. .venv/bin/python scripts/bench_xla_cpu_options.py [--dtype float32] [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

OPTIONS: dict[str, dict] = {
    "default": {},
    "xnnpack": {"xla_cpu_use_xnnpack": True},
    "vector width 512": {"xla_cpu_prefer_vector_width": 512},
    "fast math": {"xla_cpu_enable_fast_math": True},
    "oneDNN": {"xla_cpu_use_onednn": True},
    "XNN dot fusion": {"xla_cpu_experimental_xnn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "YNN dot fusion": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
    "oneDNN dot fusion": {"xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
}


def step_programs(dtype: str, reps: int) -> None:
    from jaxserve.loading.loader import load_model
    from jaxserve.worker.batch import BatchBuilder, SequenceSpan
    from jaxserve.worker.runner import ModelRunner
    from jaxserve.worker.step_programs import backbone_jit, logits_jit

    loaded = load_model(None, dtype=dtype)
    rows, ctx, page = 64, 160, 16
    per = -(-(ctx + 8) // page)
    runner = ModelRunner(loaded, num_pages=1 + per * rows, page_size=page)
    tables = [np.arange(1 + i * per, 1 + (i + 1) * per, dtype=np.int32) for i in range(rows)]
    rng = np.random.default_rng(0)
    spans = [SequenceSpan(rng.integers(1000, 30000, 1).astype(np.int32), ctx, t) for t in tables]
    tok, pos, md, lidx = runner.device_inputs(BatchBuilder(rows, rows, per, page).build(spans, rows, rows))
    h_abs = jax.ShapeDtypeStruct((rows, loaded.config.hidden_size), runner.kv_cache[0].dtype)
    exes = {}
    for name, opts in OPTIONS.items():
        try:
            bb = backbone_jit.lower(runner.graphdef, runner.attention_backend, None, runner.state, runner.kv_cache,
                                    tok, pos, md, lidx).compile(compiler_options=opts)
            lg = logits_jit.lower(runner.graphdef, None, runner.state, h_abs, np.int32(rows), num_rows=rows).compile(
                compiler_options=opts)
            exes[name] = (bb, lg)
        except Exception as e:  # an option this jaxlib does not know
            print(f"  {name}: not available ({str(e).splitlines()[0][:120]})")
    times = {k: ([], []) for k in exes}
    kv = runner.kv_cache
    for rep in range(reps + 2):
        for name, (bb, lg) in exes.items():
            t0 = time.perf_counter()
            h, kv = bb(runner.state, kv, tok, pos, md, lidx)
            jax.block_until_ready(h)
            t1 = time.perf_counter()
            jax.block_until_ready(lg(runner.state, h, np.int32(rows)))
            if rep >= 2:  # the first calls page in buffers
                times[name][0].append(t1 - t0)
                times[name][1].append(time.perf_counter() - t1)
    print(f"\n64-row decode step, ctx {ctx}, {dtype} weights ({runner.attention_backend} attention): ms")
    print(f"  {'options':20s} {'backbone med':>12s} {'min':>7s} {'logits med':>10s} {'min':>7s} {'vs default':>10s}")
    base = statistics.median(times["default"][0]) + statistics.median(times["default"][1])
    for name, (b, lg) in times.items():
        total = statistics.median(b) + statistics.median(lg)
        print(f"  {name:20s} {1e3 * statistics.median(b):12.1f} {1e3 * min(b):7.1f} "
              f"{1e3 * statistics.median(lg):10.1f} {1e3 * min(lg):7.1f} {base / total:9.2f}x")


def gemms(reps: int) -> None:
    def bench(c, args) -> float:
        jax.block_until_ready(c(*args))
        ts = []
        for _ in range(reps * 3):
            t0 = time.perf_counter()
            jax.block_until_ready(c(*args))
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    rng = np.random.default_rng(0)
    print("\nGEMMs, GFLOP/s (median): f32 | bf16 weights widened | bf16 x bf16 -> f32 accumulation")
    for opt_name in ("default", "YNN dot fusion", "oneDNN dot fusion"):
        opts = OPTIONS[opt_name]
        print(f"  [{opt_name}]")
        for m in (1, 64):
            for k, n in ((576, 960), (576, 3072), (1536, 576), (576, 49152)):
                x = jnp.asarray(rng.standard_normal((m, k), np.float32))
                w32 = jnp.asarray(rng.standard_normal((k, n), np.float32))
                w16 = w32.astype(jnp.bfloat16)
                flops = 2 * m * k * n
                f32 = jax.jit(lambda x, w: x @ w).lower(x, w32).compile(compiler_options=opts)
                mix = jax.jit(lambda x, w: x @ w.astype(jnp.float32)).lower(x, w16).compile(compiler_options=opts)
                bf = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
                             ).lower(x, w16).compile(compiler_options=opts)
                r = [flops / bench(c, a) / 1e9 for c, a in ((f32, (x, w32)), (mix, (x, w16)), (bf, (x, w16)))]
                print(f"    {m:3d} x {k:5d} x {n:6d}: {r[0]:6.0f} | {r[1]:6.0f} | {r[2]:6.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-gemms", action="store_true")
    a = ap.parse_args()
    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.2f}")
    step_programs(a.dtype, a.reps)
    if not a.skip_gemms:
        gemms(a.reps)


if __name__ == "__main__":
    main()
