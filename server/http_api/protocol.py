"""OpenAI request bodies (plus vLLM's extra sampling fields), parsed strictly, and their
translation into engine `SamplingParams`.

Bodies are validated by pydantic in strict JSON mode: a string where a number belongs, or a
float where an integer belongs, is a 400 naming the field, as OpenAI answers; unknown fields
are ignored (clients send fields of newer API versions). Parameters that would change what is
generated and that the engine cannot honour are refused by name, never silently dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from jaxserve.engine.input_processor import MAX_CHAT_MESSAGES
from scheduler import SamplingParams, StructuredOutputsParams
from server.errors import ServeError, invalid

MAX_PROMPTS = 256  # prompts in one /v1/completions call (each is one engine request per n)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # outputs always follow the schema, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk


class _Sampling(_Body):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None
    request_id: str | None = None
    best_of: int | None = None  # accepted only when equal to n: the engine returns all n it samples
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, json_object, regex, choice, grammar
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs (non-streamed calls)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options: only allowed with stream=true", "stream_options")
        if self.stream and self.prompt_logprobs:
            raise invalid("prompt_logprobs: not available with stream=true", "prompt_logprobs")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid("best_of: only best_of == n is supported (every sampled sequence is returned)", "best_of")

    def logit_bias_ids(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        out = {}
        for k, v in self.logit_bias.items():
            try:
                out[int(k)] = v
            except ValueError:
                raise invalid(f"logit_bias: keys must be token ids, got {k!r}", "logit_bias") from None
        return out

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        fields: dict[str, Any] = {
            name: getattr(self, name) for name in (
                "n", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                "include_stop_str_in_output", "cache_salt", "priority", "stop")
            if getattr(self, name) is not None}
        fields.update(max_tokens=max_tokens, logprobs=logprobs, logit_bias=self.logit_bias_ids(),
                      structured_outputs=self.structured_spec(),
                      prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            msg = str(e)
            raise invalid(msg, _leading_name(msg)) from e

    def structured_spec(self) -> StructuredOutputsParams | None:
        """`structured_outputs` (vLLM) or `response_format` (OpenAI), at most one of them."""
        rf = self.response_format if self.response_format is not None and self.response_format.type != "text" else None
        if rf is not None and self.structured_outputs is not None:
            raise invalid("response_format and structured_outputs: give at most one", "structured_outputs")
        try:
            if self.structured_outputs is not None:
                return StructuredOutputsParams.from_dict(self.structured_outputs)
            if rf is None:
                return None
            if rf.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            if rf.json_schema is None:
                raise ValueError("response_format.json_schema: required with type 'json_schema'")
            if rf.json_schema.schema_ is None:  # OpenAI: no schema means any JSON object
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=rf.json_schema.schema_)
        except ValueError as e:
            param = "structured_outputs" if self.structured_outputs is not None else "response_format"
            msg = str(e).replace("structured_outputs.json", "response_format.json_schema.schema") if rf else str(e)
            raise invalid(msg, param) from None

    @property
    def structured_param(self) -> str:
        return "structured_outputs" if self.structured_outputs is not None else "response_format"


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise invalid("suffix: insertion (fill-in-the-middle) is not supported", "suffix")
        if self.max_tokens is not None and self.max_tokens < (0 if self.echo else 1):
            raise invalid(f"max_tokens must be an integer >= {0 if self.echo else 1}, got {self.max_tokens}",
                          "max_tokens")

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0 (log-likelihood scoring): the prompt comes back, nothing
        generated; the engine samples one token (vLLM does the same) that is not shown."""
        return self.echo and self.max_tokens == 0

    @property
    def echo_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: the explicit field, else `logprobs` when echoing."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            out: list[Any] = [p]
        elif not p:
            raise invalid("prompt: must not be empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            out = [p]
        elif all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            out = list(p)
        else:
            raise invalid("prompt: a string, a list of strings, a list of token ids or a list of such lists",
                          "prompt")
        if len(out) > MAX_PROMPTS:
            raise invalid(f"prompt: at most {MAX_PROMPTS} prompts per call, got {len(out)}", "prompt")
        for i, x in enumerate(out):
            if not x:
                raise invalid(f"prompt[{i}]: must not be empty" if len(out) > 1 else "prompt: must not be empty",
                              "prompt")
        return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImageURL(_Body):
    url: str  # a data:image/...;base64, URL, or an http(s) URL of a host --allowed-media-domains lists
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor sizes images


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


class OtherPart(_Body):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str

    @pydantic.field_validator("type")
    @classmethod
    def _not_text(cls, v: str) -> str:
        if v == "text":  # a text part without its text: let TextPart's error name the field
            raise ValueError("a text part needs a 'text' string")
        return v


class CalledFunction(_Body):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Body):
    """One call of an earlier assistant turn, as OpenAI's API writes it back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    model_config = ConfigDict(strict=True, extra="allow")  # other fields reach the template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def images(self, index: int) -> list[tuple[str, str]]:
        """(url, where) of each image part, in order (`where`: `messages[i].content[j]`)."""
        if not isinstance(self.content, list):
            return []
        return [(part.image_url.url, f"messages[{index}].content[{j}]")
                for j, part in enumerate(self.content) if isinstance(part, ImagePart)]

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: content as one string (text parts
        joined by newlines, as vLLM does), or, with image parts, the parts in order as
        `{"type": "text", "text": ...}` / `{"type": "image"}` (what vision-language chat
        templates read); "developer" as "system" (templates know only it)."""
        content = self.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, TextPart | ImagePart):
                    raise invalid(f"messages[{index}].content[{j}]: only text and image_url parts are supported, "
                                  f"got type {part.type!r}", f"messages[{index}].content[{j}].type")
            if any(isinstance(part, ImagePart) for part in content):
                content = [{"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                           for p in content]
            else:
                content = "\n".join(p.text for p in content)
        out = {**(self.model_extra or {}), "role": "system" if self.role == "developer" else self.role,
               "content": content or ""}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # How long gpt-oss thinks (its harmony system message); other models ignore it, as vLLM's
    # chat templates that do not read it do.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs: requires logprobs=true", "top_logprobs")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise invalid("tool_choice: needs tools", "tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise invalid(f"tool_choice: no tool named {choice.function.name!r} in tools", "tool_choice")
        if self.tools and len({t.function.name for t in self.tools}) != len(self.tools):
            raise invalid("tools: function names must be unique", "tools")
        if self.tool_mode in ("required", "named") and self.structured_spec() is not None:
            raise invalid("tool_choice: a required or named tool call cannot be combined with "
                          "response_format / structured_outputs", "tool_choice")
        if self.continue_final_message and (self.add_generation_prompt or self.messages[-1].role != "assistant"):
            raise invalid("continue_final_message: needs add_generation_prompt=false and a final assistant message",
                          "continue_final_message")
        for name in ("max_tokens", "max_completion_tokens"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise invalid(f"{name} must be an integer >= 1, got {v}", name)

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named" (OpenAI's default: auto when tools are given)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def output_limit_field(self) -> str:
        """The field `output_limit` came from, for errors that name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def images(self) -> list[tuple[str, str]]:
        """Every image part's (url, where), in conversation order."""
        return [im for i, m in enumerate(self.messages) for im in m.images(i)]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("give one of prompt or messages", "prompt")


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Strict JSON -> model; a 400 naming the first bad field otherwise."""
    try:
        req = model.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise _validation_error(e) from None
    return req


def _validation_error(e: pydantic.ValidationError) -> ServeError:
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return invalid(f"the body is not valid JSON: {err['msg']}", None, "invalid_json")
    if err["type"] == "model_type" and not err["loc"]:
        return invalid("the body must be a JSON object", None)
    param = _param_name(err["loc"])
    got = err.get("input")
    shown = json.dumps(got)[:80] if isinstance(got, str | int | float | bool | None) else type(got).__name__
    if err["type"] == "missing":
        return invalid(f"{param}: a required field is missing", param)
    return invalid(f"{param}: {err['msg'].lower()} (got {shown})", param)


def _param_name(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; union-branch names are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]",
                      "TextPart", "OtherPart", "function-after") or "[" in str(part):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or "body"


def _leading_name(msg: str) -> str | None:
    word = msg.split(" ", 1)[0].rstrip(":")
    return word.split("[", 1)[0] if word.replace("_", "").replace("[", "").replace("]", "").isalnum() else None
