"""Quantized KV-cache pages (int8, float8_e4m3fn, float8_e5m2 values + one f32 scale per
token and KV head): the quantization math, the KV-update op, and every attention
implementation against the reference run on the dequantized pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import kv_quant
from pallas_kernels.kv_layout import kv_scales_axis_of_heads, kv_scales_shape, lanes_width, to_lanes
from pallas_kernels.ragged_paged_attention.ops import attention_implementation
from pallas_kernels.ragged_paged_attention.testing import RaggedCase, attention_numpy, make_case

DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
SM_SCALE = 0.125


# ---------------------------------------------------------------------- the math
@pytest.mark.parametrize("name", DTYPES)
def test_quantize_round_trip_error_bounds(name):
    dtype = kv_quant.kv_cache_dtype(name)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3, 64)).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4, (64, 3, 1))
    x[0, 0] = 0.0  # an all-zero row: scale 1, values 0
    values, scales = kv_quant.quantize(jnp.asarray(x), dtype)
    assert values.dtype == dtype and scales.dtype == jnp.float32 and scales.shape == (64, 3)
    values, scales = np.asarray(values), np.asarray(scales)
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(scales, np.where(amax == 0, 1.0, amax / kv_quant.qmax(dtype)), rtol=1e-6)
    assert scales[0, 0] == 1.0 and not np.any(values[0, 0].astype(np.float32))
    back = np.asarray(kv_quant.dequantize(jnp.asarray(values), jnp.asarray(scales)))
    err = np.abs(back - x)
    if name == "int8":
        assert np.all(np.abs(values.astype(np.int32)) <= 127)
        assert np.all(err <= scales[..., None] * (0.5 + 1e-5))
    else:
        # Round to nearest: half an ulp of the value (3 or 2 mantissa bits) relative, or half the
        # smallest subnormal step (x scale) for tiny values.
        mantissa = 3 if name == "fp8_e4m3" else 2
        tiny = {"fp8_e4m3": 2.0**-9, "fp8_e5m2": 2.0**-16}[name]
        bound = np.maximum(np.abs(x) * 2.0 ** -(mantissa + 1), tiny / 2 * scales[..., None]) * (1 + 1e-5)
        assert np.all(err <= bound)
    # The largest element of each row maps onto qmax exactly.
    top = np.abs(values.astype(np.float32)).max(-1)
    assert np.all(top[amax > 0] == kv_quant.qmax(dtype))


def test_dtype_names_and_scales_layouts():
    assert kv_quant.kv_cache_dtype("fp8_e4m3") == jnp.float8_e4m3fn
    assert kv_quant.kv_cache_dtype("fp8_e5m2") == jnp.float8_e5m2
    assert kv_quant.kv_cache_dtype(jnp.bfloat16) == jnp.bfloat16 and not kv_quant.is_quantized(jnp.bfloat16)
    assert kv_scales_shape(10, 16, 3, "heads") == (10, 16, 3) and kv_scales_axis_of_heads("heads") == 2
    assert kv_scales_shape(10, 16, 3, "lanes") == (3, 2, 128) and kv_scales_axis_of_heads("lanes") == 0
    with pytest.raises(ValueError, match="layout"):
        kv_scales_shape(10, 16, 3, "rows")


# ---------------------------------------------------------------------- helpers
def scales_for(per_slot: np.ndarray, num_pages: int, page_size: int, layout: str) -> jax.Array:
    """[P, S, Hkv] per-slot scales in the layout's scales array."""
    hkv = per_slot.shape[-1]
    if layout == "heads":
        return jnp.asarray(per_slot, jnp.float32)
    empty = jnp.zeros(kv_scales_shape(num_pages, page_size, hkv, "lanes"), jnp.float32)
    return kv_quant.write_scales(empty, jnp.arange(num_pages * page_size, dtype=jnp.int32),
                                 jnp.asarray(per_slot.reshape(-1, hkv)), "lanes")


STANDARD = dict(heads=(6, 3, 64), seqs=((1, 40), (2, 21)), num_tokens=4, num_rows=2, num_pages=12)


@functools.cache
def quantized_case(name: str, layout: str = "heads", q_dtype=np.float32, heads=(6, 3, 64),
                   seqs=((1, 40), (2, 21)), **kw):
    """(case on the dequantized pages (heads layout, f32), kernel args (q, pages, ... in `layout`),
    scales (k, v), unquantized case). Every slot of the pool is quantized; unused slots hold NaN
    (NaN values for fp8, NaN scales for all): no implementation may let them leak.
    The default is one decode and one 2-token chunk over 12 shuffled pages of 16 (192 slots:
    two rows of lanes-layout scales)."""
    hq, hkv, d = heads
    base = make_case(list(seqs), num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                     **{"num_tokens": 4, "num_rows": 2, "num_pages": 12, "unused_fill": np.nan, **kw})
    dtype = kv_quant.kv_cache_dtype(name)
    kq, ks = kv_quant.quantize_numpy(base.k_pages, dtype)
    vq, vs = kv_quant.quantize_numpy(base.v_pages, dtype)
    deq = RaggedCase(base.q, np.asarray(kv_quant.dequantize(jnp.asarray(kq), jnp.asarray(ks))),
                     np.asarray(kv_quant.dequantize(jnp.asarray(vq), jnp.asarray(vs))),
                     *base.args()[3:])
    num_pages, page_size = kq.shape[:2]
    if layout == "lanes":
        width = lanes_width(hkv, d)
        kq, vq = np.asarray(to_lanes(kq, width)), np.asarray(to_lanes(vq, width))
    scales = (scales_for(ks, num_pages, page_size, layout), scales_for(vs, num_pages, page_size, layout))
    args = (jnp.asarray(base.q, q_dtype), jnp.asarray(kq), jnp.asarray(vq), *map(jnp.asarray, base.args()[3:]))
    return deq, args, scales, base


_ORACLE: dict = {}


def oracle(case: RaggedCase, **kw) -> np.ndarray:
    """attention_numpy, memoized per case object (the cases above are cached)."""
    key = (id(case), tuple(sorted(kw.items())))
    if key not in _ORACLE:
        _ORACLE[key] = (case, attention_numpy(case, sm_scale=SM_SCALE, **kw))
    return _ORACLE[key][1]


def check_against_dequantized(out, deq: RaggedCase, base: RaggedCase, name: str, atol: float, **kw):
    """Tight: the oracle on the dequantized pages. Loose: f32 attention on the unquantized K/V."""
    out = np.asarray(out, np.float32)
    np.testing.assert_allclose(out, oracle(deq, **kw), atol=atol, rtol=atol)
    loose = {"int8": 0.03, "fp8_e4m3": 0.15, "fp8_e5m2": 0.3}[name]
    err = np.abs(out - oracle(base, **kw)).max()
    assert err < loose, f"{name}: {err} from the unquantized attention"


# ---------------------------------------------------------------------- KV update
def pages_as_rows(pages) -> np.ndarray:
    """[P, S, ...] pages as [P * S, row] f32 host rows."""
    pages = np.asarray(pages.astype(jnp.float32))
    return pages.reshape(pages.shape[0] * pages.shape[1], -1)


def slot_scales(scales, layout: str) -> np.ndarray:
    """A scales array as [slots, Hkv] on the host."""
    scales = np.asarray(scales)
    if layout == "lanes":
        return scales.reshape(scales.shape[0], -1).T
    return scales.reshape(-1, scales.shape[-1])


@pytest.mark.parametrize("name,layout", [("int8", "heads"), ("fp8_e5m2", "lanes")])
def test_update_writes_quantized_values_and_scales_to_their_slots(name, layout):
    dtype = kv_quant.kv_cache_dtype(name)
    num_pages, page_size, hkv, d = 6, 16, 3, 64
    rng = np.random.default_rng(1)
    k_new = jnp.asarray(rng.standard_normal((5, hkv, d)) * 3, jnp.bfloat16)
    v_new = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
    slots = np.asarray([17, 18, 95, 0, 1], np.int32)  # two padding tokens on the null page
    shape = (num_pages, page_size, hkv, d) if layout == "heads" else (num_pages, page_size, lanes_width(hkv, d))
    k_pages = jnp.full(shape, 7, dtype)
    k_sc = jnp.full(kv_scales_shape(num_pages, page_size, hkv, layout), 5.0, jnp.float32)
    update = jax.jit(functools.partial(pk.update_kv_cache, backend="reference"))
    out = update(k_new, v_new, k_pages, k_pages, jnp.asarray(slots), k_scales=k_sc, v_scales=k_sc)
    assert len(out) == 4 and [o.dtype for o in out] == [dtype, dtype, jnp.float32, jnp.float32]
    untouched = np.setdiff1d(np.arange(page_size, num_pages * page_size), slots)
    for new, pages, sc in ((k_new, out[0], out[2]), (v_new, out[1], out[3])):
        want_q, want_s = kv_quant.quantize_numpy(new, dtype)
        rows, got_s = pages_as_rows(pages), slot_scales(sc, layout)
        width = rows.shape[1]
        for t in (0, 1, 2):  # real tokens; the padding ones collide on the null page
            want = np.zeros(width, np.float32)
            want[: hkv * d] = want_q[t].astype(np.float32).reshape(-1)
            np.testing.assert_array_equal(rows[slots[t]], want)
            np.testing.assert_array_equal(got_s[slots[t]], want_s[t])
        assert np.all(rows[untouched] == 7) and np.all(got_s[untouched] == 5.0)
    # The public op's auto path writes the same.
    auto = pk.update_kv_cache(k_new, v_new, k_pages, k_pages, jnp.asarray(slots), k_scales=k_sc, v_scales=k_sc)
    for a, b in zip(auto, out):
        np.testing.assert_array_equal(pages_as_rows(a), pages_as_rows(b))


def test_update_validation_names_the_dtype_and_the_scales():
    k_new = jnp.zeros((2, 3, 64))
    slots = jnp.zeros((2,), jnp.int32)
    pages = jnp.zeros((4, 16, 3, 64), jnp.int8)
    with pytest.raises(ValueError, match="int8 are quantized: pass k_scales"):
        pk.update_kv_cache(k_new, k_new, pages, pages, slots)
    sc = jnp.zeros((4, 16, 3), jnp.float32)
    with pytest.raises(ValueError, match="k_scales must have shape"):
        pk.update_kv_cache(k_new, k_new, pages, pages, slots, k_scales=sc[:2], v_scales=sc)
    with pytest.raises(ValueError, match="float32"):
        pk.update_kv_cache(k_new, k_new, pages, pages, slots, k_scales=sc.astype(jnp.bfloat16), v_scales=sc)
    with pytest.raises(ValueError, match="quantized pages"):
        pk.update_kv_cache(k_new, k_new, pages.astype(jnp.float32), pages.astype(jnp.float32), slots,
                           k_scales=sc, v_scales=sc)
    with pytest.raises(ValueError, match="int8 are quantized"):
        pk.ragged_paged_attention(jnp.zeros((2, 6, 64)), pages, pages, slots, jnp.zeros((2, 4), jnp.int32),
                                  jnp.zeros((3,), jnp.int32), jnp.ones((1,), jnp.int32), sm_scale=1.0)


# ---------------------------------------------------------------------- attention
@pytest.mark.parametrize("name,layout", [("int8", "heads"), ("int8", "lanes"), ("fp8_e4m3", "heads"),
                                         ("fp8_e5m2", "lanes")])
def test_reference_attention_on_quantized_pages(name, layout):
    deq, args, (ks, vs), base = quantized_case(name, layout)
    out = pk.ragged_paged_attention(*args, sm_scale=SM_SCALE, num_kv_heads=3, k_scales=ks, v_scales=vs,
                                    backend="reference")
    assert out.dtype == jnp.float32
    check_against_dequantized(out, deq, base, name, atol=2e-5)


def test_attention_implementation_reports_the_cache_dtype(monkeypatch):
    from pallas_kernels.ragged_paged_attention import ops

    assert attention_implementation("gpu", 3, 64, jnp.bfloat16, kv_cache_dtype=jnp.bfloat16)[0] == "pallas"
    impl, why = attention_implementation("tpu", 3, 64, jnp.bfloat16, kv_cache_dtype="fp8_e5m2",
                                         device_kind="TPU v5 lite")
    assert impl == "pallas" and "float8_e5m2 pages" in why
    # A GPU without fp8 conversions (compute capability < 8.9): auto runs the reference and
    # says why; forcing the kernel raises, naming the kernel, the dtype and what it reads.
    monkeypatch.setattr(ops, "_gpu_compute_capability", lambda: 8.0)
    impl, why = attention_implementation("gpu", 3, 64, jnp.bfloat16, kv_cache_dtype="fp8_e4m3")
    assert impl == "reference" and "gpu (Triton) attention kernel cannot read float8_e4m3fn pages" in why
    assert "it reads float pages and int8" in why
    assert attention_implementation("gpu", 3, 64, jnp.bfloat16, kv_cache_dtype="int8")[0] == "pallas"
    _, args, (ks, vs), _ = quantized_case("fp8_e4m3")
    with pytest.raises(ValueError, match="cannot read float8_e4m3fn pages; it reads float pages and int8"):
        pk.ragged_paged_attention(*args, sm_scale=SM_SCALE, k_scales=ks, v_scales=vs, backend="pallas_gpu",
                                  interpret=True)


@pytest.mark.parametrize("name", DTYPES)
def test_native_cpu_kernel_on_quantized_pages(name):
    from pallas_kernels.ragged_paged_attention import cpu as native_cpu

    ok, why = native_cpu.available()
    if not ok:
        pytest.skip(why)
    deq, args, (ks, vs), base = quantized_case(name, "heads")
    assert attention_implementation("cpu", 3, 64, jnp.float32, num_q_heads=6, kv_cache_dtype=name)[0] == "native"
    attend = jax.jit(functools.partial(pk.ragged_paged_attention, sm_scale=SM_SCALE))
    out = attend(*args, k_scales=ks, v_scales=vs)
    check_against_dequantized(out, deq, base, name, atol=2e-5)
    hlo = attend.lower(*args, k_scales=ks, v_scales=vs).as_text()
    assert "jaxserve_ragged_paged_attention_cpu_" in hlo and "_quantized" in hlo
    # bf16 queries, D=40 (the portable loops, not the 16-lane path) and a window.
    deq, args, (ks, vs), base = quantized_case(name, "heads", q_dtype=jnp.bfloat16, heads=(4, 2, 40))
    out = pk.ragged_paged_attention(*args, sm_scale=SM_SCALE, sliding_window=7, k_scales=ks, v_scales=vs)
    assert out.dtype == jnp.bfloat16
    deq_bf16 = RaggedCase(np.asarray(jnp.asarray(deq.q, jnp.bfloat16).astype(jnp.float32)), *deq.args()[1:])
    np.testing.assert_allclose(np.asarray(out, np.float32), attention_numpy(deq_bf16, sm_scale=SM_SCALE,
                                                                            sliding_window=7), atol=2e-2)


@pytest.mark.parametrize("head_dim", [64, 40])  # the AVX-512 loads (D % 16 == 0) and the portable loops
def test_native_cpu_kernel_decodes_every_fp8_and_int8_byte_exactly(head_dim):
    """One key per sequence (softmax weight exactly 1): the output is V's dequantized row, so
    every one of the 256 byte patterns, NaN and inf included, must come back as ml_dtypes
    reads it (times a scale of 0.5)."""
    from pallas_kernels.ragged_paged_attention import cpu as native_cpu

    if not native_cpu.available()[0]:
        pytest.skip(native_cpu.available()[1])
    rows = -(-256 // head_dim)
    raw = np.resize(np.arange(256, dtype=np.uint8), rows * head_dim).reshape(rows, 1, head_dim)
    pages = np.zeros((rows + 1, 16, 1, head_dim), np.uint8)
    pages[1:, 0] = raw
    meta = (jnp.ones((rows,), jnp.int32), jnp.arange(1, rows + 1, dtype=jnp.int32)[:, None],
            jnp.arange(rows + 1, dtype=jnp.int32), jnp.asarray([rows], jnp.int32))
    scales = jnp.full((rows + 1, 16, 1), 0.5, jnp.float32)
    q = jnp.ones((rows, 2, head_dim), jnp.float32)
    for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
        values = jnp.asarray(pages.view(dtype))
        k = jnp.zeros_like(values)
        out = native_cpu.ragged_paged_attention_cpu(q, k, values, *meta, sm_scale=1.0, k_scales=scales,
                                                    v_scales=scales)
        want = raw.view(dtype).astype(np.float32) * np.float32(0.5)  # [rows, 1, D]
        np.testing.assert_array_equal(np.asarray(out)[:, 0], want[:, 0])
        np.testing.assert_array_equal(np.asarray(out)[:, 1], want[:, 0])


@pytest.mark.parametrize("name,q_dtype,splits", [("int8", jnp.float32, 1), ("int8", jnp.bfloat16, 2),
                                                ("fp8_e4m3", jnp.float32, 2), ("fp8_e5m2", jnp.float32, 1)])
def test_triton_kernel_interpreted_on_quantized_pages(name, q_dtype, splits):
    """Tiny shapes (interpret mode is slow); unsplit, and split-KV (2 splits, several 16-key
    blocks per split)."""
    from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu

    deq, args, (ks, vs), base = quantized_case(name, "heads", q_dtype=q_dtype)
    if splits == 1:  # through the public op
        out = pk.ragged_paged_attention(*args, sm_scale=SM_SCALE, k_scales=ks, v_scales=vs, backend="pallas_gpu",
                                        interpret=True)
    else:
        out = ragged_paged_attention_gpu(*args, sm_scale=SM_SCALE, k_scales=ks, v_scales=vs, max_splits=splits,
                                         block_k=16, interpret=True)
    assert out.dtype == q_dtype
    if q_dtype == jnp.float32:
        check_against_dequantized(out, deq, base, name, atol=2e-5)
    else:
        deq16 = RaggedCase(np.asarray(args[0].astype(jnp.float32)), *deq.args()[1:])
        np.testing.assert_allclose(np.asarray(out, np.float32), attention_numpy(deq16, sm_scale=SM_SCALE), atol=3e-2)


def assert_same_writes(got, want, page_size: int, layout: str):
    """Equal pages and scales outside the null page (where padding tokens collide)."""
    assert [x.dtype for x in got] == [x.dtype for x in want] and len(got) == 4
    for a, b in zip(got[:2], want[:2]):
        np.testing.assert_array_equal(pages_as_rows(a)[page_size:], pages_as_rows(b)[page_size:])
    for a, b in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(slot_scales(a, layout)[page_size:], slot_scales(b, layout)[page_size:])


def test_triton_kv_update_interpreted_writes_values_and_scales():
    layout = "heads"
    num_pages, page_size, hkv, d = 4, 16, 3, 32
    rng = np.random.default_rng(2)
    k_new = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.bfloat16)
    slots = jnp.asarray([17, 18, 60, 0, 0], jnp.int32)
    pages = jnp.full((num_pages, page_size, hkv, d), 3, jnp.float8_e4m3fn)
    sc = jnp.full((num_pages, page_size, hkv), 5.0, jnp.float32)
    got = pk.update_kv_cache(k_new, v_new, pages, pages, slots, k_scales=sc, v_scales=sc, backend="pallas_gpu",
                             interpret=True)
    want = pk.update_kv_cache(k_new, v_new, pages, pages, slots, k_scales=sc, v_scales=sc, backend="reference")
    assert_same_writes(got, want, page_size, layout)


# ---------------------------------------------------------------------- compile-only targets
def compiled_hlo(fn, args, device) -> str:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with jax.default_device(device):  # Pallas TPU reads the chip generation from it
        return jax.jit(fn).lower(*sds).compile().as_text()


def step_args(name: str, layout: str, q_dtype, heads=(9, 3, 64), tokens=16, rows=8, max_pages=16, pages=128,
              page_size=16):
    """Abstract attention args (+ scales) and KV-update args of one quantized layer."""
    hq, hkv, d = heads
    dtype = kv_quant.kv_cache_dtype(name)
    S = jax.ShapeDtypeStruct
    page = S((pages, page_size, hkv, d) if layout == "heads" else (pages, page_size, lanes_width(hkv, d)), dtype)
    sc = S(kv_scales_shape(pages, page_size, hkv, layout), jnp.float32)
    attn = (S((tokens, hq, d), q_dtype), page, page, S((rows,), jnp.int32), S((rows, max_pages), jnp.int32),
            S((rows + 1,), jnp.int32), S((1,), jnp.int32), sc, sc)
    new = S((tokens, hkv, d), q_dtype)
    return attn, (new, new, page, page, S((tokens,), jnp.int32), sc, sc)


def attention_with_scales(num_kv_heads):
    def fn(q, k, v, kv_lens, tables, cu, n, ks, vs):
        return pk.ragged_paged_attention(q, k, v, kv_lens, tables, cu, n, sm_scale=SM_SCALE, num_kv_heads=num_kv_heads,
                                         k_scales=ks, v_scales=vs)
    return fn


def update_with_scales(k_new, v_new, k_pages, v_pages, slots, ks, vs):
    return pk.update_kv_cache(k_new, v_new, k_pages, v_pages, slots, k_scales=ks, v_scales=vs)


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_auto_compiles_the_triton_kernels_on_fp8_pages_for_an_h200():
    """SmolLM2's heads, bf16 queries on float8_e4m3fn pages, a 16-token decode bucket (split-KV);
    the KV update kernel; no dequantized copy of the pages in the program."""
    try:
        from jaxserve.compilation.targets import Target

        device = Target.parse("gpu:h200").devices()[0]
    except Exception as e:  # the CUDA plugin is an optional test dependency
        pytest.skip(f"no compile-only H200: {e}")
    attn, update = step_args("fp8_e4m3", "heads", jnp.bfloat16)
    assert attention_implementation("gpu", 3, 64, jnp.bfloat16, kv_cache_dtype="fp8_e4m3")[0] == "pallas"
    hlo = compiled_hlo(attention_with_scales(3), attn, device)
    assert "__gpu$xla.gpu.triton" in hlo and "ragged_paged_attention_gpu" in hlo
    assert "bf16[128,16,3,64]" not in hlo and "f32[128,16,3,64]" not in hlo and "bf16[6144,64]" not in hlo
    hlo = compiled_hlo(update_with_scales, update, device)
    assert "__gpu$xla.gpu.triton" in hlo and "update_kv_cache_gpu" in hlo


@pytest.mark.parametrize("name", DTYPES)
def test_mosaic_kernel_interpreted_on_quantized_pages(name):
    """Lanes layout under the TPU interpreter (DMAs, semaphores and bounds simulated); f32 queries,
    D=64 (two heads share a 128-lane window), pages of 16 (8 pages' scales to a row, rotated into
    place), shuffled over two rows of scales."""
    from jax.experimental.pallas import tpu as pltpu

    deq, args, (ks, vs), base = quantized_case(name, "lanes", heads=(4, 2, 64))
    attend = functools.partial(pk.ragged_paged_attention, sm_scale=SM_SCALE, num_kv_heads=2, k_scales=ks,
                               v_scales=vs, backend="pallas_tpu", interpret=pltpu.InterpretParams())
    check_against_dequantized(attend(*args), deq, base, name, atol=2e-5)


def test_mosaic_kv_update_interpreted_writes_values_and_scales():
    """Heads layout (the DMA kernel moves the values, XLA's scatter the scales); the lanes
    layout's update is XLA's scatter under `auto` (the reference, tested above)."""
    from jax.experimental.pallas import tpu as pltpu

    layout = "heads"
    num_pages, page_size, hkv, d = 4, 16, 2, 64
    rng = np.random.default_rng(3)
    k_new = jnp.asarray(rng.standard_normal((5, hkv, d)), jnp.float32)
    slots = jnp.asarray([17, 18, 60, 0, 0], jnp.int32)
    shape = (num_pages, page_size, hkv, d) if layout == "heads" else (num_pages, page_size, lanes_width(hkv, d))
    pages = jnp.full(shape, 3, jnp.int8)
    sc = jnp.full(kv_scales_shape(num_pages, page_size, hkv, layout), 5.0, jnp.float32)
    got = pk.update_kv_cache(k_new, -k_new, pages, pages, slots, k_scales=sc, v_scales=sc, backend="pallas_tpu",
                             interpret=pltpu.InterpretParams())
    want = pk.update_kv_cache(k_new, -k_new, pages, pages, slots, k_scales=sc, v_scales=sc, backend="reference")
    assert_same_writes(got, want, page_size, layout)


@pytest.mark.usefixtures("no_persistent_cache_writes")
@pytest.mark.parametrize("topology,name", [("v5e:2x2", "fp8_e4m3"), ("v6e:2x2", "int8")])
def test_auto_compiles_the_mosaic_kernel_on_quantized_pages_for_tpu(topology, name):
    """SmolLM2's heads in the lanes layout, bf16 queries, 64 tokens: the Mosaic kernel reads the
    quantized pages and the scales in place (no copy, no dequantized pages: no temporaries);
    on the v5e also the lanes KV update (XLA's scatter, values and scales in place)."""
    try:
        from jax.experimental import topologies

        device = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices[0]
    except Exception as e:  # libtpu is an optional test dependency
        pytest.skip(f"no compile-only TPU: {e}")
    assert attention_implementation("tpu", 3, 64, jnp.bfloat16, kv_cache_dtype=name,
                                    device_kind=device.device_kind)[0] == "pallas"
    attn, update = step_args(name, "lanes", jnp.bfloat16, tokens=64, pages=1024)
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    with jax.default_device(device):
        sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in attn]
        compiled = jax.jit(attention_with_scales(3)).lower(*sds).compile()
        hlo = compiled.as_text()
        assert "tpu_custom_call" in hlo and "ragged_paged_attention_tpu" in hlo
        assert compiled.memory_analysis().temp_size_in_bytes < 2**20
        if topology.startswith("v5e"):
            sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in update]
            compiled = jax.jit(update_with_scales, donate_argnums=(2, 3, 5, 6)).lower(*sds).compile()
            assert "scatter" in compiled.as_text()
            assert compiled.memory_analysis().temp_size_in_bytes < 2**20
