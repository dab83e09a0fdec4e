"""The engine loop shared by the gRPC server and the batch API.

`add_request` validates and queues; `step()` runs one scheduler step on the device and returns
`RequestOutput` deltas. The engine is single-threaded: callers serialise access (the server
runs it on one dedicated thread).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence

import jax
import numpy as np

from jaxserve import distributed
from jaxserve.batch import BatchBuilder, SequenceSpan
from jaxserve.buckets import pick
from jaxserve.compile_cache import CompileGuard, enable_persistent_cache
from jaxserve.compile_plan import CompilePlan, ShapeKey, sampler_variant
from jaxserve.config import EngineConfig
from jaxserve.detokenizer import IncrementalDetokenizer
from jaxserve.loading import LoadedModel, load_model
from jaxserve.models.llama import kv_cache_bytes_per_page
from jaxserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob, Usage
from jaxserve.parallel import build_mesh, tp_model_config
from jaxserve.runner import ModelRunner
from jaxserve.sampler import SAMPLING_EPS, SamplerFlags, SamplingTensors
from jaxserve.warmup import WarmupReport, compile_ahead
from scheduler import FinishReason, Request, SamplingParams, Scheduler

logger = logging.getLogger(__name__)

MAX_STOP_TOKEN_IDS = 15  # per request, besides EOS: the sampler's stop-id table is [R, 16]


@dataclasses.dataclass
class StepTiming:
    """Wall time of the last step, split into host work and device work (seconds)."""

    host_s: float = 0.0
    device_s: float = 0.0
    num_tokens: int = 0  # real tokens computed
    padded_tokens: int = 0  # token bucket size


@dataclasses.dataclass
class _Sequence:
    """Engine-side state of one scheduled sequence (a child when n > 1)."""

    request: Request
    parent: _Parent
    index: int
    seed: int
    detok: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    stop_ids_row: np.ndarray  # [16] int32, -1 padded


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    outputs: list[CompletionOutput]
    num_unfinished: int
    num_cached_tokens: int = 0


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        self.distributed = None
        if config.num_processes > 1:  # before anything touches a JAX backend
            self.distributed = distributed.DistributedConfig(
                config.coordinator, config.num_processes, config.process_id, config.heartbeat_timeout_s)
            distributed.initialize(self.distributed)
            if config.tensor_parallel_size != jax.device_count():
                raise ValueError(
                    f"multi-host serving shards the model over all {jax.device_count()} devices: set "
                    f"tensor_parallel_size={jax.device_count()} (got {config.tensor_parallel_size})")
        self.healthy = True
        self.unhealthy_reason: str | None = None
        self.dtype = config.resolved_dtype()
        self.cache_dir = config.resolved_cache_dir()
        if self.cache_dir is not None:  # before anything compiles
            self.cache_dir = enable_persistent_cache(self.cache_dir)
        self.model = loaded if loaded is not None else load_model(config.model, self.dtype)
        self.model_config = mc = self.model.config
        if self.model.tokenizer is None:
            logger.warning("model has no tokenizer: only token-id prompts are accepted")
        self.tokenizer = self.model.tokenizer
        self.max_model_len = config.max_model_len or min(mc.max_position_embeddings, 4096)
        tp_config = tp_model_config(mc, config.tensor_parallel_size)  # validates the split early
        if config.num_pages is not None:
            self.num_pages = config.num_pages
        else:
            per_page = kv_cache_bytes_per_page(tp_config, config.page_size, np.float32 if self.dtype == "float32" else np.float16)
            self.num_pages = max(2, int(config.kv_cache_memory_gb * 2**30) // per_page)
        if config.num_host_pages is not None:
            self.num_host_pages = config.num_host_pages
        else:
            self.num_host_pages = self.num_pages if config.preemption_mode == "swap" else 0
        self.scheduler_config = config.scheduler_config(self.num_pages, self.max_model_len, self.num_host_pages)
        self.scheduler = Scheduler(self.scheduler_config)
        self.mesh = build_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        self.runner = ModelRunner(
            self.model, num_pages=self.num_pages, page_size=config.page_size,
            num_host_pages=self.num_host_pages, attention_backend=config.attention_backend,
            max_pages_per_seq=self.scheduler_config.max_blocks_per_seq, mesh=self.mesh,
        )
        self.plan = CompilePlan.from_config(config, swap_enabled=self.num_host_pages > 0)
        self.token_buckets = list(self.plan.token_buckets)
        self.request_buckets = list(self.plan.request_buckets)
        self.guard = CompileGuard(strict=config.strict_compile_guard)
        self.warmup_report: WarmupReport | None = None
        self._traffic_log = open(config.record_traffic_log, "a") if config.record_traffic_log else None
        self.builder = BatchBuilder(
            config.max_num_batched_tokens, config.max_num_seqs,
            self.scheduler_config.max_blocks_per_seq, config.page_size,
        )
        self._tensors = {
            r: SamplingTensors.neutral(r, MAX_STOP_TOKEN_IDS + 1, self.max_model_len)
            for r in self.request_buckets
        }
        self._neutral = SamplingTensors.neutral(1, MAX_STOP_TOKEN_IDS + 1, self.max_model_len)
        self._rng = np.random.default_rng(config.seed)
        self._seqs: dict[str, _Sequence] = {}
        self._parents: dict[str, _Parent] = {}
        self.last_step = StepTiming()
        self.channel = None
        self._monitor = None
        if self.distributed is not None:
            self.channel = distributed.StepChannel(
                config.max_num_batched_tokens, config.max_num_seqs, self.scheduler_config.max_blocks_per_seq,
                MAX_STOP_TOKEN_IDS + 1, self.max_model_len, self.plan.sampler_variants)
            if self.is_leader:
                self.runner = distributed.LeaderRunner(self.runner, self.channel)
            self._monitor = distributed.PeerMonitor(self.distributed, self._mark_unhealthy).start()
        self.eos_token_id = mc.eos_token_id if mc.eos_token_id is not None else getattr(
            self.tokenizer, "eos_token_id", None)

    # ------------------------------------------------------------------ requests
    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError naming the field when a request cannot be served."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not (isinstance(t, int | np.integer) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt_token_ids: ids must be integers in [0, {vocab}), got {bad[:5]}")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt is {n} tokens, which leaves no room for output within max_model_len "
                f"{self.max_model_len}"
            )
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs must be <= {self.config.max_logprobs} (max_logprobs), got {params.logprobs}")
        if params.n > self.config.max_n:
            raise ValueError(f"n must be <= {self.config.max_n}, got {params.n}")
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad_stop:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {bad_stop[:5]}")

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids")
        return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validates and queues a request; returns its id. Raises ValueError on bad input."""
        params = params or SamplingParams()
        if prompt_token_ids is None:
            if prompt is None or prompt == "":
                raise ValueError("prompt must not be empty")
            prompt_token_ids = self.tokenize(prompt)
        self.validate(prompt_token_ids, params)
        ids = [int(t) for t in prompt_token_ids]
        rid = request_id if request_id is not None else uuid.uuid4().hex
        child_ids = [rid] if params.n == 1 else [f"{rid}#{i}" for i in range(params.n)]
        if rid in self._parents or any(self.scheduler.get_request(c) is not None for c in child_ids):
            raise ValueError(f"duplicate request_id {rid!r}: a request with this id is still in flight")
        now = time.monotonic() if arrival_time is None else arrival_time
        parent = _Parent(rid, prompt, ids, params, RequestMetrics(now),
                         [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                          for i in range(params.n)], params.n)
        children = []
        for i, cid in enumerate(child_ids):
            seed = (params.seed + i) if params.seed is not None else int(self._rng.integers(0, 2**32))
            req = Request(cid, ids, params, eos_token_id=self.eos_token_id, arrival_time=now)
            detok = IncrementalDetokenizer(
                self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
            ) if self.tokenizer is not None else None
            stop_row = np.full(MAX_STOP_TOKEN_IDS + 1, -1, np.int32)
            stops = ([] if params.ignore_eos or self.eos_token_id is None else [self.eos_token_id])
            stops += list(params.stop_token_ids)
            stop_row[: len(stops)] = stops
            children.append(_Sequence(req, parent, i, seed & 0xFFFFFFFF, detok,
                                      [] if params.logprobs is not None else None, stop_row))
        self._parents[rid] = parent
        for seq in children:
            self._seqs[seq.request.request_id] = seq
            self.scheduler.add_request(seq.request)
        return rid

    def abort(self, request_id: str) -> bool:
        """Aborts a request (all its n sequences) and frees its KV blocks; False if unknown."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        ids = [request_id] if parent.params.n == 1 else [f"{request_id}#{i}" for i in range(parent.params.n)]
        self.scheduler.abort_requests(ids)
        for cid in ids:
            self._seqs.pop(cid, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        device_s = 0.0
        sampled: dict[str, list[int]] = {}
        logprob_rows: dict[str, TokenLogprob] = {}
        now = time.monotonic()
        if so.swap_out or so.swap_in:
            td = time.perf_counter()
            if so.swap_out:
                self.runner.swap_out(so.swap_out)
            if so.swap_in:
                self.runner.swap_in(so.swap_in)
            device_s += time.perf_counter() - td
        if so.scheduled:
            spans = []
            for sr in so.scheduled:
                spans.append(SequenceSpan(np.asarray(sr.token_ids, np.int32), sr.start, sr.block_table))
                seq = self._seqs.get(sr.request_id)
                if seq is not None and seq.parent.metrics.first_scheduled_time is None:
                    seq.parent.metrics.first_scheduled_time = now
            T = pick(self.token_buckets, so.num_scheduled_tokens)
            arrays = self.builder.build(spans, T, self.config.max_num_seqs)
            R = pick(self.request_buckets, len(spans))
            tensors, flags = self._fill_sampling(so.scheduled, R)
            td = time.perf_counter()
            try:
                h_last = self.runner.run_backbone(arrays)
                out = self.runner.sample(h_last, tensors, R, flags)
                token_ids = np.asarray(out.token_ids)
            except Exception as e:
                if self.distributed is not None:  # a collective failed: a peer is gone
                    self._mark_unhealthy(f"multi-host step failed: {e}")
                raise
            if flags.num_logprobs:
                lp = jax.device_get((out.chosen_logprob, out.chosen_rank, out.top_logprobs, out.top_token_ids))
            device_s += time.perf_counter() - td
            for i, sr in enumerate(so.scheduled):
                if not sr.samples:
                    continue
                sampled[sr.request_id] = [int(token_ids[i])]
                seq = self._seqs.get(sr.request_id)
                if flags.num_logprobs and seq is not None and seq.logprobs is not None:
                    k = seq.request.sampling_params.logprobs
                    top = tuple((int(lp[3][i, j]), float(lp[2][i, j])) for j in range(k))
                    logprob_rows[sr.request_id] = TokenLogprob(int(token_ids[i]), float(lp[0][i]), int(lp[1][i]), top)
            self.last_step = StepTiming(0.0, device_s, so.num_scheduled_tokens, T)
            self.guard.check([ShapeKey("backbone", T).name, ShapeKey("logits", R).name,
                              ShapeKey("head", R, flags).name])
            if self._traffic_log is not None:
                self._traffic_log.write(f"{so.num_scheduled_tokens}\n")
        else:
            self.last_step = StepTiming(0.0, device_s, 0, 0)
        updates = self.scheduler.update_from_output(so, sampled)
        outputs = self._process_updates(updates, logprob_rows)
        self.last_step.host_s = time.perf_counter() - t0 - device_s
        return outputs

    def _fill_sampling(self, scheduled, R: int) -> tuple[SamplingTensors, SamplerFlags]:
        t = self._tensors[R]
        n = len(scheduled)
        any_logprobs = False
        any_penalties = False
        any_sampling = False
        any_top = False
        for i, sr in enumerate(scheduled):
            seq = self._seqs.get(sr.request_id)
            if seq is None or not sr.samples:
                self._set_neutral_row(t, i)
                continue
            req = seq.request
            p = req.sampling_params
            t.temperature[i] = p.temperature
            t.top_k[i] = p.top_k if p.top_k > 0 else 0
            t.top_p[i] = p.top_p
            t.min_p[i] = p.min_p
            t.repetition_penalty[i] = p.repetition_penalty
            t.presence_penalty[i] = p.presence_penalty
            t.frequency_penalty[i] = p.frequency_penalty
            t.seeds[i] = seq.seed
            num_out = req.num_output_tokens
            t.output_pos[i] = num_out
            t.min_tokens_mask[i] = num_out < p.min_tokens
            t.stop_token_ids[i] = seq.stop_ids_row
            pen = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            if pen:
                hist = req.all_token_ids[-self.max_model_len:]
                t.penalty_token_ids[i, : len(hist)] = hist
                t.penalty_token_ids[i, len(hist):] = -1
                t.penalty_prompt_len[i] = max(0, req.num_prompt_tokens - (req.num_tokens - len(hist)))
            any_penalties |= pen
            any_sampling |= p.temperature >= SAMPLING_EPS
            any_top |= p.top_k > 0 or p.top_p < 1.0
            any_logprobs |= p.logprobs is not None
        for i in range(n, R):
            self._set_neutral_row(t, i)
        flags = sampler_variant(any_sampling, any_top, any_penalties, any_logprobs, self.config.max_logprobs)
        return t, flags

    def _set_neutral_row(self, t: SamplingTensors, i: int) -> None:
        for f in dataclasses.fields(SamplingTensors):
            getattr(t, f.name)[i] = getattr(self._neutral, f.name)[0]

    # ------------------------------------------------------------------ outputs
    def _process_updates(self, updates, logprob_rows) -> list[RequestOutput]:
        touched: dict[str, _Parent] = {}
        now = time.monotonic()
        for parent in self._parents.values():
            for c in parent.outputs:
                c.delta_text, c.delta_token_ids = "", []
                c.delta_logprobs = [] if c.logprobs is not None else None
        for up in updates:
            seq = self._seqs.get(up.request_id)
            if seq is None:
                continue
            parent = seq.parent
            comp = parent.outputs[seq.index]
            touched[parent.request_id] = parent
            if up.new_token_ids and parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            parent.num_cached_tokens = max(parent.num_cached_tokens, up.num_cached_tokens)
            comp.token_ids.extend(up.new_token_ids)
            comp.delta_token_ids.extend(up.new_token_ids)
            lp = logprob_rows.get(up.request_id)
            if lp is not None and comp.logprobs is not None:
                comp.logprobs.append(lp)
                comp.delta_logprobs.append(lp)
            finish_reason, stop_reason = up.finish_reason, up.stop_reason
            if seq.detok is not None:
                delta = seq.detok.update(up.new_token_ids) if up.new_token_ids else None
                text = delta.text if delta else ""
                if delta is not None and delta.stop_str is not None and not up.finished:
                    self.scheduler.finish_requests(up.request_id, FinishReason.STOP, delta.stop_str)
                    finish_reason, stop_reason = FinishReason.STOP, delta.stop_str
                elif up.finished and (delta is None or delta.stop_str is None):
                    text += seq.detok.flush().text
                comp.text += text
                comp.delta_text += text
            if finish_reason is not None:
                comp.finish_reason = str(finish_reason)
                comp.stop_reason = stop_reason
                parent.num_unfinished -= 1
                self._seqs.pop(up.request_id, None)
        outs = []
        for parent in touched.values():
            finished = parent.num_unfinished == 0
            if finished:
                parent.metrics.finished_time = now
                self._parents.pop(parent.request_id, None)
            completion = sum(len(c.token_ids) for c in parent.outputs)
            outs.append(RequestOutput(
                request_id=parent.request_id,
                prompt=parent.prompt,
                prompt_token_ids=parent.prompt_token_ids,
                outputs=[dataclasses.replace(c) for c in parent.outputs],
                finished=finished,
                usage=Usage(len(parent.prompt_token_ids), completion, parent.num_cached_tokens),
                metrics=parent.metrics,
            ))
        return outs

    # ------------------------------------------------------------------ warmup
    def warmup(self, *, progress: bool = False) -> WarmupReport:
        """Compiles every shape of the compile plan ahead of time (from the persistent cache
        when it is warm), installs the executables and arms the compile guard."""
        report = compile_ahead(
            self.runner, self.plan, max_reqs=self.config.max_num_seqs, tensors_by_rows=self._tensors,
            workers=self.config.warmup_threads, progress=progress, cache_enabled=self.cache_dir is not None,
        )
        self.warmup_report = report
        if self.channel is not None:  # every process compiles the broadcasts in the same order
            self.channel.prime()
        self.guard.arm()
        logger.info("warmup: %s", report.summary())
        return report

    # ------------------------------------------------------------------ multi-host
    @property
    def is_leader(self) -> bool:
        return self.distributed is None or self.distributed.process_id == 0

    def _mark_unhealthy(self, reason: str) -> None:
        self.healthy = False
        self.unhealthy_reason = reason

    def run_follower(self) -> None:
        """A follower process's whole life after warmup: run the leader's steps until STOP."""
        if self.is_leader:
            raise RuntimeError("run_follower is for processes other than process 0")
        distributed.run_follower(self.runner, self.channel, self._tensors)

    def close(self) -> None:
        """Leader: ends the followers' loops and waits until they have said goodbye, so the
        coordination service it hosts outlives them. Everyone: stops heartbeats."""
        if self._monitor is not None:
            if not self.is_leader:
                self._monitor.say_goodbye()
            elif self.healthy:
                try:
                    self.channel.send_stop()
                    self._monitor.wait_for_goodbyes(timeout_s=10.0)
                except Exception as e:  # a dead follower: nothing to stop
                    logger.warning("could not stop followers: %s", e)
            self._monitor.stop()

    @property
    def compiles_after_warmup(self) -> int:
        return self.guard.compiles_after_warmup


def run_follower_process(config: EngineConfig) -> None:
    """The whole life of a multi-host follower process (`--process-id` > 0): build the engine,
    warm up in step with the leader, run its steps until STOP, then exit the process."""
    logger.info("multi-host follower %d: running the leader's steps", config.process_id)
    engine = Engine(config)
    engine.warmup()
    engine.run_follower()
    engine.close()
    distributed.exit_follower(0)
