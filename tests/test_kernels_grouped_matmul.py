"""Grouped matmul (MoE experts): the Triton kernel in interpret mode and the CPU path (a loop
over the non-empty groups) against the reference and a numpy per-row oracle, the kernel's tile
table, the op's validation and dispatch, `auto` compiled for this CPU (the CPU path: loops, no
dense expansion, no copy of rhs), and compile-only checks that `auto` gives the Triton kernel
for an H200 (no dense expansion) and XLA's ragged dot for a TPU. Quantized rhs (int8 / fp8 with
a per-group, per-output-channel scale) on every backend, in `experts_forward`, and compiled for
this CPU, an H200 and a v5e without a dequantized copy of rhs."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.grouped_matmul.cpu import DEFAULT_BLOCKS, grouped_matmul_cpu
from pallas_kernels.grouped_matmul.gpu import (
    default_blocks,
    grouped_matmul_gpu,
    num_tiles,
    tile_schedule,
)
from pallas_kernels.grouped_matmul.ops import grouped_matmul_implementation
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference

TRITON = "__gpu$xla.gpu.triton"


def oracle(lhs, rhs, sizes) -> np.ndarray:
    """Row by row in float64: row i of group g is lhs[i] @ rhs[g]; rows past the groups 0."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    row = 0
    for g, size in enumerate(sizes):
        for i in range(row, min(row + int(size), lhs.shape[0])):
            out[i] = lhs[i] @ rhs[g]
        row += int(size)
    return out


def make(m, k, n, sizes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32)


# (M, K, N, group sizes, block_m or None): with 16-row blocks unless said otherwise.
CASES = {
    # empty groups (first, middle), 3 groups in block 0, rows past the groups (38..49), M % 16 != 0
    "uneven_empty_tail": (50, 32, 48, [0, 3, 0, 20, 1, 0, 5, 9], 16),
    # group 1 spans rows 2..46, four row blocks; the groups end exactly at M
    "spanning_blocks": (64, 64, 32, [2, 45, 17], 16),
    "single_group": (40, 32, 32, [37], 16),
    "all_empty": (20, 16, 16, [0, 0, 0], 16),
    # M smaller than one block (decode: a token's k rows); group 2 empty, row 4 past the groups
    "fewer_rows_than_a_block": (5, 32, 32, [2, 1, 0, 1], None),
    # K = 3 x 32 (the down projection's 96 as three k-steps), N = 5 x 16 column blocks
    "k96_n80": (33, 96, 80, [10, 0, 13, 6], 16),
    # the sizes sum past M: the last group is cut at M
    "sizes_past_m": (24, 16, 32, [10, 20], 16),
    # 32-row blocks, groups smaller than a block
    "block_m_32": (70, 32, 64, [1, 2, 3, 30, 4, 20], 32),
}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_the_reference_and_a_per_row_oracle(case, dtype):
    m, k, n, sizes, block_m = CASES[case]
    lhs, rhs, gs = make(m, k, n, sizes, dtype)
    out = grouped_matmul_gpu(lhs, rhs, gs, block_m=block_m, interpret=True)
    assert out.shape == (m, n) and out.dtype == dtype
    got = np.asarray(out, np.float64)
    ref = np.asarray(grouped_matmul_reference(lhs, rhs, gs), np.float64)
    want = oracle(lhs, rhs, sizes)
    tol = TOL[dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    np.testing.assert_allclose(got, ref, atol=tol, rtol=tol)
    past = min(sum(sizes), m)
    assert np.all(got[past:] == 0.0), "rows past the groups must be exactly zero"
    assert np.all(np.isfinite(got))


def test_the_public_op_runs_the_kernel_interpreted_and_rows_past_the_groups_are_zero_not_garbage():
    """Pallas' interpreter starts outputs as NaN: a row no tile writes would show."""
    lhs, rhs, gs = make(50, 32, 48, [3, 0, 20, 1, 0, 5, 9], jnp.float32, seed=1)
    out = np.asarray(pk.grouped_matmul(lhs, rhs, gs, backend="pallas_gpu", interpret=True))
    np.testing.assert_allclose(out, oracle(lhs, rhs, [3, 0, 20, 1, 0, 5, 9]), atol=2e-5, rtol=2e-5)
    assert not np.isnan(out).any() and np.all(out[38:] == 0.0)


def test_nan_rows_past_the_groups_come_out_zero():
    """Rows past the groups (another device's experts) may hold anything: their output is
    zero, not lhs times some expert (0 x NaN would be NaN), and the groups' rows are exact."""
    lhs, rhs, gs = make(40, 32, 32, [7, 9, 11], jnp.float32, seed=2)
    lhs = lhs.at[27:].set(jnp.nan)
    out = np.asarray(grouped_matmul_gpu(lhs, rhs, gs, interpret=True))
    np.testing.assert_allclose(out[:27], oracle(lhs[:27], rhs, [7, 9, 11]), atol=2e-5, rtol=2e-5)
    assert np.all(out[27:] == 0.0)


@pytest.mark.parametrize("seed", range(6))
def test_the_tile_table_covers_every_row_once_within_the_static_bound(seed):
    rng = np.random.default_rng(seed)
    num_groups, block_m = int(rng.integers(1, 12)), int(rng.choice([16, 32, 64]))
    m = int(rng.integers(1, 200))
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(num_groups) / num_groups)
    sizes[rng.random(num_groups) < 0.3] = 0  # more empty groups
    group, block, bounds = (np.asarray(x) for x in tile_schedule(jnp.asarray(sizes, jnp.int32), m, block_m))
    assert group.shape == block.shape == (num_tiles(m, num_groups, block_m),)
    ends = np.minimum(np.cumsum(sizes), m)
    np.testing.assert_array_equal(bounds, np.concatenate([[0], ends, [m]]))
    owner = np.full(m, -1)
    real = block >= 0
    assert np.all(real[: real.sum()]), "real tiles first, then the empty slots"
    for g, b in zip(group[real], block[real]):
        rows = np.arange(b * block_m, min((b + 1) * block_m, m))
        mine = rows[(rows >= bounds[g]) & (rows < bounds[g + 1])]
        assert mine.size, f"tile (group {g}, block {b}) owns no row"
        assert np.all(owner[mine] == -1), "a row written by two tiles"
        owner[mine] = g
    row_group = np.searchsorted(ends, np.arange(m), side="right")  # num_groups past the groups
    np.testing.assert_array_equal(owner, row_group)


def test_default_blocks_follow_the_rows_per_group():
    assert default_blocks(512, 2048, 192, 128) == (16, 64, 64)  # 4 rows per expert
    assert default_blocks(4096, 2048, 192, 128) == (16, 64, 64)  # 32
    assert default_blocks(16384, 96, 2048, 128) == (64, 128, 32)  # 128
    assert default_blocks(64, 48, 80, 2) == (16, 16, 16)


def test_auto_on_the_host_cpu_is_the_cpu_path_and_matches_the_oracle():
    sizes = [3, 0, 20, 1, 0, 5, 9]
    lhs, rhs, gs = make(50, 32, 48, sizes, jnp.float32, seed=3)
    np.testing.assert_allclose(np.asarray(pk.grouped_matmul(lhs, rhs, gs)), oracle(lhs, rhs, sizes),
                               atol=2e-5, rtol=2e-5)
    hlo = jax.jit(pk.grouped_matmul).lower(lhs, rhs, gs).compile().as_text()
    assert "grouped_matmul_gpu" not in hlo and "grouped_matmul_cpu" in hlo
    # K = 40 is no multiple of 16: auto still works (no kernel anywhere), pallas_gpu refuses.
    lhs, rhs, gs = make(20, 40, 16, [10, 5], jnp.float32)
    np.testing.assert_allclose(np.asarray(pk.grouped_matmul(lhs, rhs, gs)), oracle(lhs, rhs, [10, 5]),
                               atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="K=40"):
        pk.grouped_matmul(lhs, rhs, gs, backend="pallas_gpu", interpret=True)


# ------------------------------------------------------------------ the CPU path
# Block tuples: the default; 16-row whole blocks then 4-row masked ones (blocks reaching past
# a group, and moved back to end at M); GPU-like 8-row blocks only, all masked (and M=5 padded).
CPU_BLOCKS = (DEFAULT_BLOCKS, (16, 4), (8,))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_path_matches_the_reference_and_a_per_row_oracle(case, dtype):
    m, k, n, sizes, _ = CASES[case]
    lhs, rhs, gs = make(m, k, n, sizes, dtype)
    ref = np.asarray(grouped_matmul_reference(lhs, rhs, gs), np.float64)
    want = oracle(lhs, rhs, sizes)
    tol = TOL[dtype]
    past = min(sum(sizes), m)
    for blocks in CPU_BLOCKS:  # the default through the public op
        out = (pk.grouped_matmul(lhs, rhs, gs, backend="cpu") if blocks == DEFAULT_BLOCKS
               else grouped_matmul_cpu(lhs, rhs, gs, blocks=blocks))
        assert out.shape == (m, n) and out.dtype == dtype
        got = np.asarray(out, np.float64)
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"blocks={blocks}")
        np.testing.assert_allclose(got, ref, atol=tol, rtol=tol, err_msg=f"blocks={blocks}")
        assert np.all(got[past:] == 0.0), f"blocks={blocks}: rows past the groups must be exactly zero"


def test_cpu_path_nan_in_other_rows_stays_out_of_each_group():
    """NaN rows past the groups come out zero, and a masked block reaching over another
    group's (or the tail's) NaN rows leaves its own rows exact."""
    sizes = [7, 9, 11]
    lhs, rhs, gs = make(40, 32, 32, sizes, jnp.float32, seed=2)
    lhs = lhs.at[27:].set(jnp.nan)
    for blocks in CPU_BLOCKS + ((5, 3),):
        out = np.asarray(grouped_matmul_cpu(lhs, rhs, gs, blocks=blocks))
        np.testing.assert_allclose(out[:27], oracle(lhs[:27], rhs, sizes), atol=2e-5, rtol=2e-5,
                                   err_msg=f"blocks={blocks}")
        assert np.all(out[27:] == 0.0), f"blocks={blocks}"


@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_cpu_path_under_jit_one_compile_serves_every_group_size_vector(backend):
    """Group sizes are traced data: one executable, every vector below vs the oracle."""
    m, k, n, g = 37, 24, 40, 6
    lhs, rhs, _ = make(m, k, n, [0] * g, jnp.float32, seed=4)
    fn = jax.jit(functools.partial(pk.grouped_matmul, backend=backend))
    rng = np.random.default_rng(4)
    vectors = [[0, 3, 0, 20, 1, 5], [37, 0, 0, 0, 0, 0], [0] * g, [0, 0, 0, 0, 0, 37],
               [10, 10, 10, 10, 10, 10],  # sums past M: group 3 cut at 37, groups 4, 5 empty
               [1, 1, 1, 1, 1, 1], [0, 0, 2, 0, 0, 0]]
    vectors += [list(rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g)) for _ in range(4)]
    for sizes in vectors:
        got = np.asarray(fn(lhs, rhs, jnp.asarray(sizes, jnp.int32)))
        np.testing.assert_allclose(got, oracle(lhs, rhs, sizes), atol=2e-5, rtol=2e-5, err_msg=str(sizes))
        assert np.all(got[min(sum(sizes), m):] == 0.0), str(sizes)
    assert fn._cache_size() == 1
    assert "grouped_matmul_cpu" in fn.lower(lhs, rhs, jnp.zeros((g,), jnp.int32)).compile().as_text()


@pytest.mark.parametrize("seed", range(4))
def test_cpu_path_random_sizes_and_block_tuples(seed):
    rng = np.random.default_rng(seed + 10)
    g, m = int(rng.integers(1, 12)), int(rng.integers(1, 160))
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g)
    sizes[rng.random(g) < 0.3] = 0
    if seed % 2:
        sizes[-1] += int(rng.integers(1, 40))  # past M
    lhs, rhs, gs = make(m, 16, 24, list(sizes), jnp.float32, seed=seed)
    want = oracle(lhs, rhs, sizes)
    for blocks in (DEFAULT_BLOCKS, (32, 8, 2), (7, 3), (1,)):
        np.testing.assert_allclose(np.asarray(grouped_matmul_cpu(lhs, rhs, gs, blocks=blocks)), want,
                                   atol=2e-5, rtol=2e-5, err_msg=f"sizes={sizes} blocks={blocks}")


def rhs_copies(hlo: str, g: int, k: int, n: int) -> list[str]:
    """Instructions in `hlo` that produce a new array of rhs's [G, K, N] shape (not the
    parameter itself or a tuple element passing it through a loop)."""
    ops = re.findall(rf"= (?:bf16|f32)\[{g},{k},{n}\]\{{[0-9,]*\}} ([a-z-]+)\(", hlo)
    return [op for op in ops if op not in ("parameter", "get-tuple-element")]


@pytest.mark.parametrize("proj", ["gate_up", "down"])
def test_auto_compiled_for_this_cpu_is_the_cpu_path_no_dense_expansion_no_rhs_copy(proj):
    """Qwen3-30B-A3B's experts at TP 8 on CPU: loops over the groups, no array of M x G x K
    elements (XLA:CPU's ragged_dot has one: checked too), and rhs is never copied whole
    (a group's [K, N] slice is)."""
    m, k, n = QWEN3_MOE[proj]
    args = expert_args(m, k, n, jnp.float32)
    hlo = jax.jit(pk.grouped_matmul).lower(*args).compile().as_text()
    assert "grouped_matmul_cpu" in hlo and re.search(r"\bwhile\(", hlo)
    assert dense_arrays(hlo, m, k, n) == []
    assert rhs_copies(hlo, EXPERTS, k, n) == []
    assert re.search(rf"f32\[{k},{n}\]\{{1,0\}} fusion\(", hlo), "one group's weights, sliced per group"
    xla = jax.jit(functools.partial(pk.grouped_matmul, backend="xla")).lower(*args).compile().as_text()
    assert dense_arrays(xla, m, k, n) and "grouped_matmul_cpu" not in xla


def test_cpu_path_never_computes_a_block_of_all_m_rows_outside_its_loop():
    """A whole block of all M rows would be loop-invariant, and XLA would hoist its product out
    of a loop that mostly runs 0 times (64 rows of products for every group): such sizes are
    dropped. With M=64 and blocks (64, 16, 4, 1) no [64, N] product is compiled."""
    args = expert_args(64, 2048, 192, jnp.float32)
    hlo = jax.jit(functools.partial(grouped_matmul_cpu, blocks=(64, 16, 4, 1))).lower(*args).compile().as_text()
    assert not re.search(r"= f32\[64,192\]\{1,0\} dot\(", hlo)
    assert re.search(r"= f32\[16,192\]\{1,0\} dot\(", hlo)


def test_validation_names_the_argument():
    lhs, rhs, gs = make(8, 16, 16, [4, 4], jnp.float32)
    bad = [
        ((lhs[0], rhs, gs), "lhs must have shape"),
        ((lhs, rhs[:, :8], gs), "rhs must have shape"),
        ((lhs, rhs, gs[:1]), "group_sizes must have shape"),
        ((lhs, rhs, gs.astype(jnp.uint32)), "group_sizes must be int32"),
        ((lhs.astype(jnp.bfloat16), rhs, gs), "dtypes differ"),
        ((lhs.astype(jnp.int32), rhs.astype(jnp.int32), gs), "floating"),
        ((lhs, rhs[:0], gs[:0]), "at least one group"),
    ]
    for args, why in bad:
        with pytest.raises(ValueError, match=why):
            pk.grouped_matmul(*args)
    with pytest.raises(ValueError, match="backend"):
        pk.grouped_matmul(lhs, rhs, gs, backend="pallas")
    with pytest.raises(ValueError, match="needs interpret=True"):
        pk.grouped_matmul(lhs, rhs, gs, backend="pallas_gpu")
    with pytest.raises(ValueError, match="interpret=True needs backend='pallas_gpu'"):
        pk.grouped_matmul(lhs, rhs, gs, interpret=True)
    with pytest.raises(ValueError, match="interpret=True needs backend='pallas_gpu'"):
        pk.grouped_matmul(lhs, rhs, gs, backend="cpu", interpret=True)
    for blocks in ((), (4, 16), (8, 8), (4, 0)):
        with pytest.raises(ValueError, match="blocks"):
            grouped_matmul_cpu(lhs, rhs, gs, blocks=blocks)


def test_the_implementation_report():
    assert grouped_matmul_implementation("gpu", 2048, 192, jnp.bfloat16)[0] == "pallas"
    assert grouped_matmul_implementation("cuda", 96, 2048, jnp.bfloat16)[0] == "pallas"
    impl, why = grouped_matmul_implementation("gpu", 40, 192, jnp.bfloat16)
    assert impl == "xla" and "K=40" in why
    assert grouped_matmul_implementation("tpu", 2048, 192, jnp.bfloat16)[0] == "xla"
    assert grouped_matmul_implementation("cpu", 2048, 192, jnp.float32)[0] == "cpu"
    assert grouped_matmul_implementation("cpu", 40, 192, jnp.bfloat16)[0] == "cpu"  # any K, N


# ------------------------------------------------------------------ compiled without hardware
# Qwen3-30B-A3B's experts (hidden 2048, 128 experts, 768 intermediate) at tensor parallel 8:
# gate+up [128, 2048, 2 x 96], down [128, 96, 2048]; 512 rows = 64 tokens x top-8.
QWEN3_MOE = {"gate_up": (512, 2048, 192), "down": (512, 96, 2048)}
EXPERTS = 128


@functools.cache
def h200():
    from jaxserve.compilation.targets import Target

    return Target.parse("gpu:h200").devices()[0]


@functools.cache
def v5e():
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices[0]


def compiled_for(fn, args, device):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with jax.default_device(device):  # Pallas reads the TPU generation from it
        return jax.jit(fn).lower(*sds).compile()


def compiled_hlo(fn, args, device) -> str:
    return compiled_for(fn, args, device).as_text()


def expert_args(m, k, n, dtype=jnp.bfloat16):
    S = jax.ShapeDtypeStruct
    return S((m, k), dtype), S((EXPERTS, k, n), dtype), S((EXPERTS,), jnp.int32)


def dense_arrays(hlo: str, m: int, k: int, n: int) -> list[str]:
    """Arrays in `hlo` as large as the masked lhs of a dense expansion (M x G x K elements),
    other than weight-sized ones (G x K x N: the weights themselves)."""
    found = []
    for dims in set(re.findall(r"\b(?:bf16|f16|f32)\[([0-9,]+)\]", hlo)):
        size = int(np.prod([int(d) for d in dims.split(",")]))
        if size >= m * EXPERTS * k and size != EXPERTS * k * n:
            found.append(dims)
    return found


@pytest.mark.usefixtures("no_persistent_cache_writes")
@pytest.mark.parametrize("proj", list(QWEN3_MOE))
def test_auto_compiles_the_triton_kernel_for_an_h200_and_no_dense_expansion(proj):
    m, k, n = QWEN3_MOE[proj]
    device = h200()
    hlo = compiled_hlo(pk.grouped_matmul, expert_args(m, k, n), device)
    assert TRITON in hlo and "grouped_matmul_gpu" in hlo
    assert dense_arrays(hlo, m, k, n) == []
    # What the kernel replaces: XLA:GPU's own ragged_dot multiplies every row by every expert.
    xla = compiled_hlo(functools.partial(pk.grouped_matmul, backend="xla"), expert_args(m, k, n), device)
    assert TRITON not in xla and dense_arrays(xla, m, k, n)


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_f32_and_few_rows_compile_for_an_h200_and_unsupported_k_falls_back():
    assert TRITON in compiled_hlo(pk.grouped_matmul, expert_args(8, 2048, 192, jnp.float32), h200())
    hlo = compiled_hlo(pk.grouped_matmul, expert_args(64, 40, 192), h200())
    assert "grouped_matmul_gpu" not in hlo and TRITON not in hlo


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_auto_compiled_for_a_tpu_keeps_xlas_ragged_dot():
    m, k, n = QWEN3_MOE["gate_up"]
    hlo = compiled_hlo(pk.grouped_matmul, expert_args(m, k, n), v5e())
    assert "ragged_dot" in hlo or "ragged-dot" in hlo
    assert TRITON not in hlo and "grouped_matmul_gpu" not in hlo


# ------------------------------------------------------------------ quantized rhs (weight-only)
def quantized(w, method):
    """(int8 / fp8 values, [G, N] f32 scale, the dequantized f32 rhs) of `w` [G, K, N]."""
    from jaxserve.models.quantization import dequantize_weight, quantize_weight

    q, scale = quantize_weight(np.asarray(w, np.float32), method)
    return jnp.asarray(q), jnp.asarray(scale), jnp.asarray(dequantize_weight(q, scale))


QUANT_BACKENDS = (("reference", {}), ("cpu", {}), ("xla", {}), ("auto", {}), ("pallas_gpu", {"interpret": True}))
# Empty groups (first, middle) and rows past the groups (38..49); then sizes summing past M.
QUANT_SIZES = ([0, 3, 0, 20, 1, 0, 5, 9], [10, 0, 30, 0, 0, 0, 0, 25])


@pytest.mark.parametrize("method,dtype", [("int8", jnp.bfloat16), ("fp8", jnp.float32)], ids=["int8-bf16", "fp8-f32"])
def test_quantized_rhs_every_backend_vs_the_dequantized_reference_and_the_f32_product(method, dtype):
    """Each backend, tight against the reference on the dequantized rhs (with lhs in f32: only
    the output's rounding to lhs.dtype differs) and loose against the product with the
    unquantized f32 weights (the quantization error). Group g's weights are scaled by g + 1, so
    a row scaled by another group's scale would be >= 12% off. Rows past the groups exactly 0."""
    m, k, n = 50, 32, 48
    tight = {jnp.float32: 2e-5, jnp.bfloat16: 8e-3}[dtype]
    lhs, w, _ = make(m, k, n, QUANT_SIZES[0], jnp.float32, seed=5)
    w = w * (1.0 + jnp.arange(w.shape[0], dtype=jnp.float32))[:, None, None]
    q, scale, deq = quantized(w, method)
    lhs = lhs.astype(dtype)
    for sizes in QUANT_SIZES:
        gs = jnp.asarray(sizes, jnp.int32)
        want = np.asarray(grouped_matmul_reference(lhs.astype(jnp.float32), deq, gs), np.float64)
        exact = oracle(lhs.astype(jnp.float32), w, sizes)
        top = np.abs(exact).max()
        past = min(sum(sizes), m)
        for backend, kw in QUANT_BACKENDS:
            out = pk.grouped_matmul(lhs, q, gs, rhs_scale=scale, backend=backend, **kw)
            why = f"{sizes} {backend}"
            assert out.shape == (m, n) and out.dtype == dtype, why
            got = np.asarray(out, np.float64)
            np.testing.assert_allclose(got, want, atol=tight * top, rtol=tight, err_msg=why)
            np.testing.assert_allclose(got, exact, atol=0.05 * top, rtol=0.1, err_msg=why)
            assert np.all(got[past:] == 0.0), f"{why}: rows past the groups must be exactly zero"


def test_quantized_validation():
    lhs, w, gs = make(8, 16, 16, [4, 4], jnp.float32)
    q, scale, _ = quantized(w, "int8")
    with pytest.raises(ValueError, match="rhs is quantized .*pass rhs_scale"):
        pk.grouped_matmul(lhs, q, gs)
    with pytest.raises(ValueError, match="rhs_scale must have shape"):
        pk.grouped_matmul(lhs, q, gs, rhs_scale=scale[:, :8])
    with pytest.raises(ValueError, match="rhs_scale must be float32"):
        pk.grouped_matmul(lhs, q, gs, rhs_scale=scale.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="rhs_scale is only for an int8 / float8 rhs"):
        pk.grouped_matmul(lhs, w, gs, rhs_scale=scale)
    with pytest.raises(ValueError, match="floating"):
        pk.grouped_matmul(lhs, q.astype(jnp.int32), gs)
    with pytest.raises(ValueError, match="rhs_scale is required"):
        grouped_matmul_gpu(lhs, q, gs, interpret=True)
    assert grouped_matmul_implementation("gpu", 2048, 192, jnp.bfloat16, jnp.int8)[0] == "pallas"
    assert grouped_matmul_implementation("cuda", 96, 2048, jnp.bfloat16, jnp.float8_e4m3fn)[0] == "pallas"
    assert grouped_matmul_implementation("cpu", 2048, 192, jnp.bfloat16, jnp.int8)[0] == "cpu"
    impl, why = grouped_matmul_implementation("tpu", 2048, 192, jnp.bfloat16, jnp.int8)
    assert impl == "xla" and "no dequantized copy" in why
    assert "copy of rhs" in grouped_matmul_implementation("tpu", 2048, 192, jnp.bfloat16, jnp.float8_e4m3fn)[1]


# One small shape for the compiled checks: G=16 experts, M=64 rows, K=256, N=128.
QG, QM, QK, QN = 16, 64, 256, 128


def quantized_args(rhs_dtype, dtype=jnp.bfloat16):
    S = jax.ShapeDtypeStruct
    return S((QM, QK), dtype), S((QG, QK, QN), rhs_dtype), S((QG,), jnp.int32), S((QG, QN), jnp.float32)


def quantized_op(lhs, rhs, sizes, scale):
    return pk.grouped_matmul(lhs, rhs, sizes, rhs_scale=scale)


def dequantized_copies(hlo: str) -> list[str]:
    """Float arrays of rhs's [G, K, N] shape in `hlo`: a dequantized (converted) copy of rhs."""
    return re.findall(rf"\b(?:bf16|f16|f32)\[{QG},{QK},{QN}\]", hlo)


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_auto_compiled_for_this_cpu_converts_one_group_at_a_time(method):
    """f32 lhs: the CPU path's loop, no float array of rhs's shape, one group's [K, N]
    converted per iteration. int8: temp below the int8 rhs itself (no copy of rhs at all).
    fp8: XLA:CPU has no fp8 arithmetic and converts any fp8 array it slices to f16 whole, so
    the path slices rhs's bytes (a bitcast to uint8, which XLA:CPU copies once: rhs's size,
    not dequantized)."""
    rhs_dtype = jnp.int8 if method == "int8" else jnp.float8_e4m3fn
    compiled = jax.jit(quantized_op).lower(*quantized_args(rhs_dtype, jnp.float32)).compile()
    hlo = compiled.as_text()
    assert "grouped_matmul_cpu" in hlo and re.search(r"\bwhile\(", hlo)
    assert dequantized_copies(hlo) == []
    assert re.search(rf"f32\[{QK},{QN}\]\{{1,0\}} fusion\(", hlo), "one group's weights, converted per group"
    temp, rhs_bytes = compiled.memory_analysis().temp_size_in_bytes, QG * QK * QN
    assert temp < (rhs_bytes if method == "int8" else 2 * rhs_bytes), temp


@pytest.mark.usefixtures("no_persistent_cache_writes")
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_auto_compiles_the_triton_kernel_for_an_h200_without_a_dequantized_rhs(method):
    rhs_dtype = jnp.int8 if method == "int8" else jnp.float8_e4m3fn
    compiled = compiled_for(quantized_op, quantized_args(rhs_dtype), h200())
    hlo = compiled.as_text()
    assert TRITON in hlo and "grouped_matmul_gpu" in hlo
    assert dequantized_copies(hlo) == []
    assert compiled.memory_analysis().temp_size_in_bytes < QG * QK * QN  # measured: 7464 B (the tile table)


@pytest.mark.usefixtures("no_persistent_cache_writes")
def test_quantized_int8_compiled_for_a_v5e_feeds_xlas_ragged_dot_the_int8_rhs():
    """XLA:TPU's ragged-dot kernel takes a bf16 lhs with an int8 rhs as stored: no float array
    of rhs's shape and temp below the int8 rhs itself (measured at Qwen3-30B-A3B's TP 8 shapes:
    0 B, against 100 MB for the bf16 copy; see docs/kernels.md)."""
    compiled = compiled_for(quantized_op, quantized_args(jnp.int8), v5e())
    hlo = compiled.as_text()
    assert "ragged-dot" in hlo or "ragged_dot" in hlo
    assert dequantized_copies(hlo) == []
    assert compiled.memory_analysis().temp_size_in_bytes < QG * QK * QN


def test_experts_forward_with_quantized_experts_matches_dequantized_experts():
    """int8 experts with their scales == the dequantized experts (a float64 per-token oracle),
    tight: whole, under expert parallelism (each device's rows of weights and scales) and under
    the width split (gate_up's scale split like gate_up's interleaved columns, down's scale
    whole), the devices' partial outputs summed. (fp8 takes the same path: the grouped matmul
    tests above cover it.)"""
    from jaxserve.models.config import ModelConfig
    from jaxserve.models.moe import experts_forward, route

    X, E, inter, T, tp = 8, 16, 16, 11, 2
    cfg = ModelConfig("qwen3_moe", vocab_size=8, hidden_size=E, intermediate_size=8, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, num_experts=X, num_experts_per_tok=3, moe_intermediate_size=inter)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((T, E)), jnp.float32)
    weights, experts = route(x, jnp.asarray(rng.standard_normal((E, X)), jnp.float32), cfg)
    fwd = jax.jit(functools.partial(experts_forward, activation=jax.nn.silu))  # one compile per shape

    def run(gate_up, down, first, **scales):
        return np.asarray(fwd(x, weights, experts, gate_up, down, jnp.int32(first), **scales))

    def oracle_moe(gate_up, down):  # each token's k experts one by one, float64
        xs, gate_up, down = (np.asarray(a, np.float64) for a in (x, gate_up, down))
        out = np.zeros((T, E))
        for t in range(T):
            for j in range(experts.shape[1]):
                e = int(experts[t, j])
                g, u = np.split(xs[t] @ gate_up[e], 2)
                out[t] += float(weights[t, j]) * (g / (1 + np.exp(-g)) * u) @ down[e]
        return out

    gate_up, down = rng.standard_normal((X, E, 2 * inter)) / 4, rng.standard_normal((X, inter, E)) / 4
    (gu_q, gu_s, gu_d), (dn_q, dn_s, dn_d) = quantized(gate_up, "int8"), quantized(down, "int8")
    want = oracle_moe(gu_d, dn_d)
    got = run(gu_q, dn_q, 0, gate_up_scale=gu_s, down_scale=dn_s)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.abs(got - oracle_moe(gate_up, down)).max() > 1e-4, "the experts were not quantized?"
    n = X // tp  # expert parallelism: device r's experts r*n..(r+1)*n, weights and scales
    parts = [run(gu_q[r * n:(r + 1) * n], dn_q[r * n:(r + 1) * n], r * n,
                 gate_up_scale=gu_s[r * n:(r + 1) * n], down_scale=dn_s[r * n:(r + 1) * n]) for r in range(tp)]
    np.testing.assert_allclose(sum(parts), want, rtol=1e-5, atol=1e-5, err_msg="expert parallel")
    # The width split: device r holds gate_up's columns [gate_r | up_r] (interleaved per
    # shard) and down's rows r; a scale's columns go with its weight's columns.
    h = inter // tp
    cols = [np.r_[r * h:(r + 1) * h, inter + r * h:inter + (r + 1) * h] for r in range(tp)]
    parts = [run(gu_q[..., c], dn_q[:, r * h:(r + 1) * h], 0, gate_up_scale=gu_s[:, c], down_scale=dn_s)
             for r, c in enumerate(cols)]
    np.testing.assert_allclose(sum(parts), want, rtol=1e-5, atol=1e-5, err_msg="width split")
