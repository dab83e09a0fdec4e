"""Static shape buckets: a step is padded up to the smallest bucket that holds it.

Token buckets are powers of two from `min_tokens` up to `gap`, then linear steps of `gap`,
and always the exact budget, so a full step is never padded past `max_num_batched_tokens`.
With `midpoints_from` > 0, each power of two b >= midpoints_from (below the gap for tokens)
is followed by 1.5 b as well, which bounds the padding at a third instead of a half.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


def _midpoint(b: int, midpoints_from: int, below: int) -> set[int]:
    """{1.5 b} when b is at or past `midpoints_from` (> 0) and 1.5 b < `below`, else {}."""
    m = b * 3 // 2
    return {m} if 0 < midpoints_from <= b and b < m < below else set()


def token_buckets(max_tokens: int, min_tokens: int = 16, gap: int = 256,
                  extra: Iterable[int] = (), midpoints_from: int = 0) -> list[int]:
    if max_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_tokens}")
    out: set[int] = {max_tokens}
    b = min_tokens
    while b < min(gap, max_tokens):
        out.add(b)
        out |= _midpoint(b, midpoints_from, min(gap, max_tokens))
        b *= 2
    b = gap
    while b < max_tokens:
        out.add(b)
        b += gap
    out.update(x for x in extra if 0 < x <= max_tokens)
    return sorted(out)


def request_buckets(max_reqs: int, extra: Iterable[int] = (), midpoints_from: int = 0) -> list[int]:
    """Powers of two up to `max_reqs` (and their midpoints from `midpoints_from`), plus
    `max_reqs` itself."""
    out: set[int] = {max_reqs}
    b = 1
    while b < max_reqs:
        out.add(b)
        out |= _midpoint(b, midpoints_from, max_reqs)
        b *= 2
    out.update(x for x in extra if 0 < x <= max_reqs)
    return sorted(out)


def pick(buckets: list[int], n: int) -> int:
    """Smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]
