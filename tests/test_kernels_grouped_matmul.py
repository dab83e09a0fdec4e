"""Grouped matmul (MoE experts): the Triton kernel in interpret mode and the CPU path (a loop
over the non-empty groups) against the reference and a numpy per-row oracle, the kernel's tile
table, the op's validation and dispatch, `auto` compiled for this CPU (the CPU path: loops, no
dense expansion, no copy of rhs), and compile-only checks that `auto` gives the Triton kernel
for an H200 (no dense expansion) and XLA's ragged dot for a TPU."""

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
    from jaxserve.targets import Target

    return Target.parse("gpu:h200").devices()[0]


@functools.cache
def v5e():
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name="v5e:2x2", platform="tpu").devices[0]


def compiled_hlo(fn, args, device) -> str:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh([device], ("x",)), PartitionSpec())
    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
    with jax.default_device(device):  # Pallas reads the TPU generation from it
        return jax.jit(fn).lower(*sds).compile().as_text()


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
