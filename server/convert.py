"""Proto <-> the serving core's and the engine's types (the gRPC front's parsing; checks are the core's)."""

from __future__ import annotations

import json
from typing import Any

from jaxserve.engine.outputs import RequestOutput, TokenLogprob
from scheduler import SamplingParams, StructuredOutputsParams
from server.core_types import PromptInput
from server.proto import jaxserve_pb2 as pb

_SCALAR_FIELDS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "ignore_eos",
    "logprobs", "cache_salt", "priority", "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs",
)


def sampling_params_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Only fields the client set are passed on; the rest take SamplingParams' defaults.
    Raises ValueError naming the field."""
    kwargs: dict[str, Any] = {f: getattr(sp, f) for f in _SCALAR_FIELDS if sp.HasField(f)}
    if sp.stop:
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


def prompt_from_proto(req: pb.GenerateRequest | pb.TokenizeRequest) -> PromptInput:
    """The request's prompt (text, token ids or a chat); its checks are the core's."""
    kind = req.WhichOneof("input")
    if kind is None:
        raise ValueError("input: one of text, token_ids or chat is required")
    images = [(bytes(b), f"images[{i}]") for i, b in enumerate(getattr(req, "images", ()))]
    if kind == "text":
        return PromptInput(text=req.text, param="text", images=images)
    if kind == "token_ids":
        return PromptInput(token_ids=list(req.token_ids.ids), param="token_ids", images=images)
    if images:
        raise ValueError("images: a chat carries its images in its messages (chat.messages[i].images)")
    chat = req.chat
    messages, images = [], []
    for i, m in enumerate(chat.messages):
        if m.images:  # the images first, then the text, as the content parts of an OpenAI message
            images += [(bytes(b), f"chat.messages[{i}].images[{j}]") for j, b in enumerate(m.images)]
            content = [{"type": "image"} for _ in m.images] + [{"type": "text", "text": m.content}]
            messages.append({"role": m.role, "content": content})
        else:
            messages.append({"role": m.role, "content": m.content})
    add_gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    return PromptInput(messages=messages, add_generation_prompt=add_gen, param="chat.messages", images=images)


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
            _add_logprobs(d.logprobs, c.delta_logprobs)
        if isinstance(c.stop_reason, str):
            d.stop_str = c.stop_reason
        elif isinstance(c.stop_reason, int):
            d.stop_token_id = c.stop_reason
    if out.prompt_logprobs:
        _add_logprobs(resp.prompt_logprobs, out.prompt_logprobs[1:])
    u = out.usage
    resp.usage.prompt_tokens = u.prompt_tokens
    resp.usage.completion_tokens = u.completion_tokens
    resp.usage.cached_tokens = u.cached_tokens
    return resp


def _add_logprobs(field: Any, lps: list[TokenLogprob]) -> None:
    for lp in lps:
        t = field.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank)
        for tid, tlp in lp.top:
            t.top.add(token_id=tid, logprob=tlp)
