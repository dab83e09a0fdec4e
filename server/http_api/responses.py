"""OpenAI response bodies and stream chunks from engine outputs.

`ChoiceState` accumulates one choice (one sequence of one prompt) across merged deltas, for
the final body of a non-streamed call; the `*_chunk` functions frame one delta as OpenAI's
stream does. Token strings for logprobs come from `TokenText`, which decodes each id once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxserve.engine.detokenizer import TokenText
from jaxserve.engine.outputs import TokenLogprob, Usage


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


def completion_logprobs(lps: Sequence[TokenLogprob | int], text: TokenText, offset: int) -> dict[str, Any]:
    """OpenAI's legacy shape: parallel lists; `offset` is where this delta's text starts. A
    bare token id is a token without a logprob (an echoed prompt's first token: null)."""
    tokens, offsets, values, tops = [], [], [], []
    for lp in lps:
        tid = lp if isinstance(lp, int) else lp.token_id
        offsets.append(offset)
        s = text(tid)
        tokens.append(s)
        offset += len(s)
        if isinstance(lp, int):
            values.append(None)
            tops.append(None)
        else:
            values.append(_finite(lp.logprob))
            tops.append({text(t): _finite(v) for t, v in lp.top} | {s: _finite(lp.logprob)})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


@dataclasses.dataclass(frozen=True)
class EchoedPrompt:
    """What `echo` puts before a prompt's choices: its text and, with logprobs, its tokens'
    entries (the first token's logprob is null: nothing comes before it)."""

    text: str
    token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None

    def logprob_entries(self) -> list[TokenLogprob | int]:
        lps = self.prompt_logprobs or [None] * len(self.token_ids)
        return [lp if lp is not None else tid for tid, lp in zip(self.token_ids, lps)]


def vllm_prompt_logprobs(lps: list[TokenLogprob | None] | None, text: TokenText) -> list[Any] | None:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}} for the token and its top alternatives."""
    if lps is None:
        return None
    out: list[Any] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": _finite(v), "rank": r + 1, "decoded_token": text(t)}
                 for r, (t, v) in enumerate(lp.top)}
        entry[str(lp.token_id)] = {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": text(lp.token_id)}
        out.append(entry)
    return out


@dataclasses.dataclass
class ChoiceState:
    """One choice of a non-streamed call, accumulated from deltas."""

    index: int
    text: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] = dataclasses.field(default_factory=list)  # what gpt-oss's replies are parsed from

    def add(self, delta_text: str, delta_lps: list[TokenLogprob] | None, finish_reason: str | None,
            stop_reason: int | str | None, delta_token_ids: Sequence[int] = ()) -> None:
        if delta_text:
            self.text.append(delta_text)
        self.token_ids.extend(delta_token_ids)
        if delta_lps is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta_lps)
        if finish_reason is not None:
            self.finish_reason, self.stop_reason = finish_reason, stop_reason


def completion_body(rid: str, created: int, model: str, choices: list[ChoiceState], usage: Usage,
                    text: TokenText, prompts: list[EchoedPrompt], n: int, *, echo: bool = False,
                    score_only: bool = False) -> dict[str, Any]:
    """`prompts`: per prompt, what echo shows and its prompt logprobs; `score_only`: echo with
    max_tokens 0 (the prompt alone comes back, its one sampled token is dropped)."""
    out = []
    for c in choices:
        p = prompts[c.index // n]
        lps = None
        if c.logprobs is not None:
            lps = (p.logprob_entries() if echo else []) + ([] if score_only else c.logprobs)
        out.append({"index": c.index, "text": (p.text if echo else "") + ("" if score_only else "".join(c.text)),
                    "logprobs": completion_logprobs(lps, text, 0) if lps is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "prompt_logprobs": vllm_prompt_logprobs(p.prompt_logprobs, text)})
    if score_only:
        usage = dataclasses.replace(usage, completion_tokens=0)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
            "usage": usage_json(usage), "system_fingerprint": None}


def chat_body(rid: str, created: int, model: str, choices: list[ChoiceState], usage: Usage,
              text: TokenText, tools: Callable[[], Any] | None = None,
              prompt_logprobs: list[TokenLogprob | None] | None = None,
              harmony: Callable[[], Any] | None = None) -> dict[str, Any]:
    """`tools` makes each choice's tool handling (`tools.ChoiceTools`), for calls in the reply;
    `harmony` each choice's parser of gpt-oss's tokens (`harmony_reply.HarmonyReply`)."""
    out = []
    for c in choices:
        content, calls, finish = "".join(c.text), [], c.finish_reason
        if harmony is not None:
            reply = harmony()
            reply.feed(c.token_ids)
            message, finish = reply.message(), reply.finish_reason(finish)
        else:
            if tools is not None:
                content, calls, finish = tools().reply(content, finish)
            message = {"role": "assistant", "content": content, "refusal": None,
                       "tool_calls": [call.json() for call in calls]}
        out.append({"index": c.index, "message": message,
                    "logprobs": {"content": chat_logprobs(c.logprobs, text)} if c.logprobs is not None else None,
                    "finish_reason": finish, "stop_reason": c.stop_reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage_json(usage), "system_fingerprint": None,
            "prompt_logprobs": vllm_prompt_logprobs(prompt_logprobs, text)}


def chunk(rid: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
          usage: dict[str, Any] | None, with_usage_field: bool) -> dict[str, Any]:
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "system_fingerprint": None}
    if with_usage_field:
        body["usage"] = usage
    return body
