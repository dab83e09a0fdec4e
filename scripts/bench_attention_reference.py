"""Time one layer of the pure-jnp ragged paged attention on the current device.

SmolLM2-135M-like shapes (Hq=9, Hkv=3, D=64, page 16, f32). Prints the median (and min: the
machine is shared) time per call and the effective bandwidth: unique K+V bytes of the real
contexts / median time (meaningful for decode; prefill is compute-bound).

    PYTHONPATH=. .venv/bin/python scripts/bench_attention_reference.py [--block-q N] [--chunk-pages N]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

HQ, HKV, D, PAGE = 9, 3, 64, 16


def build(seqs: list[tuple[int, int]], num_tokens: int, num_rows: int, max_ctx: int, seed=0):
    """Random batch with (q_len, kv_len) per sequence; shuffled pages, f32."""
    rng = np.random.default_rng(seed)
    max_pages = -(-max_ctx // PAGE)
    pages_per = [-(-kl // PAGE) for _, kl in seqs]
    num_pages = 1 + sum(pages_per)
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
    args = (q, kp, vp, kv_lens, tables, cu, np.array([len(seqs)], np.int32))
    kv_bytes = sum(k for _, k in seqs) * HKV * D * 4 * 2
    return [jnp.asarray(a) for a in args], kv_bytes


def cases() -> dict[str, tuple]:
    return {
        "decode B=64 ctx=256": build([(1, 256)] * 64, 64, 64, 256),
        "decode B=64 ctx=1024": build([(1, 1024)] * 64, 64, 64, 1024),
        "prefill 512 (new seq)": build([(512, 512)], 512, 8, 2048),
        "prefill 512 (ctx 2048)": build([(512, 2048)], 512, 8, 2048),
        "mixed T=512: 63 dec@512 + 449 pf": build([(1, 512)] * 63 + [(449, 449)], 512, 64, 1024),
    }


def bench(fn, args, reps: int) -> tuple[float, float]:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-q", type=int, default=None)
    ap.add_argument("--chunk-pages", type=int, default=None)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default=None, help="substring of the case names to run")
    a = ap.parse_args()
    fn = jax.jit(
        functools.partial(
            ragged_paged_attention_reference,
            sm_scale=D**-0.5,
            block_q=a.block_q,
            chunk_pages=a.chunk_pages,
        )
    )
    print(f"device={jax.devices()[0]} block_q={a.block_q} chunk_pages={a.chunk_pages}")
    print(f"{'case':36s} {'median ms':>10s} {'min ms':>8s} {'KV GB/s':>8s}")
    for name, (args, kv_bytes) in cases().items():
        if a.only and a.only not in name:
            continue
        t, t_min = bench(fn, args, a.reps)
        print(f"{name:36s} {t * 1e3:10.2f} {t_min * 1e3:8.2f} {kv_bytes / t / 1e9:8.2f}")


if __name__ == "__main__":
    main()
