"""Device check for the Pallas kernels on an NVIDIA GPU (a few minutes).

1. Runs the kernel tests natively (tests/test_kernels_*.py: on a GPU the Triton kernels run
   compiled, the TPU kernels in the TPU interpreter).
2. Decode micro-benchmark of ragged paged attention: achieved K/V read bandwidth (unique
   K+V bytes of the real contexts / time), compared with the bandwidth of a device-to-device
   copy measured on the same GPU, and the speed-up over the pure-jnp reference path.
   Target (issue 7): >= 70% of copy bandwidth for contexts >= 2k.

    PYTHONPATH=. .venv/bin/python scripts/check_kernels_gpu.py [--skip-tests] [--quick]

Record the printed table in docs/kernels.md.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

PAGE = 16


def timed(fn, *args, iters: int = 20) -> float:
    """Seconds per call: back-to-back calls, one sync (dispatch overlaps the kernels)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / iters)
    return best


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the roofline to beat."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    fn = jax.jit(lambda a: a + 1.0)  # one read + one write per element
    return 2 * num_bytes / timed(fn, x)


def decode_batch(batch: int, ctx: int, hq: int, hkv: int, d: int, dtype, seed: int = 0):
    """All-decode step: `batch` sequences of `ctx` tokens, pages shuffled over the cache."""
    rng = np.random.default_rng(seed)
    pages_per = -(-ctx // PAGE)
    num_pages = 1 + batch * pages_per
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = ids.reshape(batch, pages_per)
    key = jax.random.key(seed)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, hq, d), dtype)
    k_pages = jax.random.normal(kk, (num_pages, PAGE, hkv, d), dtype)
    v_pages = jax.random.normal(kv, (num_pages, PAGE, hkv, d), dtype)
    args = (
        q,
        k_pages,
        v_pages,
        jnp.full((batch,), ctx, jnp.int32),
        jnp.asarray(tables),
        jnp.arange(batch + 1, dtype=jnp.int32),
        jnp.array([batch], jnp.int32),
    )
    kv_bytes = 2 * batch * ctx * hkv * d * jnp.dtype(dtype).itemsize
    return args, kv_bytes


def run_tests() -> bool:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "tests/test_kernels_attention.py",
        "tests/test_kernels_kv_update.py",
        "tests/test_attention_reference.py",
    ]
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode == 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    a = ap.parse_args()
    if jax.default_backend() != "gpu":
        print(f"no GPU here (platform {jax.default_backend()!r}); nothing to check")
        return 2
    print("device:", jax.devices()[0].device_kind, flush=True)
    ok = True if a.skip_tests else run_tests()

    copy_bw = copy_bandwidth()
    print(f"\ncopy bandwidth: {copy_bw / 1e12:.2f} TB/s\n")
    models = {"llama8b bf16": (32, 8, 128, jnp.bfloat16), "smollm2 bf16": (9, 3, 64, jnp.bfloat16)}
    shapes = (
        [(64, 2048), (64, 4096), (16, 8192)]
        if a.quick
        else [(8, 2048), (64, 2048), (64, 4096), (128, 4096), (16, 8192), (64, 8192)]
    )
    print(
        f"{'model':14s} {'B':>4s} {'ctx':>6s} {'kernel us':>10s} {'TB/s':>6s} "
        f"{'% copy':>7s} {'ref us':>9s} {'x ref':>6s} {'max err':>8s}"
    )
    for model, (hq, hkv, d, dtype) in models.items():
        for batch, ctx in shapes:
            args, kv_bytes = decode_batch(batch, ctx, hq, hkv, d, dtype)
            kern = jax.jit(functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5))
            ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=d**-0.5))
            t_k = timed(kern, *args)
            t_r = timed(ref, *args, iters=5)
            err = float(
                jnp.max(jnp.abs(kern(*args).astype(jnp.float32) - ref(*args).astype(jnp.float32)))
            )
            bw = kv_bytes / t_k
            print(
                f"{model:14s} {batch:4d} {ctx:6d} {t_k * 1e6:10.1f} {bw / 1e12:6.2f} "
                f"{100 * bw / copy_bw:6.1f}% {t_r * 1e6:9.1f} {t_r / t_k:6.1f} {err:8.1e}",
                flush=True,
            )
    print("\nkernel tests:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
