"""The CPU's matrix units: the native CPU matmul (bf16 and int8 weights), the attention
kernel and the KV-cache row write on each instruction set this machine has, named in the test id; the others are
skipped by name. Each unit runs in a child process (tests/cpu_units_child.py) with the
test-only JAXSERVE_TEST_CPU_ISA cap, so "avx2" runs the AVX2 build on any AVX2 machine and
"portable" the loops of a CPU without AVX2 (x86-64's SSE2 baseline) on any x86 machine.
Also: the dispatch lowers the native kernels for bf16 weights and pages on CPU, and the
CPU's default dtype follows the unit."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels._native_cpu import ISA_NEEDS, TEST_ISA_ENV, cpu_features
from pallas_kernels.kv_cache_update.ops import update_kv_cache
from pallas_kernels.quantized_matmul import cpu as native_cpu
from pallas_kernels.quantized_matmul.dense import dense_matmul

S = jax.ShapeDtypeStruct
CHILD = Path(__file__).with_name("cpu_units_child.py")
# unit -> (cap, the cpuid flags it needs, what the built matmul and attention kernels must say
# they run)
UNITS = {
    "avx512_bf16": ("native", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"), "avx512+avx512_bf16", "avx512"),
    "avx512": ("avx512", ISA_NEEDS["avx512"], "avx512", "avx512"),
    "avx2": ("avx2", ISA_NEEDS["avx2"], "avx2", "avx2"),
    "portable": ("portable", ISA_NEEDS["portable"], "generic (compiler-vectorised)", "generic (compiler-vectorised)"),
}


@pytest.mark.parametrize("unit", list(UNITS))
def test_native_matmul_attention_and_kv_write_on_unit(unit):
    cap, needs, says, attention_says = UNITS[unit]
    missing = [f for f in needs if f not in cpu_features().split()]
    if missing:
        pytest.skip(f"{unit}: this CPU lacks {', '.join(missing)}")
    if unit == "portable" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("portable: the x86-64 baseline cap is for x86 hosts (elsewhere the native build is it)")
    env = {**os.environ, TEST_ISA_ENV: cap}
    done = subprocess.run([sys.executable, str(CHILD)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in result, result
    assert result["isa"] == says, result  # the cap took effect: this unit's path ran
    assert result["attention_isa"] == attention_says, result
    assert result["packed_path"] == (unit != "portable"), result  # so bf16 is the default or not
    for check in ("dense_bf16", "int8_bf16_x", "glu", "attention", "kv_write"):
        assert result[check] <= 1.0, (check, result)


def test_unknown_or_missing_cap_is_named():
    env = {**os.environ, TEST_ISA_ENV: "sse9"}
    code = "from pallas_kernels.quantized_matmul import cpu; print(cpu.available())"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "JAXSERVE_TEST_CPU_ISA must be one of" in done.stdout, done.stdout + done.stderr


def test_auto_lowers_the_native_kernels_for_bf16():
    assert native_cpu.available()[0]
    L, m, k, n = 3, 4, 576, 960

    def scanned(x, w, k_pages, v_pages, slots):
        def body(carry, layer):
            h, kp, vp = carry
            y = dense_matmul(h, w, layer=layer, rows=jnp.int32(2))  # [m, n]
            kp, vp = update_kv_cache(y[:, :16].reshape(m, 1, 16), y[:, 16:32].reshape(m, 1, 16), kp, vp, slots)
            return (h + y[:, :k], kp, vp), None
        return jax.lax.scan(body, (x, k_pages, v_pages), jnp.arange(L, dtype=jnp.int32))[0]

    pages = S((8, 4, 1, 16), jnp.bfloat16)
    compiled = jax.jit(scanned).lower(S((m, k), jnp.bfloat16), S((L, k, n), jnp.bfloat16), pages, pages,
                                      S((m,), jnp.int32)).compile()
    hlo = compiled.as_text()
    assert "jaxserve_quantized_matmul_cpu_" in hlo and "jaxserve_kv_write_cpu_" in hlo
    # the stacked weight is read in place (no per-layer slice) and the pages are never
    # converted to f32 (XLA's own bf16 scatter upcasts the whole pool)
    assert f"bf16[{k},{n}]" not in hlo and "f32[8,4,1,16]" not in hlo


def test_bf16_dense_rows_past_live_are_zero_and_live_rows_match():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((24, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 200)) * 0.1, jnp.bfloat16)
    full = np.asarray(jax.jit(dense_matmul)(x, w), np.float32)
    part = np.asarray(jax.jit(lambda x, w: dense_matmul(x, w, rows=jnp.int32(7)))(x, w), np.float32)
    np.testing.assert_array_equal(part[:7], full[:7])
    assert not part[7:].any()


def test_cpu_default_dtype_follows_the_unit():
    """bf16 wherever the native matmul has its packed path (AVX2 + FMA or AVX-512), also in
    the AVX2 build on an AVX-512 machine; f32 where a CPU program is compiled for a target."""
    from jaxserve.config.engine_config import default_dtype_for_platform

    flags = cpu_features().split()
    has_packed = all(f in flags for f in ISA_NEEDS["avx2"]) or "avx512f" in flags
    assert native_cpu.packed_path() == has_packed
    assert default_dtype_for_platform("cpu") == ("bfloat16" if has_packed else "float32")
    assert default_dtype_for_platform("tpu") == "bfloat16"
    if not all(f in flags for f in ISA_NEEDS["avx2"]):
        return
    env = {**os.environ, TEST_ISA_ENV: "avx2"}
    code = "from jaxserve.config.engine_config import default_dtype_for_platform as d; print(d('cpu'))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "bfloat16", done.stderr[-2000:]


@pytest.mark.parametrize("m", [1, 9])
def test_bf16_head_logits_keep_the_f32_sums(m):
    """out_dtype=float32 (the head's logits): the f32 sums, not rounded to bf16."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((m, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((300, 96)) * 0.1, jnp.bfloat16)  # [V, E]: a tied head
    got = jax.jit(lambda x, w: dense_matmul(x, w, transposed=True, out_dtype=jnp.float32))(x, w)
    assert got.dtype == jnp.float32
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    bound = 2.0 ** -20 * (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= bound + 1e-30)
    assert np.any(np.asarray(got) != np.asarray(got.astype(jnp.bfloat16).astype(jnp.float32)))  # not bf16 values


def test_bad_operands_are_named_for_both_cpu_matmuls():
    """One layout check (`check_matmul_operands`, `check_glu`) for the quantized and the dense
    matmul."""
    from pallas_kernels.quantized_matmul.ops import quantized_matmul

    x = jnp.zeros((2, 8), jnp.bfloat16)
    w8, scale = jnp.zeros((8, 4), jnp.int8), jnp.ones((4,), jnp.float32)
    for call in (lambda **kw: dense_matmul(x, jnp.zeros((8, 4), jnp.bfloat16), **kw),
                 lambda **kw: quantized_matmul(x, w8, scale, **kw)):
        with pytest.raises(ValueError, match="rows must be an integer scalar"):
            call(rows=jnp.zeros((2,), jnp.int32))
        with pytest.raises(ValueError, match=r"residual must have shape \[M, N\]"):
            call(residual=jnp.zeros((2, 5), jnp.bfloat16))
        with pytest.raises(ValueError, match="glu must be one of"):
            call(glu="gelu")
        with pytest.raises(ValueError, match="no residual"):
            call(glu="silu", residual=jnp.zeros((2, 4), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"an even N \(5\)"):
        dense_matmul(x, jnp.zeros((8, 5), jnp.bfloat16), glu="silu")
    with pytest.raises(ValueError, match=r"w must have shape \[K, N\]"):
        dense_matmul(x, jnp.zeros((9, 4), jnp.bfloat16))
