"""The gRPC server end to end: a real server on 127.0.0.1 (one per module, in this process, on
its own event-loop thread) and a real grpcio client. The SIGTERM drain test runs its own
server in a subprocess."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from server_harness import ServerThread, batch_generate, free_port, wait_until

from jaxserve.config.engine_config import EngineConfig
from scheduler import SamplingParams
from server.app import ServerOptions
from server.convert import sampling_params_to_proto as sp
from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key-123"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
CFG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_pages=128, max_model_len=512)
CFG_ARGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--num-pages", "128",
            "--max-model-len", "512"]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def srv(embedded_server):
    return embedded_server


@pytest.fixture(scope="module")
def channel(srv):
    with grpc.insecure_channel(srv.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=10)
        yield ch


@pytest.fixture(scope="module")
def stub(channel):
    return pb_grpc.JaxServeStub(channel)


def generate(stub, req: pb.GenerateRequest, timeout: float = 60.0):
    """Runs one stream to the end; returns (responses, text, token_ids, last response)."""
    resps = list(stub.Generate(req, metadata=AUTH, timeout=timeout))
    text = "".join(d.text for r in resps for d in r.outputs if d.index == 0)
    ids = [t for r in resps for d in r.outputs if d.index == 0 for t in d.token_ids]
    return resps, text, ids, resps[-1]


def text_req(prompt: str, **params) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, sampling_params=sp(**params))


def server_info(stub) -> pb.ServerInfo:
    return stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=AUTH, timeout=10)


# ---------------------------------------------------------------------------- basics
def test_health_reflection_and_info(srv, channel, stub):
    health = health_pb2_grpc.HealthStub(channel)
    for svc in ("", "jaxserve.v1.JaxServe"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)  # no API key needed
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    names = [s.name for r in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
        list_services="")]), timeout=5) for s in r.list_services_response.service]
    assert "jaxserve.v1.JaxServe" in names and "grpc.health.v1.Health" in names
    mi = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH, timeout=5)
    assert mi.vocab_size == srv.server.engine.model_config.vocab_size and mi.max_model_len == 512
    assert mi.has_chat_template and mi.max_logprobs == CFG.max_logprobs
    si = server_info(stub)
    assert si.state == "serving" and si.engine_config["max_num_seqs"] == "8"
    assert si.engine_config["attention_implementation"].startswith("native (native CPU kernel jaxserve_ragged_paged_attention_cpu_")
    assert si.num_total_blocks == 127 and si.compilations_after_warmup == 0


def test_api_key_required(srv, channel, stub):
    for md in (None, (("authorization", "Bearer wrong"),), (("x-api-key", "nope"),)):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(text_req("hi", max_tokens=2), metadata=md, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("x-api-key", API_KEY),), timeout=10)
    assert ok.vocab_size > 0


def test_tokenize(srv, stub):
    tok = srv.server.engine.tokenizer
    r = stub.Tokenize(pb.TokenizeRequest(text="Hello world"), metadata=AUTH, timeout=10)
    assert list(r.token_ids) == list(tok("Hello world", add_special_tokens=True)["input_ids"])
    assert r.count == len(r.token_ids)
    msgs = [{"role": "user", "content": "Hi there"}]
    r = stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(**msgs[0])])),
                      metadata=AUTH, timeout=10)
    want = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert list(r.token_ids) == list(want)


def test_client_command(srv, capsys):
    from jaxserve.cli import main

    rc = main(["client", "The capital of France is", "--address", srv.address, "--api-key", API_KEY,
               "--max-tokens", "4", "--temperature", "0"])
    out = capsys.readouterr()
    assert rc == 0 and out.out.strip() and "completion 4" in out.err
    rc = main(["client", "hi", "--address", srv.address, "--max-tokens", "2"])  # no API key
    assert rc == 1 and "UNAUTHENTICATED" in capsys.readouterr().err


# ---------------------------------------------------------------------------- generation
def test_streaming_equals_batch_api_greedy(srv, stub):
    params = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        streamed = list(ex.map(lambda p: generate(stub, text_req(p, **params)), PROMPTS))
    ref = batch_generate(srv, PROMPTS, SamplingParams(**params))
    for (resps, text, ids, last), want in zip(streamed, ref):
        assert ids == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert last.finished and last.outputs[-1].finish_reason == "length"
        assert last.usage.completion_tokens == 16
        assert last.usage.prompt_tokens == len(want.prompt_token_ids)
        assert len(resps) >= 2  # streamed, not one blob
    # token-id and chat inputs take the same path
    tok = srv.server.engine.tokenizer
    ids0 = list(tok(PROMPTS[0], add_special_tokens=True)["input_ids"])
    _, _, ids, _ = generate(stub, pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids0), sampling_params=sp(**params)))
    assert ids == ref[0].outputs[0].token_ids
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="Say hi")])
    _, text, ids, last = generate(stub, pb.GenerateRequest(chat=chat, sampling_params=sp(max_tokens=8, temperature=0.0)))
    msgs = [{"role": "user", "content": "Say hi"}]
    want = batch_generate(srv, [{"prompt_token_ids": tok.apply_chat_template(
        msgs, tokenize=True, add_generation_prompt=True, return_dict=False)}],
        SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert ids == want.outputs[0].token_ids and text == want.outputs[0].text


def test_an_unexpected_handler_error_is_internal_with_an_error_id(srv, stub, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(srv.server.core, "_tenant_params", broken)
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, text_req("x", max_tokens=2))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "error id" in e.value.details()
    assert "secret" not in e.value.details()


def test_every_rpc_answers_an_unexpected_error_with_internal_and_an_error_id(srv, stub, monkeypatch):
    """Every method of the servicer is guarded (the LoRA ones were not: UNKNOWN with Python's text)."""
    from server.grpc_front import GrpcFront

    rpcs = [n for n in vars(pb_grpc.JaxServeServicer) if n[0].isupper()]  # the service's methods
    assert "LoadLoRAAdapter" in rpcs and len(rpcs) >= 8
    unguarded = [n for n in rpcs if not hasattr(getattr(GrpcFront, n), "__wrapped__")]
    assert unguarded == []

    def broken(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(srv.server.core, "lora_adapters", broken)
    with pytest.raises(grpc.RpcError) as e:
        stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest(), metadata=AUTH, timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL and "error id" in e.value.details()
    assert "secret" not in e.value.details()


def test_the_engine_has_every_member_the_server_uses(srv):
    """The serving core holds its engine as `ServingEngine`: a real engine has all of it."""
    import typing

    from jaxserve.engine.interface import ServingEngine

    members = set(typing.get_type_hints(ServingEngine)) | {
        n for n, v in vars(ServingEngine).items() if callable(v) and not n.startswith("_")}
    assert {"healthy", "lora_registry", "step", "add_request", "load_lora"} <= members
    assert sorted(m for m in members if not hasattr(srv.server.engine, m)) == []


def test_logit_bias_over_grpc(srv, stub):
    _, _, ids, _ = generate(stub, text_req("Once upon a time", max_tokens=3, temperature=0.0, logit_bias={1234: 100.0}))
    assert ids == [1234] * 3
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, text_req("x", logit_bias={5: 101.0}))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logit_bias[5]" in e.value.details()


def test_max_tokens_past_the_room_left_is_invalid_argument(srv, stub):
    """vLLM's 400 as gRPC: max_tokens that prompt + max_tokens cannot fit in max_model_len is
    INVALID_ARGUMENT naming the field and the lengths."""
    limit = srv.server.engine.max_model_len
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, text_req("x", max_tokens=limit + 1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'max_tokens' is too large" in e.value.details() and f"{limit} tokens" in e.value.details()


def test_explicit_zero_is_not_unset(srv, stub):
    # temperature 0 must be greedy (proto3 optional): two runs agree; n=2 gives twin sequences.
    req = text_req("Once upon a time", max_tokens=8, temperature=0.0, n=2)
    resps, _, _, last = generate(stub, req)
    seqs = {0: [], 1: []}
    for r in resps:
        for d in r.outputs:
            seqs[d.index].extend(d.token_ids)
    assert seqs[0] == seqs[1] and len(seqs[0]) > 0
    assert sum(1 for r in resps for d in r.outputs if d.finish_reason) == 2  # each finish sent once
    # seed 0 is a seed: sampling twice with seed=0 gives the same tokens
    a = generate(stub, text_req("Hello", max_tokens=8, temperature=1.0, seed=0))[2]
    b = generate(stub, text_req("Hello", max_tokens=8, temperature=1.0, seed=0))[2]
    assert a == b


def test_logprobs_usage_and_stop(srv, stub):
    resps, _, ids, last = generate(stub, text_req("The capital of France is", max_tokens=6, temperature=0.0,
                                                  logprobs=3, ignore_eos=True))
    lps = [lp for r in resps for d in r.outputs for lp in d.logprobs]
    assert [lp.token_id for lp in lps] == ids and len(ids) == 6
    for lp in lps:
        assert lp.rank == 1 and len(lp.top) == 3 and lp.top[0].token_id == lp.token_id
        assert lp.logprob <= 0 and math.isclose(lp.logprob, lp.top[0].logprob, abs_tol=1e-4)
    # a stop token id ends the stream with finish_reason stop and the id as stop_reason
    _, _, ids, last = generate(stub, text_req("The capital of France is", max_tokens=6, temperature=0.0,
                                              stop_token_ids=[ids[2]]))
    assert last.outputs[-1].finish_reason == "stop" and last.outputs[-1].stop_token_id == ids[-1]
    # the same prompt again hits the prefix cache
    _, _, _, last = generate(stub, text_req("The capital of France is " * 4, max_tokens=2))
    _, _, _, last = generate(stub, text_req("The capital of France is " * 4, max_tokens=2))
    assert last.usage.cached_tokens >= 16
    # prompt logprobs: in the first response only, one per prompt token after the first
    resps, _, _, last = generate(stub, text_req("The capital of France is " * 4, max_tokens=3, prompt_logprobs=2))
    assert [len(r.prompt_logprobs) for r in resps][1:] == [0] * (len(resps) - 1)
    plp = resps[0].prompt_logprobs
    assert len(plp) == last.usage.prompt_tokens - 1 and last.usage.cached_tokens == 0  # skips the cache
    assert all(len(e.top) == 2 and e.rank >= 1 and e.logprob <= 0 for e in plp)
    assert [e.rank for e in plp[-5:-1]] == [1] * 4, [e.rank for e in plp]  # the fourth repeat is no surprise


def test_update_weights_over_grpc(srv, stub, smollm_path):
    with pytest.raises(grpc.RpcError) as e:
        stub.UpdateWeights(pb.UpdateWeightsRequest(path="/no/such/weights"), metadata=AUTH, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "path" in e.value.details()
    version = srv.server.engine.weights_version
    r = stub.UpdateWeights(pb.UpdateWeightsRequest(path=smollm_path), metadata=AUTH, timeout=120)
    assert r.weights_version == version + 1 == srv.server.engine.weights_version


# ---------------------------------------------------------------------------- cancellation
def test_concurrent_streams_with_cancellations(srv, stub):
    info0 = server_info(stub)
    used0 = info0.num_used_blocks
    max_tokens = 12
    results: dict[int, object] = {}

    def run(i: int):
        call = stub.Generate(text_req(f"Story number {i}: once upon a time", max_tokens=max_tokens,
                                      temperature=0.8, seed=i, ignore_eos=True), metadata=AUTH, timeout=120)
        n = 0
        try:
            for resp in call:
                n += sum(len(d.token_ids) for d in resp.outputs)
                if i % 4 == 0 and n >= 2:  # 8 of the 32 streams cancel midway
                    call.cancel()
                last = resp
        except grpc.RpcError as e:
            results[i] = ("error", e.code(), n)
            return
        results[i] = ("done", last, n)

    with ThreadPoolExecutor(32) as ex:
        list(ex.map(run, range(32)))
    for i in range(32):
        kind, x, n = results[i]
        if i % 4 == 0:
            assert kind == "error" and x == grpc.StatusCode.CANCELLED, results[i]
        else:
            assert kind == "done" and x.finished and n == max_tokens, results[i]
            assert x.usage.completion_tokens == max_tokens
    info = wait_until(lambda: (lambda s: s if s.num_in_flight == 0 and s.num_running == 0
                               and s.num_waiting == 0 and s.num_used_blocks == used0 else None)(server_info(stub)),
                      show=lambda: (server_info(stub), srv.server.engine.scheduler.running,
                                    srv.server.engine.scheduler.waiting))
    assert info.num_free_blocks == info0.num_free_blocks


def test_deadline_and_abort_free_blocks(srv, stub):
    used0 = server_info(stub).num_used_blocks
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(text_req("Count to a thousand:", max_tokens=400, ignore_eos=True),
                           metadata=AUTH, timeout=1.0))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: server_info(stub).num_used_blocks == used0, timeout=5)
    # the Abort RPC ends the stream with finish_reason "abort"
    call = stub.Generate(pb.GenerateRequest(request_id="abort-me", text="Count to a thousand:",
                                            sampling_params=sp(max_tokens=400, ignore_eos=True)),
                         metadata=AUTH, timeout=60)
    first = next(call)
    assert first.request_id == "abort-me"
    assert stub.Abort(pb.AbortRequest(request_id="abort-me"), metadata=AUTH, timeout=10).found
    rest = list(call)
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert not stub.Abort(pb.AbortRequest(request_id="abort-me"), metadata=AUTH, timeout=10).found
    wait_until(lambda: server_info(stub).num_used_blocks == used0, timeout=5)


def test_cancel_aborts_within_a_step(srv, stub):
    """While another request keeps the engine stepping, a cancelled stream leaves the running
    batch within a step or two of the cancel (the abort is handled before the next step)."""
    bg = stub.Generate(text_req("Count to a thousand:", max_tokens=300, ignore_eos=True), metadata=AUTH, timeout=60)
    fg = stub.Generate(text_req("Once upon a time", max_tokens=300, ignore_eos=True), metadata=AUTH, timeout=60)
    try:
        next(bg)
        for _ in range(3):
            next(fg)
        assert server_info(stub).num_running == 2
        steps0 = srv.server.loop_runner.snapshot.num_steps
        fg.cancel()
        wait_until(lambda: server_info(stub).num_running == 1, timeout=10, interval=0.005)
        assert srv.server.loop_runner.snapshot.num_steps - steps0 <= 3
    finally:
        bg.cancel()
    wait_until(lambda: server_info(stub).num_in_flight == 0, timeout=10)


# ---------------------------------------------------------------------------- validation
BAD = [
    (pb.GenerateRequest(), "input"),
    (pb.GenerateRequest(text=""), "text"),  # an explicitly empty text is set in the oneof
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**6])), "token_ids"),  # the proto field, as the client wrote it
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])), "token_ids"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 600)), "token_ids"),
    (text_req("hello " * 600), "max_model_len"),
    (text_req("a" * (32 * 512 + 1)), "text"),
    (pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    (pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(content="x")])), "role"),
    (pb.GenerateRequest(request_id="x" * 300, text="hi"), "request_id"),
    (text_req("hi", temperature=-1.0), "temperature"),
    (text_req("hi", temperature=float("nan")), "temperature"),
    (text_req("hi", top_p=0.0), "top_p"),
    (text_req("hi", top_p=1.5), "top_p"),
    (text_req("hi", top_k=-2), "top_k"),
    (text_req("hi", min_p=2.0), "min_p"),
    (text_req("hi", repetition_penalty=0.0), "repetition_penalty"),
    (text_req("hi", presence_penalty=3.0), "presence_penalty"),
    (text_req("hi", frequency_penalty=-2.5), "frequency_penalty"),
    (text_req("hi", max_tokens=0), "max_tokens"),
    (text_req("hi", max_tokens=4, min_tokens=5), "min_tokens"),
    (text_req("hi", n=0), "n"),
    (text_req("hi", n=CFG.max_n + 1), "n"),
    (text_req("hi", logprobs=CFG.max_logprobs + 1), "logprobs"),
    (text_req("hi", logprobs=-1), "logprobs"),
    (text_req("hi", stop_token_ids=[-1]), "stop_token_ids"),
    (text_req("hi", stop_token_ids=[10**6]), "stop_token_ids"),
    (text_req("hi", stop_token_ids=list(range(16))), "stop_token_ids"),
    (text_req("hi", stop=[""]), "stop"),
    (text_req("hi", stop=["x"] * 17), "stop"),
    (text_req("hi", stop=["x" * 300]), "stop"),
    (text_req("hi", cache_salt=""), "cache_salt"),
]


@pytest.mark.parametrize("req,field", BAD, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD)])
def test_bad_input_is_invalid_argument(srv, stub, req, field):
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(req, metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert field in e.value.details()


def test_good_request_after_bad_ones_and_duplicate_id(srv, stub):
    call = stub.Generate(pb.GenerateRequest(request_id="dup", text="Count to a thousand:",
                                            sampling_params=sp(max_tokens=200, ignore_eos=True)),
                         metadata=AUTH, timeout=60)
    next(call)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.GenerateRequest(request_id="dup", text="hi"), metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    call.cancel()
    _, _, ids, last = generate(stub, text_req("hi", max_tokens=3, ignore_eos=True))
    assert len(ids) == 3 and last.finished


def test_oversized_message(srv, stub):
    # over --max-message-bytes (4 MiB): INVALID_ARGUMENT naming the field
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(text_req("a" * (5 * 2**20)), metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in e.value.details()
    big = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[40000] * 2**21))  # 6 MiB of 3-byte varints
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(big, metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids" in e.value.details()
    # far past it gRPC refuses the message itself
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(text_req("a" * (17 * 2**20)), metadata=AUTH, timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_queue_full_is_resource_exhausted(srv, stub):
    limit = srv.server.admission.max_requests
    srv.server.admission.max_requests = 8  # max_queued_requests 0: at most max_num_seqs requests in flight
    calls = []
    try:
        for i in range(8):
            calls.append(stub.Generate(text_req(f"Count to a thousand {i}:", max_tokens=400, ignore_eos=True),
                                       metadata=AUTH, timeout=60))
        for c in calls:  # each is admitted once it streams
            next(c)
        assert server_info(stub).num_in_flight == 8
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(text_req("one too many", max_tokens=2), metadata=AUTH, timeout=30))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_requests" in e.value.details()
    finally:
        for c in calls:
            c.cancel()
        srv.server.admission.max_requests = limit
    wait_until(lambda: server_info(stub).num_in_flight == 0, timeout=10)
    _, _, ids, _ = generate(stub, text_req("hi", max_tokens=2, ignore_eos=True))
    assert len(ids) == 2


def test_unhealthy_engine_turns_health_not_serving(srv, channel, stub):
    """`engine.healthy` (set False by the multi-host heartbeat monitor) drives the health
    service and refuses new requests with UNAVAILABLE."""
    health = health_pb2_grpc.HealthStub(channel)

    def status():
        return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

    engine = srv.server.engine
    engine.unhealthy_reason = "peer 1 stopped sending heartbeats"
    engine.healthy = False
    try:
        wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(text_req("hi", max_tokens=2), metadata=AUTH, timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "heartbeats" in e.value.details()
    finally:
        engine.healthy, engine.unhealthy_reason = True, None
    wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=5)


# ---------------------------------------------------------------------------- metrics
def _scrape(srv) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{srv.server.metrics_port}/metrics", timeout=10).read().decode()
    out = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_move(srv, stub):
    before = _scrape(srv)
    for _ in range(2):
        generate(stub, text_req("The capital of France is", max_tokens=5, ignore_eos=True))
    after = _scrape(srv)
    for name in ("jaxserve:generation_tokens_total", "jaxserve:prompt_tokens_total",
                 "jaxserve:time_to_first_token_seconds_count", "jaxserve:e2e_request_latency_seconds_count",
                 "jaxserve:request_queue_time_seconds_count", "jaxserve:inter_token_latency_seconds_count",
                 'jaxserve:request_success_total{finished_reason="length"}', "jaxserve:prefix_cache_queries_total"):
        assert after[name] > before.get(name, 0.0), name
    assert after["jaxserve:generation_tokens_total"] - before["jaxserve:generation_tokens_total"] == 10
    moved = lambda name: after.get(name, 0.0) - before.get(name, 0.0)  # noqa: E731
    assert moved('jaxserve:scheduled_tokens_total{phase="decode"}') == 8  # 4 decodes after each prefill's token
    assert moved('jaxserve:scheduled_tokens_total{phase="prefill"}') >= 1
    assert moved("jaxserve:iteration_tokens_total_count") >= 5 and moved("jaxserve:step_token_fill_count") >= 5
    assert moved('jaxserve:tenant_prompt_tokens_total{tenant="default"}') == moved("jaxserve:prompt_tokens_total")
    for name in ("jaxserve:num_requests_running", "jaxserve:num_requests_waiting", "jaxserve:num_requests_swapped",
                 "jaxserve:kv_cache_usage_perc", "jaxserve:kv_cache_cached_free_blocks",
                 'jaxserve:num_preemptions_total{mode="recompute"}', "jaxserve:prefix_cache_hits_total"):
        assert name in after, name
    assert after["jaxserve:compilations_after_warmup_total"] == 0


# ---------------------------------------------------------------------------- TLS
@pytest.mark.skipif(not shutil.which("openssl"), reason="needs the openssl command")
def test_tls(srv, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    from jaxserve.engine.llm_engine import Engine

    engine = Engine(CFG, loaded=srv.server.engine.model)  # shares the weights; no generation here
    tls = ServerThread(CFG, ServerOptions(host="127.0.0.1", port=0, metrics_port=-1, http_port=0, log_interval=0,
                                          tls_cert_file=str(cert), tls_key_file=str(key), warmup=False),
                       engine=engine)
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(tls.address, creds) as ch:
            stub = pb_grpc.JaxServeStub(ch)
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size > 0
            assert stub.Tokenize(pb.TokenizeRequest(text="Hello"), timeout=10).count > 0
        with grpc.insecure_channel(tls.address) as ch:  # plaintext to a TLS port fails
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.JaxServeStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        import httpx  # the HTTP API serves the same certificate

        https = f"https://127.0.0.1:{tls.server.http_port}"
        import ssl

        ctx = ssl.create_default_context(cafile=str(cert))
        r = httpx.post(https + "/tokenize", json={"prompt": "Hello"}, verify=ctx, timeout=10)
        assert r.status_code == 200 and r.json()["count"] > 0
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port fails
            httpx.get(f"http://127.0.0.1:{tls.server.http_port}/health", timeout=5)
    finally:
        tls.close()


# ---------------------------------------------------------------------------- drain (subprocess)
def test_sigterm_drains_in_flight_and_exits_0(tmp_path):
    """Both fronts drain: in-flight gRPC and HTTP streams finish (or are aborted at the
    timeout), new calls get UNAVAILABLE / 503, health turns NOT_SERVING / 503."""
    import httpx

    log = open(tmp_path / "server.log", "w+")
    http_port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--host", "127.0.0.1", "--port", "0",
         "--http-port", str(http_port),
         "--metrics-port", "-1", "--shutdown-timeout", "3", "--log-interval", "0.5", *CFG_ARGS],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = wait_until(lambda: (m := re.search(r"listening on 127\.0\.0\.1:(\d+)",
                                                  (tmp_path / "server.log").read_text())) and int(m.group(1)),
                          timeout=120, interval=0.2)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            stub = pb_grpc.JaxServeStub(ch)

            def status():
                try:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
                except grpc.RpcError:
                    return None

            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING  # still loading
            wait_until(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=300, interval=0.5)
            short = stub.Generate(text_req("Once upon a time", max_tokens=20, ignore_eos=True), timeout=60)
            long = stub.Generate(text_req("Count to a thousand:", max_tokens=480, ignore_eos=True), timeout=60)
            first_short = next(short)
            next(long)
            base = f"http://127.0.0.1:{http_port}"
            http = httpx.stream("POST", base + "/v1/completions", timeout=60, json={
                "prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True, "stream": True})
            http_resp = http.__enter__()
            http_lines = http_resp.iter_lines()
            assert next(http_lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=5)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(text_req("late", max_tokens=2), timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert httpx.get(base + "/health", timeout=5).status_code == 503
            late = httpx.post(base + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10)
            assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
            http_rest = [json.loads(x[6:]) for x in http_lines if x.startswith("data: {")]
            http.__exit__(None, None, None)
            assert http_rest[-1]["choices"][0]["finish_reason"] == "length"
            rest = list(short)
            n = sum(len(d.token_ids) for r in [first_short, *rest] for d in r.outputs)
            assert n == 20 and rest[-1].finished and rest[-1].outputs[-1].finish_reason == "length"
            rest = list(long)  # cannot finish within the shutdown timeout (480 tokens in 3 s): aborted
            assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        assert proc.wait(timeout=60) == 0
        text = (tmp_path / "server.log").read_text()
        assert re.search(r"gen [\d.]+ tok/s, batched [\d.]+ tok/s, \d+ finished \| running \d+, waiting \d+", text)
        assert "draining: 3 requests in flight" in text and "aborted 1 requests" in text
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def test_lora_over_grpc(srv, stub):
    """lora_name selects a loaded adapter (the same tokens as the batch API under it); an
    unknown one is NOT_FOUND; the adapters are listed, loaded and unloaded by RPC."""
    names = list(stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest(), metadata=AUTH).lora_names)
    lora = next(lr for lr in srv.server.engine.list_loras() if lr.lora_name == names[0])
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    want = batch_generate(srv, ["Hello"], SamplingParams(**kw), lora_request=lora)[0].outputs[0].token_ids
    base = batch_generate(srv, ["Hello"], SamplingParams(**kw))[0].outputs[0].token_ids
    _, _, ids, _ = generate(stub, pb.GenerateRequest(text="Hello", sampling_params=sp(**kw), lora_name=names[0]))
    assert ids == list(want) and ids != list(base)
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, pb.GenerateRequest(text="Hello", sampling_params=sp(**kw), lora_name="nope"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=names[0]), metadata=AUTH)
    assert names[0] not in stub.ListLoRAAdapters(pb.ListLoRAAdaptersRequest(), metadata=AUTH).lora_names
    with pytest.raises(grpc.RpcError) as e:
        stub.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=names[0]), metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    stub.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=names[0], lora_path=lora.lora_path), metadata=AUTH)
    _, _, again, _ = generate(stub, pb.GenerateRequest(text="Hello", sampling_params=sp(**kw), lora_name=names[0]))
    assert again == ids
