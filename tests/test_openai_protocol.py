"""OpenAI request bodies -> engine parameters, without a server: strict parsing, the field a
400 names, defaults, prompt shapes and chat messages as the template sees them."""

from __future__ import annotations

import json

import pytest

from server.errors import ErrorKind, ServeError
from server.http_api.protocol import ChatCompletionRequest, CompletionRequest, parse_body


def parse(model, body) -> object:
    return parse_body(model, json.dumps(body).encode())


def refused(model, body) -> ServeError:
    with pytest.raises(ServeError) as e:
        req = parse(model, body)
        req.check()
        if isinstance(req, CompletionRequest):
            req.prompts()
        req.sampling_params(16, None)
    assert e.value.kind is ErrorKind.INVALID
    return e.value


def test_defaults_follow_openai_and_unset_fields_take_the_engines():
    req = parse(CompletionRequest, {"prompt": "hi"})
    assert req.max_tokens == 16 and not req.stream
    p = req.sampling_params(req.max_tokens, req.logprobs)
    assert (p.temperature, p.top_p, p.n, p.max_tokens, p.logprobs, p.logit_bias) == (1.0, 1.0, 1, 16, None, None)
    chat = parse(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5,
                                         "max_completion_tokens": 7, "logprobs": True})
    assert chat.output_limit == 7 and chat.num_logprobs == 0  # logprobs alone: the sampled token's
    p = parse(CompletionRequest, {"prompt": "x", "temperature": 0, "seed": 0, "top_k": -1, "stop": "\n",
                                  "logit_bias": {"42": -100, "7": 2.5}}).sampling_params(3, 2)
    assert p.is_greedy and p.seed == 0 and p.top_k == 0 and p.stop == ["\n"] and p.logprobs == 2
    assert p.logit_bias == {42: -100.0, 7: 2.5}


@pytest.mark.parametrize("prompt,expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_prompt_shapes(prompt, expected):
    assert parse(CompletionRequest, {"prompt": prompt}).prompts() == expected


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": "2"}, "n"),
    ({"prompt": "x", "n": 2.0}, "n"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": ["a", [1]]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 16}, "min_tokens"),
    ({"prompt": "x", "stop": ["ok", 3]}, "stop"),
    ({"prompt": "x", "logit_bias": {"1.5": 1}}, "logit_bias"),
])
def test_completion_fields_refused_by_name(body, param):
    assert refused(CompletionRequest, body).param == param


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user"}], "continue_final_message": True}, "continue_final_message"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
    ({"messages": [{"role": "assistant", "tool_calls": 5}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": "x"}]}]},
     "messages[1].tool_calls[0].function"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "4", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
])
def test_chat_fields_refused_by_name(body, param):
    assert refused(ChatCompletionRequest, body).param == param


def test_messages_as_the_template_sees_them():
    req = parse(ChatCompletionRequest, {"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u1"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})
    req.check()  # tool_choice "none": the tools are ignored, not refused
    assert req.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "u1"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]


def test_bodies_that_are_not_json_objects():
    for body in (b"", b"{", b"null", b"[]", b'"x"'):
        with pytest.raises(ServeError) as e:
            parse_body(CompletionRequest, body)
        assert e.value.kind is ErrorKind.INVALID and e.value.param is None, body


def test_a_stream_nobody_reads_is_aborted_after_the_idle_timeout():
    """The SSE response: a write that cannot complete (the client reads nothing, its socket
    buffers full) for stream_idle_timeout ends the response and closes what it owns (the
    generations, which aborts them); a client that disconnects does the same at once."""
    import asyncio
    import contextlib
    import time

    from server.http_api.routes import EventStream

    async def events():
        for i in range(1000):
            yield f"data: {i}\n\n".encode()

    async def run(send_blocks_after: int, disconnect_after: float | None) -> tuple[list, int, bool, float]:
        sent, aborts, closed = [], [0], [False]
        stack = contextlib.AsyncExitStack()
        stack.callback(lambda: closed.__setitem__(0, True))

        async def send(msg):
            if len(sent) >= send_blocks_after:
                await asyncio.Event().wait()  # never drains
            sent.append(msg)

        async def receive():
            if disconnect_after is None:
                await asyncio.Event().wait()
            await asyncio.sleep(disconnect_after)
            return {"type": "http.disconnect"}

        resp = EventStream(events(), stack, 0.2, lambda: aborts.__setitem__(0, aborts[0] + 1))
        t0 = time.perf_counter()
        await asyncio.wait_for(resp({}, receive, send), 5)
        return sent, aborts[0], closed[0], time.perf_counter() - t0

    sent, aborts, closed, dt = asyncio.run(run(3, None))
    assert len(sent) == 3 and sent[0]["type"] == "http.response.start" and aborts == 1 and closed
    assert 0.2 <= dt < 2
    assert all(b"content-length" != k for k, _ in sent[0]["headers"])  # chunked, not a fixed length
    sent, aborts, closed, dt = asyncio.run(run(2, 0.05))  # blocked, then the client goes away
    assert aborts == 0 and closed and dt < 0.2
