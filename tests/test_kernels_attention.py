"""Ragged paged attention kernels vs the reference: Triton GPU and Mosaic TPU in interpret
mode, the native CPU kernel (cpu_kernel.cc) compiled for this host.

Small shapes only (interpret mode is slow): a few sequences, contexts <= ~200, page 16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import pallas_kernels as pk
from pallas_kernels.kv_layout import lanes_width, to_lanes
from pallas_kernels.ragged_paged_attention import cpu as native_cpu
from pallas_kernels.ragged_paged_attention.gpu import ragged_paged_attention_gpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference
from pallas_kernels.ragged_paged_attention.testing import attention_numpy, make_case
from pallas_kernels.ragged_paged_attention.tpu import ragged_paged_attention_tpu

# On an NVIDIA GPU the Triton kernel runs natively (scripts/check_kernels_gpu.py), else interpreted.
ON_GPU = jax.default_backend() == "gpu"


def lanes(pages):
    """[P, S, Hkv, D] pages in the lanes layout the TPU kernel reads ([P, S, C])."""
    return to_lanes(pages, lanes_width(pages.shape[2], pages.shape[3]))


def _tpu_on_lanes(q, k_pages, v_pages, *rest, **kw):
    # The TPU interpreter simulates DMAs/semaphores and flags out-of-bounds accesses.
    return ragged_paged_attention_tpu(q, lanes(k_pages), lanes(v_pages), *rest, num_kv_heads=k_pages.shape[2],
                                      interpret=pltpu.InterpretParams(), block_q=16, chunk_pages=2, **kw)


def _native_cpu(*args, **kw):
    ok, why = native_cpu.available()
    assert ok, why  # the Makefile's test setup has a C++ compiler: not building is a failure
    return jax.jit(functools.partial(native_cpu.ragged_paged_attention_cpu, **kw))(*args)


KERNELS = {
    "gpu": functools.partial(ragged_paged_attention_gpu, interpret=not ON_GPU),
    "tpu": _tpu_on_lanes,
    "cpu": _native_cpu,
}

CASES = {
    "all_decode": dict(seqs=[(1, 17), (1, 1), (1, 64), (1, 190)], num_tokens=8, num_rows=6),
    "all_prefill": dict(seqs=[(40, 40), (7, 7), (23, 23)], num_tokens=72, num_rows=4),
    "mixed": dict(seqs=[(1, 50), (30, 30), (1, 9), (12, 60)], num_tokens=48, num_rows=6),
    "unaligned_chunks": dict(seqs=[(13, 29), (19, 51), (5, 16)], num_tokens=40),
    "one_token_seq": dict(seqs=[(1, 1)], num_tokens=8, num_rows=3),
    "long_continuation": dict(seqs=[(3, 200), (20, 180)], num_tokens=24, num_rows=4),
}


def _args(case, dtype=jnp.float32):
    return [jnp.asarray(a, dtype) if a.dtype == np.float32 else jnp.asarray(a) for a in case.args()]


def _check(kernel, case, *, dtype=jnp.float32, atol=1e-5, tuning=None, **kw):
    args = _args(case, dtype)
    sm_scale = case.q.shape[-1] ** -0.5
    # Finished before the eager reference runs: the TPU interpreter's io_callbacks run jnp ops
    # of their own, and one deadlocked against the reference's eager gather (CI, 2026-12-04).
    got = jax.block_until_ready(KERNELS[kernel](*args, sm_scale=sm_scale, **kw, **(tuning or {})))
    assert got.shape == case.q.shape and got.dtype == dtype
    f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
    want = ragged_paged_attention_reference(*f32, sm_scale=sm_scale, **kw)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=atol, rtol=atol)
    total = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert np.all(np.asarray(got[total:], np.float32) == 0.0), "padding rows must be zero"


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_cases_f32(kernel, name):
    case = make_case(**CASES[name], num_q_heads=4, num_kv_heads=2, head_dim=64, seed=len(name))
    _check(kernel, case)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
def test_gqa_ratios(kernel, heads):
    hq, hkv = heads
    case = make_case(**CASES["mixed"], num_q_heads=hq, num_kv_heads=hkv, head_dim=64, seed=3)
    _check(kernel, case)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("window", [1, 24])
def test_sliding_window(kernel, window):
    case = make_case(**CASES["long_continuation"], head_dim=64, seed=5)
    _check(kernel, case, sliding_window=window)


# Per-layer windows (Gemma 2/3 interleave window and global layers in one scan): the window
# is an int32 array, traced under jit; <= 0 is global attention.
WINDOW_KERNELS = {**KERNELS, "reference": ragged_paged_attention_reference}
# Small (interpret mode), but long enough that a 24-key window skips whole KV chunks.
WINDOW_CASE = dict(seqs=[(2, 90), (9, 70)], num_tokens=16, num_rows=3)


@pytest.mark.parametrize("kernel", sorted(WINDOW_KERNELS))
@pytest.mark.parametrize("window", [24, 0], ids=["window24", "global0"])
def test_traced_window_matches_the_static_one(kernel, window):
    case = make_case(**WINDOW_CASE, head_dim=64, seed=5)
    args = _args(case)
    fn = WINDOW_KERNELS[kernel]
    static = window or None  # the same attention as a static int (or None: no window)
    traced = jax.jit(lambda w, *a: fn(*a, sm_scale=0.125, sliding_window=w))
    got = np.asarray(traced(jnp.array([window], jnp.int32), *args))  # shape [1]
    if kernel in ("reference", "cpu"):  # compiled fast; interpreted kernels: the oracle only
        want = np.asarray(fn(*args, sm_scale=0.125, sliding_window=static))
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-6)
    oracle = attention_numpy(case, sm_scale=0.125, sliding_window=static)
    np.testing.assert_allclose(got, oracle, atol=1e-5, rtol=1e-5)
    # The window is data: another value is the same executable.
    other = np.asarray(traced(jnp.array([0 if window else 24], jnp.int32), *args))
    assert traced._cache_size() == 1
    assert not np.allclose(other, got), "the window must change the result of this case"


def _scan_backend(kernel):
    """The public op's backend per kernel: on CPU `auto` is the native kernel."""
    return {
        "reference": dict(backend="reference"),
        "cpu": dict(backend="auto"),
        "gpu": dict(backend="pallas_gpu", interpret=not ON_GPU),
        "tpu": dict(backend="pallas_tpu", interpret=pltpu.InterpretParams()),
    }[kernel]


@pytest.mark.parametrize("kernel", sorted(WINDOW_KERNELS))
def test_scan_over_window_and_global_layers(kernel):
    """Two "layers" in one `lax.scan`, windows [17, 0], through the public op: each layer
    equals its own call with the static window (17, then None)."""
    case = make_case(**WINDOW_CASE, head_dim=64, seed=23)
    q, k, v, *meta = _args(case)
    if kernel == "tpu":
        k, v = lanes(k), lanes(v)
    op = functools.partial(pk.ragged_paged_attention, sm_scale=0.125, num_kv_heads=case.k_pages.shape[2],
                           **_scan_backend(kernel))
    qs = jnp.stack([q, -0.5 * q])  # [L, T, Hq, D]: each layer its own queries
    windows = jnp.array([17, 0], jnp.int32)  # [L]

    @jax.jit
    def layers(qs, windows):
        def body(carry, layer):
            q_l, w_l = layer
            return carry, op(q_l, k, v, *meta, sliding_window=w_l)  # w_l: a traced [] int32

        return jax.lax.scan(body, None, (qs, windows))[1]

    got = np.asarray(layers(qs, windows))
    for layer, static in enumerate((17, None)):
        want = np.asarray(op(qs[layer], k, v, *meta, sliding_window=static))
        np.testing.assert_allclose(got[layer], want, atol=1e-6, rtol=1e-6)
    oracle = attention_numpy(case, sm_scale=0.125, sliding_window=17)
    np.testing.assert_allclose(got[0], oracle, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_soft_cap(kernel):
    case = make_case(**CASES["mixed"], head_dim=64, seed=7)
    case.q[:] *= 20.0
    _check(kernel, case, soft_cap=5.0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("heads", [(8, 2), (6, 2)], ids=["gqa4", "gqa3_odd_group"])
def test_bf16_head_dim_128(kernel, heads):
    hq, hkv = heads
    case = make_case(**CASES["mixed"], num_q_heads=hq, num_kv_heads=hkv, head_dim=128, seed=9)
    _check(kernel, case, dtype=jnp.bfloat16, atol=2e-2)


def test_gpu_kernel_odd_group_smollm_heads():
    """SmolLM2-135M heads (Hq=9, Hkv=3): G=3 is padded to 4 rows per token inside."""
    case = make_case(**CASES["mixed"], num_q_heads=9, num_kv_heads=3, head_dim=64, seed=11)
    _check("gpu", case)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_nan_in_unused_slots_does_not_leak(kernel):
    """Slots past kv_len, the rest of a sequence's last page and the null page hold NaN."""
    case = make_case(**CASES["mixed"], head_dim=64, seed=15, unused_fill=np.nan)
    assert np.isnan(case.k_pages).any()
    _check(kernel, case)


def test_reference_ignores_nan_in_unused_slots():
    case = make_case(**CASES["mixed"], head_dim=32, seed=16, unused_fill=np.nan)
    got = ragged_paged_attention_reference(*_args(case), sm_scale=0.25)
    assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("head_dim", [80, 96, 256])
def test_gpu_kernel_head_dims(head_dim):
    """Non-power-of-two heads run as power-of-two column pieces (80 = 64 + 16, 96 = 64 + 32)."""
    case = make_case(**CASES["mixed"], num_q_heads=4, num_kv_heads=2, head_dim=head_dim, seed=head_dim)
    _check("gpu", case)


@pytest.mark.parametrize("max_splits", [1, 2, 3])
def test_gpu_kernel_kv_splits(max_splits):
    """Split-KV partials (several key blocks per split, uneven last split) and the unsplit path
    of a decode batch, with a window so splits start past zero."""
    case = make_case(seqs=[(1, 200), (1, 37), (2, 130)], num_tokens=8, num_rows=4, head_dim=32, seed=17)
    tuning = dict(max_splits=max_splits, block_k=16)
    _check("gpu", case, tuning=tuning)
    _check("gpu", case, tuning=tuning, sliding_window=70)


def test_gpu_kernel_default_splits_near_the_work_item_bound():
    """Ten decodes x 2 KV heads take ceil(512 / 20) = 26 splits: 260 (block, split) items of a
    grid sized ceil(T / Bq) + R + 512 / Hkv = 270, all of which must run."""
    case = make_case(seqs=[(1, 40 + 9 * i) for i in range(10)], num_tokens=16, num_rows=12, head_dim=32, seed=18)
    _check("gpu", case, tuning=dict(block_k=16))


def test_gpu_block_schedule_is_flat():
    """Grid slots map to (sequence, block) pairs of the real query blocks only."""
    from pallas_kernels.ragged_paged_attention.gpu import block_schedule

    cu = jnp.array([0, 5, 6, 6 + 9, 15, 15], jnp.int32)  # q_lens 5, 1, 9 and two padding rows
    seq, idx, total = block_schedule(cu, jnp.array([3], jnp.int32), num_blocks=10, block_q=4)
    assert int(total) == 2 + 1 + 3
    assert seq[:6].tolist() == [0, 0, 1, 2, 2, 2] and idx.tolist() == [0, 1, 0, 0, 1, 2, -1, -1, -1, -1]


@pytest.mark.parametrize("head_dim,page_size", [(72, 8), (32, 32), (64, 16)])
def test_cpu_kernel_shapes(head_dim, page_size):
    """D not a multiple of 16 takes the portable loops (the 8-lane paths on AVX2); pages of 8 and 32 slots; a decode
    batch larger than the query block (8 tokens per work item) and longer than a page."""
    seqs = [(1, 5 + 23 * i) for i in range(12)] + [(19, 40), (9, 9)]  # 14 rows, 40 tokens
    case = make_case(seqs=seqs, num_tokens=48, num_rows=16, num_q_heads=6, num_kv_heads=2,
                     head_dim=head_dim, page_size=page_size, seed=head_dim)
    _check("cpu", case)
    _check("cpu", case, sliding_window=17)


@pytest.mark.parametrize("kv,page_size", [("f32", 16), ("int8", 16), ("fp8", 16), ("int8", 32)])
def test_cpu_kernel_results_do_not_depend_on_the_block(kv, page_size):
    """A token's attention has the same bits prefilled whole, in unaligned chunks, or decoded
    one token at a time (each a different grouping of its queries and keys): chunked prefill
    and prefix-cache hits then never change greedy tokens. Odd group (9 heads on 3), D=64,
    a sliding window on the second pass. With 32-slot pages a segment of up to 16 keys takes
    the 16-row softmax and a longer one the per-row loop, per block: the two must agree."""
    from pallas_kernels import kv_quant

    case = make_case(seqs=[(40, 40)], num_tokens=48, num_rows=2, num_q_heads=9, num_kv_heads=3, head_dim=64,
                     page_size=page_size, seed=7)
    q, k, v, kv_lens, tables, cu, n = _args(case)
    kw = {}
    if kv in ("int8", "fp8"):
        dtype = jnp.int8 if kv == "int8" else jnp.float8_e4m3fn
        (k, kw["k_scales"]), (v, kw["v_scales"]) = kv_quant.quantize(k, dtype), kv_quant.quantize(v, dtype)
    for window in (None, 21):
        whole = np.asarray(_native_cpu(q, k, v, kv_lens, tables, cu, n, sm_scale=0.125, sliding_window=window,
                                       **kw))[:40]
        parts = []
        for c0, c1 in [(0, 13), (13, 29), *((t, t + 1) for t in range(29, 40))]:
            qc = jnp.zeros_like(q).at[:c1 - c0].set(q[c0:c1])
            got = _native_cpu(qc, k, v, kv_lens.at[0].set(c1), tables, cu.at[1:].set(c1 - c0), n, sm_scale=0.125,
                              sliding_window=window, **kw)
            parts.append(np.asarray(got)[:c1 - c0])
        np.testing.assert_array_equal(np.concatenate(parts), whole, err_msg=f"window {window}")


def test_cpu_kernel_clamps_bad_metadata():
    """Page ids past the pool and kv_lens past the block table read clamped addresses (wrong
    numbers at worst), never outside the buffers: the process must survive to report."""
    case = make_case(**CASES["mixed"], head_dim=64, seed=19)
    q, k, v, kv_lens, tables, cu, n = _args(case)
    tables = tables.at[0, 0].set(10**6).at[1, 0].set(-5)
    kv_lens = kv_lens.at[2].set(10**6)
    got = _native_cpu(q, k, v, kv_lens, tables, cu, n, sm_scale=0.125)
    assert np.isfinite(np.asarray(got)).all()
    # num_seqs past the rows and q_len past the tokens are clamped the same way.
    got = _native_cpu(q, k, v, kv_lens, tables, cu.at[-1].set(10**6), jnp.array([99], jnp.int32), sm_scale=0.125)
    assert got.shape == q.shape


def test_cpu_kernel_is_what_auto_lowers_on_cpu():
    """backend="auto" compiled for this CPU calls the native kernel, and agrees with it."""
    case = make_case(**CASES["mixed"], head_dim=64, seed=21)
    args = _args(case)
    fn = jax.jit(functools.partial(pk.ragged_paged_attention, sm_scale=0.125))
    assert "jaxserve_ragged_paged_attention_cpu_" in fn.lower(*args).as_text()
    want = _native_cpu(*args, sm_scale=0.125)
    np.testing.assert_array_equal(np.asarray(fn(*args)), np.asarray(want))
    ref = jax.jit(functools.partial(pk.ragged_paged_attention, sm_scale=0.125, backend="reference"))
    assert "jaxserve_ragged_paged_attention_cpu_" not in ref.lower(*args).as_text()


def test_public_op_pallas_interpret_matches_reference():
    case = make_case(**CASES["mixed"], head_dim=64, seed=13)
    args = _args(case)
    fn = jax.jit(
        functools.partial(
            pk.ragged_paged_attention, sm_scale=0.125, backend="pallas", interpret=True
        )
    )
    want = ragged_paged_attention_reference(*args, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(fn(*args)), np.asarray(want), atol=1e-5, rtol=1e-5)
    q, k, v, *rest = args
    with pytest.raises(ValueError, match="reads the lanes layout"):
        pk.ragged_paged_attention(*args, sm_scale=0.125, backend="pallas_tpu", interpret=True)
    got = pk.ragged_paged_attention(q, lanes(k), lanes(v), *rest, sm_scale=0.125, num_kv_heads=k.shape[2],
                                    backend="pallas_tpu", interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    ref_lanes = pk.ragged_paged_attention(q, lanes(k), lanes(v), *rest, sm_scale=0.125, num_kv_heads=k.shape[2],
                                          backend="reference")  # the reference reads both layouts
    np.testing.assert_allclose(np.asarray(ref_lanes), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_dispatch_rules():
    from pallas_kernels._dispatch import resolve_backend
    from pallas_kernels.ragged_paged_attention.tpu import supports

    assert resolve_backend("reference", False) == "reference"
    assert resolve_backend("pallas_tpu", True) == "tpu"
    assert resolve_backend("pallas_gpu", True) == "gpu"
    if jax.default_backend() == "cpu":
        assert resolve_backend("auto", False) == "reference"
        assert resolve_backend("pallas", True) == "gpu"
        for backend in ("pallas", "pallas_tpu", "pallas_gpu"):
            with pytest.raises(ValueError, match="interpret=True"):
                resolve_backend(backend, False)
    assert supports(8, 128) and supports(3, 64) and not supports(4, 96) and not supports(4, 512)
    assert not supports(2, 192)  # 192-lane heads straddle 128-lane tiles in the lanes layout
    assert supports(3, 64, jnp.bfloat16) and supports(8, 128, jnp.bfloat16)


@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (16, 1, 64), (6, 3, 128), (4, 2, 256)],
                         ids=["smollm_3x64_padded", "mqa_64", "3x128", "2x256"])
def test_tpu_kernel_lane_windows(heads, dtype, atol):
    """The lanes layout: two 64-wide heads share a 128-lane tile (a third one sits alone in a
    padded tile), 128- and 256-wide heads take whole tiles."""
    hq, hkv, d = heads
    case = make_case(**CASES["mixed"], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, seed=17)
    _check("tpu", case, dtype=dtype, atol=atol)


# Attention sinks (gpt-oss): one learned logit per query head in every row's denominator.
SINK_KERNELS = {**KERNELS, "reference": ragged_paged_attention_reference}


@pytest.mark.parametrize("kernel", sorted(SINK_KERNELS))
@pytest.mark.parametrize("name,window", [("mixed", None), ("all_prefill", None), ("long_continuation", 24)])
def test_sinks_join_the_softmax_denominator(kernel, name, window):
    """Against the float64 oracle, sinks from -5 to +8 (a sink larger than every score is the
    case the rescaling exists for), GQA 8:2, head dim 64 as gpt-oss's."""
    case = make_case(**CASES[name], num_q_heads=8, num_kv_heads=2, head_dim=64, seed=11)
    sinks = np.linspace(-5.0, 8.0, 8).astype(np.float32)
    sm_scale = 64 ** -0.5
    got = SINK_KERNELS[kernel](*_args(case), sm_scale=sm_scale, sliding_window=window, sinks=jnp.asarray(sinks))
    want = attention_numpy(case, sm_scale=sm_scale, sliding_window=window, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    plain = attention_numpy(case, sm_scale=sm_scale, sliding_window=window)
    total = int(case.cu_q_lens[int(case.num_seqs[0])])
    assert np.abs(np.asarray(got)[:total] - plain[:total]).max() > 0.1  # the sinks changed the result


def test_sinks_and_chunks_of_the_wrong_form_are_refused():
    from pallas_kernels import ragged_paged_attention

    case = make_case(**CASES["mixed"], num_q_heads=8, num_kv_heads=2, head_dim=64, seed=11)
    with pytest.raises(ValueError, match=r"sinks must be \[Hq=8\]"):
        ragged_paged_attention(*_args(case), sm_scale=0.125, sinks=jnp.zeros(4))
    with pytest.raises(ValueError, match="attention_chunk must be a positive int or None, got 0"):
        ragged_paged_attention(*_args(case), sm_scale=0.125, attention_chunk=0)
    with pytest.raises(ValueError, match=r"attention_chunk as an array must have shape \[\] or \[1\], got \[2\]"):
        ragged_paged_attention(*_args(case), sm_scale=0.125, attention_chunk=jnp.zeros(2, jnp.int32))


# Chunked local attention (Llama 4): a position sees only its own C-token chunk.
@pytest.mark.parametrize("kernel", sorted(SINK_KERNELS))
@pytest.mark.parametrize("chunk,traced", [(16, False), (24, True), (0, True)], ids=["c16", "c24_data", "none_data"])
def test_chunked_attention_sees_only_the_rows_own_chunk(kernel, chunk, traced):
    """Chunks of 16 (page-aligned) and 24 (not), the 24 as per-layer data, and 0 as data (no
    chunking: the global result), against the float64 oracle, on prefill that crosses chunk
    boundaries and decode deep into a later chunk."""
    case = make_case(**WINDOW_CASE, head_dim=64, seed=13)
    sm_scale = 64 ** -0.5
    arg = jnp.asarray(chunk, jnp.int32) if traced else chunk
    fn = SINK_KERNELS[kernel]
    got = jax.jit(lambda *a: fn(*a, sm_scale=sm_scale, attention_chunk=arg))(*_args(case)) if traced else \
        fn(*_args(case), sm_scale=sm_scale, attention_chunk=arg)
    want = attention_numpy(case, sm_scale=sm_scale, attention_chunk=chunk or None)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)


# attend_until (Gemma 3's image tokens see their whole image): token t sees keys up to
# min(max(p, attend_until[t]), kv_len - 1); the window and chunk bounds still follow from p.
# Small query and key blocks (GPU: 8 tokens, 16 keys, two KV splits; TPU: 16 tokens, chunks
# of 2 pages of 8), so that an image crosses blocks and its later keys lie in chunks past a
# block's last position.
UNTIL_KERNELS = {**KERNELS, "reference": ragged_paged_attention_reference,
                 "reference_per_row": functools.partial(ragged_paged_attention_reference, block_q=1),
                 "gpu": functools.partial(ragged_paged_attention_gpu, interpret=not ON_GPU, block_q=8, block_k=16,
                                          max_splits=2)}
# A 30-token prefill whose positions 5..20 are one image, a decode, a continuation chunk
# (positions 48..59) with an image at 50..55 and a last token whose limit lies past kv_len
# (clipped: the slots after it hold NaN), a decode with -1 (causal), and padding tokens
# whose limits must be ignored. TPU blocks of 16 tokens cut the first image in two.
UNTIL_CASE = dict(seqs=[(30, 30), (1, 50), (12, 60), (1, 9)], num_tokens=48, num_rows=6)


def _attend_until_case():
    case = make_case(**UNTIL_CASE, head_dim=64, page_size=8, seed=29, unused_fill=np.nan)
    until = np.zeros(48, np.int32)
    until[5:21] = 20  # sequence 0, positions 5..20
    until[30] = 10**6  # the decode of sequence 1: clipped to its own position
    until[31 + 2:31 + 8] = 55  # sequence 2, positions 50..55
    until[42] = 70  # sequence 2's last token (position 59): clipped to kv_len - 1 = 59
    until[43] = -1
    until[44:] = 1000  # padding
    return case, until


def _quantized_int8(case, kernel):
    """(int8 K/V pages, their scales for `kernel`, the case on the dequantized pages)."""
    from pallas_kernels import kv_quant
    from pallas_kernels.kv_layout import kv_scales_shape
    from pallas_kernels.ragged_paged_attention.testing import RaggedCase

    kq, ks = kv_quant.quantize_numpy(case.k_pages, jnp.int8)
    vq, vs = kv_quant.quantize_numpy(case.v_pages, jnp.int8)
    deq = RaggedCase(case.q, np.asarray(kv_quant.dequantize(jnp.asarray(kq), jnp.asarray(ks))),
                     np.asarray(kv_quant.dequantize(jnp.asarray(vq), jnp.asarray(vs))), *case.args()[3:])
    scales = [jnp.asarray(ks), jnp.asarray(vs)]
    if kernel == "tpu":  # the lanes layout's scales: [Hkv, ceil(P * ps / 128), 128]
        num_pages, page_size, hkv = ks.shape
        empty = jnp.zeros(kv_scales_shape(num_pages, page_size, hkv, "lanes"), jnp.float32)
        slots = jnp.arange(num_pages * page_size, dtype=jnp.int32)
        scales = [kv_quant.write_scales(empty, slots, jnp.asarray(s.reshape(-1, hkv)), "lanes") for s in (ks, vs)]
    return jnp.asarray(kq), jnp.asarray(vq), dict(k_scales=scales[0], v_scales=scales[1]), deq


@pytest.mark.parametrize("kernel", sorted(UNTIL_KERNELS))
@pytest.mark.parametrize("window,kv", [(None, "f32"), (8, "int8")])
def test_attend_until_lets_image_tokens_see_their_whole_image(kernel, window, kv):
    """Against the float64 oracle, with and without a window smaller than an image (its lower
    bound still follows from the position), and on int8 pages; all-zero limits are the plain
    causal result."""
    case, until = _attend_until_case()
    sm_scale = 64 ** -0.5
    fn = UNTIL_KERNELS[kernel]
    q, k, v, *meta = _args(case)
    kw, oracle_case = {}, case
    if kv == "int8":
        k, v, kw, oracle_case = _quantized_int8(case, kernel)
    got = fn(q, k, v, *meta, sm_scale=sm_scale, sliding_window=window, attend_until=jnp.asarray(until), **kw)
    got = np.asarray(jax.block_until_ready(got))
    want = attention_numpy(oracle_case, sm_scale=sm_scale, sliding_window=window, attend_until=until)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    causal = attention_numpy(oracle_case, sm_scale=sm_scale, sliding_window=window)
    assert np.abs(got[5:20] - causal[5:20]).max() > 0.1  # the image's tokens saw past themselves
    np.testing.assert_allclose(got[20:30], causal[20:30], atol=2e-5, rtol=2e-5)  # the rest: causal
    assert np.all(got[44:] == 0.0), "padding rows must be zero"
    if window is None and kv == "f32":
        zeros = fn(q, k, v, *meta, sm_scale=sm_scale, attend_until=jnp.zeros(48, jnp.int32))
        plain = fn(q, k, v, *meta, sm_scale=sm_scale)
        np.testing.assert_allclose(np.asarray(zeros), np.asarray(plain), atol=1e-6, rtol=1e-6)


def test_attend_until_of_the_wrong_form_is_refused():
    case = make_case(**CASES["mixed"], head_dim=64, seed=11)
    args = _args(case)
    num_tokens = case.q.shape[0]
    for bad in (jnp.zeros(num_tokens - 1, jnp.int32), jnp.zeros((num_tokens, 1), jnp.int32),
                jnp.zeros(num_tokens, jnp.float32), np.zeros(num_tokens, np.int64), 3):
        with pytest.raises(ValueError, match="attend_until"):
            pk.ragged_paged_attention(*args, sm_scale=0.125, attend_until=bad)
    ok = pk.ragged_paged_attention(*args, sm_scale=0.125, attend_until=jnp.zeros(num_tokens, jnp.int32),
                                   backend="reference")
    assert ok.shape == case.q.shape
