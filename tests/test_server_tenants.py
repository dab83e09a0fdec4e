"""Tenants, keys, admission by work and the auth interceptor, without a model: fast."""

from __future__ import annotations

import argparse
import asyncio
import os

import grpc
import pytest

from server.admission import Admission, AdmissionRefused, request_work
from server.auth import AuthInterceptor
from server.cli import _keys_from_args
from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc
from server.tenants import (
    API_KEY_ENV,
    Authenticator,
    Tenant,
    load_api_keys,
    parse_api_keys,
    parse_priority_range,
)

KEYS = """
# production tenants
alice  k-alice-0001   max_requests=4 max_tokens=1000 priority=0:10
bob    k-bob-0002     # no limits of his own
ops    k-ops-0003     admin
"""


def test_keys_file_parses_with_options():
    (alice, ka), (bob, kb), (ops, ko) = parse_api_keys(KEYS.splitlines(), "keys.txt")
    assert (alice.name, ka, alice.max_requests, alice.max_tokens, alice.priority_range) == (
        "alice", "k-alice-0001", 4, 1000, (0, 10))
    assert not alice.admin and bob.max_requests is None and bob.priority_range is None and ops.admin
    assert (kb, ko) == ("k-bob-0002", "k-ops-0003")


@pytest.mark.parametrize("text,msg", [
    ("alice", "keys.txt:1: expected 'name key"),
    ("alice k1\nalice k2", "keys.txt:2: tenant 'alice' appears twice"),
    ("alice k1\nbob k1", "keys.txt:2: tenant 'bob' reuses another tenant's key"),
    ("alice k1 max_requests=0", "keys.txt:1: tenant alice: max_requests must be >= 1"),
    ("alice k1 max_tokens=many", "keys.txt:1: max_tokens must be a positive integer"),
    ("alice k1 priority=5:1", "keys.txt:1: priority: range 5:1"),
    ("alice k1 priority=high", "keys.txt:1: priority: expected LO:HI"),
    ("alice k1 colour=red", "keys.txt:1: unknown option 'colour'"),
    ("alice k1 superuser", "keys.txt:1: unknown option 'superuser'"),
    ("al/ice k1", "keys.txt:1: tenant name 'al/ice'"),
    ("# nothing", "keys.txt: no tenants"),
])
def test_keys_file_errors_name_the_line(text, msg):
    with pytest.raises(ValueError) as e:
        parse_api_keys(text.splitlines(), "keys.txt")
    assert msg in str(e.value)


def test_authenticator_maps_keys_to_tenants():
    auth = Authenticator(parse_api_keys(KEYS.splitlines()))
    assert auth.required and [t.name for t in auth.tenants] == ["alice", "bob", "ops"]
    assert auth.authenticate([("authorization", "Bearer k-bob-0002")]).name == "bob"
    assert auth.authenticate([("x-api-key", "k-ops-0003")]).name == "ops"
    for md in (None, [], [("authorization", "k-bob-0002")], [("authorization", "Bearer k-bob-000")],
               [("x-api-key", b"k-bob-0002")], [("other", "k-bob-0002")]):
        assert auth.authenticate(md) is None, md
    open_auth = Authenticator()
    assert not open_auth.required and open_auth.authenticate(None).name == "default"
    assert Authenticator.single_key("s3cret").authenticate([("x-api-key", "s3cret")]).admin


def test_request_ids_and_cache_salts_are_per_tenant():
    a, b = Tenant("alice"), Tenant("bob")
    assert a.request_key("x") != b.request_key("x") == "bob/x"
    assert a.cache_salt(None, False) != b.cache_salt(None, False)
    assert a.cache_salt("s", False) != b.cache_salt("s", False)
    assert a.cache_salt("s", False) != a.cache_salt(None, False)  # the client's salt still splits
    assert a.cache_salt("s", True) == b.cache_salt("s", True) == "s" and a.cache_salt(None, True) is None


def test_admission_counts_work_per_tenant_and_server_wide():
    assert request_work(prompt_tokens=100, n=4, max_tokens=50, max_model_len=512) == 300
    assert request_work(prompt_tokens=500, n=2, max_tokens=50, max_model_len=512) == 524  # capped by the model
    adm = Admission(max_requests=3, max_tokens=1000)
    small = Tenant("small", max_requests=1, max_tokens=100)
    other = Tenant("other")
    big = adm.reserve(small, 5000)  # alone, a request over both limits still runs
    with pytest.raises(AdmissionRefused, match="tenant small: 1 requests in flight, its max_requests is 1"):
        adm.reserve(small, 1)
    with pytest.raises(AdmissionRefused, match="do not fit under max_queued_tokens 1000"):
        adm.reserve(other, 1)  # the server's work limit is passed
    adm.release(big)
    adm.release(big)  # a second release does nothing
    assert adm.usage("small") == (0, 0) and adm.total.requests == 0
    r = [adm.reserve(other, 10) for _ in range(3)]
    with pytest.raises(AdmissionRefused, match="max_num_seqs \\+ max_queued_requests = 3 requests"):
        adm.reserve(other, 10)
    for x in r:
        adm.release(x)
    assert adm.total.tokens == 0


def test_priority_range_parsing():
    assert parse_priority_range("-5:7") == (-5, 7)
    with pytest.raises(ValueError, match="--priority-range: expected LO:HI"):
        parse_priority_range("7", "--priority-range")


def _ns(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"api_keys": None, "api_key_file": None, "api_key": None, **kw})


def test_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert _keys_from_args(_ns()) == (None, ())
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert _keys_from_args(_ns()) == ("from-env", ())
    f = tmp_path / "key"
    f.write_text("\n  from-file  \n")
    assert _keys_from_args(_ns(api_key_file=str(f))) == ("from-file", ())
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    os.chmod(keys, 0o600)
    _, tenants = _keys_from_args(_ns(api_keys=str(keys)))
    assert [t.name for t, _ in tenants] == ["alice", "bob", "ops"]
    with pytest.raises(ValueError, match="give one of"):
        _keys_from_args(_ns(api_keys=str(keys), api_key="x"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds no API key"):
        _keys_from_args(_ns(api_key_file=str(tmp_path / "empty")))


def test_world_readable_keys_file_warns(tmp_path, caplog):
    keys = tmp_path / "keys"
    keys.write_text(KEYS)
    os.chmod(keys, 0o644)
    load_api_keys(str(keys))
    assert "readable by other users" in caplog.text


class _Echo(pb_grpc.JaxServeServicer):
    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(model="echo")


def test_unauthenticated_calls_are_refused_without_parsing_the_body():
    parsed = []

    def deserializer(b: bytes):
        parsed.append(len(b))
        return pb.GetModelInfoRequest.FromString(b)

    async def body():
        interceptor = AuthInterceptor(Authenticator.single_key("k"), max_open_calls=1)
        server = grpc.aio.server(interceptors=[interceptor])
        handler = grpc.method_handlers_generic_handler("jaxserve.v1.JaxServe", {
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                _Echo().GetModelInfo, request_deserializer=deserializer,
                response_serializer=pb.ModelInfo.SerializeToString)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.JaxServeStub(ch)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("x-api-key", "wrong"),))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert parsed == []  # the body was never deserialized
                ok = await stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=(("x-api-key", "k"),))
                assert ok.model == "echo" and parsed == [0]
        finally:
            await server.stop(0)

    asyncio.run(body())


def test_open_health_calls_are_bounded():
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    async def body():
        server = grpc.aio.server(interceptors=[AuthInterceptor(Authenticator.single_key("k"), max_open_calls=2)])
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                assert (await stub.Check(health_pb2.HealthCheckRequest())).status == 1  # no key needed
                watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(2)]
                for w in watches:
                    assert (await w.read()).status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Check(health_pb2.HealthCheckRequest())
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max 2" in e.value.details()
                for w in watches:
                    w.cancel()
                await asyncio.sleep(0.2)
                assert (await stub.Check(health_pb2.HealthCheckRequest())).status == 1
        finally:
            await server.stop(0)

    asyncio.run(body())


def test_concurrent_streams_per_connection_are_capped():
    """`max_concurrent_streams` reaches the interceptor: on one connection at most that many
    API calls run at once, the rest are refused with RESOURCE_EXHAUSTED naming the limit (the
    transport resets none), and the count returns to zero when they end."""
    from server.app import ServerOptions
    from server.auth import AuthInterceptor
    from server.tenants import Authenticator

    state = {"running": 0, "most": 0}

    async def slow(request, context):
        state["running"] += 1
        state["most"] = max(state["most"], state["running"])
        await asyncio.sleep(0.2)
        state["running"] -= 1
        return pb.ModelInfo(model="slow")

    opts = ServerOptions(max_concurrent_streams=2)
    interceptor = AuthInterceptor(Authenticator(), max_streams_per_connection=opts.max_concurrent_streams)

    async def body():
        server = grpc.aio.server(interceptors=[interceptor], options=opts.grpc_options())
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("jaxserve.v1.JaxServe", {
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                slow, request_deserializer=pb.GetModelInfoRequest.FromString,
                response_serializer=pb.ModelInfo.SerializeToString)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.JaxServeStub(ch)
                results = await asyncio.gather(*(stub.GetModelInfo(pb.GetModelInfoRequest()) for _ in range(6)),
                                               return_exceptions=True)
                again = await stub.GetModelInfo(pb.GetModelInfoRequest())  # the slots came back
        finally:
            await server.stop(0)
        return results, again

    results, again = asyncio.run(body())
    assert state["most"] == 2 and again.model == "slow"
    refused = [r for r in results if getattr(r, "model", None) != "slow"]
    assert len(refused) == 4, results
    assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "(max 2, --max-concurrent-streams)" in r.details()
               for r in refused)
    assert interceptor.connection_calls == {}


def test_lora_allow_lists():
    """`loras=a,b` limits a tenant to those adapters (others are not found for it); without
    the option any loaded adapter; `loras=` none."""
    import types

    from server.core import ServingCore
    from server.errors import ErrorKind, ServeError

    (alice, _), (bob, _), (carol, _) = parse_api_keys(
        ["alice k1 loras=sql-lora,chat-lora", "bob k2", "carol k3 loras="], "keys.txt")
    assert alice.loras == {"sql-lora", "chat-lora"} and bob.loras is None and carol.loras == frozenset()
    core = types.SimpleNamespace(lora_names=lambda: ["sql-lora", "chat-lora", "math-lora"])
    ServingCore.check_lora(core, alice, "chat-lora")
    ServingCore.check_lora(core, bob, "math-lora")
    for tenant, name in ((alice, "math-lora"), (carol, "sql-lora"), (bob, "unloaded")):
        with pytest.raises(ServeError) as e:
            ServingCore.check_lora(core, tenant, name)
        assert e.value.kind == ErrorKind.NOT_FOUND and e.value.param == "model"
