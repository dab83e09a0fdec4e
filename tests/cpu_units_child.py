"""Run in a child process by tests/test_kernels_cpu_units.py, with JAXSERVE_TEST_CPU_ISA
capping the native kernels' instruction set (it is read when they are built, once per
process). Checks the native CPU matmul (bf16 and int8 weights, and its gated-activation epilogue), the attention kernel
(f32, bf16 and int8 pages) and the KV-cache row write against their references and prints one JSON line: the ISA the kernels were built for and
each check's worst error as a fraction of its bound (<= 1 passes)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant
from pallas_kernels.kv_cache_update import cpu as kv_cpu
from pallas_kernels.kv_cache_update.reference import update_kv_cache_reference
from pallas_kernels.quantized_matmul import cpu as native_cpu
from pallas_kernels.quantized_matmul.dense import dense_matmul_reference
from pallas_kernels.ragged_paged_attention import cpu as attn_cpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.testing import make_case


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


def glu_checks(rng) -> float:
    """The gated-activation epilogue (silu(g) * u of the product's halves) against the same
    kernel's plain product finished in f64: bf16 x (g and u rounded to bf16 first, one bf16 ulp
    for the result) over bf16 and int8 weights, f32 x over int8 (f32 out); H = 131 columns
    (this unit's vector loop and its scalar tail); rows past the live ones 0; a call longer
    than one of the gated path's row chunks."""
    worst = 0.0
    k, n = 579, 262
    for m in (1, 4, 5, 64, 300):  # 300: two of the kernel's 256-row chunks
        live = max(1, m - 1)
        for w_kind, x_dtype in (("bf16", jnp.bfloat16), ("int8", jnp.bfloat16), ("int8", jnp.float32)):
            x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
            if w_kind == "bf16":
                w, scale = jnp.asarray(rng.standard_normal((2, k, n)) * 0.05, jnp.bfloat16), None
            else:
                w = jnp.asarray(rng.integers(-127, 128, (2, k, n), dtype=np.int8))
                scale = jnp.asarray(rng.uniform(0.5, 1.5, (2, n)).astype(np.float32) / 127 / 8)
            call = functools.partial(native_cpu.quantized_matmul_cpu, x, w, scale, 1, rows=live,
                                     precision="bf16" if x_dtype == jnp.bfloat16 else "highest")
            got = np.asarray(call(glu="silu"), np.float64)
            y = np.asarray(call(), np.float64)[:live]  # the plain product, as out's dtype holds it
            g, u = y[:, : n // 2], y[:, n // 2:]
            ref = g / (1.0 + np.exp(-g)) * u
            if x_dtype == jnp.bfloat16:
                bound = 2.0 ** (np.floor(np.log2(np.abs(ref) + 1e-30)) - 7) + 1e-6 * np.abs(ref) + 1e-30
            else:
                bound = 1e-6 * np.abs(ref) + 1e-30
            worst = max(worst, float(np.max(np.abs(got[:live] - ref) / bound)))
            if np.any(got[live:] != 0):
                worst = max(worst, 2.0)
    return worst


def attention_checks() -> float:
    """The attention kernel against the f32 reference on the same (widened) pages: decode and
    prefill rows, 9 query heads on 3 KV heads, D 64 and 72 (this unit's segment paths) and 80
    with 8-slot pages; f32 pages with a window and a soft cap, bf16 and int8 pages. Then a
    token's bits prefilled whole and decoded one token at a time (int8 pages, 32-slot pages:
    both softmax loops)."""
    worst = 0.0
    seqs = [(1, 5 + 23 * i) for i in range(6)] + [(19, 40), (9, 9)]
    for d, ps in ((64, 16), (72, 32), (80, 8)):
        case = make_case(seqs=seqs, num_tokens=40, num_rows=8, num_q_heads=9, num_kv_heads=3, head_dim=d,
                         page_size=ps, seed=d)
        q, k, v, kv_lens, tables, cu, n = (jnp.asarray(a) for a in case.args())
        for kv, kw in (("f32", dict(sliding_window=17, soft_cap=5.0)), ("bf16", {}), ("int8", {})):
            kk, vv, extra = k, v, {}
            if kv == "bf16":
                kk, vv = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
            elif kv == "int8":
                (kk, extra["k_scales"]), (vv, extra["v_scales"]) = kv_quant.quantize(k, jnp.int8), kv_quant.quantize(v, jnp.int8)
            run = jax.jit(functools.partial(attn_cpu.ragged_paged_attention_cpu, sm_scale=d ** -0.5, **kw, **extra))
            got = run(q, kk, vv, kv_lens, tables, cu, n)
            kr, vr = (kk, vv) if kv != "int8" else (kv_quant.dequantize(kk, extra["k_scales"]),
                                                  kv_quant.dequantize(vv, extra["v_scales"]))
            want = ragged_paged_attention_reference(q, kr.astype(jnp.float32), vr.astype(jnp.float32), kv_lens, tables,
                                                    cu, n, sm_scale=d ** -0.5, **kw)
            err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
            worst = max(worst, float(np.max(err / (1e-5 + 1e-5 * np.abs(np.asarray(want, np.float64))))))
    case = make_case(seqs=[(40, 40)], num_tokens=48, num_rows=2, num_q_heads=9, num_kv_heads=3, head_dim=64,
                     page_size=32, seed=7)
    q, k, v, kv_lens, tables, cu, n = (jnp.asarray(a) for a in case.args())
    (k, ks), (v, vs) = kv_quant.quantize(k, jnp.int8), kv_quant.quantize(v, jnp.int8)
    run = jax.jit(functools.partial(attn_cpu.ragged_paged_attention_cpu, sm_scale=0.125, k_scales=ks, v_scales=vs))
    whole = np.asarray(run(q, k, v, kv_lens, tables, cu, n))[:40]
    for t in range(29, 40):
        one = run(jnp.zeros_like(q).at[0].set(q[t]), k, v, kv_lens.at[0].set(t + 1), tables, cu.at[1:].set(1), n)
        if not np.array_equal(np.asarray(one)[0], whole[t]):
            worst = max(worst, 2.0)
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
    assert attn_cpu.available()[0], attn_cpu.available()[1]
    rng = np.random.default_rng(0)
    print(json.dumps({"isa": native_cpu.isa(), "attention_isa": attn_cpu.isa(),
                      "packed_path": native_cpu.packed_path(), "dense_bf16": dense_checks(rng),
                      "int8_bf16_x": int8_checks(rng), "glu": glu_checks(rng), "attention": attention_checks(),
                      "kv_write": kv_write_check(rng)}))


if __name__ == "__main__":
    main()
