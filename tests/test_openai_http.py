"""The OpenAI-compatible HTTP API end to end: the embedded model behind a real server (shared
with the gRPC tests), driven by the official `openai` client (sync, async, streaming) for the
happy paths and by raw httpx for what a client library never sends."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time

import httpx
import numpy as np
import openai
import pytest
from conftest import EMBEDDED_SERVER_KEY as KEY
from server_harness import batch_generate, wait_until

from pallas_kernels.quantized_matmul import cpu as quantized_matmul_cpu
from scheduler import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def srv(embedded_server):
    return embedded_server


@pytest.fixture(scope="module")
def base(srv) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


@pytest.fixture(scope="module")
def model(srv) -> str:
    return srv.server.served_model_names[0]


@pytest.fixture(scope="module")
def client(base):
    with openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120) as c:
        yield c


def post(base: str, path: str, body, key: str | None = KEY, headers: dict | None = None, **kw) -> httpx.Response:
    headers = {**({"authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    if isinstance(body, bytes | str):
        return httpx.post(base + path, content=body, headers={**headers, "content-type": "application/json"},
                          timeout=60, **kw)
    return httpx.post(base + path, json=body, headers=headers, timeout=60, **kw)


def sse_events(resp: httpx.Response) -> list:
    """The `data:` payloads of an event stream, JSON-decoded ([DONE] kept as the string)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", line
    return out


def idle(srv) -> bool:
    snap = srv.server.loop_runner.snapshot
    return srv.server.num_in_flight == 0 and snap.stats.num_running == 0 and snap.stats.num_waiting == 0


def chat_ids(srv, messages) -> list[int]:
    tok = srv.server.engine.tokenizer
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False))


# ---------------------------------------------------------------------------- happy paths
def test_completions_greedy_equal_the_llm_api(srv, client, model):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = batch_generate(srv, PROMPTS, params)
    r = client.completions.create(model=model, prompt=PROMPTS, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == model and r.id.startswith("cmpl-")
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 36
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 36
    # token ids in, echo: the prompt's text leads the choice's text
    ids = want[0].prompt_token_ids
    r = client.completions.create(model=model, prompt=ids, max_tokens=12, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == PROMPTS[0] + want[0].outputs[0].text


def test_chat_greedy_equals_the_llm_api_and_streams_as_openai_frames_it(srv, client, base, model):
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Name a color."}]
    want = batch_generate(srv, [{"prompt_token_ids": chat_ids(srv, messages)}],
                          SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
    r = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=10, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")
    # The same call streamed, read raw: role chunk first, content deltas, the finish, the
    # usage chunk (stream_options.include_usage), then [DONE].
    with httpx.stream("POST", base + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": model, "messages": messages, "max_tokens": 10, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks[:-1])
    body = chunks[1:-1]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in body) == want.text
    assert [c["choices"][0]["finish_reason"] for c in body][-1] == r.choices[0].finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in body[:-1])
    assert len(body) >= 2  # streamed, not one blob
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == r.usage.completion_tokens
    assert usage["usage"]["prompt_tokens"] == r.usage.prompt_tokens
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt again


def test_async_client_streams_and_n(base, model):
    async def main():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0) as c:
            async def one(p):
                stream = await c.completions.create(model=model, prompt=p, max_tokens=6, temperature=0.8, seed=7,
                                                    n=2, stream=True)
                texts, finish = {0: "", 1: ""}, {}
                async for ch in stream:
                    for choice in ch.choices:
                        texts[choice.index] += choice.text
                        if choice.finish_reason:
                            finish[choice.index] = choice.finish_reason
                return texts, finish

            return await asyncio.gather(*(one(p) for p in PROMPTS))

    results = asyncio.run(main())
    for texts, finish in results:
        assert set(finish) == {0, 1} and all(texts.values())
    again = asyncio.run(main())
    same = [t for t, _ in again] == [t for t, _ in results]  # seeded: reproducible
    if not same and quantized_matmul_cpu.bf16_dot_products():
        # Known, not fixed: with bf16 dot products (AVX512-BF16) the second run's streams can
        # differ (the tree before the 2026-12-08 kernel changes failed this check in 2 of 4
        # runs on Zen 5). Not root-caused; likely a row's logits following the step's shape
        # (the matmul's direct path below 5 rows, VDPBF16PS above), which the second run's
        # prefix-cache hits change. Batch-invariant mode is what guarantees it.
        pytest.xfail("seeded streams differ between batch shapes with bf16 dot products")
    assert same



def test_logprobs_stop_and_logit_bias(client, base, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count: 1, 2,"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.bytes == list(e.token.encode())
    assert "".join(e.token for e in content) == r.choices[0].message.content
    streamed = [e for ch in client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count: 1, 2,"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3, stream=True) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-3)
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text
    # stop strings: the text ends before the stop string, stop_reason names it
    first = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    stop = first.choices[0].text.strip().split()[0][-2:]
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert r.choices[0].model_extra["stop_reason"] == stop
    # logit_bias: +100 forces a token, -100 bans the greedy choice
    forced = 1234
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].logprobs.tokens == [post(base, "/detokenize", {"tokens": [forced]}).json()["prompt"]] * 3
    greedy_first = first.choices[0].text
    ids = post(base, "/tokenize", {"prompt": greedy_first, "add_special_tokens": False}).json()["tokens"]
    r = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                  logit_bias={str(ids[0]): -100})
    assert not greedy_first.startswith(r.choices[0].text)


def test_echo_logprobs_scores_the_prompt_as_the_legacy_api_and_vllm_frame_it(srv, client, base, model):
    """What evaluation harnesses send for log-likelihoods: echo + logprobs + max_tokens 0.
    The prompt comes back as the text, its tokens' logprobs (null first) equal the batch
    API's prompt_logprobs, nothing generated is shown or counted. With max_tokens > 0 and
    streamed, the prompt's entries lead the first chunk; n > 1 echoes each choice."""
    prompt = "The capital of France is Paris, and the capital of Italy is"
    want = batch_generate(srv, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    ids, plp = want.prompt_token_ids, want.prompt_logprobs
    r = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e[t].logprob for t, e in zip(ids[1:], plp[1:])], abs=1e-4)
    assert "".join(lp.tokens) == prompt and lp.text_offset == sorted(lp.text_offset)
    for i, top in enumerate(lp.top_logprobs[1:], 1):  # the top 2 and the prompt's own token
        assert 2 <= len(top) <= 3 and top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i], abs=1e-4)
    vllm = c.model_extra["prompt_logprobs"]
    assert vllm[0] is None and vllm[1][str(ids[1])]["logprob"] == pytest.approx(plp[1][ids[1]].logprob, abs=1e-4)
    assert vllm[1][str(ids[1])]["rank"] == plp[1][ids[1]].rank
    assert vllm[1][str(ids[1])]["decoded_token"] == plp[1][ids[1]].decoded_token
    # streamed, with generated tokens after the prompt
    with httpx.stream("POST", base + "/v1/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True,
                            "logprobs": 1, "stream": True, "ignore_eos": True}) as resp:
        chunks = [e for e in sse_events(resp) if e != "[DONE]"]
    tokens = [t for ch in chunks for t in (ch["choices"][0]["logprobs"] or {}).get("tokens", [])]
    values = [v for ch in chunks for v in (ch["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    assert len(tokens) == len(ids) + 4 and values[0] is None and None not in values[1:]
    assert values[1:len(ids)] == pytest.approx([e[t].logprob for t, e in zip(ids[1:], plp[1:])], abs=1e-4)
    assert "".join(ch["choices"][0]["text"] for ch in chunks).startswith(prompt)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2, n=2, echo=True, temperature=0.8, seed=1)
    assert [c.text.startswith(prompt) for c in r.choices] == [True, True]
    # vLLM's prompt_logprobs field on chat: top level, None first
    r = post(base, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                            "max_tokens": 1, "prompt_logprobs": 0})
    got = r.json()["prompt_logprobs"]
    assert r.status_code == 200 and got[0] is None and all(len(e) == 1 for e in got[1:])


def test_update_weights_is_admin_only_and_keeps_serving(srv, client, model, base, smollm_path):
    """The same weights again: a new version, the same greedy text, nothing compiled; a bad
    path is a 400 naming `path` and changes nothing."""
    before = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0).choices[0].text
    r = post(base, "/v1/update_weights", {"path": smollm_path})
    assert r.status_code == 200, r.text
    version = r.json()["weights_version"]
    assert version >= 1 and srv.server.engine.weights_version == version
    r = post(base, "/v1/update_weights", {"path": "/no/such/weights"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "path"
    assert post(base, "/v1/update_weights", {"path": smollm_path}, key="wrong").status_code == 401
    assert srv.server.engine.weights_version == version
    after = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0).choices[0].text
    assert after == before


def test_sleep_queues_requests_until_wake_up(srv, client, model, base):
    """vLLM's /sleep, /wake_up, /is_sleeping: a request sent while asleep waits and is
    answered after wake_up, as it would have been."""
    import concurrent.futures

    want = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=5, temperature=0).choices[0].text
    assert post(base, "/sleep?level=3", {}).status_code == 400
    assert post(base, "/sleep?level=2", {}).json() == {"is_sleeping": True}
    assert httpx.get(base + "/is_sleeping", headers={"authorization": f"Bearer {KEY}"}).json()["is_sleeping"]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.completions.create, model=model, prompt=PROMPTS[1], max_tokens=5, temperature=0)
        time.sleep(1.0)
        assert not fut.done()  # queued while asleep
        assert post(base, "/wake_up", {}).json() == {"is_sleeping": False}
        assert fut.result(timeout=60).choices[0].text == want


def test_served_model_names(srv, client, base, monkeypatch):
    import dataclasses

    monkeypatch.setattr(srv.server.core, "options", dataclasses.replace(srv.server.options,
                                                                   served_model_name=("smol", "smollm2")))
    assert [m.id for m in client.models.list() if m.parent is None] == ["smol", "smollm2"]  # then the adapters
    r = client.completions.create(model="smollm2", prompt="x", max_tokens=1)
    assert r.model == "smollm2"
    assert post(base, "/v1/completions", {"prompt": "x", "model": "embedded"}).status_code == 404
    assert post(base, "/v1/completions", {"prompt": "x", "max_tokens": 1}).json()["model"] == "smol"


def test_models_tokenize_detokenize_version_health(srv, client, base, model):
    assert [m.id for m in client.models.list() if m.parent is None] == [model]
    tok = srv.server.engine.tokenizer
    r = post(base, "/tokenize", {"model": model, "prompt": "Hello world"}).json()
    assert r["tokens"] == list(tok("Hello world", add_special_tokens=True)["input_ids"])
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == srv.server.engine.max_model_len
    msgs = [{"role": "user", "content": "Hi there"}]
    assert post(base, "/tokenize", {"messages": msgs}).json()["tokens"] == chat_ids(srv, msgs)
    assert post(base, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.get(base + "/version").json()["version"]
    assert httpx.get(base + "/health").status_code == 200  # needs no key, as on gRPC
    assert post(base, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200
    text = httpx.get(base + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    assert 'jaxserve:http_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert httpx.get(base + "/metrics").status_code == 401  # keys are on: /metrics is for admins


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": 5.5}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "n": 99}, 400, "n"),
    ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 300}}, 400, "logit_bias"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),  # 0 only with echo (scoring)
    ({"prompt": "x", "prompt_logprobs": 2, "stream": True}, 400, "prompt_logprobs"),
    ({"prompt": "x", "prompt_logprobs": 50}, 400, "prompt_logprobs"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [10 ** 9]}, 400, "prompt"),
    ({"prompt": [10 ** 9], "echo": True}, 400, "prompt"),
    ({"prompt": "x " * 600, "max_tokens": 16}, 400, "prompt"),  # over max_model_len 512
    ({"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),  # more than the room left in 512
    ({"prompt": "x", "stop": ["a"] * 40}, 400, "stop"),
    ({"prompt": "x", "top_k": 2 ** 40}, 400, "top_k"),
    ({"prompt": "x", "stop_token_ids": [2 ** 40]}, 400, "stop_token_ids"),
    ({"prompt": "x", "logit_bias": {str(2 ** 40): 1}}, 400, "logit_bias"),
    ({"prompt": "x", "seed": 2 ** 70, "max_tokens": 1}, 400, "seed"),
    ({"prompt": "x", "seed": -(2 ** 70), "max_tokens": 1}, 400, "seed"),
    ({"prompt": "x", "temperature": 1e300, "max_tokens": 1}, 400, "temperature"),
    ({"prompt": "x", "repetition_penalty": 1e300, "max_tokens": 1}, 400, "repetition_penalty"),
    (b'{"prompt": "\\ud800 lone surrogate", "max_tokens": 1}', 400, None),
    (b'{"prompt": "x", "temperature": NaN}', 400, "temperature"),
    (b"[" * 10000 + b"]" * 10000, 400, None),
    ({}, 400, "prompt"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
])
def test_completion_errors_are_openai_json_naming_the_parameter(srv, base, body, status, param):
    r = post(base, "/v1/completions", body)
    assert r.status_code == status, r.text
    if status == 200:
        return
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    assert idle(srv)


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
     "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 600}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 600}, "max_tokens"),
])
def test_chat_errors_name_the_parameter(srv, base, body, param):
    r = post(base, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_auth_size_and_route_errors(srv, base, client, model):
    r = post(base, "/v1/completions", {"prompt": "x"}, key="wrong")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(base, "/v1/models", {}, key=None).status_code in (401, 405)
    assert httpx.get(base + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    huge = json.dumps({"prompt": "x" * (srv.server.options.max_message_bytes + 10)})
    r = post(base, "/v1/completions", huge)
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(base + "/v1/nothing", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", temperature=-3)
    assert e.value.body["param"] == "temperature"
    assert idle(srv)


def test_an_unexpected_error_is_500_with_an_error_id(srv, base, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(srv.server.core, "_tenant_params", broken)
    r = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "error id" in r.json()["error"]["message"] and "secret" not in r.text
    monkeypatch.undo()
    assert post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200  # still serving


def test_queue_full_is_429_and_nothing_leaks(srv, base, model):
    """More streams than max_num_seqs + max_queued_requests: the rest get 429 with OpenAI's
    JSON and Retry-After; every admitted stream is then dropped by its client, which aborts it."""
    limit = srv.server.admission.max_requests

    async def main():
        async with httpx.AsyncClient(base_url=base, headers={"authorization": f"Bearer {KEY}"}, timeout=60,
                                     limits=httpx.Limits(max_connections=limit + 20)) as c:
            body = {"model": model, "prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True,
                    "stream": True}
            streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(limit + 6)]
            resps = await asyncio.gather(*(s.__aenter__() for s in streams))
            codes = [r.status_code for r in resps]
            refused = [r for r in resps if r.status_code == 429]
            for r in refused:
                await r.aread()
            bodies = [r.json() for r in refused]
            retry = [r.headers.get("retry-after") for r in refused]
            await asyncio.gather(*(s.__aexit__(None, None, None) for s in streams))
            return codes, bodies, retry

    codes, bodies, retry = asyncio.run(main())
    assert codes.count(200) == limit and codes.count(429) == 6, codes
    assert all(b["error"]["type"] == "rate_limit_error" and b["error"]["code"] == "max_queued_requests"
               for b in bodies)
    assert all(r == "1" for r in retry)
    wait_until(lambda: idle(srv), timeout=30)
    st = srv.server.loop_runner.snapshot.stats
    assert st.num_used_blocks == 0, st


def test_disconnects_abort_their_requests(srv, base, model):
    """A streamed call dropped after its first chunk, a non-streamed call whose client gives
    up, and a streamed call dropped before anything came back: each request is aborted in the
    engine (400 tokens take far longer than the few seconds allowed here)."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                      headers={"authorization": f"Bearer {KEY}"}, timeout=60) as resp:
        lines = resp.iter_lines()
        first = next(lines)
        if srv.server.num_in_flight != 1:  # say why the request ended: the rest of its stream
            pytest.fail(f"the request ended early: {first} ... {[ln for ln in lines if ln][-3:]}")
    wait_until(lambda: idle(srv), timeout=5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=1.0)
    wait_until(lambda: idle(srv), timeout=5)
    payload = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", srv.server.http_port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"authorization: Bearer {KEY}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_until(lambda: srv.server.num_in_flight == 1, timeout=5)
    wait_until(lambda: idle(srv), timeout=5)
    assert srv.server.loop_runner.snapshot.stats.num_used_blocks == 0


def test_a_request_that_can_never_run_is_400_before_admission_and_ids_are_named(srv, base, model):
    """n over max_n is 400 naming `n` whether the server is idle or busy (never a 429 that
    invites a retry); a request id in flight given again is 400 naming `request_id`."""
    big_n = {"model": model, "prompt": "x", "n": 10000, "max_tokens": 4}
    r = post(base, "/v1/completions", big_n)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {KEY}", "x-request-id": "busy-1"}) as resp:
        lines = resp.iter_lines()
        first = next(lines)
        if srv.server.num_in_flight != 1:
            pytest.fail(f"the request ended early: {first} ... {[ln for ln in lines if ln][-3:]}")
        r = post(base, "/v1/completions", big_n)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        assert srv.server.num_in_flight == 1, "the first request ended early"
        r = post(base, "/v1/completions", {**body, "stream": False}, headers={"x-request-id": "busy-1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    wait_until(lambda: idle(srv), timeout=5)


def test_an_upload_cut_off_is_a_quiet_abort(srv, base, caplog):
    """A client that disconnects mid-body gets no answer and leaves no ERROR line."""
    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", srv.server.http_port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  + f"authorization: Bearer {KEY}\r\ncontent-length: 1000\r\n\r\n".encode() + b'{"prompt": "x')
        time.sleep(0.3)
    r = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 1})  # served after it
    assert r.status_code == 200
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
    assert idle(srv)


def test_no_compiles_after_warmup(srv):
    assert srv.server.metrics.num_compilations_after_warmup == 0


def test_chat_template_override(srv, tmp_path):
    """--chat-template replaces the model's template for both fronts (the front-end pool
    renders it); the flag takes a file or the template itself."""
    from server.cli import _read_chat_template
    from server.frontend import FrontendPool

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    tok = srv.server.engine.tokenizer
    pool = FrontendPool(tok, 1, chat_template=template)
    try:
        ids = asyncio.run(pool.chat([{"role": "user", "content": "hi"}], True))
    finally:
        pool.close()
    assert ids == list(tok("<user>hi>", add_special_tokens=False)["input_ids"])
    f = tmp_path / "t.jinja"
    f.write_text(template)
    assert _read_chat_template(str(f)) == template == _read_chat_template(template)
    with pytest.raises(ValueError, match="--chat-template"):
        _read_chat_template(str(tmp_path / "missing.jinja"))


def test_a_bad_request_reads_the_same_on_both_fronts(srv, base):
    """One input processor: the same mistake is the same message over HTTP (400) and gRPC
    (INVALID_ARGUMENT), and HTTP's `param` is the field the message starts with."""
    import grpc

    from server.convert import sampling_params_to_proto
    from server.proto import jaxserve_pb2 as pb
    from server.proto import jaxserve_pb2_grpc as pb_grpc

    cases = [dict(n=10_000), dict(logprobs=99), dict(stop=["x"] * 17), dict(stop_token_ids=[10**6]),
             dict(logit_bias={"100000": 1.0}), dict(seed=2**64)]
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.JaxServeStub(ch)
        for fields in cases:
            r = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields})
            grpc_fields = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v) for k, v in fields.items()}
            req = pb.GenerateRequest(text="hi", sampling_params=sampling_params_to_proto(max_tokens=2, **grpc_fields)) \
                if "seed" not in fields else None
            assert r.status_code == 400, (fields, r.text)
            err = r.json()["error"]
            assert err["param"] == next(iter(fields)) and err["message"].startswith(err["param"]), err
            if req is None:  # a seed past 64 bits cannot be written into the proto's int64
                continue
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == err["message"]


def test_the_request_trace_replays_what_was_served(srv, base):
    """`--record-request-trace`: each admitted request becomes a line `jaxserve tune --trace` reads."""
    from jaxserve.tuning.workload import load_trace

    ids = [1, 2, 3, 4, 5]
    assert post(base, "/v1/completions", {"prompt": ids, "max_tokens": 3, "n": 2}).status_code == 200
    assert post(base, "/v1/completions", {"prompt": [1, 10**6], "max_tokens": 3}).status_code == 400  # not admitted
    last = load_trace(srv.request_trace)[-1]
    assert last.prompt_token_ids == tuple(ids) and last.max_tokens == 3 and last.arrival_s > 0


# ---------------------------------------------------------------------------- LoRA adapters
def _top5(lps, vocab: int) -> np.ndarray:
    """Our sampled tokens' top-5 logprobs as a [N, V] array (-inf elsewhere), for the near-tie rule."""
    out = np.full((len(lps), vocab), -np.inf)
    for i, entry in enumerate(lps):  # vLLM's shape: {token id: Logprob}
        for tok, v in entry.items():
            out[i, tok] = v.logprob
    return out


def test_lora_adapters_match_peft_and_mix_with_the_base_model(srv, smollm_adapters):
    """Base, "sql-lora" (loaded at start) and "chat-lora" (loaded over HTTP) in one batch on
    the server's own engine: peft's greedy tokens (near ties aside), nothing compiled."""
    from conftest import LORA_MAX_NEW, LORA_PROMPTS
    from hf_reference import assert_greedy_match

    from jaxserve.lora import LoRARequest

    r = post(f"http://127.0.0.1:{srv.server.http_port}", "/v1/load_lora_adapter",
             {"lora_name": "chat-lora", "lora_path": smollm_adapters["chat-lora"][0]})
    assert r.status_code == 200, r.text
    loaded = {lr.lora_name: lr for lr in srv.server.engine.list_loras()}
    names = ["base", "sql-lora", "chat-lora"]
    prompts = [p for _ in names for p in LORA_PROMPTS]
    loras = [loaded.get(n) for n in names for _ in LORA_PROMPTS]
    assert isinstance(loras[-1], LoRARequest)
    outs = batch_generate(srv, prompts, SamplingParams(max_tokens=LORA_MAX_NEW, temperature=0, logprobs=5,
                                                       ignore_eos=True), lora_request=loras)
    vocab = srv.server.engine.model_config.vocab_size
    for k, out in enumerate(outs):
        name, i = names[k // len(LORA_PROMPTS)], k % len(LORA_PROMPTS)
        toks, logp = smollm_adapters[name][1][i]
        c = out.outputs[0]
        assert_greedy_match(list(c.token_ids), _top5(c.logprobs, vocab), toks, logp)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(outs)  # every adapter changes the text
    assert srv.server.metrics.num_compilations_after_warmup == 0


def test_lora_over_http_models_routes_errors_and_metrics(srv, client, model, base, smollm_adapters):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == model and "sql-lora" in ids
    listed = {m["id"]: m for m in httpx.get(base + "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"]}
    assert listed["sql-lora"]["parent"] == model and listed[model]["parent"] is None
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    sql = next(lr for lr in srv.server.engine.list_loras() if lr.lora_name == "sql-lora")
    want = batch_generate(srv, [PROMPTS[0]], params, lora_request=sql)[0].outputs[0].text
    got = client.completions.create(model="sql-lora", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert got.choices[0].text == want and got.model == "sql-lora"
    chat = client.chat.completions.create(model="sql-lora", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "sql-lora"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-lora", prompt="x", max_tokens=2)
    # load: a bad path names lora_path; a name already loaded names lora_name; a wrong key is 401
    r = post(base, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/no/such/adapter"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path" and "'bad'" in r.json()["error"]["message"]
    r = post(base, "/v1/load_lora_adapter", {"lora_name": "sql-lora", "lora_path": smollm_adapters["sql-lora"][0]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert post(base, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/x"}, key="wrong").status_code == 401
    # unload: refused while a stream uses it, then done; unknown names are 404
    stream = client.completions.create(model="sql-lora", prompt=PROMPTS[1], max_tokens=200, temperature=0,
                                       stream=True)
    next(iter(stream))
    r = post(base, "/v1/unload_lora_adapter", {"lora_name": "sql-lora"})
    assert r.status_code == 400 and "in use" in r.json()["error"]["message"]
    stream.close()
    wait_until(lambda: idle(srv))
    metrics = httpx.get(f"http://127.0.0.1:{srv.server.metrics_port}/metrics").text
    assert "jaxserve:lora_requests_info{" in metrics and 'jaxserve:lora_requests_total{lora_name="sql-lora"}' in metrics
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "sql-lora"}).status_code == 200
    assert post(base, "/v1/unload_lora_adapter", {"lora_name": "sql-lora"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql-lora", prompt="x", max_tokens=2)
    r = post(base, "/v1/load_lora_adapter", {"lora_name": "sql-lora", "lora_path": smollm_adapters["sql-lora"][0]})
    assert r.status_code == 200  # back, under a new id: same text
    assert client.completions.create(model="sql-lora", prompt=PROMPTS[0], max_tokens=8,
                                     temperature=0).choices[0].text == want
