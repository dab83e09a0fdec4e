"""On-device sampling for a batch of R rows, every row with its own parameters.

The engine calls :func:`sample` once per step on the logits of the sampled rows. Per-row
parameters travel as :class:`SamplingTensors`, arrays of fixed dtype (never Python scalars,
which would be weak-typed and recompile). What varies between batches is data; only a few
Python flags select static variants so the compile plan stays small:

* ``all_greedy``      every row is greedy: skip temperature, filtering and the RNG.
* ``use_penalties``   some row has a repetition/presence/frequency penalty.
* ``use_top_k_top_p`` some row has top-k or top-p (min-p is cheap and always on).
* ``num_logprobs``    None (no logprobs), or the K of top logprobs to return with each
                      sampled token's own logprob (K = 0: the sampled token's only).
* ``use_bitmask``     some row has structured output: ``token_bitmask`` [R, ceil(V/32)]
                      (bit j of word w allows token 32w + j; -1 = all allowed) masks the
                      logits before anything else, as vLLM applies its grammar bitmask.

A row whose feature is off gives bit-identical results whether or not the flag is on, so a
seeded request yields the same tokens whatever else shares its batch.

Processing order follows vLLM: grammar bitmask -> penalties -> min_tokens ban -> temperature -> min-p ->
top-k -> top-p -> sample. Greedy rows take the argmax of the penalised logits.

CPU cost matters (V=49152, R up to 256), so nothing sorts [R, V]:

* top-k / top-p find each row's probability threshold by bisection on the float bits
  (31 passes of compare-and-reduce, ~10x cheaper than a sort on XLA:CPU, and exact;
  ties at the threshold are all kept, as in vLLM's masking).
* sampling draws ONE uniform per row (from the row's own key) and inverts the CDF with a
  two-level cumulative sum, instead of V Gumbel/exponential draws per row (threefry for
  [256, 49152] costs ~200 ms on CPU, the inverse CDF ~50 ms).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scheduler.request import MAX_LOGIT_BIAS

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS); dividing by them would overflow.
SAMPLING_EPS = 1e-5
# Block width of the two-level inverse CDF.
_CDF_BLOCK = 256
# Float bit patterns of probabilities lie in [0, +inf bits]; bisection searches this range.
_INF_BITS = 0x7F800000


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters; every field is an array with a leading [R] axis.

    Fields may be numpy (host buffers the engine fills in place) or jax arrays; jit
    converts them. Padding rows should hold :meth:`neutral` values.
    """

    temperature: jax.Array  # [R] f32; < SAMPLING_EPS -> greedy
    top_k: jax.Array  # [R] int32; 0 (or >= V) -> off
    top_p: jax.Array  # [R] f32; 1.0 -> off
    min_p: jax.Array  # [R] f32; 0.0 -> off
    repetition_penalty: jax.Array  # [R] f32; 1.0 -> off
    presence_penalty: jax.Array  # [R] f32; 0.0 -> off
    frequency_penalty: jax.Array  # [R] f32; 0.0 -> off
    seeds: jax.Array  # [R] uint32: a 64-bit seed's low word; the row's PRNG key is
    # fold_in(key(seed), output_pos), with fold_in(key(seed), seeds_hi) for key(seed) when
    # the high word is not 0 (so seeds below 2**32 keep their streams)
    seeds_hi: jax.Array  # [R] uint32: the seed's high word (two's complement for negative seeds)
    output_pos: jax.Array  # [R] int32; index of the output token being sampled
    min_tokens_mask: jax.Array  # [R] bool; True -> stop_token_ids are banned this step
    stop_token_ids: jax.Array  # [R, S] int32, -1 padded (EOS + stop_token_ids)
    penalty_token_ids: jax.Array  # [R, P] int32, -1 padded: prompt ids then output ids
    penalty_prompt_len: jax.Array  # [R] int32; how many leading penalty ids are the prompt
    bias_token_ids: jax.Array  # [R, LB] int32, -1 padded: logit_bias keys
    bias_values: jax.Array  # [R, LB] f32: logit_bias values (0 where unused)
    # [R, W] int32, W = ceil(V / 32): allowed tokens (-1 = all); read by use_bitmask variants only
    token_bitmask: jax.Array

    @classmethod
    def neutral(cls, num_rows: int, num_stop_ids: int, penalty_width: int,
                bias_width: int = MAX_LOGIT_BIAS, vocab_size: int = 32) -> SamplingTensors:
        """Writable numpy buffers with every feature off (greedy rows).

        ``vocab_size`` sizes the token bitmask (the default only suits variants without one).

        The engine keeps one of these per request bucket, fills rows in place each step
        and passes it to the jitted sampler (one transfer).
        """
        r = num_rows
        return cls(
            temperature=np.zeros(r, np.float32),
            top_k=np.zeros(r, np.int32),
            top_p=np.ones(r, np.float32),
            min_p=np.zeros(r, np.float32),
            repetition_penalty=np.ones(r, np.float32),
            presence_penalty=np.zeros(r, np.float32),
            frequency_penalty=np.zeros(r, np.float32),
            seeds=np.zeros(r, np.uint32),
            seeds_hi=np.zeros(r, np.uint32),
            output_pos=np.zeros(r, np.int32),
            min_tokens_mask=np.zeros(r, np.bool_),
            stop_token_ids=np.full((r, num_stop_ids), -1, np.int32),
            penalty_token_ids=np.full((r, penalty_width), -1, np.int32),
            penalty_prompt_len=np.zeros(r, np.int32),
            bias_token_ids=np.full((r, bias_width), -1, np.int32),
            bias_values=np.zeros((r, bias_width), np.float32),
            token_bitmask=np.full((r, bitmask_width(vocab_size)), -1, np.int32),
        )


class SamplerFlags(NamedTuple):
    """The static variant of :func:`sample` a batch needs (pass as ``**flags._asdict()``)."""

    all_greedy: bool
    use_penalties: bool
    use_top_k_top_p: bool
    num_logprobs: int | None
    use_bitmask: bool = False

    @classmethod
    def from_host(
        cls, tensors: SamplingTensors, num_rows: int, num_logprobs: int | None = None
    ) -> SamplerFlags:
        """Flags for the first ``num_rows`` (real) rows of host-side numpy tensors."""
        t = jax.tree.map(lambda a: np.asarray(a)[:num_rows], tensors)
        return cls(
            all_greedy=bool(np.all(t.temperature < SAMPLING_EPS)),
            use_penalties=bool(
                np.any(t.repetition_penalty != 1.0)
                or np.any(t.presence_penalty != 0.0)
                or np.any(t.frequency_penalty != 0.0)
                or np.any(t.bias_token_ids >= 0)
            ),
            use_top_k_top_p=bool(np.any(t.top_k > 0) or np.any(t.top_p < 1.0)),
            num_logprobs=None if num_logprobs is None else int(num_logprobs),
            use_bitmask=bool(np.any(t.token_bitmask != -1)),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """Sampled tokens, plus logprobs of the raw model distribution when asked for."""

    token_ids: jax.Array  # [R] int32
    chosen_logprob: jax.Array | None = None  # [R] f32
    top_logprobs: jax.Array | None = None  # [R, K] f32, descending
    top_token_ids: jax.Array | None = None  # [R, K] int32
    chosen_rank: jax.Array | None = None  # [R] int32, 1-based (1 = most likely)
    # The processed logits [R, V], only with keep_processed=True: returning them lets a caller
    # that donates the logits buffer have the penalty / min_tokens scatters done in place.
    processed_logits: jax.Array | None = None


def bitmask_width(vocab_size: int) -> int:
    """32-bit words per row of a token bitmask."""
    return -(-vocab_size // 32)


def apply_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """-inf where the row's bitmask [R, W] disallows the token (logits [R, V], V <= 32 W)."""
    r, v = logits.shape
    if bitmask.shape[1] * 32 < v:
        raise ValueError(f"token_bitmask has {bitmask.shape[1]} words per row, {v} tokens need "
                         f"{bitmask_width(v)}")
    shifts = jnp.arange(32, dtype=jnp.int32)  # [32]
    bits = (jnp.asarray(bitmask, jnp.int32)[:, :, None] >> shifts) & 1  # [R, W, 32]
    allowed = bits.reshape(r, -1)[:, :v].astype(jnp.bool_)  # [R, V]
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """The logit bias, then HF/vLLM penalties: repetition over prompt+output,
    presence/frequency over output (vLLM's order: bias first).

    Repetition divides positive logits and multiplies negative ones by the penalty; then
    ``logit -= frequency * count + presence * (count > 0)`` with output-token counts.
    """
    r, v = logits.shape
    rows = jnp.arange(r)[:, None]  # [R, 1]
    bias_ids = jnp.asarray(t.bias_token_ids)  # [R, LB]
    bias_ids = jnp.where(bias_ids >= 0, bias_ids, v)  # index v is out of range: dropped
    logits = jnp.asarray(logits).at[rows, bias_ids].add(jnp.asarray(t.bias_values, jnp.float32), mode="drop")
    ids = jnp.asarray(t.penalty_token_ids)  # [R, P]
    pos = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]  # [1, P]
    valid = ids >= 0
    is_prompt = valid & (pos < jnp.asarray(t.penalty_prompt_len)[:, None])  # [R, P]
    is_output = valid & ~is_prompt
    out_ids = jnp.where(is_output, ids, v)  # index v is out of range: dropped
    prompt_ids = jnp.where(is_prompt, ids, v)
    counts = jnp.zeros((r, v), jnp.int32).at[rows, out_ids].add(1, mode="drop")  # [R, V]
    in_prompt = jnp.zeros((r, v), jnp.bool_).at[rows, prompt_ids].set(True, mode="drop")
    seen = in_prompt | (counts > 0)  # [R, V]

    rep = jnp.asarray(t.repetition_penalty, jnp.float32)[:, None]  # [R, 1]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalised, logits)
    freq = jnp.asarray(t.frequency_penalty, jnp.float32)[:, None]
    pres = jnp.asarray(t.presence_penalty, jnp.float32)[:, None]
    return logits - freq * counts.astype(jnp.float32) - pres * (counts > 0).astype(jnp.float32)


def apply_min_tokens(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Ban stop tokens (EOS included) on rows that have not yet produced min_tokens."""
    r, v = logits.shape
    stop = jnp.asarray(t.stop_token_ids)  # [R, S]
    ban = jnp.asarray(t.min_tokens_mask)[:, None] & (stop >= 0)
    idx = jnp.where(ban, stop, v)  # index v is out of range: dropped

    def banned():
        return logits.at[jnp.arange(r)[:, None], idx].set(-jnp.inf, mode="drop")

    # Most steps ban nothing; skip the [R, V] copy the scatter costs.
    return jax.lax.cond(jnp.any(ban), banned, lambda: logits)


def _bisect_threshold(bits: jax.Array, enough) -> jax.Array:
    """Largest bit pattern ``lo`` per row with ``enough(bits >= lo)`` true, by bisection.

    ``enough`` must be monotone (true at lo=0, false at +inf bits). Non-negative floats
    order like their int32 bit patterns, so 31 halvings of [0, inf] are exact.
    """
    r = bits.shape[0]

    def body(_, carry):
        lo, hi = carry  # [R], [R]; enough(lo) holds, enough(hi) does not
        mid = lo + (hi - lo) // 2
        ok = enough(bits >= mid[:, None])  # [R]
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    init = (jnp.zeros(r, jnp.int32), jnp.full(r, _INF_BITS + 1, jnp.int32))
    lo, _ = jax.lax.fori_loop(0, 31, body, init)
    return lo


def _top_k_top_p_mask(probs: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Keep-mask [R, V] of top-k, then top-p renormalised over what top-k kept."""
    r, v = probs.shape
    bits = jax.lax.bitcast_convert_type(probs, jnp.int32)  # [R, V], monotone in probs
    k = jnp.where((top_k <= 0) | (top_k >= v), v, top_k)  # [R]
    k_on = k < v
    p_on = top_p < 1.0

    def k_threshold():
        return _bisect_threshold(bits, lambda m: m.sum(-1, dtype=jnp.int32) >= k)

    zeros = jnp.zeros(r, jnp.int32)
    thr_k = jax.lax.cond(jnp.any(k_on), k_threshold, lambda: zeros)
    thr_k = jnp.where(k_on, thr_k, 0)
    keep_k = bits >= thr_k[:, None]  # [R, V]

    kept = jnp.where(keep_k, probs, 0.0)
    target = top_p * kept.sum(-1)  # [R] mass the nucleus must reach

    def p_threshold():
        return _bisect_threshold(bits, lambda m: jnp.where(m, kept, 0.0).sum(-1) >= target)

    thr_p = jax.lax.cond(jnp.any(p_on), p_threshold, lambda: zeros)
    # A top_p that rounds to 0 in f32 (5e-324) would keep nothing: the most likely token
    # always stays.
    thr_p = jnp.where(p_on, jnp.minimum(thr_p, bits.max(-1)), 0)
    return keep_k & (bits >= thr_p[:, None])


def _row_uniforms(seeds: jax.Array, seeds_hi: jax.Array, output_pos: jax.Array) -> jax.Array:
    """One U[0, 1) per row from its own key only, so other rows never change it. The key
    takes all 64 bits of the seed (low and high words)."""

    def one(seed, seed_hi, pos):
        key = jax.random.key(seed)
        key = jax.lax.cond(seed_hi == 0, lambda k: k, lambda k: jax.random.fold_in(k, seed_hi), key)
        return jax.random.uniform(jax.random.fold_in(key, pos), (), jnp.float32)

    return jax.vmap(one)(jnp.asarray(seeds, jnp.uint32), jnp.asarray(seeds_hi, jnp.uint32),
                         jnp.asarray(output_pos, jnp.int32))


def _last_nonzero(x: jax.Array) -> jax.Array:
    """Index of the last positive entry along the last axis (0 if none)."""
    n = x.shape[-1]
    return n - 1 - jnp.argmax(jnp.flip(x > 0, -1), -1)


def _inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """Categorical sample per row from unnormalised ``probs`` [R, V] with uniforms ``u`` [R].

    Two levels (block sums, then a cumsum inside one block) keep it O(V) per row. The
    chosen token always has positive mass, whatever the rounding; a row with no mass at all
    (every logit -inf or NaN) gets -1, for the caller to replace.
    """
    r, v = probs.shape
    nb = -(-v // _CDF_BLOCK)
    padded = jnp.pad(probs, ((0, 0), (0, nb * _CDF_BLOCK - v)))
    blocks = padded.reshape(r, nb, _CDF_BLOCK)  # [R, NB, B]
    block_sums = blocks.sum(-1)  # [R, NB]
    cum = jnp.cumsum(block_sums, -1)  # [R, NB]
    target = u * cum[:, -1]  # [R]
    bi = jnp.minimum((cum <= target[:, None]).sum(-1), _last_nonzero(block_sums))  # [R]
    before = jnp.where(
        bi > 0, jnp.take_along_axis(cum, jnp.maximum(bi - 1, 0)[:, None], 1)[:, 0], 0.0
    )
    blk = jnp.take_along_axis(blocks, bi[:, None, None], 1)[:, 0]  # [R, B]
    inner = jnp.cumsum(blk, -1)  # [R, B]
    j = jnp.minimum((inner <= (target - before)[:, None]).sum(-1), _last_nonzero(blk))
    return jnp.where(cum[:, -1] > 0, bi * _CDF_BLOCK + j, -1).astype(jnp.int32)


def _random_sample(logits: jax.Array, t: SamplingTensors, use_top_k_top_p: bool) -> jax.Array:
    """Temperature -> min-p -> top-k -> top-p -> inverse-CDF sample. Returns [R] int32."""
    temp = jnp.asarray(t.temperature, jnp.float32)
    temp = jnp.where(temp < SAMPLING_EPS, 1.0, temp)  # greedy rows: keep finite, unused
    scaled = logits / temp[:, None]  # [R, V]
    row_max = scaled.max(-1, keepdims=True)  # [R, 1]
    # min-p: p_i >= min_p * p_max  <=>  s_i - s_max >= log(min_p); min_p = 0 keeps all.
    log_min_p = jnp.log(jnp.asarray(t.min_p, jnp.float32))[:, None]
    probs = jnp.where(scaled - row_max >= log_min_p, jnp.exp(scaled - row_max), 0.0)
    if use_top_k_top_p:
        total = probs.sum(-1, keepdims=True)
        keep = _top_k_top_p_mask(
            probs / total, jnp.asarray(t.top_k, jnp.int32), jnp.asarray(t.top_p, jnp.float32)
        )
        probs = jnp.where(keep, probs, 0.0)
    return _inverse_cdf(probs, _row_uniforms(t.seeds, t.seeds_hi, t.output_pos))


def token_logprobs(raw_logits: jax.Array, token_ids: jax.Array, k: int) -> dict[str, jax.Array]:
    """Logprobs of the raw model distribution: chosen token, its rank, and the top k."""
    lp = jax.nn.log_softmax(raw_logits, axis=-1)  # [R, V]
    chosen = jnp.take_along_axis(lp, token_ids[:, None], 1)[:, 0]  # [R]
    top_lp, top_ids = jax.lax.top_k(lp, k)  # [R, K]
    rank = (lp > chosen[:, None]).sum(-1, dtype=jnp.int32) + 1
    return dict(
        chosen_logprob=chosen,
        top_logprobs=top_lp,
        top_token_ids=top_ids.astype(jnp.int32),
        chosen_rank=rank,
    )


ARGMAX_CHUNK = 1024  # vocabulary entries per chunk of `_argmax`'s first pass


def _first_index_of(x: jax.Array, m: jax.Array) -> jax.Array:
    """First index of `m` [R] in each row of x [R, N]; N where the row has none."""
    n = x.shape[-1]
    return jnp.min(jnp.where(x == m[:, None], jnp.arange(n, dtype=jnp.int32), n), axis=-1)


def _argmax_two_pass(x: jax.Array) -> jax.Array:
    v = x.shape[-1]
    return jnp.minimum(_first_index_of(x, x.max(-1)), v - 1)  # no match (NaN-only row): V - 1


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the row max [R] int32, as `_argmax_two_pass` (the row max, then the first
    index equal to it; XLA:CPU's own argmax is ~2x slower than that).

    Reads the logits about once instead of twice: one pass for the max of each chunk of
    ARGMAX_CHUNK entries, then the index is looked up in the first chunk whose max is the
    row max (2.0 -> 0.5 ms for [64, 49152] f32 on a 2-core EPYC). XLA:CPU's max skips NaN,
    so a chunk of NaNs has max -inf: a row made only of NaN and -inf (with a chunk of NaNs
    before its first -inf) gives V - 1 here where the two-pass rule finds that -inf. A branch
    to the two-pass rule for such rows cost 0.4 ms per call, on every call.
    """
    r, v = x.shape
    c = ARGMAX_CHUNK
    nc = v // c
    if nc < 2:
        return _argmax_two_pass(x)
    main = x[:, : nc * c].reshape(r, nc, c)  # [R, nc, c]
    tail = x[:, nc * c :]  # [R, v - nc * c], maybe empty
    chunk_max = main.max(-1)  # [R, nc]
    m = chunk_max.max(-1)  # [R]
    if tail.shape[-1]:
        m = jnp.maximum(m, tail.max(-1))
    first = _first_index_of(chunk_max, m)  # [R]: nc when the max lies in the tail only
    chunk = jnp.take_along_axis(main, jnp.minimum(first, nc - 1)[:, None, None], axis=1)[:, 0]  # [R, c]
    within = _first_index_of(chunk, m)  # [R]: c when the chunk does not hold m (NaNs only)
    in_tail = nc * c + _first_index_of(tail, m) if tail.shape[-1] else jnp.full_like(first, v)
    found = jnp.where(first < nc, jnp.where(within < c, first * c + within, v), in_tail)
    return jnp.minimum(found, v - 1)


def sample(
    logits: jax.Array,
    tensors: SamplingTensors,
    *,
    all_greedy: bool = False,
    use_penalties: bool = False,
    use_top_k_top_p: bool = False,
    num_logprobs: int | None = None,
    use_bitmask: bool = False,
    keep_processed: bool = False,
) -> SamplerOutput:
    """Sample one token per row of ``logits`` [R, V] (traceable; see :data:`sample_jit`).

    Keyword flags are static: they pick the compiled variant, they never change what a
    row whose feature is off receives.
    """
    raw = logits.astype(jnp.float32)  # [R, V]
    x = apply_bitmask(raw, tensors.token_bitmask) if use_bitmask else raw
    x = apply_penalties(x, tensors) if use_penalties else x
    x = apply_min_tokens(x, tensors)
    greedy = _argmax(x)  # [R]
    if all_greedy:
        token_ids = greedy
    else:
        sampled = _random_sample(x, tensors, use_top_k_top_p)
        is_greedy = jnp.asarray(tensors.temperature, jnp.float32) < SAMPLING_EPS
        token_ids = jnp.where(is_greedy | (sampled < 0), greedy, sampled)
    kept = {"processed_logits": x} if keep_processed else {}
    if num_logprobs is not None:
        return SamplerOutput(token_ids=token_ids, **token_logprobs(raw, token_ids, num_logprobs), **kept)
    return SamplerOutput(token_ids=token_ids, **kept)


def per_row(fn: Callable[..., Any], *rows: Any) -> Any:
    """fn over the leading axis of `rows` (pytrees of [R, ...] arrays), one [1, ...] row at a
    time: every row is computed by one program whatever R is (batch-invariant mode).

    XLA:CPU reduces the rows of an [R, V] array in an order that depends on R (a log-softmax
    row of a [3, V] array measured 1 ulp from the same row alone), so the sampler compiled
    once per request bucket is not the same arithmetic in every bucket. The trip count is
    hidden from XLA so that no bucket gets the loop unrolled or dropped. Costs the
    parallelism across rows (the sampler is a small part of a step)."""
    num = jax.tree.leaves(rows)[0].shape[0]
    first = jax.tree.map(lambda a: a[:1], rows)
    out = jax.tree.map(lambda s: jnp.zeros((num, *s.shape[1:]), s.dtype), jax.eval_shape(fn, *first))

    def one(i, out):
        row = jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, i, 1, 0), rows)
        return jax.tree.map(lambda acc, y: jax.lax.dynamic_update_slice_in_dim(acc, y, i, 0), out, fn(*row))

    return jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(num)), one, out)


sample_jit = jax.jit(
    sample, static_argnames=("all_greedy", "use_penalties", "use_top_k_top_p", "num_logprobs", "use_bitmask")
)
