"""The model runner: owns the device params and the paged KV cache, runs jitted ragged steps.

`execute(SchedulerOutput) -> ModelRunnerOutput` is the whole step seen from the engine: the
runner updates its persistent input batch (per-request sampling state), does the swap copies,
picks the token and request buckets, builds the padded batch and the sampling rows, runs the
device programs and returns the sampled ids and logprobs as host data.

`nnx.split` happens once; each step is a plain `jax.jit` over a pure function. Separate jits
keep the number of compiled shapes O(m + n) rather than O(m * n):

- the backbone, keyed on the token bucket T only (its per-sequence metadata always has the
  full `max_reqs` rows), with the KV cache donated so it is updated in place;
- the head (logits of the sampled rows + sampler), keyed on the request bucket R and the few
  static sampler variants.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxserve.loading import LoadedModel
from jaxserve.lora.slots import LoRASlots
from jaxserve.models.fused import fuse_projections
from jaxserve.models.llama import LlamaForCausalLM
from jaxserve.models.lora import LoRABatch
from jaxserve.models.metadata import AttentionMetadata, MultimodalMetadata, RecurrentMetadata
from jaxserve.models.registry import family_of
from jaxserve.worker import mtp_inputs as mtp
from jaxserve.worker import parallel, prompt_logprobs
from jaxserve.worker.batch import BatchBuilder, SequenceSpan, StepArrays
from jaxserve.worker.buckets import pick
from jaxserve.worker.compile_cache import CompileGuard
from jaxserve.worker.compile_plan import STATE_COPY_SIZE, SWAP_SIZES, ShapeKey
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.runner_output import (
    ModelRunnerOutput,
    SpecDecodeCounts,
    StepTiming,
    TokenLogprob,
)
from jaxserve.worker.sampler import SamplerFlags, SamplerOutput, SamplingTensors
from jaxserve.worker.step_programs import (
    StepPrograms,
    abstract,
    backbone_jit,
    gather_pages_jit,
    gather_states_jit,
    logits_jit,
    mtp_draft_jit,
    mtp_jit,
    prompt_logprob_rows,
    prompt_logprobs_jit,
    sample_jit,
    scatter_pages_jit,
    scatter_states_jit,
)
from jaxserve.worker.vision import EncoderCache, VisionRunner, multimodal_inputs, vision_dtype
from pallas_kernels.quantized_matmul.dense import native_dense_available
from scheduler import SchedulerOutput


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """The step shapes and limits `execute` works within (resolved engine settings)."""

    token_buckets: tuple[int, ...]
    request_buckets: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_logprobs: int = 20
    seed: int = 0
    strict_compile_guard: bool = False
    record_traffic_log: str | None = None  # append each step's token count to this file
    mtp_tokens: int = 0  # drafts per step from the model's MTP layer (`spec_decode.mtp`); 0: none


def num_drafts_kept(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts equal the tokens the target chose at their positions
    (`targets` holds 1 + len(drafts) tokens: one per draft position, then the bonus)."""
    n = 0
    while n < len(drafts) and targets[n] == drafts[n]:
        n += 1
    return n


def cpu_weight_layout(platform: str, num_devices: int, row_tile: int, config: Any, act_dtype: Any,
                      embed_dtype: Any, quantized_embed: bool, has_lm_head: bool) -> tuple[bool, bool]:
    """(native_dense, embed_columns): how one CPU device holds and reads the weights. The
    runner and `jaxserve compile` (abstract params) both ask, so a serialized program's
    operands are laid out as the serving process holds them.

    native_dense: bf16 dense projections and head on the native CPU matmul (read in place
    by layer index), for bf16 weights on one CPU device outside batch-invariant mode (whose
    fixed row tiles need XLA's dot), in the families on the dense Llama decoder (the others'
    projections stay on XLA). embed_columns: a tied embedding served [E, V] where the native
    kernel reads the head: int8 (64 rows: 10.8 against 12.2 ms for SmolLM2's head read
    [V, E], one row 0.9 against 2.0 ms) or bf16; the lookup's column gather costs ~0.1 ms
    more per 64 tokens."""
    if platform != "cpu" or num_devices != 1:
        return False, False
    native_dense = (row_tile == 0 and family_of(config).model_class is LlamaForCausalLM
                    and act_dtype == jnp.bfloat16 and embed_dtype == jnp.bfloat16
                    and native_dense_available(jnp.bfloat16))
    embed_columns = (quantized_embed and embed_dtype == jnp.int8) or (native_dense and not has_lm_head)
    return native_dense, embed_columns


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
        num_host_pages: int = 0,
        attention_backend: str = "auto",
        max_pages_per_seq: int = 0,
        mesh: Mesh | None = None,
        steps: StepConfig | None = None,
        channel: Any = None,
        kv_layout: str = "heads",
        kv_cache_dtype: str | None = None,
        structured: Any = None,
        expert_parallel: bool = False,
        matmul_precision: str = "highest",
        row_tile: int = 0,
        lora: tuple[int, int, Any] | None = None,
        num_state_slots: int = 0,
        encoder_cache_bytes: int = 256 * 2**20,
    ):
        """`steps` is needed by `execute` only (tools that call `forward` leave it out);
        `channel` is the multi-host leader's `StepChannel`: each step is broadcast on it
        before it runs; `structured` the `StructuredOutputManager` filling token bitmasks;
        `kv_cache_dtype` a quantized page dtype (int8 / float8; pages then carry f32 scales);
        `lora` (max_loras, max_lora_rank, LoRARegistry): the adapter slots and where their
        weights come from; `num_state_slots` a hybrid model's state slots (null, running,
        snapshots: `SchedulerConfig.num_state_slots`); `encoder_cache_bytes` the host memory of
        a vision-language model's encoder-output cache."""
        self.page_size = page_size
        self.num_state_slots = num_state_slots
        self.num_pages = num_pages
        self.kv_layout = kv_layout
        self.max_pages_per_seq = max_pages_per_seq
        groups = loaded.config.kv_layer_groups
        self.num_kv_groups = groups.num_groups if groups is not None else 1  # block tables per request
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.expert_parallel = expert_parallel
        self.matmul_precision = matmul_precision
        self.row_tile = row_tile  # batch-invariant mode's matmul row tile (0: off)
        p = loaded.params
        self.native_dense, self.embed_columns = cpu_weight_layout(
            jax.devices()[0].platform, 1 if self.mesh is None else self.mesh.size, row_tile, loaded.config,
            jnp.dtype(p["final_norm"].dtype), jnp.dtype(p["embed"].dtype), "embed_scale" in p, "lm_head" in p)
        t0 = time.perf_counter()
        if self.mesh is None:
            self.config = loaded.config
            params = jax.tree.map(host_to_device, self._serving_params(loaded.params, loaded.config))
            self.input_sharding = None
        else:  # tensor parallel: KV heads replicated up to tp when fewer, params sharded
            self.config = parallel.tp_model_config(loaded.config, self.mesh.shape[parallel.MODEL_AXIS],
                                                   expert_parallel)
            params = parallel.shard_params(self._serving_params(loaded.params, loaded.config), self.config,
                                           self.mesh, expert_parallel)
            self.input_sharding = parallel.replicated(self.mesh)
        self.graphdef, self.state = nnx.split(self._model(params))
        self.dtype = params["final_norm"].dtype  # the activations' (the embedding may be quantized)
        self.kv_dtype = jnp.dtype(kv_cache_dtype) if kv_cache_dtype is not None else self.dtype
        spec = family_of(self.config).kv_cache
        self.recurrent = spec.recurrent
        if self.recurrent and num_state_slots < 2:
            raise ValueError(f"{self.config.architecture} keeps per-sequence states: num_state_slots must be >= 2, "
                             f"got {num_state_slots}")
        # The cache's arrays: pages (and their scales), then a hybrid model's state pools.
        self.num_state_arrays = len(spec.state_shapes(self.config, 1)) if self.recurrent else 0
        t1 = time.perf_counter()
        self.kv_cache = self._new_kv_cache()
        # Start-up split for reports (`Engine.startup_seconds`): params placed on the devices
        # (fused, sharded) and the model built; the KV cache allocated.
        self.startup_seconds = {"params_to_device": t1 - t0, "kv_cache": time.perf_counter() - t1}
        self.lora: LoRASlots | None = None
        self.lora_registry = None
        if lora is not None:
            max_loras, max_rank, self.lora_registry = lora
            self.lora = LoRASlots(self.config, loaded.config, max_loras, max_rank, self.dtype, self.mesh,
                                  parallel.MODEL_AXIS)
        self.attention_backend = attention_backend
        # A vision-language model's image encoder (its step inputs carry image rows and 3-D positions).
        self.multimodal = self.config.vision is not None
        self.vision: VisionRunner | None = None
        self._mm_zeros: dict[int, dict[str, jax.Array]] = {}  # a step without images: its rows, per bucket
        if self.multimodal:
            self.vision = self._vision_runner(loaded, encoder_cache_bytes)
        # Host-side swap pool, as the swap gather returns pages: [L, H, S, ...] per array (K, V
        # and, for a quantized cache, their scales [L, H, S, Hkv]); pages keep their dtype.
        self.host_pool: list[np.ndarray] | None = None
        self.host_states: list[np.ndarray] | None = None
        if num_host_pages:
            pages = gather_pages_jit.eval_shape(abstract(self._pages()), jax.ShapeDtypeStruct((1,), jnp.int32))
            self.host_pool = [np.zeros((p.shape[0], num_host_pages, *p.shape[2:]), p.dtype) for p in pages]
            if self.recurrent:  # a host state slot per request that can be swapped out
                n = steps.max_num_seqs if steps is not None else 1
                self.host_states = [np.zeros((x.shape[0], n, *x.shape[2:]), x.dtype) for x in self._states()]
        # Ahead-of-time compiled executables by shape (filled by warmup or `--compiled`); a shape
        # missing here falls back to the jit, which the compile guard reports.
        self.executables: dict[ShapeKey, Any] = {}
        self.steps = steps
        self.channel = channel
        self.guard = CompileGuard(strict=steps.strict_compile_guard if steps else False)
        if steps is not None:
            self.input_batch = InputBatch(steps.request_buckets, steps.max_model_len, steps.max_logprobs, steps.seed,
                                          vocab_size=self.config.vocab_size, structured=structured)
            self.builder = BatchBuilder(steps.max_num_batched_tokens, steps.max_num_seqs, max_pages_per_seq, page_size,
                                        recurrent=self.recurrent, num_kv_groups=self.num_kv_groups)
        self._traffic_log = open(steps.record_traffic_log, "a") if steps and steps.record_traffic_log else None
        # MTP drafts of the last step: request id -> (the history length they follow, drafts)
        self.mtp_drafts: dict[str, tuple[int, list[int]]] = {}
        if steps is not None and steps.mtp_tokens:
            self._mtp_builder = BatchBuilder(pick(steps.token_buckets, steps.max_num_seqs), steps.max_num_seqs,
                                             max_pages_per_seq, page_size)  # the chained passes' inputs

    def _vision_runner(self, loaded: LoadedModel, cache_bytes: int) -> VisionRunner:
        """The encoder in f32 on CPU (XLA:CPU's bf16 dot is 10x slower than its f32 one), else
        in the decoder's dtype; its params replicated like the step inputs."""
        if loaded.vision is None:
            raise ValueError(f"{self.config.architecture}: the image encoder's weights were not loaded "
                             "(vision-language models load from HF checkpoints)")
        vdtype = vision_dtype(jax.devices()[0].platform, self.dtype)
        params = {k: np.asarray(v).astype(vdtype) for k, v in loaded.vision.items()}
        params = jax.device_put(params, self.input_sharding)
        return VisionRunner(self.config.vision, params, np.dtype(self.dtype), EncoderCache(cache_bytes),
                            sharding=self.input_sharding)

    def _serving_params(self, params: dict[str, Any], config: Any) -> dict[str, Any]:
        """Loaded params (host arrays) as the model holds them: projections fused (and, under
        tensor parallelism, KV heads replicated up to the degree), still on the host; on one
        CPU device a quantized tied embedding transposed to [E, V] (`embed_columns`)."""
        family = family_of(config)
        if family.serving_layers is not None:
            params = {**params, "layers": family.serving_layers(params["layers"], config)}
        if self.mesh is None:
            out = {**params, "layers": fuse_projections(params["layers"])}
            if self.embed_columns:  # (a partial update's mask is transposed alike)
                out["embed"] = np.ascontiguousarray(np.asarray(params["embed"]).T)  # [E, V]
            return out
        tp = self.mesh.shape[parallel.MODEL_AXIS]
        params = parallel.expand_kv_heads(params, config, self.config.num_kv_heads, self.config.global_num_kv_heads)
        return {**params, "layers": fuse_projections(params["layers"], tp, 1 if self.expert_parallel else tp)}

    def _model(self, params: dict[str, Any]) -> Any:
        tp = 1 if self.mesh is None else self.mesh.shape[parallel.MODEL_AXIS]
        extra = {"native_dense": True} if self.native_dense else {}  # (families off the Llama decoder lack it)
        return family_of(self.config).model_class(self.config, params, shards=tp, expert_parallel=self.expert_parallel and tp > 1,
                                matmul_precision=self.matmul_precision, row_tile=self.row_tile,
                                embed_columns=self.embed_columns, kv_layout=self.kv_layout, **extra)

    def replace_params(self, params: dict[str, Any], config: Any, mask: dict[str, Any] | None = None) -> None:
        """New weights in place of the running ones, every compiled program kept: each tensor
        must have the running one's shape and dtype (else ValueError naming it and both shapes,
        before anything changes); it is placed with the running sharding and the old buffer
        freed, one tensor at a time, so the peak is one tensor more than the params.
        `mask` (a partial update, `loading.partial`): 1 where `params` hold new values; a
        tensor it leaves all 0 is not touched, one it covers in part is merged on the host."""
        new = nnx.split(self._model(self._serving_params(params, config)))[1]
        masks = None
        if mask is not None:
            masks = jax.tree.leaves(nnx.split(self._model(self._serving_params(mask, config)))[1])
        old_leaves = jax.tree_util.tree_leaves_with_path(self.state)
        new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
        if [p for p, _ in old_leaves] != [p for p, _ in new_leaves]:
            raise ValueError("the new weights hold other tensors than the running ones "
                             f"({len(new_leaves)} tensors against {len(old_leaves)})")
        for (path, old), (_, x) in zip(old_leaves, new_leaves):
            if tuple(x.shape) != tuple(old.shape) or jnp.dtype(x.dtype) != old.dtype:
                raise ValueError(f"weight {jax.tree_util.keystr(path)}: the new tensor is {tuple(x.shape)} "
                                 f"{jnp.dtype(x.dtype).name}, the running one {tuple(old.shape)} {old.dtype.name}")
        placed = []
        for i, ((_, old), (_, x)) in enumerate(zip(old_leaves, new_leaves)):
            if masks is not None:
                m = np.asarray(masks[i]) > 0
                if not m.any():
                    placed.append(old)
                    continue
                if not m.all():
                    x = np.where(m, np.asarray(x), np.asarray(jax.device_get(old)))
            if not isinstance(old, jax.Array):  # a host constant, or a weight offloaded by sleep
                placed.append(np.asarray(x))
                continue
            placed.append(parallel.place(x, old.sharding))
            old.delete()
        self.state = jax.tree_util.tree_unflatten(new_def, placed)

    # ------------------------------------------------------------------ sleep / wake
    def free_kv_cache(self) -> None:
        """Frees the KV cache's device buffers (its contents are lost); `rebuild_kv_cache`
        makes a new one with the same shapes and shardings."""
        for x in self.kv_cache or ():
            x.delete()
        self.kv_cache = None

    def offload_params(self) -> None:
        """The weights to host memory, their device buffers freed; `restore_params` puts
        them back with the same shardings. `replace_params` meanwhile replaces the host copy."""
        leaves, treedef = jax.tree_util.tree_flatten(self.state)
        self._param_shardings = [x.sharding if isinstance(x, jax.Array) else None for x in leaves]
        host = []
        for x in leaves:
            host.append(np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else x)
            if isinstance(x, jax.Array):
                x.delete()
        self.state = jax.tree_util.tree_unflatten(treedef, host)

    def restore_params(self) -> None:
        leaves, treedef = jax.tree_util.tree_flatten(self.state)
        placed = [x if s is None else jax.device_put(x, s) for x, s in zip(leaves, self._param_shardings)]
        self.state = jax.tree_util.tree_unflatten(treedef, placed)

    def device_bytes(self) -> dict[str, int]:
        """Bytes of the weights and of the KV cache that are on the device now."""
        def size(tree) -> int:
            return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not x.is_deleted())
        return {"weights": size(self.state), "kv_cache": size(self.kv_cache or ())}

    # ------------------------------------------------------------------ the step
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one scheduled step: swap copies first (swap-outs before swap-ins), then the
        ragged step over every scheduled span. Returns host data only."""
        self.input_batch.update(so.finished_request_ids, so.new_requests)
        td = time.perf_counter()
        if so.state_saves:
            self.copy_states(so.state_saves)
        if so.swap_out:
            self.swap_out(so.swap_out)
        if so.state_swap_out:
            self.swap_out_states(so.state_swap_out)
        if so.swap_in:
            self.swap_in(so.swap_in)
        if so.state_swap_in:
            self.swap_in_states(so.state_swap_in)
        if so.state_restores:
            self.copy_states(so.state_restores)
        device_s = time.perf_counter() - td
        if not so.scheduled:
            return ModelRunnerOutput.empty(StepTiming(device_s))
        cfg = self.steps
        lora_slots = self._lora_slots(so)
        spans = [SequenceSpan(np.asarray(sr.token_ids, np.int32), sr.start, sr.block_table, 1 + sr.num_draft_tokens,
                              lora_slots.get(sr.request_id, 0), sr.state_slot)
                 for sr in so.scheduled]
        T = pick(cfg.token_buckets, so.num_scheduled_tokens)
        arrays = self.builder.build(spans, T, cfg.max_num_seqs)
        if self.multimodal:
            arrays = dataclasses.replace(arrays, multimodal=multimodal_inputs(
                so.scheduled, self.input_batch.requests, T, self.config.hidden_size, np.dtype(self.dtype),
                self.vision))
        R = pick(cfg.request_buckets, arrays.num_rows)
        tensors, flags = self.input_batch.sampling_rows(so.scheduled, R)
        td = time.perf_counter()
        mask_s = 0.0
        if self.channel is not None:
            if flags.use_bitmask:  # the followers need the masks before the step
                mask_s = self._fill_bitmask(so, tensors)
            self.channel.send_step(arrays, tensors, R, flags)
        h_last, h_all = self.run_backbone(arrays)  # dispatched: the device runs while the host goes on
        if flags.use_bitmask and self.channel is None:
            mask_s = self._fill_bitmask(so, tensors)
        out = self.sample(h_last, tensors, R, flags, arrays.num_rows)
        prompt_lps = self._prompt_logprobs(so, h_all, T)
        token_ids = np.asarray(out.token_ids)
        lp = None
        if flags.num_logprobs is not None:
            lp = jax.device_get((out.chosen_logprob, out.chosen_rank, out.top_logprobs, out.top_token_ids))
        timing = StepTiming(device_s + time.perf_counter() - td, num_tokens=so.num_scheduled_tokens,
                            padded_tokens=T, num_rows=R, mask_s=mask_s,
                            num_decode_tokens=sum(1 + s.num_draft_tokens for s in so.scheduled if not s.is_prefill))
        result = self._collect(so, token_ids, lp, timing)
        if cfg.mtp_tokens:
            self.mtp_drafts = self._run_mtp(so, T, h_all, result.sampled_token_ids)
        if prompt_lps:
            result = dataclasses.replace(result, prompt_logprobs=prompt_lps)
        self.guard.check([ShapeKey("backbone", T).name, ShapeKey("logits", R).name, ShapeKey("head", R, flags).name])
        if self._traffic_log is not None:
            self._traffic_log.write(f"{so.num_scheduled_tokens}\n")
        return result

    def _lora_slots(self, so: SchedulerOutput) -> dict[str, int]:
        """The device slot of each scheduled request's adapter, writing missing adapters into
        slots first (request id -> slot; base-model requests are absent)."""
        if self.lora is None:
            return {}
        states = self.input_batch.requests
        ids = {sr.request_id: states[sr.request_id].lora_id for sr in so.scheduled
               if sr.request_id in states and states[sr.request_id].lora_id}
        if not ids:
            return {}
        slots = self.lora.assign(ids.values(), self.lora_registry.adapter)
        return {rid: slots[i] for rid, i in ids.items()}

    def drop_lora(self, load_id: int) -> None:
        """An adapter was unloaded: its slot is free."""
        if self.lora is not None:
            self.lora.drop(load_id)

    def _prompt_logprobs(self, so: SchedulerOutput, h_all: jax.Array, T: int) -> dict:
        """Prompt logprobs of this step's prefill positions, for the requests that asked."""
        states = self.input_batch.requests
        plan = prompt_logprobs.plan_rows(so.scheduled, states)
        if plan is None:
            return {}
        key = ShapeKey("prompt_logprobs", T, num_top=self.steps.max_logprobs)
        exe = self.executables.get(key)
        if exe is None:
            exe = functools.partial(prompt_logprobs_jit, self.graphdef, self.mesh, num_top=key.num_top)
        self.guard.check([key.name])

        def run_slice(rows, targets):
            rows, targets = self._put((rows, targets))
            out = exe(self.state, h_all, rows, targets)
            return out["chosen_logprob"], out["chosen_rank"], out["top_logprobs"], out["top_token_ids"]

        top_n = {rid: states[rid].params.prompt_logprobs for rid, _, _ in plan.owners}
        return prompt_logprobs.score(plan, prompt_logprob_rows(T), run_slice, top_n)

    def _fill_bitmask(self, so: SchedulerOutput, tensors: SamplingTensors) -> float:
        t0 = time.perf_counter()
        self.input_batch.fill_bitmask(so.scheduled, tensors)
        return time.perf_counter() - t0

    def _collect(self, so: SchedulerOutput, token_ids: np.ndarray, lp, timing: StepTiming) -> ModelRunnerOutput:
        """Sampled ids (and logprobs where asked) of the spans that sample; each id is also
        appended to the request's own history (penalties, output count) and advances its
        grammar. A span with drafts keeps the longest run of drafts equal to what the target
        sampled at their positions, then the target's token after them: with the drafts
        proposed deterministically this is exactly rejection sampling (a draft d is kept with
        probability p(d); else the token comes from p without d), so greedy and seeded
        sampling give the tokens the plain engine gives."""
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        grammar_errors: dict[str, str] = {}
        spec = SpecDecodeCounts.zero(max((s.num_draft_tokens for s in so.scheduled), default=0))
        states = self.input_batch.requests
        row = 0
        for sr in so.scheduled:
            first, k = row, sr.num_draft_tokens
            row += 1 + k
            if not sr.samples:
                continue
            targets = token_ids[first : first + 1 + k].tolist()
            n = 1
            if k:
                n += num_drafts_kept(sr.draft_token_ids, targets)
                spec.add(k, n - 1)
            toks = targets[:n]
            sampled[sr.request_id] = toks
            st = states.get(sr.request_id)
            if st is None:
                continue
            if st.matcher is not None:
                for i, tok in enumerate(toks):
                    if not st.matcher.accept_token(tok):
                        toks = sampled[sr.request_id] = toks[: i + 1]
                        grammar_errors[sr.request_id] = (
                            f"structured output: the grammar allowed no token the sampler could choose after "
                            f"{len(st.output_token_ids) + i} output tokens ({st.matcher.error or 'token rejected'})")
                        break
            st.output_token_ids.extend(toks)
            top_n = st.params.logprobs
            if top_n is not None and lp is not None:
                logprobs[sr.request_id] = [
                    TokenLogprob(tok, float(lp[0][i]), int(lp[1][i]),
                                 tuple((int(lp[3][i, j]), float(lp[2][i, j])) for j in range(top_n)))
                    for i, tok in zip(range(first, first + n), toks)]
        return ModelRunnerOutput(sampled, logprobs, timing, grammar_errors, spec if spec.num_drafts else None)

    def run_step(self, arrays: StepArrays, tensors: SamplingTensors, num_rows: int,
                 flags: SamplerFlags) -> SamplerOutput:
        """The device part of a step (what every multi-host process runs)."""
        return self.sample(self.run_backbone(arrays)[0], tensors, num_rows, flags, arrays.num_rows)

    def kv_cache_lost(self) -> bool:
        """True when a failed call had already consumed the donated cache buffers."""
        return any(x.is_deleted() for x in self.kv_cache)

    def rebuild_kv_cache(self) -> None:
        """A fresh, zeroed cache with the same shapes and shardings (its contents are gone:
        the scheduler must recompute every request that held device blocks)."""
        self.kv_cache = self._new_kv_cache()

    @property
    def host_k(self) -> np.ndarray | None:
        return self.host_pool[0] if self.host_pool is not None else None

    def _new_kv_cache(self) -> tuple[jax.Array, ...]:
        """Zeroed cache buffers; the jitted initialiser is kept, so a rebuild after a failed
        step reuses its executable instead of compiling while serving."""
        if not hasattr(self, "_init_kv_cache"):
            tp = self.mesh.shape[parallel.MODEL_AXIS] if self.mesh is not None else 1
            shardings = None
            if self.mesh is not None:
                shardings = parallel.kv_cache_shardings(self.mesh, self.kv_layout, family_of(self.config).kv_cache,
                                                        quantized=self.kv_dtype.itemsize == 1)
            extra = {"state_slots": self.num_state_slots} if self.recurrent else {}
            self._init_kv_cache = jax.jit(
                functools.partial(family_of(self.config).kv_cache.init, self.config, self.num_pages, self.page_size, self.kv_dtype,
                                  self.kv_layout, tp, **extra),
                out_shardings=shardings,
            )
        return self._init_kv_cache()

    # ------------------------------------------------------------------ host API
    def device_inputs(self, arrays: StepArrays) -> tuple[Any, ...]:
        """One host-to-device transfer of the step's arrays (replicated over the mesh)."""
        host = (arrays.token_ids, arrays.positions, arrays.slot_mapping, arrays.cu_q_lens,
                arrays.kv_lens, arrays.block_tables, arrays.num_seqs, arrays.logits_indices)
        tok, pos, slots, cu, kv, tables, nseq, lidx = self._put(host)
        rec = None
        if self.recurrent:
            if arrays.recurrent is None:
                raise ValueError(f"{self.config.architecture}: the step's arrays lack the state slots "
                                 "(BatchBuilder(recurrent=True))")
            rec = RecurrentMetadata(**self._put(arrays.recurrent))
        mm = None
        if self.multimodal:
            mm = self._multimodal_metadata(arrays)
        md = AttentionMetadata(slot_mapping=slots, cu_q_lens=cu, kv_lens=kv, block_tables=tables, num_seqs=nseq,
                               recurrent=rec, multimodal=mm)
        return tok, pos, md, lidx

    def _multimodal_metadata(self, arrays: StepArrays) -> MultimodalMetadata:
        """The step's image rows and 3-D positions on the devices. A step without image tokens
        (every decode step) sends its positions only: its zero rows are kept on the devices
        per token bucket, not sent ([T, E] and [D, T, E] each step)."""
        T = arrays.token_ids.shape[0]
        host = arrays.multimodal
        if host is None:  # text only (tools that run `forward`): 1-D positions on every axis
            host = {"mrope_positions": np.broadcast_to(arrays.positions, (3, T)), "is_embed": np.zeros(T, bool)}
            if self.config.vision.bidirectional_images:
                host["attend_until"] = np.zeros(T, np.int32)
        if host["is_embed"].any():
            return MultimodalMetadata(**self._put(host))
        zeros = self._mm_zeros.get(T)
        if zeros is None:
            E, D = self.config.hidden_size, len(self.config.vision.deepstack_visual_indexes)
            zeros = {"embeds": np.zeros((T, E), np.dtype(self.dtype)), "is_embed": np.zeros(T, bool),
                     "deepstack": np.zeros((D, T, E), np.dtype(self.dtype))}
            if self.config.vision.bidirectional_images:
                zeros["attend_until"] = np.zeros(T, np.int32)
            zeros = self._mm_zeros[T] = self._put(zeros)
        return MultimodalMetadata(mrope_positions=self._put(np.ascontiguousarray(host["mrope_positions"])), **zeros)

    def _put(self, tree):
        """Host data to (replicated) device arrays. Across processes each one places its own
        copy on its local devices and the global array is assembled without a jit, so a step
        never compiles a transfer."""
        sharding = self.input_sharding
        if sharding is None or sharding.is_fully_addressable:
            return jax.device_put(tree, sharding)

        def one(x):
            x = np.asarray(x)
            local = [jax.device_put(x, d) for d in sharding.addressable_devices]
            return jax.make_array_from_single_device_arrays(x.shape, sharding, local)

        return jax.tree.map(one, tree)

    def run_backbone(self, arrays: StepArrays) -> tuple[jax.Array, jax.Array]:
        """Runs the layers over the step; returns the sampled rows' hidden states [max_reqs, E]
        and every token's, before the final norm [T, E] (read only for prompt logprobs)."""
        tok, pos, md, lidx = self.device_inputs(arrays)
        self._step_inputs = (pos, md)  # (the MTP pass reuses them)
        lora = None
        if self.lora is not None:
            slots = arrays.lora_slots if arrays.lora_slots is not None else np.zeros(tok.shape[0], np.int32)
            lora = LoRABatch(self.lora.weights, self._put(slots))
        exe = self.executables.get(ShapeKey("backbone", tok.shape[0]))
        if exe is not None:
            h_last, h_all, self.kv_cache = exe(self.state, self.kv_cache, tok, pos, md, lidx, lora)
        else:
            h_last, h_all, self.kv_cache = backbone_jit(self.graphdef, self.attention_backend, self.mesh,
                                                         self.state, self.kv_cache, tok, pos, md, lidx, lora)
        return h_last, h_all

    # ------------------------------------------------------------------ MTP drafts
    def _run_mtp(self, so: SchedulerOutput, T: int, h_all: jax.Array,
                 sampled: dict[str, list[int]]) -> dict[str, tuple[int, list[int]]]:
        """The MTP layer's passes after a sampled step (`spec_decode.mtp`): the first over the
        step's tokens, then one chained pass per further draft. Returns the drafts."""
        cfg = self.steps
        first = mtp.first_pass(so, T, cfg.max_num_seqs, sampled, self._known_token)
        pos, md = self._step_inputs
        tok, rows, src = self._put((first.token_ids, first.rows, np.arange(T, dtype=np.int32)))
        h_rows = self._mtp_pass("mtp", T, h_all, src, tok, pos, md, rows)
        if not first.sequences:
            return {}
        out = self._mtp_draft(h_rows, len(so.scheduled))
        drafts = {s.request_id: [int(out[s.row])] for s in first.sequences}
        live, src_rows = list(first.sequences), [s.row for s in first.sequences]
        for j in range(1, cfg.mtp_tokens):
            keep = [i for i, s in enumerate(live) if mtp.can_chain(s, s.next_position + j - 1, self.page_size)]
            if not keep:
                break
            live, src_rows = [live[i] for i in keep], [src_rows[i] for i in keep]
            spans = [SequenceSpan(np.array(drafts[s.request_id][-1:], np.int32), s.next_position + j - 1,
                                  s.block_table) for s in live]
            T2 = pick(cfg.token_buckets, len(spans))
            arrays = self._mtp_builder.build(spans, T2, cfg.max_num_seqs)
            src = np.zeros(T2, np.int32)
            src[: len(live)] = src_rows
            tok, pos, md, lidx = self.device_inputs(arrays)
            h_rows = self._mtp_pass("mtp_chain", T2, h_rows, self._put(src), tok, pos, md, lidx)
            out = self._mtp_draft(h_rows, len(live))
            for r, s in enumerate(live):
                drafts[s.request_id].append(int(out[r]))
            src_rows = list(range(len(live)))
        return {s.request_id: (s.next_position + 1, drafts[s.request_id]) for s in first.sequences}

    def _mtp_pass(self, kind: str, T: int, h_src, src, tok, pos, md, rows) -> jax.Array:
        """One MTP pass (compiled shape `kind`[T]); updates the cache, returns its rows' outputs."""
        key = ShapeKey(kind, T)
        self.guard.check([key.name])
        exe = self.executables.get(key)
        if exe is not None:
            h_rows, self.kv_cache = exe(self.state, self.kv_cache, h_src, src, tok, pos, md, rows)
        else:
            h_rows, self.kv_cache = mtp_jit(self.graphdef, self.attention_backend, self.mesh, self.state,
                                            self.kv_cache, h_src, src, tok, pos, md, rows,
                                            normalize_prev=kind == "mtp")
        return h_rows

    def _mtp_draft(self, h_rows: jax.Array, num_live: int) -> np.ndarray:
        """Greedy drafts of h_rows' first `num_live` rows (a request bucket's worth computed)."""
        R = pick(self.steps.request_buckets, num_live)
        key = ShapeKey("mtp_draft", R)
        self.guard.check([key.name])
        live = self._put(np.int32(num_live))
        exe = self.executables.get(key)
        if exe is not None:
            return np.asarray(exe(self.state, h_rows, live))
        return np.asarray(mtp_draft_jit(self.graphdef, self.mesh, self.state, h_rows, live, num_rows=R))

    def _known_token(self, request_id: str, position: int) -> int | None:
        """The request's token at `position` (prompt, then output), None past what is known."""
        st = self.input_batch.requests.get(request_id)
        if st is None:
            return None
        n = len(st.prompt_token_ids)
        if position < n:
            return st.prompt_token_ids[position]
        out = st.output_token_ids
        return out[position - n] if position - n < len(out) else None

    def sample(self, h_last: jax.Array, tensors: SamplingTensors, num_rows: int,
               flags: SamplerFlags, live_rows: int | None = None) -> SamplerOutput:
        """Logits of the first `num_rows` rows (`live_rows` of them real, the rest padding;
        default all), then the sampler: two executables, because XLA:CPU fusing the sampler's
        reductions into the logits matmul makes the pair ~40% slower than running them apart."""
        live = self._put(np.int32(num_rows if live_rows is None else live_rows))
        if self.input_sharding is not None:
            tensors = self._put(tensors)
        logits_exe = self.executables.get(ShapeKey("logits", num_rows))
        if logits_exe is not None:
            logits = logits_exe(self.state, h_last, live)
        else:
            logits = logits_jit(self.graphdef, self.mesh, self.state, h_last, live, num_rows=num_rows)
        exe = self.executables.get(ShapeKey("head", num_rows, flags))
        if exe is not None:
            return exe(logits, tensors)
        return sample_jit(logits, tensors, flags=flags, one_row_at_a_time=self.row_tile > 0)

    def forward(self, arrays: StepArrays) -> jax.Array:
        """Logits [max_reqs, V] (f32) of each sequence's last token; for tests and tools."""
        h_last = self.run_backbone(arrays)[0]
        return logits_jit(self.graphdef, self.mesh, self.state, h_last, self._put(np.int32(h_last.shape[0])),
                          num_rows=h_last.shape[0])

    def forward_numpy(self, arrays: StepArrays) -> np.ndarray:
        return np.asarray(self.forward(arrays))[: arrays.num_reqs]

    # ------------------------------------------------------------------ swap preemption
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device pages to host pages: [(device_page, host_page), ...]."""
        for dev, host in _chunks([(d, h) for d, h in pairs]):
            pages = self._swap_exe(len(dev), 0, gather_pages_jit)(self._pages(), _page_ids(dev))
            n = len(host)
            for pool, x in zip(self.host_pool, pages):
                pool[:, host] = np.asarray(x)[:, :n]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host pages back to device pages: [(host_page, device_page), ...]."""
        for dev, host in _chunks([(d, h) for h, d in pairs]):
            n = len(host)
            pages = []
            for pool in self.host_pool:
                x = np.zeros((pool.shape[0], len(dev), *pool.shape[2:]), pool.dtype)
                x[:, :n] = pool[:, host]
                pages.append(x)
            new = self._swap_exe(len(dev), 1, scatter_pages_jit)(self._pages(), _page_ids(dev), tuple(pages))
            self.kv_cache = (*new, *self._states())

    def _pages(self) -> tuple[jax.Array, ...]:
        """The cache's page arrays (and their scales)."""
        return self.kv_cache[:len(self.kv_cache) - self.num_state_arrays]

    def _states(self) -> tuple[jax.Array, ...]:
        """A hybrid model's state pools ([layers, slots, ...] each; none for other models)."""
        return self.kv_cache[len(self.kv_cache) - self.num_state_arrays:]

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """State slot copies on the device: [(source slot, destination slot), ...], in order."""
        for src, dst in pairs:  # one at a time: a later pair may read what an earlier one wrote
            ids = _state_ids([src])
            values = self._state_exe(0, gather_states_jit)(self._states(), ids)
            self._set_states(_state_ids([dst]), values)

    def swap_out_states(self, pairs: list[tuple[int, int]]) -> None:
        """State slots to host state slots: [(state slot, host slot), ...]."""
        for chunk in _state_chunks(pairs):
            values = self._state_exe(0, gather_states_jit)(self._states(), _state_ids([s for s, _ in chunk]))
            for store, x in zip(self.host_states, values):
                store[:, [h for _, h in chunk]] = np.asarray(x)[:, :len(chunk)]

    def swap_in_states(self, pairs: list[tuple[int, int]]) -> None:
        """Host state slots back to state slots: [(host slot, state slot), ...]."""
        for chunk in _state_chunks(pairs):
            values = []
            for store in self.host_states:
                x = np.zeros((store.shape[0], STATE_COPY_SIZE, *store.shape[2:]), store.dtype)
                x[:, :len(chunk)] = store[:, [h for h, _ in chunk]]
                values.append(x)
            self._set_states(_state_ids([d for _, d in chunk]), tuple(values))

    def _set_states(self, ids: jax.Array, values) -> None:
        new = self._state_exe(1, scatter_states_jit)(self._states(), ids, tuple(values))
        self.kv_cache = (*self._pages(), *new)

    def _state_exe(self, which: int, fallback):
        pair = self.executables.get(ShapeKey("states", STATE_COPY_SIZE))
        return pair[which] if pair is not None else fallback

    def _swap_exe(self, size: int, which: int, fallback):
        pair = self.executables.get(ShapeKey("swap", size))
        return pair[which] if pair is not None else fallback

    # ------------------------------------------------------------------ ahead-of-time compilation
    def programs(self) -> StepPrograms:
        """This runner's step programs over abstract copies of its params and cache."""
        return StepPrograms(
            graphdef=self.graphdef, state=abstract(self.state), kv_cache=abstract(self.kv_cache), mesh=self.mesh,
            input_sharding=self.input_sharding, index_sharding=None, hidden_size=self.config.hidden_size,
            vocab_size=self.config.vocab_size, attention_backend=self.attention_backend,
            max_pages_per_seq=self.max_pages_per_seq,
            lora=abstract(self.lora.weights) if self.lora is not None else None, batch_invariant=self.row_tile > 0,
            num_state_arrays=self.num_state_arrays, multimodal=self.multimodal,
            vision=abstract(self.vision.params) if self.vision is not None else None, vision_config=self.config.vision,
            num_kv_groups=self.num_kv_groups)

    def lower_shape(self, key: ShapeKey, max_reqs: int, tensors: SamplingTensors | None = None):
        """Lowers one planned shape on abstract values (no device buffers) and compiles it."""
        return self.programs().lower(key, max_reqs, tensors)

    def install(self, key: ShapeKey, executable: Any) -> None:
        if key.kind == "vision":
            self.vision.executables[key.size] = executable
        self.executables[key] = executable


def host_to_device(x: Any) -> jax.Array:
    """A host array on the default device. On a CPU backend a read-only host array (the
    loader's: `loading.params.freeze_params`) that is 64-byte aligned becomes the device
    array's memory instead of being copied, so the weights are held once."""
    if isinstance(x, np.ndarray) and not x.flags.writeable and jax.default_backend() == "cpu":
        return jax.device_put(x, may_alias=True)
    return jnp.asarray(x)


def _page_ids(dev: np.ndarray) -> jax.Array:
    """A swap call's page ids on the device. `jnp.asarray` of a host array compiles a staging
    program per new shape (jax 0.10), which the first swap of each size then did while serving."""
    return jax.device_put(dev)


def _state_ids(slots: list[int]) -> jax.Array:
    """State slots padded with the null slot 0 to one copy's fixed size."""
    ids = np.zeros(STATE_COPY_SIZE, np.int32)
    ids[:len(slots)] = slots
    return jax.device_put(ids)


def _state_chunks(pairs: list[tuple[int, int]]):
    for i in range(0, len(pairs), STATE_COPY_SIZE):
        yield pairs[i:i + STATE_COPY_SIZE]


def _chunks(pairs: list[tuple[int, int]]):
    """Splits (device_page, host_page) pairs into chunks, the device ids padded to a swap
    bucket with the null page 0, so only `len(SWAP_SIZES)` shapes are ever compiled."""
    step = SWAP_SIZES[-1]
    for i in range(0, len(pairs), step):
        chunk = pairs[i : i + step]
        size = next(b for b in SWAP_SIZES if b >= len(chunk))
        dev = np.zeros(size, np.int32)
        dev[: len(chunk)] = [d for d, _ in chunk]
        yield dev, [h for _, h in chunk]
