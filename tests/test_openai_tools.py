"""Structured output and tool calling through the fronts: OpenAI `response_format`,
vLLM's `structured_outputs`, the gRPC field, `tools` / `tool_choice` (constrained and
parsed), streamed tool-call deltas; the tool-call parsers on their own."""

from __future__ import annotations

import json
import logging

import grpc
import jsonschema
import openai
import pytest
import test_openai_http
from conftest import EMBEDDED_SERVER_KEY as KEY
from test_openai_http import post, sse_events

from server.convert import sampling_params_to_proto
from server.http_api.tools import StreamingToolParser, parse_tool_calls
from server.proto import jaxserve_pb2 as pb
from server.proto import jaxserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
srv, base, client = test_openai_http.srv, test_openai_http.base, test_openai_http.client  # the same fixtures

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                                       "required": ["tz"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_and_structured_outputs(client, base):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Invent a person."}], temperature=0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(model=model, prompt="Call me at", max_tokens=20, temperature=0.7, seed=1,
                                  extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 8
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=30, n=2, temperature=1.0, seed=3,
                                       response_format={"type": "json_object"})
    for c in r.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad", "parameters": {"type": "frob"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_specs_are_400_naming_the_field(srv, base, body, param):
    r = post(base, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_grammar_failing_while_it_runs_is_the_fields_400_not_a_500(srv, base, caplog):
    """After "ok" the grammar allows only EOS, which min_tokens bans: the request ends as bad
    input naming its field (non-streamed: 400), no ERROR line, the server keeps serving."""
    caplog.set_level(logging.INFO)
    body = {"prompt": "Say ok:", "max_tokens": 10, "min_tokens": 5, "temperature": 0,
            "structured_outputs": {"choice": ["ok"]}}
    r = post(base, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "allowed no token" in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
    assert post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


def test_grpc_structured_outputs(srv):
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.JaxServeStub(ch)
        params = sampling_params_to_proto(max_tokens=10, temperature=0.0,
                                          structured_outputs={"choice": ["red", "green", "blue"]})
        req = pb.GenerateRequest(text="My favourite colour is", sampling_params=params)
        resps = list(stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60))
        text = "".join(c.text for r in resps for c in r.outputs)
        assert text in ("red", "green", "blue")
        bad = pb.GenerateRequest(text="x", sampling_params=sampling_params_to_proto(structured_outputs={"regex": "(("}))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs.regex" in e.value.details()


def test_named_and_required_tool_calls_always_parse(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0,
                                       max_tokens=60, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and r.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], temperature=0.8, seed=2,
                                       max_tokens=80, tool_choice="required", n=2, parallel_tool_calls=False)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c
        for call in c.message.tool_calls:
            tool = WEATHER if call.function.name == "get_weather" else TIME
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_streamed_tool_calls_match_the_unstreamed(base, client):
    model = client.models.list().data[0].id
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        body = {"model": model, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": choice,
                "temperature": 0, "max_tokens": 60}
        whole = post(base, "/v1/chat/completions", body).json()["choices"][0]
        with openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0).with_streaming_response.chat \
                .completions.create(**body, stream=True) as resp:
            events = [e for e in sse_events(resp.http_response) if e != "[DONE]"]
        calls: dict[int, dict] = {}
        finish = None
        for e in events:
            for c in e["choices"]:
                finish = c["finish_reason"] or finish
                for tc in c["delta"].get("tool_calls") or []:
                    acc = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                    acc["name"] += tc.get("function", {}).get("name") or ""
                    acc["arguments"] += tc.get("function", {}).get("arguments") or ""
                    if "id" in tc:
                        assert tc["id"].startswith("call_") and tc["type"] == "function"
        want = [{"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                for t in whole["message"]["tool_calls"]]
        assert [calls[i] for i in sorted(calls)] == want
        assert finish == whole["finish_reason"]


def test_auto_and_tool_messages_through_the_template(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60)
    m = r.choices[0].message
    assert (m.content is not None) != bool(m.tool_calls) or m.tool_calls  # one or the other, well-formed
    convo = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    r = client.chat.completions.create(model=model, messages=convo, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=20)
    assert r.choices[0].message.content


# ---------------------------------------------------------------------- the parsers alone
def test_hermes_and_llama3_parsers():
    text = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, "hermes")
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}),
                                                                                                ("g", {})]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", "hermes")[1] == []
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"a": "b"}}; '
                                      '{"name": "g", "parameters": {}}', "llama3_json")
    assert content is None and [c.name for c in calls] == ["f", "g"] and json.loads(calls[0].arguments) == {"a": "b"}
    assert parse_tool_calls("Just text {x}", "llama3_json") == ("Just text {x}", [])


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streaming_parser_splits_content_and_calls_at_any_chunking(step):
    text = 'Sure <tool_c thing> <tool_call>{"name": "f", "arguments": {"q": "<tool_call>"}}</tool_call> done'
    p = StreamingToolParser("hermes")
    content, calls = [], []
    for i in range(0, len(text), step):
        c, k = p.feed(text[i:i + step])
        content.append(c)
        calls += k
    c, k = p.finish()
    content.append(c)
    calls += k
    assert "".join(content) == "Sure <tool_c thing>  done"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"q": "<tool_call>"})]
