"""pallas_kernels.quantized_matmul: the native CPU kernel against the reference, the dispatch,
and compile-only checks that TPU/GPU programs fuse the weight's conversion into the dot."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pallas_kernels.quantized_matmul import cpu as native_cpu
from pallas_kernels.quantized_matmul.ops import quantized_matmul, quantized_matmul_implementation
from pallas_kernels.quantized_matmul.reference import quantized_matmul_reference

S = jax.ShapeDtypeStruct


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    ok, why = native_cpu.available()
    assert ok, why


def operands(m, k, n, layers=None, x_dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(x_dtype)
    w = jnp.asarray(rng.integers(-127, 128, (*lead, k, n), dtype=np.int8))
    scale = jnp.asarray(rng.uniform(0.5, 1.5, (*lead, n)).astype(np.float32) / 127)
    return x, w, scale


def exact(x, w, scale):
    """f64 on the host: what both implementations approximate."""
    acc = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    return acc * np.asarray(scale, np.float64)


def assert_close(got, want, x, w, scale, rel):
    """|got - want| within `rel` of the sum of |terms| of each output (the error bound of
    a dot product in that precision, whatever the summation order)."""
    bound = (np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))) * np.abs(
        np.asarray(scale, np.float64))
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= rel * bound + 1e-30), float(np.max(err / (bound + 1e-30)))


# M: decode (direct path: 1, 3, 4; 5 and 8 in two passes), and the packed path with a
# partial 6-row tile (9, 64, 130); K not a multiple of 8 or 16, N odd (a partial 16-lane
# vector and a partial 64-column panel); N past 4096: the direct path's two column parts,
# each summing its K-parts, and the packed path's partial span of panels.
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 9, 64, 130])
@pytest.mark.parametrize("k,n", [(37, 75), (579, 131), (803, 1), (203, 4201)])
def test_kernel_matches_reference_f32(m, k, n):
    x, w, scale = operands(m, k, n, seed=m * 1000 + k + n)
    got = jax.jit(functools.partial(quantized_matmul, backend="cpu"))(x, w, scale)
    ref = quantized_matmul_reference(x, w, scale)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    want = exact(x, w, scale)
    assert_close(got, want, x, w, scale, 1e-6)
    assert_close(ref, want, x, w, scale, 1e-6)


@pytest.mark.parametrize("m", [1, 2, 64])
def test_kernel_bf16_activations(m):
    x, w, scale = operands(m, 300, 97, x_dtype=jnp.bfloat16, seed=m)
    got = jax.jit(functools.partial(quantized_matmul, backend="cpu"))(x, w, scale)
    ref = quantized_matmul_reference(x, w, scale)
    assert got.dtype == jnp.bfloat16 == ref.dtype
    want = exact(x, w, scale)  # x is bf16 already: the products are exact in f32
    # f32 sums, then one rounding to bf16 (2^-8 relative) of outputs that may be small
    # against the sum of |terms|: bound by both.
    tol = 2.0**-8 * np.abs(want) + 1e-6 * (np.abs(np.asarray(x, np.float64))
                                          @ np.abs(np.asarray(w, np.float64))) * np.asarray(scale)
    assert np.all(np.abs(np.asarray(got, np.float64) - want) <= tol)
    assert np.all(np.abs(np.asarray(ref, np.float64) - want) <= tol)


@pytest.mark.parametrize("m", [1, 5, 9, 64, 130])
def test_bf16_products(m):
    """precision="bf16": x rounded to bf16, exact products, f32 sums (the packed path runs on
    bf16 dot-product instructions); within 2^-9 of the f32 result, relative to the sum of
    |terms|, on top of f32 summation error."""
    x, w, scale = operands(m, 577, 131, seed=m + 5)
    got = jax.jit(functools.partial(quantized_matmul, backend="cpu", precision="bf16"))(x, w, scale)
    ref = quantized_matmul_reference(x, w, scale, precision="bf16")
    assert got.dtype == jnp.float32 == ref.dtype
    xb = x.astype(jnp.bfloat16)
    assert_close(got, exact(xb, w, scale), xb, w, scale, 1e-6)
    assert_close(ref, exact(xb, w, scale), xb, w, scale, 1e-6)
    assert_close(got, exact(x, w, scale), x, w, scale, 2.0**-9 + 1e-6)
    with pytest.raises(ValueError, match="precision"):
        quantized_matmul(x, w, scale, precision="int8")


# w [N, K] (a tied embedding as the LM head): the direct path's row dot products (1, 5: a
# second 4-row pass) and the packed path's gathered panels (9, 64), with K not a multiple
# of 4 or 16 (the scalar packing tail, masked lanes) and N not a multiple of 4 or 64.
@pytest.mark.parametrize("m", [1, 5, 9, 64])
@pytest.mark.parametrize("k,n", [(579, 131), (64, 1030)])
@pytest.mark.parametrize("precision", ["highest", "bf16"])
def test_transposed_weights(m, k, n, precision):
    x, w, scale = operands(m, k, n, seed=m + k + n)
    wt = jnp.asarray(np.ascontiguousarray(np.asarray(w).T))  # [N, K]
    fn = functools.partial(quantized_matmul, transposed=True, precision=precision)
    got = jax.jit(functools.partial(fn, backend="cpu"))(x, wt, scale)
    ref = fn(x, wt, scale, backend="reference")
    assert got.shape == (m, n) == ref.shape
    xp = x.astype(jnp.bfloat16) if precision == "bf16" else x
    assert_close(got, exact(xp, w, scale), xp, w, scale, 1e-6)
    assert_close(ref, exact(xp, w, scale), xp, w, scale, 1e-6)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        quantized_matmul(x, w, scale, transposed=True)  # [K, N] given
    with pytest.raises(ValueError, match="unstacked"):
        quantized_matmul(x, wt[None], scale[None], layer=0, transposed=True)


@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_residual_is_added_in_the_epilogue_with_the_same_bits(m, x_dtype, transposed):
    """residual + product in the kernel's epilogue equals the separate add bit for bit (the
    model's skip connections rely on it), on the direct, packed and transposed paths."""
    k, n = 96, 200
    x, w, scale = operands(m, k, n, x_dtype=x_dtype, seed=m)
    if transposed:
        w = w.T
    res = jnp.asarray(np.random.default_rng(m + 1).standard_normal((m, n), dtype=np.float32)).astype(x_dtype)
    for precision in ("highest", "bf16"):
        kw = {"backend": "cpu", "precision": precision, "transposed": transposed}
        fused = jax.jit(functools.partial(quantized_matmul, **kw))(x, w, scale, residual=res)
        added = res + jax.jit(functools.partial(quantized_matmul, **kw))(x, w, scale)
        np.testing.assert_array_equal(np.asarray(fused), np.asarray(added))
        ref = quantized_matmul(x, w, scale, residual=res, backend="reference", precision=precision,
                               transposed=transposed)
        np.testing.assert_allclose(np.asarray(fused, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="residual"):
        quantized_matmul(x, w, scale, residual=res[:, :-1], transposed=transposed)
    with pytest.raises(ValueError, match="residual"):
        quantized_matmul(x, w, scale, residual=res.astype(jnp.float16), transposed=transposed)


@pytest.mark.parametrize("m,transposed", [(4, False), (24, False), (24, True)])
def test_only_the_live_rows_are_computed_with_the_full_results_bits(m, transposed):
    """`rows` (a traced count, as the model passes its real tokens): the live rows are the bits
    of the whole computation (the path follows the padded M, so a row's bits do not depend on
    how many rows are live), the padded ones 0; with a residual too. The reference computes
    every row."""
    k, n = 96, 200
    x, w, scale = operands(m, k, n, seed=m)
    if transposed:
        w = w.T
    res = jnp.asarray(np.random.default_rng(m + 1).standard_normal((m, n), dtype=np.float32))
    for precision in ("highest", "bf16"):
        kw = {"backend": "cpu", "precision": precision, "transposed": transposed}
        full = np.asarray(quantized_matmul(x, w, scale, residual=res, **kw))
        live_fn = jax.jit(lambda x, r, live, kw=kw: quantized_matmul(x, w, scale, residual=r, rows=live, **kw))
        for live in (0, 1, 3, m - 1, m, m + 7):
            got = np.asarray(live_fn(x, res, jnp.int32(live)))
            np.testing.assert_array_equal(got[:live], full[:live])
            assert not got[live:].any(), f"padded rows past {live} not zero"
        ref = quantized_matmul(x, w, scale, residual=res, rows=2, backend="reference", precision=precision,
                               transposed=transposed)
        np.testing.assert_allclose(np.asarray(ref), full, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="rows"):
        quantized_matmul(x, w, scale, rows=jnp.zeros(2, jnp.int32), transposed=transposed)


def test_vmap_over_activations():
    x, w, scale = operands(6, 40, 24)
    xs = x.reshape(3, 2, 40)
    got = jax.vmap(lambda a: quantized_matmul(a, w, scale, backend="cpu"))(xs)
    assert_close(got.reshape(6, 24), exact(x, w, scale), x, w, scale, 1e-6)


def test_zero_scale_columns_are_zero():
    x, w, scale = operands(5, 64, 40)
    scale = scale.at[::3].set(0.0)
    for m in (1, 5):
        got = quantized_matmul(x[:m], w, scale, backend="cpu")
        assert np.all(np.asarray(got)[:, ::3] == 0.0)
        assert_close(got, exact(x[:m], w, scale), x[:m], w, scale, 1e-6)


@pytest.mark.parametrize("m", [1, 20])
def test_stacked_layer_traced_in_jit_and_scan(m):
    num_layers, k, n = 4, 70, 51
    x, w, scale = operands(m, k, n, layers=num_layers, seed=7 + m)
    mm = jax.jit(lambda x, w, s, layer: quantized_matmul(x, w, s, layer=layer, backend="cpu"))
    for layer in range(num_layers):
        got = mm(x, w, scale, jnp.int32(layer))
        assert_close(got, exact(x, w[layer], scale[layer]), x, w[layer], scale[layer], 1e-6)
    # Out of range as dynamic_index_in_dim: negative from the end, then clamped.
    for layer, picked in ((-1, num_layers - 1), (num_layers + 3, num_layers - 1), (-9, 0)):
        np.testing.assert_array_equal(mm(x, w, scale, jnp.int32(layer)),
                                      mm(x, w, scale, jnp.int32(picked)))

    @jax.jit
    def scanned(x, w, s):  # as the model: the stacked weights, the layer index traced
        def body(carry, layer):
            return carry, quantized_matmul(x, w, s, layer=layer)  # auto: the native kernel here
        return jax.lax.scan(body, 0, jnp.arange(num_layers, dtype=jnp.int32))[1]

    out = scanned(x, w, scale)
    for layer in range(num_layers):
        assert_close(out[layer], exact(x, w[layer], scale[layer]), x, w[layer], scale[layer], 1e-6)


def test_auto_on_cpu_lowers_the_kernel_and_no_dequantized_weight():
    num_layers, m, k, n = 3, 4, 576, 960

    def scanned(x, w, s):
        def body(h, layer):
            return h + quantized_matmul(h, w, s, layer=layer)[:, :k], None
        return jax.lax.scan(body, x, jnp.arange(num_layers, dtype=jnp.int32))[0]

    compiled = jax.jit(scanned).lower(S((m, k), jnp.float32), S((num_layers, k, n), jnp.int8),
                                      S((num_layers, n), jnp.float32)).compile()
    hlo = compiled.as_text()
    assert "jaxserve_quantized_matmul_cpu_" in hlo
    # The stacked weight goes to the custom call whole (read in place): no slice, no convert.
    assert f"s8[{k},{n}]" not in hlo and f"f32[{k},{n}]" not in hlo
    assert compiled.memory_analysis().temp_size_in_bytes < k * n  # not even an int8 copy
    # The reference (forced) does materialise the f32 weight on CPU: what the kernel avoids.
    ref = jax.jit(functools.partial(quantized_matmul, backend="reference")).lower(
        S((m, k), jnp.float32), S((k, n), jnp.int8), S((n,), jnp.float32)).compile()
    assert ref.memory_analysis().temp_size_in_bytes >= 4 * k * n


def test_float8_weights_take_the_reference_on_cpu():
    x, w, scale = operands(3, 40, 24)
    w8 = w.astype(jnp.float32).astype(jnp.float8_e4m3fn)
    hlo = jax.jit(quantized_matmul).lower(x, w8, scale).compile().as_text()
    assert "jaxserve_quantized_matmul_cpu_" not in hlo
    np.testing.assert_allclose(quantized_matmul(x, w8, scale),
                               quantized_matmul_reference(x, w8, scale))
    with pytest.raises(ValueError, match="int8"):
        quantized_matmul(x, w8, scale, backend="cpu")
    with pytest.raises(ValueError, match="backend"):
        quantized_matmul(x, w, scale, backend="pallas")
    assert quantized_matmul_implementation("cpu").startswith("native")
    assert quantized_matmul_implementation("cpu", jnp.float8_e4m3fn).startswith("reference")
    assert quantized_matmul_implementation("tpu").startswith("reference")
    assert quantized_matmul_implementation("cuda").startswith("reference")


# Compile-only TPU (libtpu) and H200 (CUDA plugin) targets, as tests/test_tpu_compile.py and
# tests/test_gpu_compile.py obtain them: the reference's int8 -> bf16/f32 conversion must be
# fused into the dot, never a dequantized copy of the weight.
@pytest.mark.usefixtures("no_persistent_cache_writes")
@pytest.mark.parametrize("target", ["tpu:v5e-1", "gpu:h200"])
@pytest.mark.parametrize("x_dtype", [jnp.bfloat16, jnp.float32])
def test_accelerators_fuse_the_weight_conversion(target, x_dtype):
    from jaxserve.compilation.targets import Target

    device = Target.parse(target).devices()[0]
    m, k, n = 8, 1024, 2048
    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    args = [S((m, k), x_dtype, sharding=sharding), S((k, n), jnp.int8, sharding=sharding),
            S((n,), jnp.float32, sharding=sharding)]
    with jax.default_device(device):
        compiled = jax.jit(quantized_matmul).lower(*args).compile()
    hlo = compiled.as_text()
    dequantized = k * n * jnp.dtype(x_dtype).itemsize
    assert compiled.memory_analysis().temp_size_in_bytes < dequantized / 4  # below even int8
    assert "jaxserve_quantized_matmul_cpu_" not in hlo
