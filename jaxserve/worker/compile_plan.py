"""The compile plan: the single source of truth for which step shapes exist.

The engine, the warmup script and the tests all read it. Shapes are O(m + n), not O(m * n):
the backbone is keyed on the token bucket T only; the logits on the request bucket R; the
sampler on R and one of a few static sampler variants; the swap copies on a few chunk sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from jaxserve.worker.buckets import request_buckets, token_buckets
from jaxserve.worker.sampler import SamplerFlags

SWAP_SIZES = (8, 64, 512)  # pages per swap copy call (lists are padded up or split)
STATE_COPY_SIZE = 8  # hybrid models' state slots per copy call (padded with the null slot, or split)


def sampler_variant(sampling: bool, top: bool, penalties: bool, logprobs: bool, max_logprobs: int,
                    bitmask: bool = False) -> SamplerFlags:
    """Collapses a batch's needs onto a few compiled sampler variants.

    Three modes (greedy, sample, full) times logprobs off/on, and for batches with a
    structured-output row two masked modes (greedy+mask, full+mask) times logprobs. Rows
    whose feature is off get neutral values, so a richer variant never changes a row's
    result, only its cost.
    """
    num_lp = max_logprobs if logprobs else None
    if not sampling and not penalties and not top:
        return SamplerFlags(True, False, False, num_lp, bitmask)
    if penalties or top or bitmask:
        return SamplerFlags(False, True, True, num_lp, bitmask)
    return SamplerFlags(False, False, False, num_lp)


def sampler_variants(max_logprobs: int, structured_outputs: bool = True) -> tuple[SamplerFlags, ...]:
    modes = [(False, False, False, False), (True, False, False, False), (True, True, True, False)]
    if structured_outputs:
        modes += [(False, False, False, True), (True, True, True, True)]
    lps = (False, True)  # logprobs=0 (the sampled token's own) works with max_logprobs=0
    return tuple(sampler_variant(s, t, p, lp, max_logprobs, m) for (s, t, p, m) in modes for lp in lps)


def variant_name(flags: SamplerFlags) -> str:
    mode = "greedy" if flags.all_greedy else ("full" if flags.use_penalties else "sample")
    if flags.use_bitmask:
        mode += "+mask"
    return mode if flags.num_logprobs is None else f"{mode}+lp{flags.num_logprobs}"


@dataclasses.dataclass(frozen=True)
class ShapeKey:
    # "backbone" | "logits" | "head" (the sampler) | "prompt_logprobs" | "swap", and with MTP
    # speculative decoding "mtp" (its pass over a step), "mtp_chain" (a chained draft's pass) and
    # "mtp_draft" (its greedy head); "vision": a vision-language model's image encoder
    kind: str
    size: int  # T for the backbone, prompt logprobs and MTP passes, R for logits, sampler and MTP drafts, pages for swaps
    flags: SamplerFlags | None = None  # head only
    num_top: int = 0  # prompt_logprobs only: the top-k width (max_logprobs)

    @property
    def name(self) -> str:
        if self.kind == "backbone":
            return f"backbone[T={self.size}]"
        if self.kind == "head":
            return f"head[R={self.size},{variant_name(self.flags)}]"
        if self.kind == "logits":
            return f"logits[R={self.size}]"
        if self.kind == "prompt_logprobs":
            return f"prompt_logprobs[T={self.size},k={self.num_top}]"
        if self.kind in ("mtp", "mtp_chain"):
            return f"{self.kind}[T={self.size}]"
        if self.kind == "mtp_draft":
            return f"mtp_draft[R={self.size}]"
        if self.kind == "states":
            return f"states[{self.size}]"
        if self.kind == "vision":
            return f"vision[windows={self.size}]"
        return f"swap[{self.size}]"


@dataclasses.dataclass(frozen=True)
class CompileTier:
    """Shapes that, compiled with the tiers before, let steps reach `max_tokens` tokens and
    `max_seqs` sequences."""

    max_tokens: int
    max_seqs: int
    shapes: tuple[ShapeKey, ...]


@dataclasses.dataclass(frozen=True)
class CompilePlan:
    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]
    sampler_variants: tuple[SamplerFlags, ...]
    swap_sizes: tuple[int, ...]
    # Top-k width of the prompt-logprobs programs (one per token bucket); None: not planned
    # (a draft model's plan).
    prompt_logprobs_top: int | None = None
    mtp_tokens: int = 0  # drafts per step from the MTP layer (speculative method "mtp"); 0: none
    state_copies: bool = False  # a hybrid model's state slot copies (snapshots, state swaps)
    # A vision-language model's image encoder programs, by window count (`qwen_vision.window_buckets`).
    vision_windows: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config, *, swap_enabled: bool, platform: str | None = None,
                    recurrent: bool = False, vision_windows: Sequence[int] = ()) -> CompilePlan:
        """`config` is an EngineConfig; `platform` the one compiled for (None: the host's)."""
        config = config.with_platform_defaults(platform)
        midpoints = config.resolved_midpoint_buckets_from(platform)
        if config.token_buckets:
            tokens = sorted({*config.token_buckets, config.max_num_batched_tokens})
            if tokens[-1] > config.max_num_batched_tokens or tokens[0] < 1:
                raise ValueError(
                    f"token_buckets must lie in [1, max_num_batched_tokens={config.max_num_batched_tokens}]"
                )
        elif config.traffic_log:
            tokens = derive_token_buckets(
                read_traffic_log(config.traffic_log), config.max_num_batched_tokens, config.max_token_buckets
            )
        else:
            tokens = token_buckets(config.max_num_batched_tokens, config.resolved_min_token_bucket(platform),
                                   config.token_bucket_gap, config.extra_token_buckets, midpoints)
        return cls(
            token_buckets=tuple(tokens),
            request_buckets=tuple(request_buckets(config.max_num_seqs, midpoints_from=midpoints)),
            sampler_variants=sampler_variants(config.max_logprobs, config.structured_outputs),
            swap_sizes=SWAP_SIZES if swap_enabled else (),
            prompt_logprobs_top=config.max_logprobs,
            mtp_tokens=spec.num_speculative_tokens if (spec := config.speculative_config) and spec.method == "mtp" else 0,
            state_copies=recurrent,
            vision_windows=tuple(vision_windows),
        )

    def mtp_shapes(self, token_bucket: int, new_request_buckets: Sequence[int]) -> list[ShapeKey]:
        """The MTP programs a step of `token_bucket` tokens needs beyond those of smaller steps:
        its pass, a chained pass where a step's one token per sequence can fill this bucket,
        and the draft heads of the request buckets it newly allows."""
        if not self.mtp_tokens:
            return []
        out = [ShapeKey("mtp", token_bucket)]
        smaller = [t for t in self.token_buckets if t < token_bucket]
        if self.mtp_tokens > 1 and (not smaller or smaller[-1] < self.request_buckets[-1]):
            out.append(ShapeKey("mtp_chain", token_bucket))
        return out + [ShapeKey("mtp_draft", r) for r in new_request_buckets]

    def shapes(self) -> list[ShapeKey]:
        out = [ShapeKey("backbone", t) for t in self.token_buckets]
        out += [ShapeKey("logits", r) for r in self.request_buckets]
        out += [ShapeKey("head", r, f) for r in self.request_buckets for f in self.sampler_variants]
        if self.prompt_logprobs_top is not None:
            out += [ShapeKey("prompt_logprobs", t, num_top=self.prompt_logprobs_top) for t in self.token_buckets]
        out += [ShapeKey("swap", s) for s in self.swap_sizes]
        out += [ShapeKey("states", STATE_COPY_SIZE)] if self.state_copies else []
        out += [ShapeKey("vision", w) for w in self.vision_windows]
        for t in self.token_buckets:
            out += [k for k in self.mtp_shapes(t, ()) if k.kind != "mtp_draft"]
        out += [ShapeKey("mtp_draft", r) for r in self.request_buckets if self.mtp_tokens]
        return out

    def tiers(self) -> list[CompileTier]:
        """The plan in the order serving needs it. Tier i holds what steps of at most
        `token_buckets[i]` tokens need beyond the tiers before it: that bucket's backbone and
        prompt-logprobs programs, and the logits and sampler programs of the request buckets
        it newly allows (a step samples at most one row per token); tier 0 also the swap
        copies, the last tier whatever is left. Every planned shape is in exactly one tier."""
        tiers, given, max_seqs = [], 0, 0
        for i, t in enumerate(self.token_buckets):
            last = i == len(self.token_buckets) - 1
            new = [r for r in self.request_buckets[given:] if last or r <= t]
            given += len(new)
            max_seqs = new[-1] if new else max_seqs
            shapes = [ShapeKey("backbone", t)]
            if self.prompt_logprobs_top is not None:
                shapes.append(ShapeKey("prompt_logprobs", t, num_top=self.prompt_logprobs_top))
            shapes += [ShapeKey("logits", r) for r in new]
            shapes += [ShapeKey("head", r, f) for r in new for f in self.sampler_variants]
            shapes += self.mtp_shapes(t, new)
            if i == 0:
                shapes += [ShapeKey("swap", s) for s in self.swap_sizes]
                shapes += [ShapeKey("states", STATE_COPY_SIZE)] if self.state_copies else []
                shapes += [ShapeKey("vision", w) for w in self.vision_windows]
            tiers.append(CompileTier(t, max(max_seqs, 1), tuple(shapes)))
        return tiers

    def __len__(self) -> int:
        return (len(self.token_buckets) * (1 + (self.prompt_logprobs_top is not None))
                + len(self.request_buckets) * (1 + len(self.sampler_variants)) + len(self.swap_sizes)
                + int(self.state_copies) + len(self.vision_windows)
                + sum(len(self.mtp_shapes(t, ())) for t in self.token_buckets)
                + (len(self.request_buckets) if self.mtp_tokens else 0))


# ---------------------------------------------------------------------- traffic-derived buckets
def read_traffic_log(path: str) -> list[int]:
    """A traffic log is a text file of observed step token counts, one integer per line
    (`#` comments allowed); the engine writes one with `EngineConfig.record_traffic_log`."""
    counts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                counts.append(int(line))
            except ValueError:
                raise ValueError(f"{path}:{lineno}: not an integer token count: {line!r}") from None
    if not counts:
        raise ValueError(f"traffic log {path} holds no token counts")
    return counts


def padding_fraction(counts: Iterable[int], buckets: Sequence[int]) -> float:
    """Share of computed tokens that are padding when each count runs in its smallest bucket."""
    b = np.asarray(sorted(buckets))
    c = np.asarray(list(counts))
    if c.max() > b[-1]:
        raise ValueError(f"a step of {c.max()} tokens exceeds the largest bucket {b[-1]}")
    padded = b[np.searchsorted(b, c)]
    return float((padded - c).sum() / padded.sum())


def derive_token_buckets(counts: Sequence[int], max_tokens: int, max_buckets: int) -> list[int]:
    """The at most `max_buckets` token buckets (always including `max_tokens`) that minimise
    the padded tokens of the observed steps: an exact dynamic programme over the distinct
    counts (a bucket is best placed exactly at an observed count)."""
    if max_buckets < 1:
        raise ValueError(f"max_token_buckets must be >= 1, got {max_buckets}")
    c = np.clip(np.asarray(counts, np.int64), 1, max_tokens)
    values, freq = np.unique(c, return_counts=True)
    if values[-1] != max_tokens:  # the exact budget is always a bucket
        values = np.append(values, max_tokens)
        freq = np.append(freq, 0)
    n = len(values)
    k_max = min(max_buckets, n)
    # cost(i, j): padding when counts values[i..j] all run in bucket values[j]
    cum_f = np.concatenate([[0], np.cumsum(freq)])
    cum_fv = np.concatenate([[0], np.cumsum(freq * values)])

    def cost_from(starts: np.ndarray, j: int) -> np.ndarray:
        """Padding when values[start..j] all run in bucket values[j], for each start."""
        return values[j] * (cum_f[j + 1] - cum_f[starts]) - (cum_fv[j + 1] - cum_fv[starts])

    inf = np.iinfo(np.int64).max // 4
    best = np.full((k_max + 1, n), inf, np.int64)  # best[k, j]: values[..j] in k buckets, last at j
    prev = np.full((k_max + 1, n), -1, np.int64)
    best[1] = [cost_from(np.array([0]), j)[0] for j in range(n)]
    for k in range(2, k_max + 1):
        for j in range(k - 1, n):
            i = np.arange(k - 2, j)
            v = best[k - 1, i] + cost_from(i + 1, j)
            a = int(np.argmin(v))
            best[k, j], prev[k, j] = v[a], i[a]
    k = min(range(1, k_max + 1), key=lambda kk: best[kk, n - 1])
    out, j = [], n - 1
    while k >= 1 and j >= 0:
        out.append(int(values[j]))
        j = int(prev[k, j])
        k -= 1
    return sorted(out)
