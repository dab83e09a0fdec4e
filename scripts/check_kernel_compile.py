"""Which (target, dtype, head layout, page size) cases the Pallas attention compiles for.

Compiles `pallas_kernels.ragged_paged_attention(backend="auto")` for compile-only devices and
prints, per case, whether the target's kernel is in the compiled HLO (Mosaic on TPU, Triton
on GPU; else the reference fallback), the compile time, and the HBM bytes XLA gives the
arguments against their size in the target's cache layout (1.0x: no padding). GPU cases
compile a decode-sized call (16 tokens: the split-KV path) and a prefill-sized one (64: the
unsplit path) in one program. Nothing runs on a device: no speed figure comes out of this.

Needs libtpu (TPU) and the CUDA plugin + ptxas (GPU); `make install-test` puts them in
.venv/accel/{tpu,cuda}:

    PYTHONPATH=.venv/accel/tpu:.venv/accel/cuda JAX_PLATFORMS=cpu \\
        python scripts/check_kernel_compile.py [--targets tpu:v5e,tpu:v6e,gpu:h100,gpu:h200]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from jaxserve.compilation.aot import KERNEL_MARKERS  # noqa: E402
from jaxserve.compilation.targets import Target  # noqa: E402
from pallas_kernels.kv_layout import lanes_width  # noqa: E402

T, T_DECODE, R, MAX_PAGES, NUM_PAGES = 64, 16, 8, 16, 64
HEADS = [(h * g, h, d) for h in (1, 2, 3, 4, 8, 16) for g in (1, 3, 4, 8) for d in (64, 128, 256)]
# Head dims that are not a power of two (the GPU kernel cuts them into column pieces).
ODD_HEADS = [(h * g, h, d) for h in (1, 2, 8) for g in (1, 4) for d in (80, 96)]


def compile_case(target: Target, device, dtype, heads, page_size, window, cap):
    hq, hkv, d = heads
    sh = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sh)
    layout = pk.kv_cache_layout(target.platform)
    page_shape = (NUM_PAGES, page_size, lanes_width(hkv, d)) if layout == "lanes" else (NUM_PAGES, page_size, hkv, d)
    page = S(page_shape, dtype)
    meta = (S((R,), jnp.int32), S((R, MAX_PAGES), jnp.int32), S((R + 1,), jnp.int32), S((1,), jnp.int32))
    attn = functools.partial(pk.ragged_paged_attention, sm_scale=d**-0.5, num_kv_heads=hkv, sliding_window=window,
                             soft_cap=cap)
    token_counts = (T_DECODE, T) if target.platform == "gpu" else (T,)
    queries = [S((n, hq, d), dtype) for n in token_counts]

    def fn(qs, k, v, *rest):
        return [attn(q, k, v, *rest) for q in qs]

    t0 = time.perf_counter()
    with jax.default_device(device):  # Pallas reads the TPU generation from it
        compiled = jax.jit(fn).lower(queries, page, page, *meta).compile()
    seconds = time.perf_counter() - t0
    hlo = compiled.as_text()
    custom_call, name = KERNEL_MARKERS[target.platform]
    kernel = custom_call in hlo and hlo.count(name) >= len(token_counts)
    item = jnp.dtype(dtype).itemsize
    logical = 2 * NUM_PAGES * page_size * page_shape[-1] * (hkv if layout == "heads" else 1) * item
    logical += sum(n * hq * d * item for n in token_counts) + 4 * (R + R * MAX_PAGES + R + 2)
    hbm = compiled.memory_analysis().argument_size_in_bytes
    return kernel, seconds, hbm, logical


def cases():
    heads = HEADS + ODD_HEADS
    cases = [(dt, h, 16, None, None) for dt, h in itertools.product((jnp.bfloat16, jnp.float32), heads)]
    cases += [(jnp.bfloat16, (32, 8, 128), ps, None, None) for ps in (32, 64, 128)]
    cases += [(jnp.bfloat16, (9, 3, 64), 16, 128, 30.0), (jnp.bfloat16, (32, 8, 128), 32, 256, 50.0)]
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="tpu:v5e,tpu:v6e,gpu:h100,gpu:h200",
                    help="tpu:<chip> and gpu:<part> entries, comma-separated")
    args = ap.parse_args()
    print(f"{'target':8} {'dtype':9} {'Hq/Hkv/D':11} {'page':>4} {'opts':10} {'result':10} {'s':>5}  "
          f"argument HBM / logical bytes", flush=True)
    failures, counts = 0, {}
    for name in args.targets.split(","):
        target = Target.parse(name + "-1" if name.startswith("tpu:") else name)
        device = target.devices()[0]
        for dtype, heads, ps, window, cap in cases():
            opts = "window+cap" if window else "-"
            layout = "/".join(map(str, heads))
            try:
                kernel, s, hbm, logical = compile_case(target, device, dtype, heads, ps, window, cap)
                result = "kernel" if kernel else "reference"
                extra = f"{hbm / logical:5.1f}x"
            except Exception as e:  # noqa: BLE001 - report and go on
                failures += 1
                result, s, extra = "FAIL", 0.0, str(e).splitlines()[0][:80]
            counts[(name, result)] = counts.get((name, result), 0) + 1
            print(f"{name:8} {jnp.dtype(dtype).name:9} {layout:11} {ps:4d} {opts:10} {result:10} {s:5.1f}  {extra}",
                  flush=True)
    for (name, result), n in sorted(counts.items()):
        print(f"{name}: {n} {result}")
    print(f"{failures} failed")


if __name__ == "__main__":
    main()
