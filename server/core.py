"""The serving core: what both fronts share, with no transport in it.

`ServingCore` owns the engine and its thread (`EngineLoop`), the tenants' keys, admission,
the front-end tokenizer pool, the server's state (loading, serving, draining, stopped),
engine health, the drain and the metrics. A front (gRPC in `server/grpc_front.py`, OpenAI
HTTP in `server/http_api/routes.py`) parses its protocol into the typed requests below,
calls the core's async methods, and renders their outputs and `ServeError`s in its protocol;
no front reaches the engine, the metrics registry or the tokenizer. The core lives in
`server/` rather than `jaxserve/` because it is made of server things (tenants, admission,
an event loop); the batch API drives the engine directly.

A generation, in order (`generate`): serving? -> the request's checks that need no tokens
(`InputProcessor`: sizes, caps, stop lists, logit_bias) -> tokenize / chat template on the
pool -> serving? (a drain may have begun meanwhile) -> grammar compile off the event loop
-> `InputProcessor.process` (ids, room left, seeds) -> admission (work reserved per tenant)
-> the engine thread, under a tenant-scoped id. So a request that can never run is a 400
before admission, and admission's 429 means only "retry later".
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.detokenizer import TokenText
from jaxserve.engine.input_processor import InputError, InputProcessor
from jaxserve.engine.interface import ServingEngine
from scheduler import SamplingParams
from server.admission import Admission, AdmissionRefused, request_work
from server.core_types import GenerateInput, ModelInfo, PromptInput, ServerInfo
from server.engine_loop import EngineDead, EngineLoop, new_error_id
from server.errors import ErrorKind, ServeError, invalid
from server.frontend import FrontendBusy, FrontendPool
from server.generation import Generation
from server.metrics import ServerMetrics
from server.options import VERSION, ServerOptions, ServerState
from server.status_log import log_status
from server.streams import EngineFailed, StreamBuffer
from server.tenants import Authenticator, Tenant

logger = logging.getLogger("jaxserve.server")

EXIT_ENGINE_FAILED = 1  # the exit code when the engine thread stopped on an error
GRAMMAR_COMPILE_TIMEOUT_S = 30.0  # a structured-output grammar that compiles longer is refused
MAX_REQUEST_ID_CHARS = 256


class ServingCore:
    def __init__(self, engine_config: EngineConfig, options: ServerOptions | None = None, *,
                 engine: ServingEngine | None = None):
        self.engine_config = engine_config
        self.options = o = options or ServerOptions()
        if o.api_key and o.tenants:
            raise ValueError("give one API key or a tenants file, not both")
        self.auth = Authenticator(list(o.tenants)) if o.tenants else (
            Authenticator.single_key(o.api_key) if o.api_key else Authenticator())
        self.engine: ServingEngine | None = engine
        self.processor: InputProcessor | None = None
        self.loop_runner: EngineLoop | None = None
        self.frontend: FrontendPool | None = None
        self.admission: Admission | None = None
        self.state = ServerState.LOADING
        self.metrics = ServerMetrics(snapshot=self._snapshot)
        self.num_streams = 0  # open generations (drain waits for these)
        self._buffers: set[StreamBuffer] = set()
        self._started = time.monotonic()
        self.started_wall = time.time()
        self._token_text: TokenText | None = None
        self._health_listeners: list[Callable[[bool], Awaitable[None]]] = []
        self._model_hooks: list[Callable[[ModelInfo], None]] = []
        self._model_known = False  # the engine is built: model_info() describes what is served
        self._tasks: list[asyncio.Task] = []
        self._trace: Any = None  # a TraceWriter with --record-request-trace
        self._healthy = True
        self._idle = asyncio.Event()
        self._idle.set()
        self.engine_failed = asyncio.Event()  # the engine thread stopped on an error
        self.exit_code = 0

    # ------------------------------------------------------------------ life cycle
    def on_health_change(self, listener: Callable[[bool], Awaitable[None]]) -> None:
        """`listener(serving)` runs on the event loop whenever new requests start or stop
        being served (loaded, engine unhealthy / healthy again, engine dead)."""
        self._health_listeners.append(listener)

    def on_model_loaded(self, hook: Callable[[ModelInfo], None]) -> None:
        """`hook(model_info)` runs (on a worker thread) once the engine is built and before the
        server serves, or at once when that is done: a front prepares there what depends on the
        model (the OpenAI front loads gpt-oss's harmony encoding). Its exception stops the start,
        so a model the front cannot serve fails loudly instead of failing each request."""
        if self._model_known:
            hook(self.model_info())
        else:
            self._model_hooks.append(hook)

    async def _notify_health(self, serving: bool) -> None:
        for listener in self._health_listeners:
            await listener(serving)

    async def load(self) -> None:
        """Builds the engine (unless given) and warms it up off the event loop, then serves."""
        t0 = time.perf_counter()
        if self.engine is None:
            from jaxserve.engine.llm_engine import Engine
            self.engine = await asyncio.to_thread(Engine, self.engine_config)
        self._model_known = True
        for hook in self._model_hooks:  # before warmup: a front that cannot serve the model fails fast
            await asyncio.to_thread(hook, self.model_info())
        t1 = time.perf_counter()
        logger.info("model loaded in %.1f s", t1 - t0)
        o = self.options
        if o.lora_modules:
            await asyncio.to_thread(self._load_lora_modules, o.lora_modules)
        warmup = o.warmup
        if not warmup and self.engine_config.num_processes > 1:
            # The followers always warm up, and every process must run the same programs in
            # the same order; a leader that did not would mismatch their collectives.
            logger.warning("--no-warmup is ignored across hosts: the leader warms up in step with its followers")
            warmup = True
        if warmup:
            report = await asyncio.to_thread(self.engine.warmup)
            logger.info("warmup done in %.1f s: %s", time.perf_counter() - t1, report.summary())
            if o.require_warm_cache and report.num_misses:
                missed = [r.name for r in report.records if r.cache == "miss"]
                raise RuntimeError(
                    f"--require-warm-cache: {len(missed)} of {report.num_shapes} shapes missed the "
                    f"compilation cache ({', '.join(missed[:5])}{', ...' if len(missed) > 5 else ''}); "
                    "fill it with `jaxserve warmup` using the same flags")
        self.processor = self._server_processor(self.engine.input_processor)
        threads = o.frontend_threads or max(1, min(4, (os.cpu_count() or 1) // 4))
        self.frontend = FrontendPool(self.engine.tokenizer, threads, o.tokenizer_backlog_chars, o.chat_template)
        self.metrics.set_frontend(self.frontend)
        kv_tokens = self.engine.num_pages * self.engine.config.page_size
        self.admission = Admission(
            self.engine.config.max_num_seqs + o.max_queued_requests,
            o.max_queued_tokens if o.max_queued_tokens is not None else 4 * kv_tokens)
        self.loop_runner = EngineLoop(self.engine, asyncio.get_running_loop(), self.metrics,
                                      on_fatal=lambda: asyncio.ensure_future(self._on_engine_dead()))
        self.loop_runner.start()
        self.metrics.set_engine_thread(self.loop_runner.thread)
        if o.request_trace:
            from jaxserve.tuning.workload import TraceWriter

            self._trace = TraceWriter(o.request_trace)
        self.state = ServerState.SERVING
        await self._notify_health(True)
        if o.log_interval > 0:
            self._tasks.append(asyncio.create_task(log_status(self.loop_runner, self.metrics, o.log_interval)))
        self._tasks.append(asyncio.create_task(self._watch_engine_health()))
        logger.info("serving %s (max_model_len %d, %d KV pages of %d tokens; %d tenant%s, work limit %d tokens)",
                    self.model_name, self.engine.max_model_len, self.engine.num_pages, self.engine.config.page_size,
                    len(self.auth.tenants), "" if len(self.auth.tenants) == 1 else "s", self.admission.max_tokens)

    def _server_processor(self, engine_processor: InputProcessor) -> InputProcessor:
        """The engine's processor with the server's prompt-size limit (and its seed stream)."""
        limits = dataclasses.replace(engine_processor.limits, max_prompt_chars=self.max_prompt_chars)
        proc = copy.copy(engine_processor)
        proc.limits = limits
        return proc

    def begin_drain(self) -> None:
        """New requests are refused (UNAVAILABLE / 503) from now on."""
        self.state = ServerState.DRAINING

    async def drain(self, timeout: float | None = None) -> None:
        """Stops admitting; lets open generations finish up to `timeout`, then aborts the rest."""
        timeout = self.options.shutdown_timeout if timeout is None else timeout
        self.begin_drain()
        logger.info("draining: %d requests in flight, up to %.1f s", self.num_streams, timeout)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            if self.loop_runner is not None and not self.loop_runner.dead:
                n = await asyncio.wrap_future(self.loop_runner.abort_all("server shutting down"))
                logger.warning("drain timeout: aborted %d requests", n)
            try:
                await asyncio.wait_for(self._idle.wait(), 5.0)
            except TimeoutError:
                pass

    async def close(self) -> None:
        """Stops the engine thread, the tokenizer pool and the engine (after the fronts)."""
        self.state = ServerState.STOPPED
        for task in self._tasks:
            task.cancel()
        if self.loop_runner is not None:
            await asyncio.to_thread(self.loop_runner.stop)
        if self.frontend is not None:
            self.frontend.close()
        if self._trace is not None:
            self._trace.close()
        if self.engine is not None and hasattr(self.engine, "close"):
            try:  # multi-host leader: stops the followers' loops and the heartbeats
                await asyncio.to_thread(self.engine.close)
            except Exception:  # noqa: BLE001
                logger.exception("engine.close failed")

    # ------------------------------------------------------------------ state
    @property
    def model_name(self) -> str:
        return self.engine_config.model or "embedded:SmolLM2-135M-Instruct"

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.options.served_model_name or (self.model_name,)

    @property
    def num_in_flight(self) -> int:
        """Requests admitted and not yet done in the engine."""
        return self.admission.total.requests if self.admission is not None else 0

    @property
    def max_prompt_chars(self) -> int:
        if self.options.max_prompt_chars is not None:
            return self.options.max_prompt_chars
        return 32 * self.engine.max_model_len

    def serving_error(self) -> ServeError | None:
        """Why new requests are refused now (UNAVAILABLE / 503), or None when serving."""
        if self.state == ServerState.LOADING:
            return ServeError(ErrorKind.UNAVAILABLE, "the server is loading the model", code="loading")
        if self.state != ServerState.SERVING:
            return ServeError(ErrorKind.UNAVAILABLE, "the server is shutting down", code="draining")
        if self.loop_runner.dead:
            return ServeError(ErrorKind.UNAVAILABLE, f"the engine stopped (error id {self.loop_runner.fatal_error_id}); "
                              "the server is going down", code="engine_stopped")
        if not self.engine.healthy:
            reason = self.engine.unhealthy_reason or "unknown"
            return ServeError(ErrorKind.UNAVAILABLE, f"the engine is unhealthy: {reason}", code="unhealthy")
        return None

    def require_serving(self) -> None:
        err = self.serving_error()
        if err is not None:
            raise err

    def authenticate(self, metadata: Sequence[tuple[str, str]]) -> Tenant | None:
        """The tenant whose key is in `metadata` ((name, value) pairs); None (counted) if none."""
        tenant = self.auth.authenticate(metadata)
        if tenant is None:
            self.metrics.auth_failures.inc()
        return tenant

    def model_info(self) -> ModelInfo | None:
        """The model served, or None while it loads."""
        e = self.engine
        if e is None:
            return None
        mc = e.model_config
        return ModelInfo(
            model=self.model_name, architecture=mc.architecture, vocab_size=mc.vocab_size,
            max_model_len=e.max_model_len, num_layers=mc.num_layers,
            hidden_size=mc.hidden_size, dtype=e.dtype,
            eos_token_id=e.eos_token_id if e.eos_token_id is not None else -1,
            has_chat_template=e.tokenizer is not None and bool(e.tokenizer.chat_template),
            max_logprobs=self.engine_config.max_logprobs, max_n=self.engine_config.max_n)

    async def update_weights(self, tenant: Tenant, path: Any) -> int:
        """Admin only: the engine takes the weights at `path` (`Engine.update_weights`);
        returns its new weights version. A bad source is INVALID and changes nothing."""
        self._require_admin(tenant, "update_weights")
        if not isinstance(path, str) or not path:
            raise invalid("path: a weights path (HF directory, jaxserve checkpoint or GGUF file) is required", "path")
        self.require_serving()
        try:
            return await self.loop_runner.update_weights(path)
        except (ValueError, FileNotFoundError) as e:
            raise invalid(f"path: {e}", "path") from None

    async def sleep(self, tenant: Tenant, level: Any) -> None:
        """Admin only: `Engine.sleep(level)`; requests that arrive while asleep wait."""
        self._require_admin(tenant, "sleep")
        if level not in (1, 2) or isinstance(level, bool):
            raise invalid(f"level: 1 (KV cache) or 2 (KV cache and weights), got {level!r}", "level")
        try:
            await self.loop_runner.call(lambda engine: engine.sleep(level))
        except ValueError as e:
            raise invalid(str(e), "level") from None

    async def wake_up(self, tenant: Tenant) -> None:
        self._require_admin(tenant, "wake_up")
        await self.loop_runner.call(lambda engine: engine.wake_up())

    def is_sleeping(self) -> bool:
        return bool(self.engine.sleep_level)

    # ------------------------------------------------------------------ LoRA adapters
    def _load_lora_modules(self, modules: Sequence[tuple[str, str]]) -> None:
        """--lora-modules: before serving, so a bad adapter stops the start with its reason."""
        from jaxserve.lora import LoRARequest

        for i, (name, path) in enumerate(modules):
            self.engine.load_lora(LoRARequest(name, i + 1, path))
            logger.info("LoRA adapter %r loaded from %s", name, path)

    def lora_adapters(self, tenant: Tenant | None = None) -> list[Any]:
        """The loaded adapters (`LoRARequest`s) in load order, those `tenant` may use when
        given (none when LoRA is off)."""
        registry = self.engine.lora_registry
        loaded = registry.loaded() if registry is not None else []
        return [lr for lr in loaded if tenant is None or tenant.may_use_lora(lr.lora_name)]

    def lora_names(self) -> list[str]:
        return [lr.lora_name for lr in self.lora_adapters()]

    def check_lora(self, tenant: Tenant, name: str) -> None:
        """The tenant may run requests under adapter `name` (NOT_FOUND otherwise, as vLLM
        answers for a model it does not serve; an adapter a tenant may not use is not shown
        to exist)."""
        if name not in self.lora_names() or not tenant.may_use_lora(name):
            raise ServeError(ErrorKind.NOT_FOUND, f"the model {name!r} does not exist", "model", "model_not_found")

    async def load_lora(self, tenant: Tenant, name: Any, path: Any) -> None:
        """Admin only: reads and registers an adapter (vLLM's /v1/load_lora_adapter)."""
        self._require_admin(tenant, "load_lora_adapter")
        if self.engine.lora_registry is None:
            raise invalid("lora_name: this server runs without LoRA (start it with --enable-lora)", "lora_name")
        for field, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise invalid(f"{field}: a non-empty string is required", field)
        if name in self.served_model_names:
            raise invalid(f"lora_name: {name!r} is the base model's name", "lora_name")
        from jaxserve.lora import LoRARequest

        try:  # read off the engine thread: a large adapter must not stall the steps
            adapter = await asyncio.to_thread(self.engine.lora_registry.read, name, path)
        except ValueError as e:
            raise invalid(str(e), "lora_path" if "already loaded" not in str(e) else "lora_name") from None

        def load(engine) -> None:
            next_id = 1 + max((lr.lora_int_id for lr in engine.list_loras()), default=0)
            engine.load_lora(LoRARequest(name, next_id, path), adapter)

        try:
            await self.loop_runner.call(load)
        except ValueError as e:  # loaded meanwhile under the same name
            raise invalid(str(e), "lora_name") from None

    async def unload_lora(self, tenant: Tenant, name: Any) -> None:
        """Admin only: forgets an adapter (refused while a request uses it)."""
        self._require_admin(tenant, "unload_lora_adapter")
        if not isinstance(name, str) or not name:
            raise invalid("lora_name: a non-empty string is required", "lora_name")
        try:
            await self.loop_runner.call(lambda engine: engine.unload_lora(name))
        except KeyError as e:
            raise ServeError(ErrorKind.NOT_FOUND, str(e.args[0]), "lora_name", "lora_not_found") from None
        except ValueError as e:
            raise invalid(str(e), "lora_name") from None

    def _require_admin(self, tenant: Tenant, what: str) -> None:
        if self.auth.required and not tenant.admin:
            raise ServeError(ErrorKind.UNAUTHENTICATED, f"{what}: needs an admin key", code="admin_only")

    def server_info(self, tenant: Tenant) -> ServerInfo:
        """Server-wide engine state for admin tenants; others see the state and their own
        requests in flight only (the rest would tell them about the other tenants' load)."""
        base = dict(version=VERSION, state=self.state, uptime_s=time.monotonic() - self._started,
                    max_queued_requests=self.options.max_queued_requests)
        if not tenant.admin:
            mine = self.admission.usage(tenant.name)[0] if self.admission is not None else 0
            return ServerInfo(**base, num_in_flight=mine)
        # the engine's config once it is built (platform defaults set); the server's before
        cfg = self.engine.config if self.engine is not None else self.engine_config
        config = {f.name: str(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
        attention = self.engine.attention if self.engine is not None else None
        if attention:
            config["attention_implementation"] = f"{attention[0]} ({attention[1]})"
        stats: dict[str, Any] = {}
        snap = self._snapshot()
        if snap is not None:
            st = snap.stats
            stats = dict(num_running=st.num_running, num_waiting=st.num_waiting, num_swapped=st.num_swapped,
                         num_used_blocks=st.num_used_blocks, num_free_blocks=st.num_free_blocks,
                         num_cached_free_blocks=st.num_cached_free_blocks, num_total_blocks=st.num_total_blocks,
                         kv_cache_usage=st.kv_usage, prefix_cache_queries=st.prefix_cache_queries,
                         prefix_cache_hits=st.prefix_cache_hits, num_preemptions=st.num_preemptions)
        return ServerInfo(**base, num_in_flight=self.num_in_flight, engine_config=config,
                          compilations_after_warmup=self.metrics.num_compilations_after_warmup, **stats)

    @property
    def token_text(self) -> TokenText:
        """Token strings for logprobs (its own tokenizer copy: the engine thread detokenizes with the original)."""
        if self._token_text is None:
            self._token_text = TokenText(copy.deepcopy(self.engine.tokenizer))
        return self._token_text

    # ------------------------------------------------------------------ what fronts count
    def count_http(self, endpoint: str, status: int) -> None:
        self.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def count_stream_idle_abort(self) -> None:
        self.metrics.stream_idle_aborts.inc()

    def count_refusal(self, limit: str) -> None:
        self.metrics.requests_refused.labels(limit=limit).inc()

    def count_auth_failure(self) -> None:
        self.metrics.auth_failures.inc()

    def metrics_exposition(self, tenant: Tenant | None) -> tuple[bytes, str]:
        """The Prometheus text (body, content type); an admin's only when keys are required."""
        if self.auth.required and (tenant is None or not tenant.admin):
            raise ServeError(ErrorKind.UNAUTHENTICATED, "/metrics: needs an admin key (it shows every tenant's load)",
                             code="admin_only")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ requests
    async def tokenize(self, tenant: Tenant, prompt: PromptInput) -> list[int]:
        """The prompt's ids: given, or tokenized / chat-templated on the front-end pool."""
        self.require_serving()
        ids = await self._prompt_ids(tenant, prompt)
        self.metrics.tokenize_requests.inc()
        return ids

    async def detokenize(self, tenant: Tenant, token_ids: Sequence[int], param: str = "tokens") -> str:
        self.require_serving()
        try:
            self.processor.check_token_ids(token_ids, param)
        except InputError as e:
            raise _invalid(e) from None
        return await self._on_pool(self.frontend.decode(list(token_ids), tenant.name), param)

    async def generate(self, tenant: Tenant, req: GenerateInput) -> Generation:
        """Checks, prepares and admits one request, then hands it to the engine thread; the
        caller iterates the returned `Generation` inside `async with`. Raises ServeError."""
        self.require_serving()
        if len(req.request_id) > MAX_REQUEST_ID_CHARS:
            raise invalid(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters", "request_id")
        params = self._tenant_params(req.params, tenant)
        if req.lora_name is not None:
            self.check_lora(tenant, req.lora_name)
        try:  # caps first: no tokenizing a request that can never run
            self.processor.check_params(params, req.field_names)
        except InputError as e:
            raise _invalid(e) from None
        if req.prompt.images and self.processor.images is None:  # before any template sees the parts
            where = req.prompt.images[0][1]
            raise invalid(f"{where}: only text parts are supported (this model takes text), got an image",
                          f"{where}.type")
        ids = await self._prompt_ids(tenant, req.prompt)
        mm = None
        if req.prompt.images:
            ids, mm = await self._image_prompt(tenant, ids, req.prompt)
        self.require_serving()  # again: the drain may have begun while it tokenized
        grammar = None
        if params.structured_outputs is not None:
            grammar = await self._compile_grammar(params, req.structured_param or "structured_outputs")
        try:
            request = self.processor.process(ids, params, prompt=req.prompt.text, fill_max_tokens=req.fill_max_tokens,
                                             grammar=grammar, param=req.prompt.param, field_names=req.field_names,
                                             params_checked=True, multimodal=mm)
        except InputError as e:
            raise _invalid(e) from None
        p = request.params
        try:
            reservation = self.admission.reserve(tenant, request_work(len(ids), p.n, p.max_tokens,
                                                                      self.engine.max_model_len))
        except AdmissionRefused as e:
            self.count_refusal(e.limit)
            raise ServeError(ErrorKind.EXHAUSTED, str(e), code=e.limit) from e
        gen = await self._submit(tenant, req, request, reservation)
        if self._trace is not None:
            self._trace.record(request.prompt_token_ids, p.max_tokens)
        return gen

    async def _submit(self, tenant: Tenant, req: GenerateInput, request: Any, reservation: Any) -> Generation:
        from jaxserve.engine.llm_engine import (
            DuplicateRequestId,  # with the engine, not with this module
        )

        key = tenant.request_key(req.request_id)
        buffer = StreamBuffer(on_engine_done=lambda: self.admission.release(reservation))
        gen = Generation(key, request.params.n, buffer, reservation, on_close=self._leave,
                         abort=lambda k, ticket: self.loop_runner.abort(k, ticket=ticket),
                         structured_param=req.structured_param, num_logprobs=request.params.logprobs or 0,
                         num_prompt_logprobs=request.params.prompt_logprobs or 0)
        self._enter(gen)
        try:
            await self.loop_runner.add_request(key, request, buffer, arrival_time=time.monotonic(), ticket=gen.ticket,
                                               lora_name=req.lora_name)
        except DuplicateRequestId as e:
            gen.close()
            raise invalid(str(e).replace(repr(key), repr(req.request_id)), "request_id") from e
        except ValueError as e:  # the adapter was unloaded since it was checked
            gen.close()
            raise ServeError(ErrorKind.NOT_FOUND, str(e), "model", "model_not_found") from e
        except EngineDead as e:
            gen.close()
            raise ServeError(ErrorKind.UNAVAILABLE, str(e), code="engine_stopped") from e
        except Exception as e:
            gen.close()
            error_id = new_error_id()
            logger.exception("admitting %s failed [error id %s]", key, error_id)
            raise ServeError(ErrorKind.INTERNAL, f"could not admit the request (error id {error_id})") from e
        except BaseException:  # cancelled while being admitted: abort it once it is in
            gen.close()
            raise
        return gen

    async def abort(self, tenant: Tenant, request_id: str) -> bool:
        """Aborts the caller's own request of that id (another tenant's is never found)."""
        self.require_serving()
        return await asyncio.wrap_future(
            self.loop_runner.abort(tenant.request_key(request_id), notify="aborted by client"))

    def _tenant_params(self, params: SamplingParams, tenant: Tenant) -> SamplingParams:
        """The client's parameters with its priority clamped to the tenant's range and its
        cache salt moved into the tenant's prefix-cache space."""
        lo, hi = tenant.priority_range or self.options.priority_range
        shared = self.options.shared_prefix_cache or len(self.auth.tenants) == 1
        return dataclasses.replace(params, priority=min(max(params.priority, lo), hi),
                                   cache_salt=tenant.cache_salt(params.cache_salt, shared))

    async def _prompt_ids(self, tenant: Tenant, p: PromptInput) -> list[int]:
        proc = self.processor
        try:
            if p.token_ids is not None:
                return list(p.token_ids)
            if p.messages is not None:
                proc.check_messages(p.messages, p.param)
            else:
                proc.check_text(p.text or "", p.param)
        except InputError as e:
            raise _invalid(e) from None
        if p.messages is not None and p.render is not None:
            job = self.frontend.render(p.render, p.messages, tenant.name)
        elif p.messages is not None:
            job = self.frontend.chat(p.messages, p.add_generation_prompt, tenant.name, p.continue_final_message,
                                     p.tools, p.messages_without_tool_support)
        else:
            job = self.frontend.encode(p.text, tenant.name, p.add_special_tokens)
        return await self._on_pool(job, p.param)

    async def _image_prompt(self, tenant: Tenant, ids: list[int], p: PromptInput) -> tuple[list[int], Any]:
        """The prompt's images decoded (fetched from an allowed host), resized and patched on
        the front-end pool, its placeholders expanded: a bad image is a 400 naming its part."""
        cost = sum(len(src) if isinstance(src, str | bytes) else 0 for src, _ in p.images)
        try:
            return await self.frontend.run(self.processor.image_prompt, ids, list(p.images), p.param,
                                           owner=tenant.name, cost_chars=cost)
        except InputError as e:
            raise _invalid(e) from None
        except FrontendBusy as e:
            self.count_refusal("tokenizer_backlog_chars")
            raise ServeError(ErrorKind.EXHAUSTED, str(e), code="tokenizer_backlog_chars") from e

    async def _on_pool(self, job: Awaitable[Any], param: str) -> Any:
        try:
            return await job
        except ValueError as e:
            raise invalid(str(e), param) from e
        except FrontendBusy as e:
            self.count_refusal("tokenizer_backlog_chars")
            raise ServeError(ErrorKind.EXHAUSTED, str(e), code="tokenizer_backlog_chars") from e

    async def _compile_grammar(self, params: SamplingParams, param: str) -> Any:
        """Compiles a structured-output grammar off the event loop (cached for the engine)."""
        try:
            return await asyncio.to_thread(self.processor.compile_grammar, params, GRAMMAR_COMPILE_TIMEOUT_S, param)
        except InputError as e:
            raise _invalid(e) from None

    # ------------------------------------------------------------------ bookkeeping
    def _snapshot(self):
        return self.loop_runner.snapshot if self.loop_runner is not None else None

    def _enter(self, gen: Generation) -> None:
        self.num_streams += 1
        self._buffers.add(gen.buffer)
        self._idle.clear()

    def _leave(self, gen: Generation) -> None:
        """Called once per Generation, when its front is done with it."""
        self.admission.release(gen.reservation)
        self.num_streams -= 1
        self._buffers.discard(gen.buffer)
        if self.num_streams == 0:
            self._idle.set()

    async def _watch_engine_health(self, interval: float = 0.1) -> None:
        """Mirrors `engine.healthy` (a multi-host peer died, ...) and the engine thread's life
        into the health listeners."""
        while self.state == ServerState.SERVING:
            if self.loop_runner.dead:
                await self._on_engine_dead()
                return
            healthy = self.engine.healthy
            if healthy != self._healthy:
                self._healthy = healthy
                await self._notify_health(healthy)
                if healthy:
                    logger.info("engine healthy again: serving")
                else:
                    logger.error("engine unhealthy (%s): health NOT_SERVING, new requests refused",
                                 self.engine.unhealthy_reason)
            await asyncio.sleep(interval)

    async def _on_engine_dead(self) -> None:
        """The engine thread is gone: NOT_SERVING, every open stream ends now, exit non-zero."""
        if self.engine_failed.is_set():
            return
        self.engine_failed.set()
        error_id = self.loop_runner.fatal_error_id or new_error_id()
        if self.loop_runner.fatal is None:
            logger.critical("the engine thread is gone [error id %s]", error_id)
        await self._notify_health(False)
        for buf in list(self._buffers):
            buf.push(EngineFailed(error_id, fatal=True))
        self.exit_code = EXIT_ENGINE_FAILED
        logger.critical("health NOT_SERVING: %d open streams ended; the server exits with status %d after the "
                        "drain so that a supervisor restarts it", len(self._buffers), EXIT_ENGINE_FAILED)


def _invalid(e: InputError) -> ServeError:
    return invalid(str(e), e.param, e.code)
