"""Proto <-> engine types, and the front-side input checks (sizes, required fields)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from jaxserve.outputs import RequestOutput
from scheduler import SamplingParams, StructuredOutputsParams
from server.proto import jaxserve_pb2 as pb

_SCALAR_FIELDS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "ignore_eos",
    "logprobs", "cache_salt", "priority", "skip_special_tokens", "include_stop_str_in_output",
)
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_REQUEST_ID_CHARS = 256
MAX_CHAT_MESSAGES = 1024


def sampling_params_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Only fields the client set are passed on; the rest take SamplingParams' defaults.
    Raises ValueError naming the field."""
    kwargs: dict[str, Any] = {f: getattr(sp, f) for f in _SCALAR_FIELDS if sp.HasField(f)}
    if sp.stop:
        check_stop_strings(sp.stop)
        kwargs["stop"] = list(sp.stop)
    if sp.stop_token_ids:
        kwargs["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        kwargs["logit_bias"] = dict(sp.logit_bias)
    if sp.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(sp.structured_outputs)
    return SamplingParams(**kwargs)


def structured_outputs_from_proto(so: pb.StructuredOutputs) -> StructuredOutputsParams:
    kind = so.WhichOneof("kind")
    if kind is None:
        raise ValueError("structured_outputs: set one of json, json_object, regex, choice, grammar")
    value = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    return StructuredOutputsParams(**{kind: value})


def check_stop_strings(stops: Sequence[str]) -> None:
    """The front ends' bound on stop strings (each is matched against every new token's text)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stops):
        raise ValueError(f"stop: each string must be at most {MAX_STOP_STRING_CHARS} characters")


def check_prompt_chars(n: int, limit: int, field: str) -> None:
    if n > limit:
        raise ValueError(f"{field}: {n} characters is over the limit of {limit} (max_prompt_chars)")


def sampling_params_to_proto(params: SamplingParams | None = None, **fields: Any) -> pb.SamplingParams:
    """Client helper: keyword fields (None = unset) -> proto."""
    out = pb.SamplingParams()
    for k, v in fields.items():
        if v is None:
            continue
        if k in ("stop", "stop_token_ids"):
            getattr(out, k).extend([v] if isinstance(v, str) else v)
        elif k == "logit_bias":
            out.logit_bias.update(v)
        elif k == "structured_outputs":
            spec = v if isinstance(v, StructuredOutputsParams) else StructuredOutputsParams(**v)
            so = out.structured_outputs
            if spec.kind == "choice":
                so.choice.choices.extend(spec.choice)
            elif spec.kind == "json":
                so.json = json.dumps(spec.json)
            else:
                setattr(so, spec.kind, getattr(spec, spec.kind))
        else:
            setattr(out, k, v)
    return out


def check_input(req: pb.GenerateRequest | pb.TokenizeRequest, max_prompt_chars: int,
                max_model_len: int) -> tuple[str | None, list[int] | None, tuple[list[dict], bool] | None]:
    """Returns (text, token_ids, chat) with exactly one set; raises ValueError naming the field."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValueError("input: one of text, token_ids or chat is required")
    if kind == "text":
        if not req.text:
            raise ValueError("text: the prompt must not be empty")
        check_prompt_chars(len(req.text), max_prompt_chars, "text")
        return req.text, None, None
    if kind == "token_ids":
        ids = list(req.token_ids.ids)
        if not ids:
            raise ValueError("token_ids: the prompt must not be empty")
        if len(ids) >= max_model_len:
            raise ValueError(f"token_ids: {len(ids)} tokens leaves no room for output within "
                             f"max_model_len {max_model_len}")
        return None, ids, None
    chat = req.chat
    if not chat.messages:
        raise ValueError("chat.messages: must not be empty")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"chat.messages: at most {MAX_CHAT_MESSAGES} messages, got {len(chat.messages)}")
    check_prompt_chars(sum(len(m.content) + len(m.role) for m in chat.messages), max_prompt_chars, "chat.messages")
    for i, m in enumerate(chat.messages):
        if not m.role:
            raise ValueError(f"chat.messages[{i}].role: must not be empty")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return None, None, (messages, add_gen)


def output_to_proto(out: RequestOutput, reported: set[int] | None = None, *,
                    request_id: str | None = None) -> pb.GenerateResponse:
    """One response from one step's (or several merged steps') deltas. `reported` (kept per
    stream) holds the indices whose finish was already sent, so a finished sequence of an n > 1
    request is sent once. `request_id`: the id the client knows (the engine's is tenant-scoped)."""
    resp = pb.GenerateResponse(request_id=out.request_id if request_id is None else request_id,
                               finished=out.finished)
    for c in out.outputs:
        new_finish = c.finish_reason is not None and (reported is None or c.index not in reported)
        if not (c.delta_token_ids or c.delta_text or new_finish):
            continue
        if new_finish and reported is not None:
            reported.add(c.index)
        d = resp.outputs.add(index=c.index, text=c.delta_text, token_ids=c.delta_token_ids,
                             finish_reason=c.finish_reason or "")
        if c.delta_logprobs:
            for lp in c.delta_logprobs:
                t = d.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank)
                for tid, tlp in lp.top:
                    t.top.add(token_id=tid, logprob=tlp)
        if isinstance(c.stop_reason, str):
            d.stop_str = c.stop_reason
        elif isinstance(c.stop_reason, int):
            d.stop_token_id = c.stop_reason
    u = out.usage
    resp.usage.prompt_tokens = u.prompt_tokens
    resp.usage.completion_tokens = u.completion_tokens
    resp.usage.cached_tokens = u.cached_tokens
    return resp
