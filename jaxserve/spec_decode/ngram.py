"""Prompt-lookup (n-gram) drafts: the tokens that followed the last occurrence of the
sequence's current suffix earlier in its own prompt and output.

Host work on every step, so it must stay far under a millisecond at 64 sequences. Each
sequence's history is kept as little-endian int32 bytes, extended by the tokens added since
the last step, and searched with `bytes.rfind` (a C substring search) for the longest suffix
of `prompt_lookup_max` down to `prompt_lookup_min` tokens; a hit at an offset that is not a
whole token is skipped. `scripts/bench_spec_decode.py` times it.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

from scheduler import DraftCandidate

_LITTLE = sys.byteorder == "little"


class _History:
    __slots__ = ("data", "num_tokens")

    def __init__(self) -> None:
        self.data = bytearray()
        self.num_tokens = 0

    def extend(self, token_ids: Sequence[int]) -> None:
        new = array.array("i", token_ids[self.num_tokens:])
        if not _LITTLE:
            new.byteswap()
        self.data += new.tobytes()
        self.num_tokens = len(token_ids)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._histories: dict[str, _History] = {}

    def propose(self, candidates: Sequence[DraftCandidate]) -> dict[str, list[int]]:
        """Drafts for the sequences that have a recurring suffix; the histories of sequences
        that are not candidates any more are dropped (rebuilt if they come back)."""
        out = {}
        for c in candidates:
            drafts = self.lookup(c.request_id, c.token_ids, c.max_drafts)
            if drafts:
                out[c.request_id] = drafts
        keep = {c.request_id for c in candidates}
        for rid in [r for r in self._histories if r not in keep]:
            del self._histories[rid]
        return out

    def lookup(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) draft tokens to follow `token_ids` (the whole sequence
        so far, prompt and output); [] when no suffix recurs."""
        n = min(self.k, max_drafts)
        if n <= 0:
            return []
        hist = self._histories.get(request_id)
        if hist is None or hist.num_tokens > len(token_ids):
            hist = self._histories[request_id] = _History()
        hist.extend(token_ids)
        data, total = hist.data, hist.num_tokens
        # A longer n-gram recurs only where the shortest does: one scan settles the common
        # case (nothing recurs); the longer sizes are searched only after a hit.
        shortest = self._last_match(data, total, self.min_n)
        if shortest is None:
            return []
        for size in range(min(self.max_n, total - 1), self.min_n, -1):
            start = self._last_match(data, total, size)
            if start is not None:
                return list(token_ids[start:start + n])
        return list(token_ids[shortest:shortest + n])

    @staticmethod
    def _last_match(data: bytearray, total: int, size: int) -> int | None:
        """The index of the token after the last earlier occurrence of the final `size`
        tokens, or None. An occurrence must end before the final token (something follows
        it) and start on a token boundary."""
        if size >= total:
            return None
        suffix = bytes(data[4 * (total - size):])
        end = 4 * (total - 1)
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                return None
            if at % 4 == 0:
                return at // 4 + size
            end = at + len(suffix) - 1
