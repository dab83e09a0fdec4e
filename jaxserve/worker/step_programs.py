"""The device programs of a serving step and how each planned shape is lowered.

`StepPrograms` holds what lowering needs and nothing that lives on a device: the model's graph
definition and *abstract* params and KV cache (`jax.ShapeDtypeStruct`s carrying their
shardings). A `ModelRunner` builds one from its real arrays (warmup); `jaxserve compile`
builds one from a model config alone for devices that are not attached (a TPU, a GPU, or
this host), so a model of any size is planned without its weights.

The jits are module-level with the graph definition static: runners of the same model and
shapes share executables and persistent-cache keys.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, Sharding

import pallas_kernels
from jaxserve.models.gated_delta import linear_mixing
from jaxserve.models.lora import LoRABatch
from jaxserve.models.metadata import AttentionMetadata, RecurrentMetadata
from jaxserve.models.registry import family_of
from jaxserve.worker import parallel
from jaxserve.worker.compile_plan import ShapeKey
from jaxserve.worker.recurrent_inputs import chunk_grid
from jaxserve.worker.sampler import SamplingTensors, per_row, sample, token_logprobs
from jaxserve.worker.vision import abstract_multimodal, lower_encoder
from pallas_kernels.mla_attention.ops import mla_paged_attention, update_latent_cache

PROMPT_LOGPROB_ROWS = 128  # prompt positions scored per call: [128, V] f32 logits at most


def prompt_logprob_rows(num_tokens: int) -> int:
    """Positions per prompt-logprobs call for a step of token bucket `num_tokens`."""
    return min(num_tokens, PROMPT_LOGPROB_ROWS)


def sds(shape, dtype, sharding: Sharding | None = None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def abstract(tree):
    """ShapeDtypeStructs with each leaf's own sharding: warmup shardings equal serving ones."""
    def one(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return jax.tree.map(one, tree)


@dataclasses.dataclass(frozen=True)
class StepPrograms:
    graphdef: Any
    state: Any  # abstract params (nnx.State of ShapeDtypeStructs)
    kv_cache: tuple[jax.ShapeDtypeStruct, ...]  # K, V: [L, P, S, Hkv, D] or [L, P, S, C]; quantized: + scales
    mesh: Mesh | None  # tensor-parallel mesh (None: one device)
    input_sharding: Sharding | None  # step inputs, hidden states, logits (None: the default device)
    index_sharding: Sharding | None  # the swap copies' page ids
    hidden_size: int
    vocab_size: int
    attention_backend: str
    max_pages_per_seq: int  # a request's whole block-table row (every layer group's)
    lora: dict[str, jax.ShapeDtypeStruct] | None = None  # the LoRA slots (`LoRABatch.weights`); None: off
    batch_invariant: bool = False  # the sampler one row at a time (`sampler.per_row`)
    num_state_arrays: int = 0  # a hybrid model's state pools, last in `kv_cache`
    multimodal: bool = False  # a vision-language model: the backbone takes image rows and 3-D positions
    vision: dict[str, jax.ShapeDtypeStruct] | None = None  # its image encoder's abstract params
    vision_config: Any = None  # and its `VisionConfig`
    num_kv_groups: int = 1  # the cache's layer groups: [G * T] slots, G block tables per row

    @property
    def dtype(self) -> Any:
        """The activations' dtype (the final norm's; weights and KV pages may be quantized)."""
        return jax.tree.leaves(self.state["final_norm"])[0].dtype

    def lower(self, key: ShapeKey, max_reqs: int, tensors: SamplingTensors | None = None):
        """Lowers one planned shape on abstract values (no device buffers) and compiles it.
        A swap shape compiles to a (gather, scatter) pair."""
        rep = self.input_sharding

        def i32(*shape):
            return sds(shape, jnp.int32, rep)

        def metadata(T: int) -> AttentionMetadata:
            rec = None
            if self.num_state_arrays:
                nc, C = chunk_grid(T, max_reqs)
                rec = RecurrentMetadata(state_slots=i32(max_reqs), token_rows=i32(T), chunk_tokens=i32(nc, C),
                                        chunk_rows=i32(nc), num_chunks=i32(1))
            mm = None
            if self.multimodal:
                ds = len(self.vision_config.deepstack_visual_indexes) if self.vision_config is not None else 0
                bidi = self.vision_config is not None and self.vision_config.bidirectional_images
                mm = abstract_multimodal(T, self.hidden_size, self.dtype, ds, rep, bidirectional=bidi)
            return AttentionMetadata(
                slot_mapping=i32(self.num_kv_groups * T), cu_q_lens=i32(max_reqs + 1), kv_lens=i32(max_reqs),
                block_tables=i32(max_reqs, self.max_pages_per_seq), num_seqs=i32(1), recurrent=rec,
                multimodal=mm,
            )

        if key.kind == "vision":
            return lower_encoder(self.vision_config, self.vision, key.size, rep)
        if key.kind == "backbone":
            T = key.size
            md = metadata(T)
            lora = LoRABatch(self.lora, i32(T)) if self.lora is not None else None
            return backbone_jit.lower(
                self.graphdef, self.attention_backend, self.mesh, self.state, self.kv_cache,
                i32(T), i32(T), md, i32(max_reqs), lora,
            ).compile()
        if key.kind in ("mtp", "mtp_chain"):  # the source rows: the target's [T, E], or the last pass's rows
            T = key.size
            md = metadata(T)
            h = sds((T if key.kind == "mtp" else max_reqs, self.hidden_size), self.dtype, rep)
            return mtp_jit.lower(self.graphdef, self.attention_backend, self.mesh, self.state, self.kv_cache, h,
                                 i32(T), i32(T), i32(T), md, i32(max_reqs), normalize_prev=key.kind == "mtp").compile()
        if key.kind == "mtp_draft":
            h = sds((max_reqs, self.hidden_size), self.dtype, rep)
            return mtp_draft_jit.lower(self.graphdef, self.mesh, self.state, h, i32(), num_rows=key.size).compile()
        if key.kind == "logits":
            h = sds((max_reqs, self.hidden_size), self.dtype, rep)
            return logits_jit.lower(self.graphdef, self.mesh, self.state, h, i32(), num_rows=key.size).compile()
        if key.kind == "prompt_logprobs":
            T = key.size
            h = sds((T, self.hidden_size), self.dtype, rep)
            P = prompt_logprob_rows(T)
            return prompt_logprobs_jit.lower(self.graphdef, self.mesh, self.state, h, i32(P), i32(P),
                                             num_top=key.num_top).compile()
        if key.kind == "head":
            logits = sds((key.size, self.vocab_size), jnp.float32, rep)
            t = jax.tree.map(lambda x: sds(x.shape, x.dtype, rep), tensors)
            return sample_jit.lower(logits, t, flags=key.flags, one_row_at_a_time=self.batch_invariant).compile()
        if key.kind in ("swap", "states"):
            n = self.num_state_arrays
            arrays = self.kv_cache[len(self.kv_cache) - n:] if key.kind == "states" else self.kv_cache[
                :len(self.kv_cache) - n]
            gather_jit, scatter_jit = ((gather_states_jit, scatter_states_jit) if key.kind == "states"
                                       else (gather_pages_jit, scatter_pages_jit))
            ids = sds((key.size,), jnp.int32, self.index_sharding)
            values = tuple(sds(p.shape, p.dtype, self.index_sharding) for p in gather_jit.eval_shape(arrays, ids))
            return gather_jit.lower(arrays, ids).compile(), scatter_jit.lower(arrays, ids, values).compile()
        raise ValueError(f"unknown shape kind {key.kind!r}")


# ---------------------------------------------------------------------- pure step functions
def _backbone(graphdef, attention_backend, mesh, state, kv_cache, token_ids, positions, md, logits_indices,
              lora=None):
    model = nnx.merge(graphdef, state)
    attention_fn, kv_update_fn, extra = _layer_fns(model, attention_backend, mesh)
    h_last, h_all, kv_cache = model(token_ids, positions, kv_cache, md, logits_indices,
                                    attention_fn=attention_fn, kv_update_fn=kv_update_fn, lora=lora, **extra)
    if mesh is not None:  # the heads receive replicated hidden states, as their warmup assumed
        h_last = jax.lax.with_sharding_constraint(h_last, parallel.replicated(mesh))
        h_all = jax.lax.with_sharding_constraint(h_all, parallel.replicated(mesh))
    return h_last, h_all, kv_cache


def _layer_fns(model, attention_backend, mesh):
    """The attention, cache-update and (under a mesh) expert functions the model's layers call."""
    extra = {}
    if family_of(model.config).attention == "latent":  # MLA: a latent cache every rank holds whole
        attention_fn = functools.partial(mla_paged_attention, backend=attention_backend,
                                         batch_invariant=model.row_tile > 0)
        kv_update_fn = update_latent_cache
        if mesh is not None:
            attention_fn = parallel.per_shard_latent_attention(attention_fn, mesh)
    else:
        attention_fn = functools.partial(pallas_kernels.ragged_paged_attention, backend=attention_backend,
                                         batch_invariant=model.row_tile > 0)
        kv_update_fn = functools.partial(pallas_kernels.update_kv_cache, backend=attention_backend)
        if mesh is not None:
            attention_fn, kv_update_fn = parallel.per_shard_attention(attention_fn, kv_update_fn, mesh)
    if mesh is not None and model.config.is_moe:
        extra["moe_fn"] = parallel.per_shard_moe(mesh, model.expert_parallel)
    if mesh is not None and family_of(model.config).kv_cache.recurrent:
        extra["recurrent_fn"] = parallel.per_shard_recurrent(linear_mixing, mesh)
    return attention_fn, kv_update_fn, extra


def _mtp(graphdef, attention_backend, mesh, state, kv_cache, h_src, src_rows, token_ids, positions, md, rows, *,
         normalize_prev):
    """One pass of the multi-token-prediction layer over a step's T tokens (`spec_decode.mtp`):
    token t pairs `h_src[src_rows[t]]` with `token_ids[t]`. Returns the outputs of `rows`
    [max_reqs, E] (the next pass's `h_src` when drafts are chained) and the cache."""
    model = nnx.merge(graphdef, state)
    attention_fn, kv_update_fn, extra = _layer_fns(model, attention_backend, mesh)
    h_prev = jnp.take(h_src, src_rows, axis=0)  # [T, E]
    h_rows, kv_cache = model.mtp_forward(h_prev, token_ids, positions, kv_cache, md, rows,
                                         normalize_prev=normalize_prev, attention_fn=attention_fn,
                                         kv_update_fn=kv_update_fn, **extra)
    if mesh is not None:
        h_rows = jax.lax.with_sharding_constraint(h_rows, parallel.replicated(mesh))
    return h_rows, kv_cache


def _mtp_draft(graphdef, mesh, state, h_rows, live_rows, *, num_rows):
    """The greedy draft [num_rows] int32 of each of h_rows' first rows."""
    model = nnx.merge(graphdef, state)
    h = jax.lax.optimization_barrier(h_rows[:num_rows])  # (as `_logits`: the slice before the head's GEMM)
    logits = model.mtp_logits(h, live_rows)  # [R, V]
    if mesh is not None:
        logits = jax.lax.with_sharding_constraint(logits, parallel.replicated(mesh))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _logits(graphdef, mesh, state, h_last, live_rows, *, num_rows):
    """Logits [num_rows, V] of h_last's first rows; `live_rows` (int32 []) of them are real
    (the rest pad the request bucket: a quantized head skips them where it can, 0 there)."""
    model = nnx.merge(graphdef, state)
    # The slice is materialised before the head's matmul: XLA:GPU (jax 0.10.2) fails to
    # compile a one-row slice fused into a GEMM with a transposed (tied) embedding ("Reshape
    # input and output shapes must be the same, got 1x16 -> 16x8"). It costs an [R, E] copy.
    h = jax.lax.optimization_barrier(h_last[:num_rows])  # [R, E]
    logits = model.compute_logits(h, live_rows)  # [R, V]
    if mesh is not None:  # the sampler receives replicated logits, as its warmup assumed
        logits = jax.lax.with_sharding_constraint(logits, parallel.replicated(mesh))
    return logits


def _prompt_logprobs(graphdef, mesh, state, h_all, rows, targets, *, num_top):
    """Logprobs of prompt tokens, one slice of positions per call: rows `rows` [P] of the
    step's pre-norm hidden states `h_all` [T, E] score the tokens `targets` [P] that follow
    them. Returns the target's logprob and rank and the top `num_top` [P, K] of the raw
    distribution (as the sampler's logprobs). P is fixed per token bucket, so a long chunk
    takes several calls and the [P, V] logits stay small however large T and V are."""
    model = nnx.merge(graphdef, state)
    logits = model.compute_logits(model.final_hidden(jnp.take(h_all, rows, axis=0)))  # [P, V]
    if mesh is not None:
        logits = jax.lax.with_sharding_constraint(logits, parallel.replicated(mesh))
    score = functools.partial(token_logprobs, k=num_top)
    return per_row(score, logits, targets) if model.row_tile else score(logits, targets)


def _sample(logits, tensors, *, flags, one_row_at_a_time=False):
    """The sampler over [R, V] logits; `one_row_at_a_time` (batch-invariant mode): each row
    by the same [1, V] program whatever R is. The logits are donated and the processed ones
    returned, so scatters run in place."""
    fn = functools.partial(sample, **flags._asdict(), keep_processed=True)
    return per_row(fn, logits, tensors) if one_row_at_a_time else fn(logits, tensors)


backbone_jit = jax.jit(_backbone, static_argnums=(0, 1, 2), donate_argnums=(4,))
logits_jit = jax.jit(_logits, static_argnums=(0, 1), static_argnames=("num_rows",))
prompt_logprobs_jit = jax.jit(_prompt_logprobs, static_argnums=(0, 1), static_argnames=("num_top",))
sample_jit = jax.jit(_sample, static_argnames=("flags", "one_row_at_a_time"), donate_argnums=(0,))
mtp_jit = jax.jit(_mtp, static_argnums=(0, 1, 2), static_argnames=("normalize_prev",), donate_argnums=(4,))
mtp_draft_jit = jax.jit(_mtp_draft, static_argnums=(0, 1), static_argnames=("num_rows",))


def _gather_pages(kv, ids):
    """Pages `ids` of every layer: each page array's [L, n, S, ...] (K and V, or a latent) and a
    quantized cache's scales [L, n, S, Hkv]. Page arrays are [L, P, S, ...] (4-D or 5-D), the
    scales pools 3-D."""
    L, P, S = kv[0].shape[:3]
    return tuple(x[:, ids] if x.ndim >= 4 else _scale_pages(x, L, P, S)[:, ids] for x in kv)


def _scatter_pages(kv, ids, pages):
    L, P, S = kv[0].shape[:3]
    return tuple(x.at[:, ids].set(new) if x.ndim >= 4 else _set_scale_pages(x, L, P, S, ids, new)
                 for x, new in zip(kv, pages))


def _scale_pages(s, L, P, S):
    """A scales pool (`models.llama.kv_scales_pool_shape`) viewed as [L, P, S, Hkv]."""
    if s.shape[:2] == (L * P, S):  # heads layout: [L*P, S, Hkv]
        return s.reshape(L, P, S, s.shape[2])
    hkv = s.shape[0]  # lanes layout: [Hkv, rows, 128], each head's scales in slot order
    return s.reshape(hkv, -1)[:, :L * P * S].reshape(hkv, L, P, S).transpose(1, 2, 3, 0)


def _set_scale_pages(s, L, P, S, ids, new):
    if s.shape[:2] == (L * P, S):
        return s.reshape(L, P, S, s.shape[2]).at[:, ids].set(new).reshape(s.shape)
    flat = s.reshape(s.shape[0], -1)
    view = _scale_pages(s, L, P, S).at[:, ids].set(new)  # [L, P, S, Hkv]
    flat = flat.at[:, :L * P * S].set(view.transpose(3, 0, 1, 2).reshape(s.shape[0], -1))
    return flat.reshape(s.shape)


def _gather_states(states, ids):
    """State slots `ids` of every linear layer: [Ll, n, ...] per pool."""
    return tuple(x[:, ids] for x in states)


def _scatter_states(states, ids, values):
    return tuple(x.at[:, ids].set(v) for x, v in zip(states, values))


gather_states_jit = jax.jit(_gather_states)
scatter_states_jit = jax.jit(_scatter_states, donate_argnums=(0,))
gather_pages_jit = jax.jit(_gather_pages)
scatter_pages_jit = jax.jit(_scatter_pages, donate_argnums=(0,))
