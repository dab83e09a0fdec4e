"""Which (chip, dtype, head layout, page size) cases the Mosaic attention compiles for.

Compiles `pallas_kernels.ragged_paged_attention(backend="auto")` for compile-only TPU devices
(libtpu: `make install-test` puts it in .venv/accel/tpu; run with
`PYTHONPATH=.venv/accel/tpu JAX_PLATFORMS=cpu`) and prints, per case, whether the Mosaic kernel
is in the compiled HLO, the compile time, and the HBM bytes XLA:TPU gives the arguments
against their size in the lanes layout (1.0x: XLA keeps [S, C] pages unpadded).
Nothing runs on a TPU: no speed figure comes out of this.

    PYTHONPATH=.venv/accel/tpu JAX_PLATFORMS=cpu python scripts/check_tpu_compile.py [--chips v5e,v6e]
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
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels.kv_layout import lanes_width  # noqa: E402

T, R, MAX_PAGES, NUM_PAGES = 64, 8, 16, 64
HEADS = [(h * g, h, d) for h in (1, 2, 3, 4, 8, 16) for g in (1, 3, 4, 8) for d in (64, 128, 256)]


def compile_case(device, dtype, heads, page_size, window, cap):
    hq, hkv, d = heads
    sh = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    S = functools.partial(jax.ShapeDtypeStruct, sharding=sh)
    lanes = lanes_width(hkv, d)  # the lanes layout the engine allocates on TPU
    page = S((NUM_PAGES, page_size, lanes), dtype)
    args = (S((T, hq, d), dtype), page, page, S((R,), jnp.int32), S((R, MAX_PAGES), jnp.int32),
            S((R + 1,), jnp.int32), S((1,), jnp.int32))
    fn = functools.partial(pk.ragged_paged_attention, sm_scale=d**-0.5, num_kv_heads=hkv, sliding_window=window,
                           soft_cap=cap)
    t0 = time.perf_counter()
    with jax.default_device(device):
        compiled = jax.jit(fn).lower(*args).compile()
    seconds = time.perf_counter() - t0
    kernel = "ragged_paged_attention_tpu" in compiled.as_text()
    item = jnp.dtype(dtype).itemsize
    logical = 2 * NUM_PAGES * page_size * lanes * item + T * hq * d * item + 4 * (R + R * MAX_PAGES + R + 2)
    hbm = compiled.memory_analysis().argument_size_in_bytes
    return kernel, seconds, hbm, logical


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chips", default="v5e,v6e")
    args = ap.parse_args()
    print(f"{'chip':5} {'dtype':9} {'Hq/Hkv/D':11} {'page':>4} {'opts':10} {'result':12} {'s':>5}  "
          f"argument HBM / logical bytes")
    failures = 0
    for chip in args.chips.split(","):
        device = topologies.get_topology_desc(topology_name=f"{chip}:2x2", platform="tpu").devices[0]
        cases = [(dt, h, 16, None, None) for dt, h in itertools.product((jnp.bfloat16, jnp.float32), HEADS)]
        cases += [(jnp.bfloat16, (32, 8, 128), ps, None, None) for ps in (32, 64, 128)]
        cases += [(jnp.bfloat16, (9, 3, 64), 16, 128, 30.0), (jnp.bfloat16, (32, 8, 128), 32, 256, 50.0)]
        for dtype, heads, ps, window, cap in cases:
            opts = "window+cap" if window else "-"
            name = "/".join(map(str, heads))
            try:
                kernel, s, hbm, logical = compile_case(device, dtype, heads, ps, window, cap)
                result = "kernel" if kernel else "reference"
                extra = f"{hbm / logical:5.1f}x"
            except Exception as e:  # noqa: BLE001 - report and go on
                failures += 1
                result, s, extra = "FAIL", 0.0, str(e).splitlines()[0][:80]
            print(f"{chip:5} {jnp.dtype(dtype).name:9} {name:11} {ps:4d} {opts:10} {result:12} {s:5.1f}  {extra}",
                  flush=True)
    print(f"{failures} failed")


if __name__ == "__main__":
    main()
