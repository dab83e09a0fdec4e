"""Run in a child process by tests/test_kernels_cpu_units.py, with JAXSERVE_TEST_CPU_ISA
capping the native kernels' instruction set (it is read when they are built, once per
process). Checks the native CPU matmul (bf16 and int8 weights) and the KV-cache row write
against their references and prints one JSON line: the ISA the kernels were built for and
each check's worst error as a fraction of its bound (<= 1 passes)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_cache_update import cpu as kv_cpu
from pallas_kernels.kv_cache_update.reference import update_kv_cache_reference
from pallas_kernels.quantized_matmul import cpu as native_cpu
from pallas_kernels.quantized_matmul.dense import dense_matmul_reference


def bf16_bound(x, w, ref):
    """One bf16 ulp of the result plus f32 rounding of the sums in any order."""
    mag = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    ulp = 2.0 ** (np.floor(np.log2(np.abs(ref) + 1e-30)) - 7)
    return ulp + 2.0 ** -20 * mag + 1e-30


def dense_checks(rng) -> float:
    worst = 0.0
    for m in (1, 4, 5, 64):
        for k, n in ((579, 131), (64, 1030)):
            for transposed in (False, True):
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
                w = jnp.asarray(rng.standard_normal((n, k) if transposed else (3, k, n)) * 0.05, jnp.bfloat16)
                layer = None if transposed else 2
                got = native_cpu.quantized_matmul_cpu(x, w, None, layer, transposed=transposed, precision="bf16")
                ww = np.asarray(w, np.float64)
                ww = ww.T if transposed else ww[2]
                ref = np.asarray(x, np.float64) @ ww
                err = np.abs(np.asarray(got, np.float64) - ref)
                worst = max(worst, float(np.max(err / bf16_bound(x, ww, ref))))
                # and the dispatch's reference agrees with the same bound
                want = dense_matmul_reference(x, w, layer, transposed=transposed)
                err = np.abs(np.asarray(want, np.float64) - ref)
                worst = max(worst, float(np.max(err / bf16_bound(x, ww, ref))))
    return worst


def int8_checks(rng) -> float:
    worst = 0.0
    for m in (1, 5, 64):
        k, n = 579, 131
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = jnp.asarray(rng.integers(-127, 128, (k, n), dtype=np.int8))
        scale = jnp.asarray(rng.uniform(0.5, 1.5, n).astype(np.float32) / 127)
        got = native_cpu.quantized_matmul_cpu(x, w, scale)
        wf = np.asarray(w, np.float64) * np.asarray(scale, np.float64)
        ref = np.asarray(x, np.float64) @ wf
        err = np.abs(np.asarray(got, np.float64) - ref)
        worst = max(worst, float(np.max(err / bf16_bound(x, wf, ref))))
    return worst


def kv_write_check(rng) -> float:
    pages = jnp.asarray(rng.standard_normal((6, 4, 2, 8)), jnp.bfloat16)  # [P, S, Hkv, D]
    new_k = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
    new_v = jnp.asarray(rng.standard_normal((5, 2, 8)), jnp.float32)
    slots = jnp.asarray([3, 9, 10, 0, 23], jnp.int32)
    got = jax.jit(kv_cpu.update_kv_cache_cpu)(new_k, new_v, pages, pages + 1, slots)
    want = update_kv_cache_reference(new_k, new_v, pages, pages + 1, slots)
    same = all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)) for a, b in zip(got, want))
    return 0.0 if same else 2.0


def main() -> None:
    ok, why = native_cpu.available()
    if not ok:
        print(json.dumps({"error": why}))
        return
    assert kv_cpu.available()[0], kv_cpu.available()[1]
    rng = np.random.default_rng(0)
    print(json.dumps({"isa": native_cpu.isa(), "dense_bf16": dense_checks(rng), "int8_bf16_x": int8_checks(rng),
                      "kv_write": kv_write_check(rng)}))


if __name__ == "__main__":
    main()
