"""OpenAI response bodies and stream chunks from engine outputs.

`ChoiceState` accumulates one choice (one sequence of one prompt) across merged deltas, for
the final body of a non-streamed call; the `*_chunk` functions frame one delta as OpenAI's
stream does. Token strings for logprobs come from `TokenText`, which decodes each id once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxserve.outputs import TokenLogprob, Usage
from server.core_types import TokenText


def usage_json(u: Usage) -> dict[str, Any]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def sum_usage(usages: list[Usage]) -> Usage:
    return Usage(sum(u.prompt_tokens for u in usages), sum(u.completion_tokens for u in usages),
                 sum(u.cached_tokens for u in usages))


def _finite(logprob: float) -> float:
    """-inf (a banned token) as OpenAI's -9999.0: JSON has no infinity."""
    return max(logprob, -9999.0)


def chat_logprobs(lps: list[TokenLogprob], text: TokenText) -> list[dict[str, Any]]:
    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = text(tid)
        return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]


def completion_logprobs(lps: list[TokenLogprob], text: TokenText, offset: int) -> dict[str, Any]:
    """OpenAI's legacy shape: parallel lists; `offset` is where this delta's text starts."""
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        s = text(lp.token_id)
        tokens.append(s)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": [{text(t): _finite(v) for t, v in lp.top} | {text(lp.token_id): _finite(lp.logprob)}
                             for lp in lps],
            "text_offset": offsets}


@dataclasses.dataclass
class ChoiceState:
    """One choice of a non-streamed call, accumulated from deltas."""

    index: int
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta_text: str, delta_lps: list[TokenLogprob] | None, finish_reason: str | None,
            stop_reason: int | str | None) -> None:
        if delta_text:
            self.text.append(delta_text)
        if delta_lps is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta_lps)
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason


def completion_body(rid: str, created: int, model: str, choices: list[ChoiceState], usage: Usage,
                    text: TokenText, echo: list[str] | None) -> dict[str, Any]:
    out = []
    for c in choices:
        prefix = echo[c.index] if echo is not None else ""
        out.append({"index": c.index, "text": prefix + "".join(c.text),
                    "logprobs": completion_logprobs(c.logprobs, text, 0) if c.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage_json(usage), "system_fingerprint": None}


def chat_body(rid: str, created: int, model: str, choices: list[ChoiceState], usage: Usage,
              text: TokenText, tools: Callable[[], Any] | None = None) -> dict[str, Any]:
    """`tools` makes each choice's tool handling (`tools.ChoiceTools`), for calls in the reply."""
    out = []
    for c in choices:
        content, calls, finish = "".join(c.text), [], c.finish_reason
        if tools is not None:
            content, calls, finish = tools().reply(content, finish)
        out.append({"index": c.index,
                    "message": {"role": "assistant", "content": content, "refusal": None,
                                "tool_calls": [call.json() for call in calls]},
                    "logprobs": {"content": chat_logprobs(c.logprobs, text)} if c.logprobs is not None else None,
                    "finish_reason": finish, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage_json(usage), "system_fingerprint": None}


def chunk(rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
          usage: dict[str, Any] | None, with_usage_field: bool) -> dict[str, Any]:
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "system_fingerprint": None}
    if with_usage_field:
        body["usage"] = usage
    return body
