"""Time one layer of the CPU attention: the native kernel (cpu_kernel.cc, what the engine
runs on CPU) against the pure-jnp reference, interleaved in the same run.

SmolLM2-135M-like shapes (Hq=9, Hkv=3, D=64, page 16; f32, or `--dtype bfloat16` as the
CPU's default serves; pages shuffled in a pool larger than the batch). Prints the median
(and min: the machine is shared) time per call, the effective bandwidth (unique K+V bytes of the real contexts / median time; meaningful for
decode, prefill is compute-bound), the native/reference speedup, and this machine's copy
bandwidth measured in the same run (an XLA copy of a 256 MB array, bytes read + written).

    PYTHONPATH=. .venv/bin/python scripts/bench_attention_reference.py [--block-q N] [--chunk-pages N]
        [--dtype bfloat16] [--no-reference] [--only CASE]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention import cpu as native_cpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

HQ, HKV, D, PAGE = 9, 3, 64, 16


def build(seqs: list[tuple[int, int]], num_tokens: int, num_rows: int, max_ctx: int, dtype=np.float32, seed=0):
    """Random batch with (q_len, kv_len) per sequence; shuffled pages of a pool twice the
    batch's size (so the live pages are scattered as in a serving cache); q and the pages in
    `dtype` (f32, or bf16 as the CPU's default serves)."""
    rng = np.random.default_rng(seed)
    max_pages = -(-max_ctx // PAGE)
    pages_per = [-(-kl // PAGE) for _, kl in seqs]
    num_pages = 1 + 2 * sum(pages_per)
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = np.zeros((num_rows, max_pages), np.int32)
    at = 0
    for i, n in enumerate(pages_per):
        tables[i, :n] = ids[at : at + n]
        at += n
    cu = np.full(num_rows + 1, sum(q for q, _ in seqs), np.int32)
    cu[: len(seqs) + 1] = np.concatenate([[0], np.cumsum([q for q, _ in seqs])])
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[: len(seqs)] = [k for _, k in seqs]
    q = rng.standard_normal((num_tokens, HQ, D), np.float32)
    kp = rng.standard_normal((num_pages, PAGE, HKV, D), np.float32)
    vp = rng.standard_normal((num_pages, PAGE, HKV, D), np.float32)
    q, kp, vp = (jnp.asarray(x, dtype) for x in (q, kp, vp))
    args = (q, kp, vp, kv_lens, tables, cu, np.array([len(seqs)], np.int32))
    kv_bytes = sum(k for _, k in seqs) * HKV * D * np.dtype(dtype).itemsize * 2
    return [jnp.asarray(a) for a in args], kv_bytes


def cases(dtype=np.float32) -> dict[str, tuple]:
    b = functools.partial(build, dtype=dtype)
    return {
        "decode B=64 ctx=160": b([(1, 160)] * 64, 64, 64, 256),
        "decode B=64 ctx=256": b([(1, 256)] * 64, 64, 64, 256),
        "decode B=64 ctx=1024": b([(1, 1024)] * 64, 64, 64, 1024),
        "prefill 512 (new seq)": b([(512, 512)], 512, 8, 2048),
        "prefill 512 (ctx 2048)": b([(512, 2048)], 512, 8, 2048),
        "mixed T=512: 63 dec@512 + 449 pf": b([(1, 512)] * 63 + [(449, 449)], 512, 64, 1024),
        "decode B=1 ctx=256": b([(1, 256)], 8, 8, 256),
    }


def bench(fns: dict, args, reps: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per call of each fn, calls interleaved so drift hits all alike."""
    for fn in fns.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[k].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v)) for k, v in times.items()}


def copy_bandwidth(reps: int = 5) -> float:
    """Bytes read + written per second by an XLA:CPU copy of 256 MB (output reused)."""
    x = jnp.ones((64 << 20,), jnp.float32)
    out = jnp.zeros_like(x)
    copy = jax.jit(lambda src, dst: dst.at[:].set(src), donate_argnums=(1,))
    out = jax.block_until_ready(copy(x, out))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(copy(x, out))
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-q", type=int, default=None, help="reference tuning")
    ap.add_argument("--chunk-pages", type=int, default=None, help="reference tuning")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default=None, help="substring of the case names to run")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="q and the pages")
    ap.add_argument("--no-reference", action="store_true", help="time the native kernel only")
    a = ap.parse_args()
    ok, why = native_cpu.available()
    fns = {} if a.no_reference else {"reference": jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=D**-0.5,
                                                  block_q=a.block_q, chunk_pages=a.chunk_pages))}
    if ok:
        fns["native"] = jax.jit(functools.partial(native_cpu.ragged_paged_attention_cpu, sm_scale=D**-0.5))
    bw = copy_bandwidth()
    print(f"device={jax.devices()[0]} load avg {os.getloadavg()[0]:.2f}; native: {why}")
    print(f"copy bandwidth (XLA, 256 MB, read + write): {bw / 1e9:.1f} GB/s")
    print(f"{'case':36s} {'impl':>9s} {'median ms':>10s} {'min ms':>8s} {'KV GB/s':>8s} {'speedup':>8s}")
    for name, (args, kv_bytes) in cases(jnp.dtype(a.dtype)).items():
        if a.only and a.only not in name:
            continue
        res = bench(fns, args, a.reps)
        for impl, (t, t_min) in res.items():
            speed = f"{res['reference'][0] / t:7.2f}x" if impl != "reference" and "reference" in res else f"{'':8s}"
            print(f"{name:36s} {impl:>9s} {t * 1e3:10.3f} {t_min * 1e3:8.3f} {kv_bytes / t / 1e9:8.2f} {speed}")


if __name__ == "__main__":
    main()
