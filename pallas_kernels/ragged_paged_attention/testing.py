"""Test helpers shared by the reference and kernel tests: batch builder and a numpy oracle.

Kept in the package (numpy only, no pytest) so that the kernel tests, the GPU check script
and the benchmarks build batches the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RaggedCase:
    """One ragged step: numpy arrays laid out as in docs/architecture.md."""

    q: np.ndarray  # [T, Hq, D]
    k_pages: np.ndarray  # [P, ps, Hkv, D]
    v_pages: np.ndarray  # [P, ps, Hkv, D]
    kv_lens: np.ndarray  # [R] int32
    block_tables: np.ndarray  # [R, M] int32
    cu_q_lens: np.ndarray  # [R+1] int32
    num_seqs: np.ndarray  # [1] int32

    def args(self) -> tuple[np.ndarray, ...]:
        return (
            self.q,
            self.k_pages,
            self.v_pages,
            self.kv_lens,
            self.block_tables,
            self.cu_q_lens,
            self.num_seqs,
        )


def make_case(
    seqs: list[tuple[int, int]],  # (q_len, kv_len) per real sequence
    *,
    num_tokens: int | None = None,
    num_rows: int | None = None,
    num_q_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    page_size: int = 16,
    max_pages_per_seq: int | None = None,
    num_pages: int | None = None,
    dtype: type = np.float32,
    seed: int = 0,
    shuffle_pages: bool = True,
    unused_fill: float | None = None,
) -> RaggedCase:
    """Random ragged batch; pages are handed out in random (non-contiguous) order.

    Everything that must be ignored (padding query rows, the null page, slots past a
    sequence's kv_len) is filled with large values so a masking bug shows up loudly;
    `unused_fill` (NaN, say) fills the unused KV slots instead.
    """
    rng = np.random.default_rng(seed)
    n = len(seqs)
    total = sum(ql for ql, _ in seqs)
    num_tokens = num_tokens or total
    num_rows = num_rows or n
    assert total <= num_tokens and n <= num_rows
    assert all(0 < ql <= kl for ql, kl in seqs)
    pages_per = [-(-kl // page_size) for _, kl in seqs]
    max_pages_per_seq = max_pages_per_seq or max(pages_per)
    num_pages = num_pages or 1 + sum(pages_per) + 2
    ids = np.arange(1, num_pages)
    if shuffle_pages:
        rng.shuffle(ids)
    k_pages = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)) * 30
    v_pages = rng.standard_normal((num_pages, page_size, num_kv_heads, head_dim)) * 30
    if unused_fill is not None:
        k_pages[:] = v_pages[:] = unused_fill
    tables = np.zeros((num_rows, max_pages_per_seq), np.int32)
    next_id = 0
    for i, (_, kl) in enumerate(seqs):
        tables[i, : pages_per[i]] = ids[next_id : next_id + pages_per[i]]
        next_id += pages_per[i]
        # Real data for the live slots; garbage stays in the rest.
        for p in range(kl):
            page, off = tables[i, p // page_size], p % page_size
            k_pages[page, off] = rng.standard_normal((num_kv_heads, head_dim))
            v_pages[page, off] = rng.standard_normal((num_kv_heads, head_dim))
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim))
    q[total:] = 1e3  # padding rows
    cu = np.full(num_rows + 1, total, np.int32)
    cu[: n + 1] = np.concatenate([[0], np.cumsum([ql for ql, _ in seqs])])
    kv_lens = np.zeros(num_rows, np.int32)
    kv_lens[:n] = [kl for _, kl in seqs]
    return RaggedCase(
        q=q.astype(dtype),
        k_pages=k_pages.astype(dtype),
        v_pages=v_pages.astype(dtype),
        kv_lens=kv_lens,
        block_tables=tables,
        cu_q_lens=cu,
        num_seqs=np.array([n], np.int32),
    )


def attention_numpy(
    case: RaggedCase,
    *,
    sm_scale: float,
    sliding_window: int | np.ndarray | None = None,
    soft_cap: float | None = None,
    sinks: np.ndarray | None = None,
    attention_chunk: int | None = None,
    attend_until: np.ndarray | None = None,
) -> np.ndarray:  # [T, Hq, D] float64
    """Dead-simple oracle: per sequence, per token, per head, in float64. A window <= 0 is
    no window, as a per-layer window array's value is in the ops. `sinks` [Hq]: one more
    softmax entry per head, with no value (gpt-oss). `attention_chunk` C: a position sees only
    its own C-token chunk (Llama 4). `attend_until` [T]: token t sees keys up to
    min(max(p, attend_until[t]), kv_len - 1) instead of p (Gemma 3's image tokens); the window
    and the chunk still start from p."""
    if sliding_window is not None:
        sliding_window = int(np.asarray(sliding_window).reshape(()))
        sliding_window = sliding_window if sliding_window > 0 else None
    q = case.q.astype(np.float64)
    kp = case.k_pages.astype(np.float64)
    vp = case.v_pages.astype(np.float64)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kp.shape[1], kp.shape[2]
    group = num_q_heads // num_kv_heads
    out = np.zeros((num_tokens, num_q_heads, head_dim))
    for i in range(int(case.num_seqs[0])):
        start, end = int(case.cu_q_lens[i]), int(case.cu_q_lens[i + 1])
        kv_len = int(case.kv_lens[i])
        for j in range(end - start):
            pos = kv_len - (end - start) + j
            last = pos if attend_until is None else min(max(pos, int(attend_until[start + j])), kv_len - 1)
            keys = [k for k in range(last + 1) if (sliding_window is None or pos - k < sliding_window)
                    and (not attention_chunk or k >= pos - pos % attention_chunk)]
            for h in range(num_q_heads):
                kh = h // group
                ks = np.stack(
                    [kp[case.block_tables[i, k // page_size], k % page_size, kh] for k in keys]
                )
                vs = np.stack(
                    [vp[case.block_tables[i, k // page_size], k % page_size, kh] for k in keys]
                )
                logits = ks @ q[start + j, h] * sm_scale
                if soft_cap is not None:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                top = logits.max() if sinks is None else max(logits.max(), float(sinks[h]))
                w = np.exp(logits - top)
                extra = 0.0 if sinks is None else np.exp(float(sinks[h]) - top)
                out[start + j, h] = (w / (w.sum() + extra)) @ vs
    return out
