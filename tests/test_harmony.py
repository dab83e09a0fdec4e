"""gpt-oss's chat format (harmony) on the OpenAI chat front, checked against openai-harmony itself.

The served model is a `ScriptedEngine` (tests/fake_engine.py) behind the real serving core and
the real OpenAI routes: it reports architecture "gpt_oss" and "generates" a reply recorded by
rendering assistant messages with openai-harmony. The front's prompt must equal harmony's
rendering of the conversation, and its `reasoning_content` / `content` / `tool_calls`, whole and
streamed, what openai-harmony's own `parse_messages_from_completion_tokens` reads from the same
ids. No model, no JAX work: fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from fake_engine import EncodingTokenizer, ScriptedEngine
from openai_harmony import (
    Author,
    Conversation,
    DeveloperContent,
    HarmonyEncoding,
    HarmonyEncodingName,
    HarmonyError,
    Message,
    ReasoningEffort,
    Role,
    SystemContent,
    ToolDescription,
    load_harmony_encoding,
)

from jaxserve.config.engine_config import EngineConfig
from server.core import ServingCore
from server.http_api.harmony import HarmonyUnavailable
from server.http_api.routes import OpenAIFront
from server.options import ServerOptions, ServerState

VOCAB_SIZE = 201_088  # gpt-oss's
A = Role.ASSISTANT
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"]}}}
ASK = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"}]
ARGS = '{"city":"Paris","unit":"C"}'


@pytest.fixture(scope="module")
def enc(harmony_vocab) -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


# ---------------------------------------------------------------------- harmony, by openai-harmony
def analysis(text: str) -> Message:
    return Message.from_role_and_content(A, text).with_channel("analysis")


def final(text: str) -> Message:
    return Message.from_role_and_content(A, text).with_channel("final")


def preamble(text: str) -> Message:
    return Message.from_role_and_content(A, text).with_channel("commentary")


def call(name: str, arguments: str) -> Message:
    return (Message.from_role_and_content(A, arguments).with_channel("commentary")
            .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))


def special(enc: HarmonyEncoding, name: str) -> int:
    (token,) = enc.encode(f"<|{name}|>", allowed_special="all")
    return token


def reply_ids(enc: HarmonyEncoding, *messages: Message) -> list[int]:
    """What gpt-oss generates for a reply of these messages: each rendered by openai-harmony,
    the first without its `<|start|>assistant` (the prompt ends with it), an answer ended by
    `<|return|>` as the model ends it."""
    ids = [t for m in messages for t in enc.render(m)]
    head = enc.encode("<|start|>assistant", allowed_special="all")
    assert ids[:len(head)] == head
    ids = ids[len(head):]
    if ids[-1] == special(enc, "end"):
        ids[-1] = special(enc, "return")
    return ids


def harmony_parse(enc: HarmonyEncoding, ids: Sequence[int], offered: set[str]) -> dict[str, Any]:
    """The OpenAI fields of a reply, from openai-harmony's own parse of its ids: analysis is
    reasoning, a call of an offered function a tool call, everything else content."""
    reasoning, content, calls = [], [], []
    for m in enc.parse_messages_from_completion_tokens(ids, A):
        text, to = m.content[0].text, m.recipient
        if to is not None and to.startswith("functions.") and to.removeprefix("functions.") in offered:
            calls.append({"name": to.removeprefix("functions."), "arguments": text})
        elif to is None and m.channel == "analysis":
            reasoning.append(text)
        else:
            content.append(text)
    return {"reasoning_content": "\n".join(reasoning) if reasoning else None,
            "content": "\n".join(content) if content else None, "tool_calls": calls}


def harmony_prompt(enc: HarmonyEncoding, today: str, turns: list[Message], *, instructions: str | None = None,
                   tools: Sequence[dict] = (), effort: ReasoningEffort | None = None) -> list[int]:
    """The prompt vLLM's recipe gives, rendered by openai-harmony."""
    system = SystemContent.new().with_conversation_start_date(today)
    if effort is not None:
        system = system.with_reasoning_effort(effort)
    if not tools:
        system = system.with_required_channels(["analysis", "final"])
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions(instructions)
        if tools:
            dev = dev.with_function_tools([ToolDescription.new(t["function"]["name"], t["function"]["description"],
                                                               t["function"]["parameters"]) for t in tools])
        messages.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    return enc.render_conversation_for_completion(Conversation.from_messages(messages + turns), A)


def user(text: str) -> Message:
    return Message.from_role_and_content(Role.USER, text)


# ---------------------------------------------------------------------- the server
@contextlib.asynccontextmanager
async def serving(enc: HarmonyEncoding, architecture: str = "gpt_oss") -> AsyncIterator[tuple[ScriptedEngine, Any]]:
    """The real core and OpenAI routes over a scripted engine, and an HTTP client of them."""
    engine = ScriptedEngine(EncodingTokenizer(enc), architecture=architecture, vocab_size=VOCAB_SIZE)
    core = ServingCore(EngineConfig(), ServerOptions(http_port=-1, metrics_port=-1, log_interval=0, warmup=False),
                       engine=engine)
    front = OpenAIFront(core)
    await core.load()
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=front.app), base_url="http://jaxserve") as c:
            yield engine, c
    finally:
        await core.close()


def run(coro) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


async def stream(client: httpx.AsyncClient, body: dict) -> list:
    """The `data:` payloads of a streamed chat call ([DONE] kept as the string)."""
    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in r.text.splitlines() if line.startswith("data: ")]


def merged(events: list) -> dict[str, Any]:
    """A stream's deltas put together as a client does: the fields of the whole reply."""
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    out: dict[str, Any] = {"reasoning_content": None, "content": None, "tool_calls": []}
    finish = None
    for e in events[1:-1]:
        (choice,) = e["choices"]
        delta = choice["delta"]
        for field in ("reasoning_content", "content"):
            if field in delta:
                out[field] = (out[field] or "") + delta[field]
        for tc in delta.get("tool_calls", ()):
            if tc["index"] == len(out["tool_calls"]):  # a new call: its id, type and name come first
                assert tc["id"].startswith("call_") and tc["type"] == "function", tc
                out["tool_calls"].append({"name": tc["function"]["name"], "arguments": ""})
            out["tool_calls"][tc["index"]]["arguments"] += tc["function"].get("arguments", "")
        finish = choice["finish_reason"] or finish
    return {**out, "finish_reason": finish}


def whole_fields(body: dict) -> dict[str, Any]:
    (choice,) = body["choices"]
    m = choice["message"]
    return {"reasoning_content": m["reasoning_content"], "content": m["content"],
            "tool_calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                           for c in m["tool_calls"]], "finish_reason": choice["finish_reason"]}


# ---------------------------------------------------------------------- replies
REPLIES = {  # name: (messages, max_tokens, finish reason)
    "reasoning_then_call": ([analysis("The user wants Paris's weather: call get_weather."),
                             call("get_weather", ARGS)], None, "tool_calls"),
    "reasoning_then_answer": ([analysis("Easy."), analysis("No tool needed."),
                               final("Sunny, 21 °C 🌞 — a fine day.")], None, "stop"),
    "preamble_then_call": ([analysis("Look it up."), preamble("Checking the forecast."),
                            call("get_weather", ARGS)], None, "tool_calls"),
    "answer_cut_short": ([analysis("Easy."), final("Sunny, 21 °C — a fine day in Paris.")], 14, "length"),
}


@pytest.mark.parametrize("case", sorted(REPLIES))
def test_replies_whole_and_streamed_equal_harmonys_own_parse(enc, case):
    messages, max_tokens, finish = REPLIES[case]
    ids = reply_ids(enc, *messages)
    want = {**harmony_parse(enc, ids[:max_tokens] if max_tokens else ids, {"get_weather"}), "finish_reason": finish}
    body = {"messages": ASK, "tools": [WEATHER], "reasoning_effort": "high",
            **({"max_tokens": max_tokens} if max_tokens else {})}

    async def go():
        async with serving(enc) as (engine, client):
            engine.script = ids
            day = datetime.date.today().isoformat()
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return day, engine.requests, r.json(), await stream(client, body)

    day, requests, whole, events = run(go())
    assert whole_fields(whole) == want
    assert merged(events) == want
    prompt = harmony_prompt(enc, day, [user("Weather in Paris?")], instructions="You are terse.", tools=[WEATHER],
                            effort=ReasoningEffort.HIGH)
    for r in requests:  # the whole and the streamed call sent the same prompt: harmony's rendering
        assert list(r.prompt_token_ids) == prompt
        assert set(enc.stop_tokens_for_assistant_actions()) <= set(r.params.stop_token_ids)
    assert whole["usage"]["prompt_tokens"] == len(prompt)


def test_a_call_to_a_function_not_offered_is_content_not_a_tool_call(enc):
    ids = reply_ids(enc, analysis("Maybe the time too."), call("get_time", '{"tz":"CET"}'))
    want = {**harmony_parse(enc, ids, {"get_weather"}), "finish_reason": "stop"}
    assert want["content"] == '{"tz":"CET"}' and want["tool_calls"] == []  # kept, as text
    body = {"messages": ASK, "tools": [WEATHER]}

    async def go():
        async with serving(enc) as (engine, client):
            engine.script = ids
            return (await client.post("/v1/chat/completions", json=body)).json(), await stream(client, body)

    whole, events = run(go())
    assert whole_fields(whole) == want
    assert merged(events) == want


def test_a_reply_that_is_not_harmony_ends_with_an_error_and_the_server_serves_on(enc):
    """A stray `<|message|>` after a complete message: openai-harmony's parser refuses it. A
    stream sends what it parsed, then an error event naming the failure, then [DONE]; a whole
    reply is a 500; the request leaves the engine; the next request is served."""
    head = reply_ids(enc, analysis("Thinking."))
    head[-1] = special(enc, "end")  # the analysis message ends, and the reply goes on
    bad = head + [special(enc, "message")] + enc.encode("oops") + [special(enc, "return")]
    with pytest.raises(HarmonyError):
        enc.parse_messages_from_completion_tokens(bad, A)
    good = reply_ids(enc, final("Sunny."))

    async def go():
        async with serving(enc) as (engine, client):
            engine.script = bad
            whole = await client.post("/v1/chat/completions", json={"messages": ASK})
            events = await stream(client, {"messages": ASK})
            for _ in range(200):
                if not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            left = engine.has_unfinished_requests()
            engine.script = good
            after = await client.post("/v1/chat/completions", json={"messages": ASK})
            return whole, events, left, after

    whole, events, left, after = run(go())
    assert whole.status_code == 500
    err = whole.json()["error"]
    assert err["code"] == "harmony_parse_error" and "not valid harmony" in err["message"], err
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "harmony_parse_error" and "Unexpected token" in error["message"], error
    assert "".join(e["choices"][0]["delta"].get("reasoning_content", "") for e in events[1:-2]) == "Thinking."
    assert not left
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == "Sunny."


# ---------------------------------------------------------------------- prompts
def test_history_renders_reasoning_calls_and_tool_results_as_harmony(enc):
    """An earlier turn's reasoning_content goes to analysis, its calls to commentary (to
    functions.NAME), a tool message comes from the function its tool_call_id names."""
    history = [*ASK,
               {"role": "assistant", "content": None, "reasoning_content": "Call get_weather.",
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather", "arguments": ARGS}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    chat = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Weather?"}]

    async def go():
        async with serving(enc) as (engine, client):
            engine.script = reply_ids(enc, final("21 °C."))
            day = datetime.date.today().isoformat()
            for body in ({"messages": history, "tools": [WEATHER], "reasoning_effort": "low"},
                         {"messages": chat, "tools": [WEATHER], "tool_choice": "none"}):
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            return day, engine.requests

    day, (with_tools, without) = run(go())
    tool_result = (Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 21}')
                   .with_recipient("assistant").with_channel("commentary"))
    assert list(with_tools.prompt_token_ids) == harmony_prompt(
        enc, day, [user("Weather in Paris?"), analysis("Call get_weather."), call("get_weather", ARGS), tool_result],
        instructions="You are terse.", tools=[WEATHER], effort=ReasoningEffort.LOW)
    # tool_choice "none": no tools in the prompt, no commentary channel
    assert list(without.prompt_token_ids) == harmony_prompt(
        enc, day, [user("Hi"), final("Bonjour"), user("Weather?")], instructions="Answer in French.")


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "{}"}]}, "messages[2].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "content": "Sun"}], "add_generation_prompt": False,
      "continue_final_message": True}, "continue_final_message"),
])
def test_what_harmony_cannot_honour_is_a_400_naming_the_field(enc, body, param):
    async def go():
        async with serving(enc) as (engine, client):
            r = await client.post("/v1/chat/completions", json={"messages": ASK, **body})
            return r, engine.requests

    r, requests = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert requests == []


# ---------------------------------------------------------------------- start and other models
def test_a_gpt_oss_server_without_the_vocabulary_does_not_start(enc, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path))  # an empty folder

    async def go():
        engine = ScriptedEngine(EncodingTokenizer(enc), architecture="gpt_oss", vocab_size=VOCAB_SIZE)
        core = ServingCore(EngineConfig(), ServerOptions(http_port=-1, metrics_port=-1, log_interval=0,
                                                         warmup=False), engine=engine)
        OpenAIFront(core)
        try:
            with pytest.raises(HarmonyUnavailable) as e:
                await core.load()
            return str(e.value), core.state
        finally:
            await core.close()

    message, state = run(go())
    assert "TIKTOKEN_ENCODINGS_BASE" in message and "o200k_base.tiktoken" in message, message
    assert state == ServerState.LOADING


def test_other_models_chat_through_their_template_unchanged(enc):
    """Not gpt-oss: the chat template makes the prompt and the reply is its text, whatever it
    holds (harmony's tokens included), whole and streamed; reasoning_effort is accepted and
    ignored; tool calls are parsed from the text (Hermes) as before."""
    ids = reply_ids(enc, analysis("x"), final("Hello"))
    hermes = enc.encode('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>')
    tok = EncodingTokenizer(enc)
    body = {"messages": ASK, "reasoning_effort": "high"}

    async def go():
        async with serving(enc, architecture="llama") as (engine, client):
            engine.script = ids
            whole = await client.post("/v1/chat/completions", json=body)
            events = await stream(client, body)
            engine.script = hermes
            called = await client.post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
            return whole, events, called, engine.requests

    whole, events, called, requests = run(go())
    assert whole.status_code == 200, whole.text
    message = whole.json()["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == tok.decode(ids, skip_special_tokens=True)
    assert merged(events) == {"reasoning_content": None, "content": message["content"], "tool_calls": [],
                              "finish_reason": "stop"}
    assert list(requests[0].prompt_token_ids) == tok.apply_chat_template(ASK)
    assert not set(enc.stop_tokens_for_assistant_actions()) & set(requests[0].params.stop_token_ids)
    (tool_call,) = called.json()["choices"][0]["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
