"""The engine loop shared by the gRPC server and the batch API.

`add_request` validates and queues; `step()` is schedule -> `ModelRunner.execute` ->
`Scheduler.update_from_output` -> `OutputProcessor.process`, and returns `RequestOutput`
deltas. The engine never touches a scheduler `Request` and never builds device inputs: the
runner owns buckets, batch building and sampling rows; the output processor owns text.
The engine is single-threaded: callers serialise access (the server runs it on one thread).

A failed device step fails only the requests in it (finish reason `error`): the engine
rebuilds the KV cache if the failed call had consumed it (the requests that held device
blocks then recompute) and keeps serving; it reports unhealthy only when it cannot recover.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxserve.compilation.targets import fp8_weights_unsupported
from jaxserve.compilation.warmup import BackgroundCompile, WarmupReport, compile_ahead
from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.input_processor import EngineRequest, ImageSupport, InputLimits, InputProcessor
from jaxserve.engine.output_processor import OutputProcessor, child_ids
from jaxserve.engine.outputs import OutputKind, RequestOutput
from jaxserve.loading import LoadedModel, load_model, load_model_config
from jaxserve.loading.loader import resolve_dtype
from jaxserve.loading.part import LoadPart
from jaxserve.lora.registry import LoRARegistry
from jaxserve.lora.request import LoRARequest
from jaxserve.models.quantization import (
    params_quantization,
    quantize_params,
    storage_dtype,
)
from jaxserve.models.registry import check_support, family_of
from jaxserve.spec_decode import SpeculativeConfig, make_ngram_proposer
from jaxserve.structured import StructuredOutputManager, make_manager
from jaxserve.worker import distributed, parallel
from jaxserve.worker.compile_cache import (
    UnplannedCompilationError,
    during_setup,
    enable_persistent_cache,
)
from jaxserve.worker.compile_plan import CompileTier, ShapeKey
from jaxserve.worker.input_batch import STOP_ID_WIDTH
from jaxserve.worker.kernel_choice import KernelChoice, choose_kernels, prepare_native_kernels
from jaxserve.worker.parallel import build_mesh, tp_model_config
from jaxserve.worker.runner import ModelRunner, StepConfig
from jaxserve.worker.runner_output import SpecDecodeCounts, StepTiming
from jaxserve.worker.sampler import bitmask_width
from scheduler import (
    FinishReason,
    Request,
    SamplingParams,
    Scheduler,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class DuplicateRequestId(ValueError):
    """A request id that is still in flight was given again (the client's field: request_id)."""


class Engine:
    @during_setup  # what building compiles is not another engine's compilation after warmup
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        self.distributed = self._join_processes(config)  # before anything touches a JAX backend
        asked = config
        self.config = config = config.with_platform_defaults()
        self.healthy = True
        self.weights_version = 0  # update_weights calls so far
        self.sleep_level = 0  # 0: awake; 1: KV cache freed; 2: weights on the host too
        self.unhealthy_reason: str | None = None
        self.dtype = config.resolved_dtype()
        self.cache_dir = config.resolved_cache_dir()
        if self.cache_dir is not None:  # before anything compiles
            self.cache_dir = enable_persistent_cache(self.cache_dir)
        self._check_quantization_target(config)
        self.model = self._load(config, loaded, self._load_part(config))
        self.model_config = mc = self.model.config
        if self.model.tokenizer is None:
            logger.warning("model has no tokenizer: only token-id prompts are accepted")
        self.tokenizer = self.model.tokenizer
        if family_of(mc).kv_cache.recurrent and asked.max_num_seqs is None:  # as many as state slots fit
            self.config = config = dataclasses.replace(config, max_num_seqs=min(
                config.max_num_seqs, asked._state_fitting_seqs(mc, None)))
        if mc.vision is not None and config.num_processes > 1:
            raise ValueError(f"{mc.architecture}: images are not served across hosts yet (num_processes "
                             f"{config.num_processes}); run one process per host group")
        check_support(mc, lora=config.enable_lora, quantized_kv=config.kv_cache_dtype != "auto",
                      spec_decode=config.speculative_config is not None,
                      tensor_parallel=config.tensor_parallel_size > 1, expert_parallel=config.enable_expert_parallel)
        # Everything derived from the model, once (tp_model_config validates the TP split).
        self.resolved = config.resolve(mc, tp_model_config(mc, config.tensor_parallel_size,
                                                           config.enable_expert_parallel))
        self.scheduler_config = self.resolved.scheduler
        self.max_model_len = self.resolved.max_model_len
        self.num_pages = self.resolved.num_pages
        self.num_host_pages = self.resolved.num_host_pages
        self.plan = self.resolved.plan
        self.scheduler = Scheduler(self.scheduler_config)
        self.mesh = build_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        self._compiled = self._check_compiled() if config.compiled_dir else None  # before the cache exists
        self.channel = None
        self._monitor = None
        if self.distributed is not None:
            self.channel = distributed.StepChannel(
                config.max_num_batched_tokens, config.max_num_seqs, self.scheduler_config.table_width,
                STOP_ID_WIDTH, self.max_model_len, self.plan.sampler_variants, bitmask_width(mc.vocab_size),
                num_kv_groups=self.scheduler_config.num_kv_groups)
            self._monitor = distributed.PeerMonitor(self.distributed, self._mark_unhealthy).start()
        self.eos_token_id = mc.eos_token_id if mc.eos_token_id is not None else getattr(
            self.tokenizer, "eos_token_id", None)
        # Grammars compile on the manager's threads; None: structured outputs are off.
        self.structured: StructuredOutputManager | None = (
            make_manager(self.tokenizer, mc.vocab_size, self.eos_token_id)
            if config.structured_outputs and self.tokenizer is not None else None)
        # LoRA adapters known on the host (None: enable_lora is off); the runner holds the slots.
        self.lora_registry = (LoRARegistry(mc, config.max_lora_rank, resolve_dtype(self.dtype))
                              if config.enable_lora else None)
        self.lora_stats: dict[str, list[int]] = {}  # adapter name -> [requests, output tokens]
        t0 = time.perf_counter()
        self.runner = self._make_runner()
        # Where start-up went, in seconds: weights, tokenizer, params to device, KV cache,
        # runner (all of the runner's construction); warmup is reported apart.
        self.startup_seconds = {**self.model.seconds, **self.runner.startup_seconds,
                                "runner": time.perf_counter() - t0}
        self.kernels = self._choose_kernels()
        self.attention = self.kernels.attention
        self._check_batch_invariant(config, mc)
        self.outputs = OutputProcessor(self.tokenizer)
        self.warmup_report: WarmupReport | None = None
        self._background: BackgroundCompile | None = None  # serve_while_compiling: the later tiers
        self.last_step = StepTiming()
        self.input_processor = self._make_input_processor()
        spec = config.speculative_config
        self.proposer = self._make_proposer(spec) if spec is not None else None
        self._draft_batch_limit = spec.batch_size_limit(self.platform) if spec is not None else None
        self.spec_decode = SpecDecodeCounts.zero(spec.num_speculative_tokens if spec else 0)  # since start

    @staticmethod
    def _join_processes(config: EngineConfig) -> distributed.DistributedConfig | None:
        """Multi-host: join the process group (one model sharded over every device)."""
        if config.num_processes <= 1:
            return None
        dc = distributed.DistributedConfig(
            config.coordinator, config.num_processes, config.process_id, config.heartbeat_timeout_s)
        distributed.initialize(dc)
        if config.tensor_parallel_size != jax.device_count():
            raise ValueError(
                f"multi-host serving shards the model over all {jax.device_count()} devices: set "
                f"tensor_parallel_size={jax.device_count()} (got {config.tensor_parallel_size})")
        return dc

    def _check_batch_invariant(self, config: EngineConfig, mc: Any) -> None:
        """What batch-invariant mode cannot make invariant yet is refused, naming why."""
        if not config.batch_invariant:
            return
        if mc.is_moe:
            raise ValueError("batch_invariant: not for MoE models yet (routed experts are not tiled by rows)")
        if self.platform == "cpu" and self.attention[0] != "native":
            raise ValueError(f"batch_invariant on CPU needs the native CPU attention kernel (the reference sums "
                             f"a chunk's keys in another order than a decode's); attention here: {self.attention[1]}")

    @staticmethod
    def _check_quantization_target(config: EngineConfig) -> None:
        """fp8 weights only where the devices have fp8 arithmetic (CPU emulates: logged)."""
        if config.quantization != "fp8":
            return
        device = jax.devices()[0]
        cc = getattr(device, "compute_capability", None)
        cc = tuple(int(c) for c in str(cc).split(".")) if cc else None
        platform = "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform
        why = fp8_weights_unsupported(platform, device.device_kind, cc)
        if why is not None:
            raise ValueError(why)
        if platform == "cpu":
            logger.warning("quantization='fp8' on CPU: weights are stored in fp8 and converted in every "
                           "matmul (memory saving, no speed-up; int8 has a native CPU path)")

    def _load_part(self, config: EngineConfig) -> LoadPart | None:
        """Across hosts, the slices of the checkpoint this process's devices hold (None:
        everything)."""
        if self.distributed is None or config.tensor_parallel_size == 1:
            return None
        mesh = build_mesh(config.tensor_parallel_size)
        return parallel.process_load_part(load_model_config(config.model), mesh.size, parallel.process_ranks(mesh),
                                          config.enable_expert_parallel)

    @staticmethod
    def _load(config: EngineConfig, loaded: LoadedModel | None, part: LoadPart | None = None) -> LoadedModel:
        """The model, its weights quantized as `config.quantization` asks (at load, or as the
        checkpoint was published); `part`: what this process reads of it (multi-host)."""
        spec = config.speculative_config
        mtp = spec is not None and spec.method == "mtp"
        if mtp and config.num_processes > 1:
            raise ValueError("speculative_config: method 'mtp' runs in one process (num_processes 1): the other "
                             "processes do not run its passes yet")
        if loaded is not None and mtp and not loaded.config.mtp_layers:
            raise ValueError("speculative_config: method 'mtp' needs the model loaded with its MTP layer "
                             "(load_model(..., mtp=True))")
        if loaded is None:
            loaded = load_model(config.model, config.resolved_dtype(), quantization=config.quantization,
                                quantize_lm_head=config.quantize_lm_head, part=part, mtp=mtp)
        elif config.quantization is not None and params_quantization(loaded.params) is None:
            loaded = dataclasses.replace(loaded, params=quantize_params(
                loaded.params, config.quantization, config.quantize_lm_head))
        if config.mm_processor_kwargs and loaded.config.vision is not None:  # the engine's resize bounds
            vision = dataclasses.replace(loaded.config.vision, **config.mm_processor_kwargs)
            loaded = dataclasses.replace(loaded, config=dataclasses.replace(loaded.config, vision=vision))
        if config.limit_mm_per_prompt == 0 and loaded.config.vision is not None:
            loaded = _text_only(loaded)
        if loaded.config.bounded_window_kv != config.bounded_window_kv:
            loaded = dataclasses.replace(loaded, config=dataclasses.replace(
                loaded.config, bounded_window_kv=config.bounded_window_kv))
        held = params_quantization(loaded.params)
        if config.quantization is not None and held != config.quantization:
            raise ValueError(f"quantization={config.quantization!r} but the model's weights are {held or 'not quantized'}")
        if held is not None:
            logger.info("weights: %s, one scale per output channel%s", held,
                        " (LM head included)" if "lm_head_scale" in loaded.params or "embed_scale" in loaded.params
                        else "")
        return loaded

    def _make_runner(self) -> ModelRunner:
        config = self.config
        steps = StepConfig(
            token_buckets=self.plan.token_buckets, request_buckets=self.plan.request_buckets,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, max_logprobs=config.max_logprobs, seed=config.seed,
            strict_compile_guard=config.strict_compile_guard, record_traffic_log=config.record_traffic_log,
            mtp_tokens=self.plan.mtp_tokens)
        return ModelRunner(
            self.model, num_pages=self.num_pages, page_size=config.page_size,
            num_host_pages=self.num_host_pages, attention_backend=config.attention_backend,
            max_pages_per_seq=self.scheduler_config.table_width, mesh=self.mesh, steps=steps,
            channel=self.channel if self.is_leader else None, kv_layout=self.resolved.kv_layout,
            kv_cache_dtype=self.resolved.kv_cache_dtype,
            structured=self.structured, expert_parallel=config.enable_expert_parallel,
            matmul_precision=self.resolved.quantized_matmul_precision, row_tile=self.resolved.row_tile,
            lora=(config.max_loras, config.max_lora_rank, self.lora_registry) if config.enable_lora else None,
            num_state_slots=self.scheduler_config.num_state_slots,
            encoder_cache_bytes=int(config.mm_encoder_cache_gb * 2**30),
        )

    @property
    def platform(self) -> str:
        """The platform the engine's programs are compiled for ("cpu", "tpu", "gpu")."""
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()
        return next(iter(devices)).platform

    def _choose_kernels(self) -> KernelChoice:
        """Builds the native CPU kernels (programs loaded from `compiled_dir`, never traced
        here, call them by name), then logs what each program runs; a slow fallback is a
        warning."""
        held = params_quantization(self.model.params)
        dense_native = self.runner.native_dense  # bf16 weights on the native CPU matmul
        for name, (ok, why) in prepare_native_kernels(self.platform, held is not None, dense_native).items():
            (logger.info if ok else logger.warning)("native CPU %s kernel: %s", name.replace("_", " "), why)
        config = self.config
        choice = choose_kernels(
            self.platform, self.runner.config, num_devices=config.tensor_parallel_size,
            expert_parallel=config.enable_expert_parallel, attention_backend=config.attention_backend,
            dtype=self.runner.dtype, kv_cache_dtype=self.runner.kv_dtype, device_kind=jax.devices()[0].device_kind,
            weights_dtype=storage_dtype(held) if held is not None else None, lora=config.enable_lora)
        impl, why = choice.attention
        (logger.warning if impl == "reference" and self.platform != "cpu" and config.attention_backend != "reference"
         else logger.info)("attention on %s: %s (%s)", self.platform, impl, why)
        if choice.experts is not None:
            logger.info("experts on %s: %s (%s)", self.platform, *choice.experts)
        if choice.lora is not None:
            logger.info("LoRA on %s: %s (%s)", self.platform, *choice.lora)
        if choice.quantized_matmul is not None:
            slow = choice.quantized_matmul.startswith("reference") and self.platform == "cpu"
            (logger.warning if slow else logger.info)("%s weights on %s: %s", held, self.platform,
                                                      choice.quantized_matmul)
        return choice

    @property
    def token_buckets(self) -> list[int]:
        return list(self.plan.token_buckets)

    @property
    def request_buckets(self) -> list[int]:
        return list(self.plan.request_buckets)

    # ------------------------------------------------------------------ requests
    def _make_input_processor(self) -> InputProcessor:
        why = ("the model has no tokenizer" if self.tokenizer is None
               else "the engine runs with structured_outputs=False")
        limits = InputLimits(vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                             max_logprobs=self.config.max_logprobs, max_n=self.config.max_n,
                             prompt_logprobs=self.config.num_processes == 1)
        vision = self.model_config.vision
        blank = ()
        if vision is not None and vision.kind == "gemma3" and self.tokenizer is not None:
            blank = self.tokenizer("\n\n", add_special_tokens=False)["input_ids"]
        images = None if vision is None else ImageSupport.for_model(
            vision, self.config.limit_mm_per_prompt, self.config.allowed_media_domains, self.config.max_image_pixels,
            blank_line_ids=blank)
        return InputProcessor(limits, self.tokenizer, self.structured, why, seed=self.config.seed, images=images)

    def add_prompt(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request: LoRARequest | str | None = None,
        images: Sequence[Any] = (),
    ) -> str:
        """Processes a prompt (text or ids) with `input_processor` and queues it; returns its
        id. Raises ValueError (an InputError naming the field) on bad input. The batch API's
        and the tests' way in; the servers process on their event loop and call `add_request`.
        `images`: a vision-language model's images (PIL images, bytes or data URLs), one per
        placeholder token in the prompt, in order."""
        if self.sleep_level:
            raise RuntimeError(f"the engine is asleep (level {self.sleep_level}): call wake_up() first")
        params = params or SamplingParams()
        if prompt_token_ids is None:
            prompt_token_ids = self.input_processor.encode(prompt or "")
        prompt_token_ids, mm = self.input_processor.image_prompt(
            prompt_token_ids, [(im, f"multi_modal_data.image[{i}]") for i, im in enumerate(images)])
        request = self.input_processor.process(prompt_token_ids, params, prompt=prompt, multimodal=mm)
        return self.add_request(request, request_id=request_id, arrival_time=arrival_time, output_kind=output_kind,
                                lora_request=lora_request)

    def add_request(
        self,
        request: EngineRequest,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request: LoRARequest | str | None = None,
    ) -> str:
        """Queues a processed request (`InputProcessor.process`); returns its id. Raises
        DuplicateRequestId when the id is still in flight; `lora_request` names the adapter
        (loaded here the first time its id is seen; a bad adapter is a ValueError naming it).

        An `n > 1` request becomes `n` sequences, each with its own seed from `request.seeds`;
        all but the first wait for the first to compute the shared prompt. `output_kind` DELTA
        makes its outputs carry only each step's delta (streaming)."""
        params = request.params
        rid = request_id if request_id is not None else uuid.uuid4().hex
        seq_ids = child_ids(rid, params.n)
        if rid in self.outputs or any(self.scheduler.get_request(c) is not None for c in seq_ids):
            raise DuplicateRequestId(f"request_id {rid!r} is a duplicate: a request with this id is still in flight")
        lora_id = self._lora_load_id(lora_request)
        now = time.monotonic() if arrival_time is None else arrival_time
        grammar = request.grammar
        ids = list(request.prompt_token_ids)
        self.outputs.add_request(rid, request.prompt, ids, params, now, output_kind)
        for i, cid in enumerate(seq_ids):
            seq_params = params if params.seed == request.seeds[i] else dataclasses.replace(params, seed=request.seeds[i])
            req = Request(cid, ids, seq_params, eos_token_id=self.eos_token_id, arrival_time=now,
                          grammar=grammar, lora_id=lora_id, multimodal=request.multimodal)
            self.scheduler.add_request(req, share_prompt_with=seq_ids[0] if i else None)
        if lora_request is not None:
            name = lora_request if isinstance(lora_request, str) else lora_request.lora_name
            self.lora_stats.setdefault(name, [0, 0])[0] += 1
        return rid

    # ------------------------------------------------------------------ LoRA adapters
    def _lora_load_id(self, lora: LoRARequest | str | None) -> int:
        """The load id of a request's adapter: a LoRARequest (loaded if its id is new) or the
        name of an adapter already loaded (the servers' way)."""
        if lora is None:
            return 0
        if not isinstance(lora, LoRARequest | str):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        name = lora if isinstance(lora, str) else lora.lora_name
        if self.lora_registry is None:
            raise ValueError(f"LoRA adapter {name!r}: this engine runs without LoRA (enable_lora=False)")
        if isinstance(lora, str):
            load_id = self.lora_registry.load_id(lora)
            if not load_id:
                raise ValueError(f"LoRA adapter {lora!r} is not loaded")
            return load_id
        return self.lora_registry.resolve(lora)

    def load_lora(self, lora: LoRARequest, adapter: Any = None) -> None:
        """Registers an adapter (read and checked now, unless `adapter` is what
        `lora_registry.read` returned for it; written into a device slot when a request first
        uses it). A name or id already loaded is a ValueError."""
        if self.lora_registry is None:
            raise ValueError(f"LoRA adapter {lora.lora_name!r}: this engine runs without LoRA (enable_lora=False)")
        self.lora_registry.load(lora, adapter)

    def unload_lora(self, name: str) -> None:
        """Forgets an adapter. Refused (ValueError) while a request in flight uses it; an
        unknown name is a KeyError."""
        if self.lora_registry is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded (enable_lora=False)")
        load_id = self.lora_registry.load_id(name)
        if not load_id:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        users = self.scheduler.num_requests_with_lora(load_id)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s) in flight")
        self.lora_registry.unload(name)
        self.runner.drop_lora(load_id)
        self.lora_stats.pop(name, None)

    def _count_lora_tokens(self, so: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        for sr in so.scheduled:
            req = self.scheduler.get_request(sr.request_id)
            name = self.lora_registry.name_of(req.lora_id) if req is not None and req.lora_id else None
            if name is not None:
                self.lora_stats.setdefault(name, [0, 0])[1] += len(sampled.get(sr.request_id, ()))

    def list_loras(self) -> list[LoRARequest]:
        return self.lora_registry.loaded() if self.lora_registry is not None else []

    def encoder_activity(self) -> dict[str, int] | None:
        """A vision-language model's image encoder: images encoded, encoder-cache hits and
        misses (lookups by image hash), and the cache's bytes and entries (None: a text model)."""
        vision = self.runner.vision
        if vision is None:
            return None
        cache = vision.cache
        return {"images_encoded": vision.num_encoded, "cache_hits": cache.hits, "cache_misses": cache.misses,
                "cache_bytes": cache.nbytes, "cache_entries": len(cache)}

    def lora_activity(self) -> dict[str, Any] | None:
        """Adapters of the running and the waiting requests (names), the slots and the
        adapter loads into them, and the per-adapter counts (None: LoRA is off)."""
        if self.lora_registry is None:
            return None
        name = self.lora_registry.name_of
        s = self.scheduler
        return {"running": sorted({name(r.lora_id) or "" for r in s.running if r.lora_id}),
                "waiting": sorted({name(r.lora_id) or "" for r in s.waiting if r.lora_id}),
                "max_loras": self.config.max_loras, "num_loads": self.runner.lora.num_loads,
                "stats": {k: tuple(v) for k, v in self.lora_stats.items()}}

    def abort(self, request_id: str) -> bool:
        """Aborts a request (all its n sequences) and frees its KV blocks; False if unknown."""
        ids = self.outputs.abort(request_id)
        if ids is None:
            return False
        self.scheduler.abort_requests(ids)
        return True

    def abort_all(self) -> int:
        """Aborts every request in flight; returns how many there were."""
        ids = self.outputs.request_ids()
        for rid in ids:
            self.abort(rid)
        return len(ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.outputs)

    def update_weights(self, source: str | os.PathLike | Mapping[str, Any]) -> int:
        """Takes new weights in place, without recompiling: `source` is an HF directory, a
        jaxserve (orbax) checkpoint, a GGUF file, or a mapping of HF tensor names to arrays
        (every tensor, or some: the others keep their values; partial updates need unquantized
        weights). The model's config must be the running one's and every tensor must match the
        running one's shape and dtype (quantized as the engine runs); otherwise ValueError
        naming the tensor, and nothing changes. Requests in flight are aborted (finish reason
        "abort"): none finishes on a mix of weights. The prefix cache is reset (its K/V came
        from the old weights). Returns the new `weights_version`."""
        multi_host = self.channel is not None
        if multi_host and not isinstance(source, (str, os.PathLike)):
            raise ValueError("update_weights: a multi-host engine takes a path (each process reads its own copy)")
        if not multi_host:
            loaded, mask = self._checked_update(source)
        self.abort_all()
        while self.has_unfinished_requests() and not self.sleep_level:  # the aborts reach the runner
            self.step()
        if multi_host:
            self.channel.send_update_weights(os.fspath(source))
            return self._update_everywhere(os.fspath(source))
        return self._apply_update(loaded, mask)

    def _checked_update(self, source: str | os.PathLike | Mapping[str, Any]) -> tuple[LoadedModel, dict | None]:
        loaded, mask = self._load_update(source)
        if loaded.config != self.model_config:
            raise ValueError(f"update_weights: the new weights' model config differs from the running one's "
                             f"({_config_difference(loaded.config, self.model_config)})")
        return loaded, mask

    def _update_everywhere(self, path: str) -> int:
        """Multi-host (every process runs it, the leader first broadcasting `path`): each
        process loads and checks its copy, then all apply it, or, when any process failed,
        none does (ValueError; the failing process logs why)."""
        loaded, error = None, None
        try:
            loaded = self._checked_update(path)
        except (ValueError, OSError) as e:
            error = e
        if not self.channel.all_agree(error is None):
            if error is not None:
                raise ValueError(str(error)) from None
            raise ValueError(f"update_weights: another process could not load {path} (see its log); "
                             "no process changed its weights")
        return self._apply_update(*loaded)

    def _apply_update(self, loaded: LoadedModel, mask: dict | None) -> int:
        self.runner.replace_params(loaded.params, loaded.config, mask)
        self.reset_prefix_cache()
        self.weights_version += 1
        logger.info("weights updated (version %d)", self.weights_version)
        return self.weights_version

    def sleep(self, level: int = 1) -> None:
        """Gives back device memory between jobs (an RL trainer's turn): level 1 frees the KV
        cache (its contents and the prefix cache are lost), level 2 also moves the weights to
        host memory. Compiled programs stay. Needs no request in flight (ValueError otherwise).
        While asleep, `add_prompt` refuses requests and `step` runs nothing: requests added
        with `add_request` (the servers') wait for `wake_up`. `update_weights` works asleep (at
        level 2 it replaces the host copy, which `wake_up` puts on the device)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level!r}")
        if self.distributed is not None:  # the followers' caches and weights would stay, out of step
            raise ValueError("sleep is not supported on a multi-host engine (the KV cache and weights are "
                             "held by every process)")
        if self.has_unfinished_requests():
            raise ValueError(f"sleep: {self.num_unfinished_requests} requests in flight; finish or abort them first")
        if level <= self.sleep_level:
            return
        if not self.sleep_level:
            self.scheduler.reset_prefix_cache()
            self.runner.free_kv_cache()
            if self.proposer is not None:
                self.proposer.propose([])  # a draft model gives back its pages
        if level == 2:
            self.runner.offload_params()
        self.sleep_level = level
        logger.info("asleep (level %d): device bytes now %s", level, self.runner.device_bytes())

    def wake_up(self) -> None:
        """Puts back what `sleep` freed (a fresh, empty KV cache; the weights, if offloaded)."""
        if self.sleep_level == 2:
            self.runner.restore_params()
        if self.sleep_level:
            self.runner.rebuild_kv_cache()
            self.sleep_level = 0
            logger.info("awake: device bytes %s", self.runner.device_bytes())

    def _load_update(self, source: str | os.PathLike | Mapping[str, Any]) -> tuple[LoadedModel, dict | None]:
        """The new weights, and for a partial mapping the mask of what it covers."""
        from jaxserve.loading.errors import MissingTensorError
        from jaxserve.loading.hf_loader import TensorMapping, load_hf_params
        from jaxserve.loading.partial import load_partial_params

        config = self.config
        if not isinstance(source, Mapping):
            update = dataclasses.replace(config, model=os.fspath(source))
            return self._load(update, None, self._load_part(update)), None
        dtype = resolve_dtype(self.dtype)
        mask = None
        try:
            params = load_hf_params("", self.model_config, dtype, config.quantization, config.quantize_lm_head,
                                    index=TensorMapping(source))
        except MissingTensorError as e:
            if config.quantization is not None:
                raise ValueError(f"{e} (a partial update needs unquantized weights; this engine runs "
                                 f"{config.quantization})") from None
            params, mask = load_partial_params(source, self.model_config, dtype)
        return LoadedModel(self.model_config, params, None, self.model.dtype, "mapping", "", config.quantization), mask

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (after a weight reload, say); blocks running requests
        hold are never shared afterwards either. Returns how many blocks lost their hash."""
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        if self.sleep_level:  # requests wait for wake_up
            time.sleep(0.001)
            return []
        t0 = time.perf_counter()
        if self._background is not None and (limits := self._background.take_limits()) is not None:
            self.scheduler.limit_steps(*limits)
        so = self.scheduler.schedule(self._propose_or_stop() if self.proposer is not None else None)
        failed = [out for rid, why in self.scheduler.take_grammar_errors()
                  for out in self.outputs.fail([rid], why, param="structured_outputs")]
        if so.new_requests:
            self.outputs.record_scheduled((nr.request_id for nr in so.new_requests), time.monotonic())
        elif not so.scheduled and self.scheduler.num_awaiting_grammar:
            time.sleep(0.001)  # only grammars compiling: let their threads run instead of spinning
        try:
            ro = self.runner.execute(so)
        except UnplannedCompilationError:
            raise
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            return failed + self._fail_step(so, e)
        for seq_id, why in ro.grammar_errors.items():  # ended first: their rejected token is not output
            self.scheduler.finish_requests(seq_id, FinishReason.ERROR)
            failed += self.outputs.fail([seq_id], why, param="structured_outputs")
        if ro.spec_decode is not None:
            self.spec_decode.merge(ro.spec_decode)
        if self.lora_registry is not None:
            self._count_lora_tokens(so, ro.sampled_token_ids)
        updates = self.scheduler.update_from_output(so, ro.sampled_token_ids)
        processed = self.outputs.process(updates, ro.logprobs, ro.prompt_logprobs)
        for seq_id, stop_str in processed.stopped_by_string:
            self.scheduler.finish_requests(seq_id, FinishReason.STOP, stop_str)
        if self.proposer is not None and not self.scheduler.has_unfinished_requests():
            self.proposer.propose([])  # idle: the proposer lets go of every sequence (a draft model's pages)
        self.last_step = dataclasses.replace(ro.timing, host_s=time.perf_counter() - t0 - ro.timing.device_s)
        return failed + processed.outputs

    def _make_proposer(self, spec: SpeculativeConfig):
        if spec.method == "ngram":
            return make_ngram_proposer(spec)
        if spec.method == "mtp":
            from jaxserve.spec_decode.mtp import MTPProposer

            logger.info("speculative decoding: the model's MTP layer, %d tokens per step", spec.num_speculative_tokens)
            return MTPProposer(self.runner)
        from jaxserve.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer

        config = self.config
        if config.tensor_parallel_size > 1 or config.num_processes > 1 or config.compiled_dir:
            raise ValueError("speculative_config: a draft model runs on one device of one process, without "
                             "--compiled executables (tensor_parallel_size 1, num_processes 1, no compiled_dir)")
        draft = load_model(spec.model, config.resolved_dtype(), quantization=config.quantization)
        check_same_tokenizer(self.tokenizer, draft.tokenizer, self.model_config.vocab_size, draft.config.vocab_size,
                             spec.model)
        logger.info("speculative decoding: draft model %s (%d layers), %d tokens per step", spec.model,
                    draft.config.num_layers, spec.num_speculative_tokens)
        return DraftModelProposer(
            draft, spec.num_speculative_tokens, num_pages=self.num_pages, page_size=config.page_size,
            max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, plan=self.plan,
            attention_backend=config.attention_backend, kv_layout=self.resolved.kv_layout, seed=config.seed)

    def _propose_or_stop(self) -> dict[str, list[int]] | None:
        """Drafts; a proposer that fails is turned off (logged) and the engine goes on
        without speculation: its outputs are the same, only slower."""
        try:
            return self._propose()
        except Exception as e:  # noqa: BLE001 - drafts are an optimisation, never a reason to fail requests
            logger.error("speculative decoding turned off: the %s proposer failed: %s: %s",
                         self.config.speculative_config.method, type(e).__name__, e)
            self.proposer = None
            return None

    def _propose(self) -> dict[str, list[int]] | None:
        """Drafts for the decoding sequences, unless the batch is past the configured size
        (where a step is compute-bound and verifying drafts costs more than it saves)."""
        limit = self._draft_batch_limit
        over = limit is not None and self.scheduler.num_running > limit
        candidates = [] if over else self.scheduler.draft_candidates(self.config.speculative_config.num_speculative_tokens)
        # Called with no candidates too: the proposer forgets (frees) every sequence not listed.
        drafts = self.proposer.propose(candidates)
        if drafts and self.structured is not None:  # a structured-output draft ends where its grammar says no
            valid = self.runner.input_batch.valid_drafts
            drafts = {rid: kept for rid, d in drafts.items() if (kept := valid(rid, d))}
        return drafts or None

    def _fail_step(self, so: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """The step's requests end with `error`; the engine recovers or reports unhealthy."""
        failed = self.scheduler.fail_step(so)
        logger.error("engine step failed (%d requests end with error): %s: %s",
                     len(failed), type(error).__name__, error)
        if self.distributed is not None:  # a collective failed: a peer is gone
            self._mark_unhealthy(f"multi-host step failed: {error}")
        elif self.runner.kv_cache_lost():
            try:
                self.runner.rebuild_kv_cache()
            except Exception as e:  # noqa: BLE001 - nothing left to serve with
                self._mark_unhealthy(f"KV cache lost and could not be rebuilt: {e}")
            else:
                requeued = self.scheduler.drop_device_kv()
                logger.warning("KV cache rebuilt after a failed step; %d running requests recompute", len(requeued))
        self.last_step = StepTiming()
        return self.outputs.fail(failed, f"the engine step failed ({type(error).__name__}); the request was not completed")

    # ------------------------------------------------------------------ warmup
    def _check_compiled(self) -> dict:
        """The `compiled_dir` manifest, checked against this engine (raises CompiledMismatchError)."""
        from jaxserve.compilation import aot

        manifest = aot.read_manifest(self.config.compiled_dir)
        devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        fingerprint = aot.program_fingerprint(self.model_config, self.config, self.resolved,
                                              self.config.tensor_parallel_size)
        aot.check_manifest(manifest, platform=self.platform, num_devices=len(devices),
                           device_kind=devices[0].device_kind, fingerprint=fingerprint,
                           directory=self.config.compiled_dir)
        return manifest

    def _executable_store(self) -> Any:
        """Where this server's executables are kept for the next start (None: not kept: no
        persistent cache, `reuse_executables` off, `compiled_dir` given, or several processes)."""
        config = self.config
        if (self.cache_dir is None or not config.reuse_executables or config.compiled_dir
                or self.distributed is not None):
            return None
        from jaxserve.compilation.aot import program_fingerprint
        from jaxserve.compilation.executable_store import ExecutableStore, Identity

        devices = list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1]
        fingerprint = program_fingerprint(self.model_config, config, self.resolved, config.tensor_parallel_size)
        kernels = dataclasses.asdict(self.kernels)
        return ExecutableStore(self.cache_dir, Identity.of(self.platform, len(devices), devices[0].device_kind,
                                                            fingerprint, kernels))

    @during_setup
    def warmup(self, *, progress: bool = False) -> WarmupReport:
        """Makes every shape of the compile plan ready and arms the compile guard: loaded
        from `compiled_dir` when set, else from the executables a start with the same
        identity saved (`executable_store`), else compiled (from the persistent cache when it
        is warm) and saved for the next start. With `serve_while_compiling` it returns once
        the first tier is compiled, steps limited to it, and compiles the rest on a
        background thread (the guard is armed when that ends)."""
        if self.structured is not None:
            self.structured.prepare_in_background()
        store = self._executable_store()
        later: list[CompileTier] = []
        if self._compiled is not None:
            from jaxserve.compilation.aot import load_compiled

            report = load_compiled(self.config.compiled_dir, self._compiled, self.runner, self.plan.shapes())
        elif store is None or (report := store.load(self.runner, self.plan.shapes())) is None:
            tiers = self.plan.tiers() if self.config.serve_while_compiling else []
            if len(tiers) > 1:  # serve with the first tier; the rest compiles in the background
                first, *later = tiers
                report = self._compile(list(first.shapes), progress)
                self.scheduler.limit_steps(first.max_tokens, first.max_seqs)
            else:
                report = self._compile(None, progress)
                self._save_executables(store, report)
        if hasattr(self.proposer, "warmup"):  # a draft model: its own shapes, before the guard is armed
            draft = self.proposer.warmup(workers=self.config.warmup_threads, cache_enabled=self.cache_dir is not None)
            report = dataclasses.replace(report, records=report.records + draft.records,
                                         wall_seconds=report.wall_seconds + draft.wall_seconds)
        self.warmup_report = report
        if self.channel is not None:  # every process compiles the broadcasts in the same order
            self.channel.prime()
        logger.info("warmup: %s", report.summary())
        if later:
            logger.info("serving with steps of up to %d tokens and %d sequences while %d more shapes compile",
                        self.scheduler.step_tokens, self.scheduler.step_seqs, sum(len(t.shapes) for t in later))
            self._background = BackgroundCompile(lambda tier: self._compile(list(tier.shapes), False), later,
                                                 functools.partial(self._background_done, report, store))
            self._background.start()
        else:
            self.runner.guard.arm()
        return report

    def _compile(self, keys: list[ShapeKey] | None, progress: bool) -> WarmupReport:
        """Compiles `keys` (None: the whole plan) into the runner."""
        return compile_ahead(self.runner, self.plan, keys=keys, max_reqs=self.config.max_num_seqs,
                             tensors_by_rows=self.runner.input_batch.tensors, workers=self.config.warmup_threads,
                             progress=progress, cache_enabled=self.cache_dir is not None)

    def _save_executables(self, store: Any, report: WarmupReport) -> None:
        from jaxserve.compilation.executable_store import not_saveable

        if store is None:
            return
        if skipped := not_saveable(self.platform, report.records):
            logger.info("executables not saved: %d shapes (first: %s) came from the persistent compilation cache, "
                        "and XLA:CPU cannot serialize those whole; the next start loads them from that cache again",
                        len(skipped), skipped[0])
            return
        t0 = time.perf_counter()
        if store.save(self.runner, self.plan.shapes()):
            logger.info("executables saved for the next start in %.1f s (%s)", time.perf_counter() - t0, store.path)

    def _background_done(self, first: WarmupReport, store: Any, rest: WarmupReport, error: Exception | None
                         ) -> None:
        """On the compile thread, after its last tier: the whole report, the executables
        saved (when every shape compiled), the compile guard armed."""
        self.warmup_report = dataclasses.replace(first, records=first.records + rest.records,
                                                 wall_seconds=first.wall_seconds + rest.wall_seconds)
        compiled = {r.name for r in self.warmup_report.records}
        if error is None and all(k.name in compiled for k in self.plan.shapes()):
            self._save_executables(store, self.warmup_report)
        self.runner.guard.arm()
        logger.info("background compilation done: %s", self.warmup_report.summary())

    @property
    def compiling_in_background(self) -> bool:
        return self._background is not None and self._background.running

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
        distributed.run_follower(self.runner, self.channel, self.runner.input_batch.tensors,
                                 update_weights=self._update_everywhere)

    def close(self) -> None:
        """Leader: ends the followers' loops and waits until they have said goodbye, so the
        coordination service it hosts outlives them. Everyone: stops heartbeats (and a
        background compilation: no new tier starts)."""
        if self._background is not None:
            self._background.stop(timeout=0)
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
        if self.structured is not None:
            self.structured.close()

    @property
    def compiles_after_warmup(self) -> int:
        return self.runner.guard.compiles_after_warmup


def run_follower_process(config: EngineConfig) -> None:
    """The whole life of a multi-host follower process (`--process-id` > 0): build the engine,
    warm up in step with the leader, run its steps until STOP, then exit the process."""
    logger.info("multi-host follower %d: running the leader's steps", config.process_id)
    engine = Engine(config)
    engine.warmup()
    engine.run_follower()
    engine.close()
    distributed.exit_follower(0)


def _config_difference(new: Any, running: Any) -> str:
    """The fields that differ between two model configs, as `name: new vs running`."""
    diffs = [f"{f.name}: {getattr(new, f.name)!r} vs {getattr(running, f.name)!r}"
             for f in dataclasses.fields(running) if getattr(new, f.name) != getattr(running, f.name)]
    return "; ".join(diffs[:4]) or "equal fields"


def _text_only(loaded: LoadedModel) -> LoadedModel:
    """`limit_mm_per_prompt` 0 (vLLM's text-only mode): the language model alone, without its
    image encoder. Gemma 3's is then served as Gemma 3 text (its family takes tensor
    parallelism and LoRA); a Qwen VL decoder keeps its family (its M-RoPE over text positions
    is plain RoPE)."""
    cfg = dataclasses.replace(loaded.config, vision=None)
    if loaded.config.vision.kind == "gemma3":
        cfg = dataclasses.replace(cfg, architecture="gemma3")
    return dataclasses.replace(loaded, config=cfg, vision=None)
