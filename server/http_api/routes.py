"""The OpenAI-compatible HTTP API: FastAPI routes, a thin adapter over `ServingCore`.

A route authenticates (`Authorization: Bearer KEY` or `x-api-key`), parses its JSON body
(`protocol.py`) into the core's types, calls the core (the same keys and tenants, admission,
tokenizer pool, input checks, engine thread and drain as the gRPC front) and renders outputs
as OpenAI's bodies and stream chunks (`responses.py`). Errors are OpenAI's JSON with the status of their `ErrorKind`
(400 naming the parameter, 401, 404 for another model, 413, 429, 503, 500 with an error id).

A client that disconnects aborts its requests: a streamed call notices it while waiting for
tokens (the response listens for `http.disconnect` beside the writer), a non-streamed call
likewise while it waits for the whole answer. A stream the client stops reading is aborted
after `stream_idle_timeout`, as on gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from openai_harmony import HarmonyEncoding
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxserve.engine.detokenizer import TokenText
from jaxserve.engine.outputs import RequestOutput
from scheduler import StructuredOutputsParams
from server.core import ServingCore
from server.core_types import GenerateInput, ModelInfo, PromptInput
from server.errors import ErrorKind, ServeError, invalid
from server.generation import Generation
from server.http_api.harmony import check_request, harmony_prompt, load_encoding, speaks_harmony
from server.http_api.harmony_reply import HarmonyReply
from server.http_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from server.http_api.responses import (
    ChoiceState,
    EchoedPrompt,
    chat_body,
    chat_logprobs,
    chunk,
    completion_body,
    completion_logprobs,
    sum_usage,
    usage_json,
)
from server.http_api.tools import (
    ChoiceTools,
    messages_for_plain_template,
    named_schema,
    required_schema,
)
from server.options import VERSION
from server.tenants import Tenant

logger = logging.getLogger("jaxserve.server")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class OpenAIFront:
    def __init__(self, core: ServingCore):
        self.core = core
        self.harmony: HarmonyEncoding | None = None  # gpt-oss: its chat format's encoding
        core.on_model_loaded(self._model_loaded)
        app = self.app = FastAPI(title="jaxserve", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_exception_handler(StarletteHTTPException, self._http_exception)
        app.add_exception_handler(Exception, self._unexpected)
        for path, method, fn in (
                ("/v1/completions", "POST", self.completions), ("/v1/chat/completions", "POST", self.chat),
                ("/v1/models", "GET", self.models), ("/health", "GET", self.health),
                ("/metrics", "GET", self.metrics_text), ("/tokenize", "POST", self.tokenize),
                ("/detokenize", "POST", self.detokenize), ("/version", "GET", self.version),
                ("/v1/update_weights", "POST", self.update_weights),
                ("/v1/load_lora_adapter", "POST", self.load_lora_adapter),
                ("/v1/unload_lora_adapter", "POST", self.unload_lora_adapter), ("/sleep", "POST", self.sleep),
                ("/wake_up", "POST", self.wake_up), ("/is_sleeping", "GET", self.is_sleeping)):
            app.add_api_route(path, self._guard(fn, path), methods=[method], include_in_schema=False)

    def _model_loaded(self, info: ModelInfo) -> None:
        """gpt-oss speaks harmony: its encoding is loaded now, once (HarmonyUnavailable stops
        the start when it cannot be)."""
        if speaks_harmony(info.architecture):
            self.harmony = load_encoding()
            logger.info("%s speaks harmony: chat prompts and replies use gpt-oss's format", info.model)

    # ------------------------------------------------------------------ plumbing
    def _guard(self, fn, path: str):
        async def route(request: Request) -> Response:
            try:
                resp = await fn(request)
            except ServeError as e:
                resp = error_response(e)
            except ClientGone:
                resp = Response(status_code=499)
            self.core.count_http(path, resp.status_code)
            return resp

        route.__name__ = fn.__name__
        return route

    async def _http_exception(self, request: Request, exc: StarletteHTTPException) -> Response:
        kind = ErrorKind.NOT_FOUND if exc.status_code == 404 else ErrorKind.INVALID
        resp = error_response(ServeError(kind, f"{request.method} {request.url.path}: {exc.detail}"))
        resp.status_code = exc.status_code
        return resp

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        from server.engine_loop import new_error_id

        error_id = new_error_id()
        logger.error("HTTP %s %s failed [error id %s]", request.method, request.url.path, error_id, exc_info=exc)
        return error_response(ServeError(ErrorKind.INTERNAL, f"internal error (error id {error_id})"))

    def _tenant(self, request: Request) -> Tenant:
        h = request.headers
        md = [(k, h[k]) for k in ("authorization", "x-api-key") if k in h]
        tenant = self.core.authenticate(md)
        if tenant is None:
            raise ServeError(ErrorKind.UNAUTHENTICATED, "missing or wrong API key (Authorization: Bearer KEY)",
                             code="invalid_api_key")
        return tenant

    async def _body(self, request: Request, model: type) -> Any:
        limit = self.core.options.max_message_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ServeError(ErrorKind.TOO_LARGE, f"the body is {declared} bytes, over max_message_bytes {limit}")
        chunks, size = [], 0
        try:
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise ServeError(ErrorKind.TOO_LARGE, f"the body is over max_message_bytes {limit}")
                chunks.append(part)
        except ClientDisconnect:  # the upload was cut off: nobody to answer, nothing to log
            raise ClientGone() from None
        return parse_body(model, b"".join(chunks))

    def _check_model(self, name: str | None) -> None:
        names = self.core.served_model_names
        if name and name not in names and name not in self.core.lora_names():
            raise ServeError(ErrorKind.NOT_FOUND, f"the model {name!r} does not exist; this server serves "
                             f"{names[0]!r}", "model", "model_not_found")

    def _lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` selects (None: the base model)."""
        return model if model and model not in self.core.served_model_names else None

    @property
    def token_text(self) -> TokenText:
        return self.core.token_text

    def _request_id(self, request: Request, body_id: str | None, prefix: str) -> str:
        return request.headers.get("x-request-id") or body_id or f"{prefix}-{uuid.uuid4().hex}"

    async def _request(self, request: Request, model: type) -> tuple[Tenant, Any]:
        """The caller, and its body parsed and checked, while the server is serving."""
        tenant = self._tenant(request)
        req = await self._body(request, model)
        if hasattr(req, "check"):
            req.check()
        self._check_model(req.model)
        self.core.require_serving()
        return tenant, req

    # ------------------------------------------------------------------ generation
    async def completions(self, request: Request) -> Response:
        tenant, req = await self._request(request, CompletionRequest)
        prompts = req.prompts()
        rid = self._request_id(request, req.request_id, "cmpl")
        echo = None
        if req.echo:
            echo = [p if isinstance(p, str) else await self.core.detokenize(tenant, p, "prompt") for p in prompts]
        params = req.sampling_params(req.max_tokens or 1, req.logprobs, req.echo_prompt_logprobs)
        gens = []
        async with contextlib.AsyncExitStack() as stack:
            for i, p in enumerate(prompts):
                prompt = (PromptInput(text=p, add_special_tokens=req.add_special_tokens) if isinstance(p, str)
                          else PromptInput(token_ids=p))
                gen = await self.core.generate(tenant, GenerateInput(
                    rid if len(prompts) == 1 else f"{rid}-{i}", prompt, params,
                    fill_max_tokens=req.max_tokens is None, structured_param=req.structured_param,
                    lora_name=self._lora_of(req.model)))
                stack.push_async_callback(gen.__aexit__)
                gens.append(gen)
            created, model = int(time.time()), req.model or self.core.served_model_names[0]
            if req.stream:
                events = self._completion_events(gens, req, rid, created, model, echo)
                return EventStream(events, stack.pop_all(), self.core.options.stream_idle_timeout,
                                   self.core.count_stream_idle_abort)
            choices = await until_disconnect(request, _collect(gens, req.n))
            prompts = [EchoedPrompt(echo[i] if echo else "", g.prompt_token_ids, g.prompt_logprobs)
                       for i, g in enumerate(gens)]
            return JSONResponse(completion_body(rid, created, model, choices, sum_usage([g.last_usage for g in gens]),
                                                self.token_text, prompts, req.n, echo=req.echo,
                                                score_only=req.score_only))

    async def chat(self, request: Request) -> Response:
        tenant, req = await self._request(request, ChatCompletionRequest)
        if self.harmony is not None:
            return await self._harmony_chat(request, tenant, req)
        mode = req.tool_mode
        messages = req.template_messages()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if mode != "none" else None
        prompt = PromptInput(messages=messages, add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message, tools=tools,
                             messages_without_tool_support=messages_for_plain_template(messages, req.tools)
                             if tools else None, param="messages", images=req.images())
        limit = req.output_limit
        params = req.sampling_params(limit or 1, req.num_logprobs)
        structured_param = req.structured_param
        name = req.tool_choice.function.name if mode == "named" else None
        if mode in ("required", "named"):  # every call parses and validates
            schema = named_schema(req.tools, name) if name else required_schema(req.tools, req.parallel_tool_calls)
            params = dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))
            structured_param = "tools"
        choice_tools = None
        if mode != "none":
            choice_tools = functools.partial(ChoiceTools, mode, self.core.options.tool_call_parser, name)
        rid = self._request_id(request, req.request_id, "chatcmpl")
        gen = await self.core.generate(tenant, GenerateInput(rid, prompt, params, fill_max_tokens=limit is None,
                                                      structured_param=structured_param,
                                                      field_names={"logprobs": "top_logprobs",
                                                                   "max_tokens": req.output_limit_field},
                                                      lora_name=self._lora_of(req.model)))
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(gen.__aexit__)
            created, model = int(time.time()), req.model or self.core.served_model_names[0]
            if req.stream:
                events = self._chat_events(gen, req, rid, created, model, choice_tools)
                return EventStream(events, stack.pop_all(), self.core.options.stream_idle_timeout,
                                   self.core.count_stream_idle_abort)
            choices = await until_disconnect(request, _collect([gen], req.n))
            return JSONResponse(chat_body(rid, created, model, choices, gen.last_usage, self.token_text,
                                          choice_tools, gen.prompt_logprobs))

    async def _harmony_chat(self, request: Request, tenant: Tenant, req: ChatCompletionRequest) -> Response:
        """A chat with gpt-oss: the prompt rendered by openai-harmony (`harmony.py`), the reply
        stopped on harmony's end-of-action tokens and parsed from its tokens (`harmony_reply.py`)."""
        check_request(req)
        encoding, prompt = self.harmony, harmony_prompt(req)
        limit = req.output_limit
        params = req.sampling_params(limit or 1, req.num_logprobs)
        stops = [t for t in encoding.stop_tokens_for_assistant_actions() if t not in params.stop_token_ids]
        params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *stops])
        rid = self._request_id(request, req.request_id, "chatcmpl")
        gen = await self.core.generate(tenant, GenerateInput(
            rid, PromptInput(messages=req.template_messages(), render=functools.partial(prompt.token_ids, encoding),
                             param="messages"),
            params, fill_max_tokens=limit is None,
            field_names={"logprobs": "top_logprobs", "max_tokens": req.output_limit_field},
            lora_name=self._lora_of(req.model)))
        replies = functools.partial(HarmonyReply, encoding, prompt.tool_names, rid)
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(gen.__aexit__)
            created, model = int(time.time()), req.model or self.core.served_model_names[0]
            if req.stream:
                events = self._chat_events(gen, req, rid, created, model, harmony=replies)
                return EventStream(events, stack.pop_all(), self.core.options.stream_idle_timeout,
                                   self.core.count_stream_idle_abort)
            choices = await until_disconnect(request, _collect([gen], req.n))
            return JSONResponse(chat_body(rid, created, model, choices, gen.last_usage, self.token_text,
                                          prompt_logprobs=gen.prompt_logprobs, harmony=replies))

    async def _completion_events(self, gens: list[Generation], req: CompletionRequest, rid: str, created: int,
                                 model: str, echo: list[str] | None) -> AsyncIterator[bytes]:
        n = req.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        offsets: dict[int, int] = {}
        reported: set[int] = set()
        async for pi, out in _merge(gens):
            choices = []
            for c in out.outputs:
                idx = pi * n + c.index
                new_finish = c.finish_reason is not None and idx not in reported
                text, delta_lps = c.delta_text, c.delta_logprobs
                if req.score_only:  # the one sampled token is not shown
                    text, delta_lps = "", ([] if delta_lps is not None else None)
                if echo is not None and idx not in offsets:
                    text = echo[pi] + text
                    if delta_lps is not None:
                        g = gens[pi]
                        delta_lps = EchoedPrompt(echo[pi], g.prompt_token_ids, g.prompt_logprobs).logprob_entries() + \
                            delta_lps
                if not (text or delta_lps or (c.delta_token_ids and not req.score_only) or new_finish):
                    continue
                if new_finish:
                    reported.add(idx)
                off = offsets.get(idx, 0)
                lps = completion_logprobs(delta_lps, self.token_text, off) if delta_lps else None
                offsets[idx] = off + len(text)
                choices.append({"index": idx, "text": text, "logprobs": lps,
                                "finish_reason": c.finish_reason if new_finish else None,
                                "stop_reason": c.stop_reason if new_finish else None})
            if choices:
                usage = usage_json(sum_usage([g.last_usage for g in gens])) if continuous else None
                yield sse(chunk(rid, "text_completion", created, model, choices, usage, include_usage))
        if include_usage:
            yield sse(chunk(rid, "text_completion", created, model, [],
                            usage_json(sum_usage([g.last_usage for g in gens])), True))
        yield b"data: [DONE]\n\n"

    async def _chat_events(self, gen: Generation, req: ChatCompletionRequest, rid: str, created: int,
                           model: str, choice_tools=None, harmony=None) -> AsyncIterator[bytes]:
        """`choice_tools` / `harmony` make each choice's tool-call parser / gpt-oss reply parser."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        obj = "chat.completion.chunk"
        for i in range(req.n):  # OpenAI sends each choice's role first
            yield sse(chunk(rid, obj, created, model, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}],
                            None, include_usage))
        reported: set[int] = set()
        tools = {i: choice_tools() for i in range(req.n)} if choice_tools is not None else None
        replies = {i: harmony() for i in range(req.n)} if harmony is not None else None
        async for out in gen:
            for c in out.outputs:
                new_finish = c.finish_reason is not None and c.index not in reported
                if not (c.delta_text or c.delta_token_ids or new_finish):
                    continue
                if new_finish:
                    reported.add(c.index)
                lps = {"content": chat_logprobs(c.delta_logprobs, self.token_text)} if c.delta_logprobs else None
                usage = usage_json(gen.last_usage) if continuous else None
                if replies is not None:  # a reply gpt-oss's format cannot parse ends the stream here
                    deltas, finish = replies[c.index].feed(c.delta_token_ids), replies[c.index].finish_reason(
                        c.finish_reason)
                    if not deltas and (lps or new_finish):
                        deltas = [{}]
                elif tools is None:
                    deltas, finish = ([{"content": c.delta_text}] if c.delta_text else [{}]), c.finish_reason
                else:
                    deltas = tools[c.index].feed(c.delta_text)
                    finish = c.finish_reason
                    if new_finish:
                        more, finish = tools[c.index].finish(c.finish_reason)
                        deltas += more
                    if not deltas and (lps or new_finish):
                        deltas = [{}]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    choice = {"index": c.index, "delta": delta, "logprobs": lps if last else None,
                              "finish_reason": finish if new_finish and last else None}
                    if new_finish and last:
                        choice["stop_reason"] = c.stop_reason
                    yield sse(chunk(rid, obj, created, model, [choice], usage, include_usage))
        if include_usage:
            yield sse(chunk(rid, obj, created, model, [], usage_json(gen.last_usage), True))
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------------ the rest
    async def models(self, request: Request) -> Response:
        """The base model's names, then the LoRA adapters the caller may use (`parent`: the
        base model, `root`: the adapter's path, as vLLM lists them)."""
        tenant = self._tenant(request)
        info = self.core.model_info()
        created = int(self.core.started_wall)
        base = self.core.served_model_names[0]
        extra = {"max_model_len": info.max_model_len if info is not None else None,
                 "vocab_size": info.vocab_size if info is not None else None}
        data = [{"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                 "root": self.core.model_name, "parent": None, **extra}
                for name in self.core.served_model_names]
        for lr in self.core.lora_adapters(tenant):
            data.append({"id": lr.lora_name, "object": "model", "created": created, "owned_by": "jaxserve",
                         "root": lr.lora_path, "parent": base, **extra})
        return JSONResponse({"object": "list", "data": data})

    async def load_lora_adapter(self, request: Request) -> Response:
        """Admin only, vLLM's: {"lora_name", "lora_path"}."""
        tenant = self._tenant(request)
        body = await self._json_object(request)
        await self.core.load_lora(tenant, body.get("lora_name"), body.get("lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """Admin only, vLLM's: {"lora_name"}; refused (400) while a request uses it."""
        tenant = self._tenant(request)
        body = await self._json_object(request)
        await self.core.unload_lora(tenant, body.get("lora_name"))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    async def _json_object(self, request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise invalid("the body is not valid JSON") from None
        if not isinstance(body, dict):
            raise invalid("the body must be a JSON object")
        return body

    async def health(self, request: Request) -> Response:
        err = self.core.serving_error()
        return Response(status_code=200 if err is None else 503, content=b"" if err is None else err.message)

    async def metrics_text(self, request: Request) -> Response:
        tenant = self._tenant(request) if self.core.auth.required else None
        body, content_type = self.core.metrics_exposition(tenant)
        return Response(body, media_type=content_type)

    async def update_weights(self, request: Request) -> Response:
        """Admin only: {"path": ...} -> {"weights_version": N} once the engine runs them."""
        tenant = self._tenant(request)
        try:
            body = json.loads(await request.body())
        except ValueError:
            raise invalid("the body is not valid JSON") from None
        path = body.get("path") if isinstance(body, dict) else None
        return JSONResponse({"weights_version": await self.core.update_weights(tenant, path)})

    async def sleep(self, request: Request) -> Response:
        """Admin only, vLLM's: `POST /sleep?level=1|2`."""
        tenant = self._tenant(request)
        raw = request.query_params.get("level", "1")
        await self.core.sleep(tenant, int(raw) if raw.isdigit() else raw)
        return JSONResponse({"is_sleeping": True})

    async def wake_up(self, request: Request) -> Response:
        await self.core.wake_up(self._tenant(request))
        return JSONResponse({"is_sleeping": False})

    async def is_sleeping(self, request: Request) -> Response:
        self._tenant(request)
        return JSONResponse({"is_sleeping": self.core.is_sleeping()})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": VERSION})

    async def tokenize(self, request: Request) -> Response:
        tenant, req = await self._request(request, TokenizeRequest)
        if req.prompt is not None:
            prompt = PromptInput(text=req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            prompt = PromptInput(messages=[m.template_dict(i) for i, m in enumerate(req.messages)],
                                 add_generation_prompt=req.add_generation_prompt, param="messages")
        ids = await self.core.tokenize(tenant, prompt)
        return JSONResponse({"count": len(ids), "max_model_len": self.core.model_info().max_model_len,
                             "tokens": ids, "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        tenant, req = await self._request(request, DetokenizeRequest)
        return JSONResponse({"prompt": await self.core.detokenize(tenant, req.tokens, "tokens")})


def error_response(e: ServeError) -> JSONResponse:
    headers = {"retry-after": "1"} if e.kind in (ErrorKind.EXHAUSTED, ErrorKind.UNAVAILABLE) else None
    return JSONResponse(e.openai_json(), status_code=e.kind.http_status, headers=headers)


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _merge(gens: list[Generation]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(generation index, output) from several generations as they come."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, g: Generation) -> None:
        try:
            async for out in g:
                await queue.put((i, out, None))
        except ServeError as e:
            await queue.put((i, None, e))
        await queue.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                left -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def _collect(gens: list[Generation], n: int) -> list[ChoiceState]:
    choices = {pi * n + j: ChoiceState(pi * n + j) for pi in range(len(gens)) for j in range(n)}
    async for pi, out in _merge(gens):
        for c in out.outputs:
            choices[pi * n + c.index].add(c.delta_text, c.delta_logprobs, c.finish_reason, c.stop_reason,
                                          c.delta_token_ids)
    return [choices[k] for k in sorted(choices)]


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, coro) -> Any:
    """Runs `coro` unless the client disconnects first (then cancels it: ClientGone)."""
    task = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ServeError):
                await task
            raise ClientGone()
    return task.result()


class EventStream(Response):
    """A server-sent-event response that owns its generations: they are closed (aborted
    when unfinished) when the stream ends, the client disconnects, or it stops reading."""

    def __init__(self, events: AsyncIterator[bytes], owned: contextlib.AsyncExitStack, idle_timeout: float,
                 on_idle_abort) -> None:
        super().__init__(status_code=200, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self.events = events
        self.owned = owned
        self.idle_timeout = idle_timeout
        self.on_idle_abort = on_idle_abort

    async def __call__(self, scope, receive, send) -> None:
        async with self.owned:
            producer = asyncio.ensure_future(self._produce(send))
            watch = asyncio.ensure_future(_wait_disconnect_raw(receive))
            try:
                await asyncio.wait({producer, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (producer, watch):
                    t.cancel()
                results = await asyncio.gather(producer, watch, return_exceptions=True)
                await self.events.aclose()
            if isinstance(results[0], Exception):
                logger.error("HTTP stream failed", exc_info=results[0])

    async def _produce(self, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.events:
                await self._send(send, data)
        except ServeError as e:  # mid-stream: OpenAI's error event, then the end of the stream
            await self._send(send, sse(e.openai_json()) + b"data: [DONE]\n\n")
        except OSError:  # the client went away
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.idle_timeout):
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except TimeoutError:
            self.on_idle_abort()
            logger.warning("HTTP stream not read for %.0f s: aborted", self.idle_timeout)
            raise OSError("stream_idle_timeout") from None


async def _wait_disconnect_raw(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
