"""Hardware check of the GPU kernels on one NVIDIA GPU (estimated ~5 minutes on an H200). Exits 1 when a
check fails; every figure it prints is measured on the device it runs on.

1. Correctness, asserted: the Triton attention against the pure-jnp reference (f32 inside)
   on engine-shaped calls: R = max_num_seqs rows with padding rows, token buckets with padding
   tokens, all-decode / mixed decode+prefill / prefill, sliding window + soft cap, contexts to
   8k, a K pool and a V pool of > 4 GiB each (64-bit offsets) with the batch's pages at the
   highest ids, and NaN in every unused slot. Against the reference on f32 copies of the
   inputs: bf16 within 2e-2 and f32 within 1e-4 (absolute + relative), all finite.
2. Device time from one jitted loop of N dependent calls (not host dispatch): the decode
   bandwidth table B x context (unique K+V bytes / time) against the copy bandwidth measured
   the same way, and against JAX's own Pallas `decode_attention.gqa` (k_splits=16, contiguous
   KV, no paging) on the same batch.
3. The KV update runs in place: compiled with the cache donated, no cache-sized copy or
   temporary, and an update of 64 tokens takes a small fraction of one copy of the pool.
4. With `--compiled DIR`: executables that `jaxserve compile --target gpu:<part> --out DIR`
   wrote on a machine without a GPU (`--prepare DIR` does that with this script's engine
   flags) are loaded and served; their greedy tokens must equal those of an engine that
   compiled here.

    python scripts/check_kernels_gpu.py [--quick] [--compiled DIR]     # on the GPU machine
    PYTHONPATH=.venv/accel/cuda JAX_PLATFORMS=cpu python scripts/check_kernels_gpu.py --prepare DIR
    python scripts/check_kernels_gpu.py --smoke    # CPU: the same code paths, tiny, interpreted

Record the printed tables in docs/kernels.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu  # noqa: E402
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference  # noqa: E402

PAGE = 16
# Engine flags the --prepare / --compiled round trip uses on both sides.
ENGINE_FLAGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024, num_pages=512)
FAILURES: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}", flush=True)
    if not ok:
        FAILURES.append(what)


# ---------------------------------------------------------------------- batches
@dataclasses.dataclass(frozen=True)
class Pool:
    """Random K/V pages, NaN everywhere no batch writes; pages are handed out from the top."""
    k: jax.Array  # [P, ps, Hkv, D]
    v: jax.Array

    @classmethod
    def make(cls, num_pages: int, hkv: int, d: int, dtype, seed: int = 0) -> Pool:
        shape = (num_pages, PAGE, hkv, d)
        kk, kv = jax.random.split(jax.random.key(seed))
        return cls(jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype))


def engine_batch(pool: Pool, seqs: list[tuple[int, int]], num_tokens: int, num_rows: int, hq: int, seed: int = 0):
    """Args of one engine step over `pool`: (q_len, kv_len) per real sequence, padded to
    `num_tokens` tokens and `num_rows` rows like the engine's buckets. The sequences' pages are
    the highest ids of the pool, shuffled; every other slot (and each last page's tail) is NaN."""
    rng = np.random.default_rng(seed)
    num_pages, _, hkv, d = pool.k.shape
    per = [-(-kv // PAGE) for _, kv in seqs]
    max_pages = max(per)
    ids = num_pages - 1 - rng.permutation(sum(per))
    tables = np.zeros((num_rows, max_pages), np.int32)
    live = np.zeros((num_pages, PAGE), bool)
    at = 0
    for i, ((_, kv), n) in enumerate(zip(seqs, per)):
        tables[i, :n] = ids[at:at + n]
        at += n
        slots = np.arange(kv)
        live[tables[i, slots // PAGE], slots % PAGE] = True
    mask = jnp.asarray(live)[:, :, None, None]
    k = jnp.where(mask, pool.k, jnp.nan)
    v = jnp.where(mask, pool.v, jnp.nan)
    total = sum(q for q, _ in seqs)
    assert total <= num_tokens and len(seqs) <= num_rows
    cu = np.full(num_rows + 1, total, np.int32)
    cu[: len(seqs) + 1] = np.concatenate([[0], np.cumsum([q for q, _ in seqs])])
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    q = jax.random.normal(jax.random.key(seed + 1), (num_tokens, hq, d), pool.k.dtype)
    return (q, k, v, jnp.asarray(kv_lens), jnp.asarray(tables), jnp.asarray(cu), jnp.array([len(seqs)], jnp.int32))


# ---------------------------------------------------------------------- timing
def device_seconds(fn, *args, n: int = 50, reps: int = 5) -> float:
    """Median seconds per call of `fn(*args)` over `reps` runs of one jitted loop of `n` calls.
    Each call's query depends on the previous output, so XLA can neither hoist nor merge them."""

    @jax.jit
    def loop(first, *rest):
        def body(_, acc):
            out = fn(first + (acc * 0).astype(first.dtype), *rest)
            return acc + out.reshape(-1)[0].astype(jnp.float32)

        return jax.lax.fori_loop(0, n, body, jnp.float32(0))

    jax.block_until_ready(loop(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int) -> float:
    """Bytes/s of `x + 1` over `num_bytes` (one read and one write per element)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    return 2 * num_bytes / device_seconds(lambda a: a + 1.0, x, n=20)


# ---------------------------------------------------------------------- 1. correctness
def correctness(smoke: bool, interpret: bool) -> None:
    print("\n1. correctness: Triton kernel vs the reference (NaN in unused slots, pages at the top ids)")
    if smoke:
        heads = {"smollm2 bf16": (9, 3, 64, jnp.bfloat16, 2e-2), "llama f32": (8, 2, 128, jnp.float32, 1e-4)}
        pool_pages, ctx, rows = 64, 100, 8
    else:
        heads = {"llama-3-8b bf16": (32, 8, 128, jnp.bfloat16, 2e-2), "smollm2 bf16": (9, 3, 64, jnp.bfloat16, 2e-2),
                 "d=80 bf16": (16, 4, 80, jnp.bfloat16, 2e-2), "llama-3-8b f32": (32, 8, 128, jnp.float32, 1e-4)}
        pool_pages, ctx, rows = None, 8192, 256
    rng = np.random.default_rng(0)
    for name, (hq, hkv, d, dtype, tol) in heads.items():
        item = jnp.dtype(dtype).itemsize
        # > 4 GiB per pool in bf16 (Pallas switches to 64-bit offsets there); f32 cases stay smaller.
        pages = pool_pages or ((int(4.5 * 2**30) if item == 2 else 2**30) // (PAGE * hkv * d * item))
        pool = Pool.make(pages, hkv, d, dtype)
        print(f" {name}: pool {2 * pages * PAGE * hkv * d * item / 2**30:.2f} GiB (K+V), {pages} pages", flush=True)
        decodes = [(1, int(c)) for c in rng.integers(1, ctx + 1, size=rows // 4)]
        cases = {
            f"decode R={rows} B={len(decodes)} T=64": (decodes, 64, None, None),
            "mixed: decodes + 2 prefill chunks, T=1024": (
                decodes[:30] + [(min(512, ctx // 2), ctx // 2), (min(300, ctx // 2), min(300, ctx // 2))], 1024,
                None, None),
            "prefill chunk to ctx, T=2048": ([(min(2000, ctx), ctx)], 2048, None, None),
            f"mixed + window {4096 if not smoke else 24} + soft cap 50": (
                decodes[:30] + [(min(512, ctx // 2), ctx // 2)], 1024, 4096 if not smoke else 24, 50.0),
        }
        for label, (seqs, tokens, window, cap) in cases.items():
            args = engine_batch(pool, seqs, tokens, rows, hq, seed=len(label))
            kw = dict(sm_scale=d**-0.5, sliding_window=window, soft_cap=cap)
            got = jax.jit(functools.partial(ragged_paged_attention_gpu, interpret=interpret, **kw))(*args)
            f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
            want = jax.jit(functools.partial(ragged_paged_attention_reference, **kw))(*f32)
            got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
            del f32, want
            err = np.abs(got32 - want32)
            worst = float(np.max(err / (1.0 + np.abs(want32))))  # tol is absolute and relative
            total = int(args[5][len(seqs)])
            check(bool(np.isfinite(got32).all()) and worst <= tol and not got32[total:].any(),
                  f"{label}: max |err| {float(err.max()):.1e}, max |err| / (1 + |want|) {worst:.1e} (<= {tol:g}), "
                  "finite, padding zero")
        del pool


# ---------------------------------------------------------------------- 2. decode bandwidth
def decode_table(quick: bool, smoke: bool, interpret: bool, copy_bw: float, copy_bytes: int) -> None:
    from jax.experimental.pallas.ops.gpu import decode_attention

    print("\n2. decode attention, Llama-3-8B heads (32/8/128) bf16, device time of a jitted loop")
    print(f"   copy bandwidth (x + 1 over {copy_bytes / 2**30:g} GiB): {copy_bw / 1e12:.2f} TB/s")
    hq, hkv, d, dtype = (8, 2, 64, jnp.float32) if smoke else (32, 8, 128, jnp.bfloat16)
    batches = (1, 4) if smoke else ((1, 8, 64) if quick else (1, 2, 4, 8, 16, 64, 128))
    contexts = (64,) if smoke else (2048, 8192)
    print(f"   {'B':>4} {'ctx':>5} {'kernel us':>10} {'TB/s':>6} {'% copy':>7} {'gqa us':>8} {'gqa TB/s':>8} "
          f"{'kernel/gqa':>10}")
    rows = 128
    for ctx in contexts:
        for b in batches:
            tokens = max(16, 1 << (b - 1).bit_length())
            pages = 1 + b * -(-ctx // PAGE)
            pool = Pool.make(pages, hkv, d, dtype, seed=b)
            args = engine_batch(pool, [(1, ctx)] * b, tokens, max(rows, b), hq, seed=b)
            args = (args[0], pool.k, pool.v, *args[3:])  # timing: no NaN slots needed
            kernel = functools.partial(ragged_paged_attention_gpu, sm_scale=d**-0.5, interpret=interpret)
            t_k = device_seconds(kernel, *args)
            kv_bytes = 2 * b * ctx * hkv * d * jnp.dtype(dtype).itemsize
            # The baseline: the same batch as contiguous [B, ctx, Hkv, D] KV.
            k_c = pool.k[args[4][:b]].reshape(b, -1, hkv, d)[:, :ctx]
            v_c = pool.v[args[4][:b]].reshape(b, -1, hkv, d)[:, :ctx]
            splits = 16 if ctx >= 2048 else 1
            gqa = functools.partial(decode_attention.gqa, sm_scale=d**-0.5, k_splits=splits,
                                    block_k=min(128, ctx // splits), interpret=interpret)
            t_g = device_seconds(gqa, args[0][:b], k_c, v_c)
            bw_k, bw_g = kv_bytes / t_k, kv_bytes / t_g
            print(f"   {b:4d} {ctx:5d} {t_k * 1e6:10.1f} {bw_k / 1e12:6.2f} {100 * bw_k / copy_bw:6.1f}% "
                  f"{t_g * 1e6:8.1f} {bw_g / 1e12:8.2f} {t_g / t_k:9.2f}x", flush=True)
            del pool, args, k_c, v_c
    print("   targets (on hardware): >= 70% of copy at B >= 8 and ctx >= 2k; >= 50% at B = 1, ctx 8k")


# ---------------------------------------------------------------------- 3. KV update in place
def kv_update_in_place(smoke: bool, interpret: bool, copy_bw: float) -> None:
    import pallas_kernels as pk
    from jaxserve.compilation.aot import cache_copies

    print("\n3. KV update: in place on a donated cache")
    hkv, d, dtype = 8, 128, jnp.bfloat16
    pages = 64 if smoke else int(4.5 * 2**30) // (PAGE * hkv * d * 2)
    pool_bytes = pages * PAGE * hkv * d * 2
    k = jnp.zeros((pages, PAGE, hkv, d), dtype)
    v = jnp.zeros_like(k)
    new = jax.random.normal(jax.random.key(0), (64, hkv, d), dtype)
    slots = jnp.asarray(np.random.default_rng(0).permutation(pages * PAGE)[:64].astype(np.int32))
    backend = "pallas" if interpret else "auto"
    update = jax.jit(functools.partial(pk.update_kv_cache, backend=backend, interpret=interpret), donate_argnums=(2, 3))
    compiled = update.lower(new, new, k, v, slots).compile()
    hlo = compiled.as_text()
    temp = compiled.memory_analysis().temp_size_in_bytes
    copies = cache_copies(hlo, (PAGE, hkv, d), pages * PAGE * hkv * d)
    # (Interpreted on CPU the kernel is a loop of XLA ops: its temporaries say nothing.)
    check(smoke or ("update_kv_cache_gpu" in hlo and temp < pool_bytes // 100), f"kernel in HLO, temporaries "
          f"{temp / 2**20:.2f} MiB of a {pool_bytes / 2**30:.2f} GiB pool")
    check(copies == 0, f"{copies} cache-sized copies in the compiled update")
    k2, v2 = compiled(new, new, k, v, slots)
    got = np.asarray(k2.reshape(-1, hkv, d)[np.asarray(slots)], np.float32)
    check(np.array_equal(got, np.asarray(new, np.float32)), "the 64 rows landed in their slots")

    def step(kv, _):
        return update(new, new, *kv, slots), None

    loop = jax.jit(lambda kk, vv: jax.lax.scan(step, (kk, vv), None, length=50)[0], donate_argnums=(0, 1))
    k2, v2 = jax.block_until_ready(loop(k2, v2))
    t0 = time.perf_counter()
    k2, v2 = jax.block_until_ready(loop(k2, v2))
    t_update = (time.perf_counter() - t0) / 50
    t_copy = 2 * pool_bytes / copy_bw  # K and V, read + write
    print(f"   update of 64 tokens: {t_update * 1e6:.1f} us; one copy of the K+V pool would take "
          f"{t_copy * 1e6:.1f} us ({t_update / t_copy:.4f}x)")
    if not smoke:
        check(t_update < 0.01 * t_copy, "the update costs < 1% of a pool copy (it does not copy)")


# ---------------------------------------------------------------------- 4. serialized executables
def prepare(directory: str, part: str) -> int:
    from jaxserve.cli import main as cli

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_FLAGS.items()]
    return cli(["compile", "--target", f"gpu:{part}", "--out", directory, "--quiet", *flags])


def serve_compiled(directory: str) -> None:
    from jaxserve import LLM, SamplingParams

    print(f"\n4. executables from {directory}, compiled without a GPU, loaded and served")
    params = SamplingParams(temperature=0, max_tokens=24)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    try:
        loaded = LLM(compiled_dir=directory, **ENGINE_FLAGS)
        got = [o.outputs[0].token_ids for o in loaded.generate(prompts, params)]
        del loaded
    except Exception as e:  # noqa: BLE001 - report the refusal itself (a device-kind mismatch, say)
        check(False, f"load and serve: {type(e).__name__}: {str(e)[:400]}")
        return
    want = [o.outputs[0].token_ids for o in LLM(**ENGINE_FLAGS).generate(prompts, params)]
    check(got == want, "greedy tokens equal those of an engine compiled on this GPU")


def run_kernel_tests() -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-k", "gpu", "tests/test_kernels_attention.py",
           "tests/test_kernels_kv_update.py"]
    print("$", " ".join(cmd), flush=True)
    check(subprocess.run(cmd).returncode == 0, "kernel tests (the Triton kernels run natively)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--compiled", default=None, help="a `--prepare` directory to load and serve")
    ap.add_argument("--prepare", default=None, help="compile the engine for --part into this directory (no GPU)")
    ap.add_argument("--part", default="h200")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, kernels interpreted (tests the script)")
    a = ap.parse_args()
    if a.prepare:
        return prepare(a.prepare, a.part)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not a.smoke:
        print(f"no GPU here (platform {jax.default_backend()!r}); --smoke runs the script's paths on CPU")
        return 2
    print("device:", jax.devices()[0].device_kind, f"({jax.device_count()} visible)", flush=True)
    if on_gpu:
        from jaxserve.compilation.gpu_specs import GPUS

        kinds = {s.device_kind: p for p, s in GPUS.items()}
        print(f"  gpu_specs part for this device kind: {kinds.get(jax.devices()[0].device_kind, 'none')}")
        if not a.skip_tests:
            run_kernel_tests()
    interpret = not on_gpu
    correctness(a.smoke, interpret)
    copy_bytes = 2**20 if a.smoke else 2**31
    copy_bw = copy_bandwidth(copy_bytes)
    decode_table(a.quick, a.smoke, interpret, copy_bw, copy_bytes)
    kv_update_in_place(a.smoke, interpret, copy_bw)
    if a.compiled:
        serve_compiled(a.compiled)
    print(f"\n{len(FAILURES)} checks failed" + (": " + "; ".join(FAILURES) if FAILURES else ""))
    if a.smoke:
        print("(smoke run on CPU: the figures above are not GPU figures)")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
