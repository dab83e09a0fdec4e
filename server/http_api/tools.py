"""Tool calling for the chat API: constrained calls, the model's own call formats, streaming.

* tool_choice "required" and a named function are constrained by a JSON schema built from
  the tools' parameters (as vLLM does), so every call parses and validates: a named call's
  output is its arguments object; a required call's output is a JSON array of
  ``{"name": ..., "parameters": ...}``.
* tool_choice "auto" leaves the model free and parses its own format from the text:
  ``hermes`` (Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) or
  ``llama3_json`` (Llama 3.x: the whole reply is ``{"name": ..., "parameters": ...}``, several
  joined by ``;``, optionally after ``<|python_tag|>``).
* A chat template that ignores ``tools`` (the embedded SmolLM2's does) gets the tools and
  the Hermes call format described in a system message instead, so "auto" still works.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict[str, Any]:
        return {"index": index, **self.json()}


def _params_schema(tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools, parallel: bool | None) -> dict[str, Any]:
    """An array of one call (or more, unless parallel_tool_calls is false) of any tool."""
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _params_schema(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    out: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel is False:
        out["maxItems"] = 1
    return out


def named_schema(tools, name: str) -> dict[str, Any]:
    return _params_schema(next(t for t in tools if t.function.name == name))


def parse_required(text: str) -> list[ToolCall]:
    """The calls of a constrained "required" output (a complete JSON array), or [] if cut short."""
    try:
        return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
    except (json.JSONDecodeError, KeyError, TypeError):
        return []


def _call_from_json(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a free-form reply in the model's own format."""
    if parser == "hermes":
        calls = []
        for m in _HERMES.finditer(text):
            try:
                call = _call_from_json(json.loads(m.group(1)), ("arguments", "parameters"))
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a well-formed call: the text stays content
                return text, []
            calls.append(call)
        if not calls:
            return text, []
        content = _HERMES.sub("", text).strip()
        return content or None, calls
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in _split_json_objects(body):
        try:
            call = _call_from_json(json.loads(part), ("parameters", "arguments"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _split_json_objects(body: str) -> list[str]:
    """`{...}; {...}` -> its objects (a JSON decoder finds where each ends)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            _, end = dec.raw_decode(body, i)
        except json.JSONDecodeError:
            return [body]  # let the caller's json.loads report it
        out.append(body[i:end])
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return out


class StreamingToolParser:
    """Splits a streamed auto-mode reply into content deltas and whole tool calls.

    Content streams as it comes, except a tail that may be the start of a call marker;
    a call is sent in one delta once it is complete (OpenAI's clients accumulate either way).
    """

    def __init__(self, parser: str):
        self.parser = parser
        self._buf = ""
        self._in_call = False
        self._json_reply: bool | None = None  # llama3_json: does the reply start with "{"?
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        if self.parser == "llama3_json":
            return self._feed_json()
        content, calls = [], []
        while True:
            if self._in_call:
                end = self._buf.find(_HERMES_CLOSE)
                if end < 0:
                    break
                text = _HERMES_OPEN + self._buf[:end] + _HERMES_CLOSE
                _, found = parse_tool_calls(text, "hermes")
                if found:
                    calls += found
                else:
                    content.append(text)
                self._buf = self._buf[end + len(_HERMES_CLOSE):]
                self._in_call = False
            else:
                start = self._buf.find(_HERMES_OPEN)
                if start < 0:
                    keep = _partial_prefix(self._buf, _HERMES_OPEN)
                    content.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._buf[:start])
                self._buf = self._buf[start + len(_HERMES_OPEN):]
                self._in_call = True
        self.calls += calls
        return "".join(content), calls

    def _feed_json(self) -> tuple[str, list[ToolCall]]:
        if self._json_reply is None:
            head = self._buf.lstrip()
            if not head:
                return "", []
            if head.startswith(_PYTHON_TAG[: len(head)]) and len(head) < len(_PYTHON_TAG):
                return "", []  # maybe the tag: wait for more
            self._json_reply = head.startswith("{") or head.startswith(_PYTHON_TAG)
        if self._json_reply:
            return "", []  # parsed whole at the end
        out, self._buf = self._buf, ""
        return out, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left at the end of the reply."""
        rest, self._buf = self._buf, ""
        if self.parser == "llama3_json" and self._json_reply:
            content, calls = parse_tool_calls(rest, "llama3_json")
            self.calls += calls
            return content or "", calls
        if self._in_call:  # an unterminated call is left as text
            self._in_call = False
            return _HERMES_OPEN + rest, []
        return rest, []


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def tool_prompt(tools) -> str:
    """A system message teaching the Hermes call format, for templates that ignore tools."""
    specs = "\n".join(json.dumps({"type": "function", "function": {
        "name": t.function.name, "description": t.function.description or "",
        "parameters": _params_schema(t)}}, ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to help with the user query. The functions are:\n"
            f"<tools>\n{specs}\n</tools>\n"
            "To call a function, reply with a JSON object of its name and arguments inside tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def messages_for_plain_template(messages: list[dict[str, Any]], tools) -> list[dict[str, Any]]:
    """The conversation for a template without tool support: the tools in the system message,
    earlier assistant calls and tool results written out in the Hermes format."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if m["role"] == "assistant" and calls:
            blocks = [f"<tool_call>\n{json.dumps(_call_dict(c), ensure_ascii=False)}\n</tool_call>" for c in calls]
            m["content"] = "\n".join(filter(None, [m.get("content") or "", *blocks]))
        elif m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    prompt = tool_prompt(tools)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _call_dict(call: Any) -> dict[str, Any]:
    fn = call.get("function", {}) if isinstance(call, dict) else {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return {"name": fn.get("name", ""), "arguments": args}


class ChoiceTools:
    """One choice's tool handling, for a whole reply (`reply`) or a stream (`feed`/`finish`),
    in mode "auto", "required" or "named"."""

    def __init__(self, mode: str, parser: str, name: str | None = None):
        self.mode, self.parser, self.name = mode, parser, name
        self._stream = StreamingToolParser(parser) if mode == "auto" else None
        self._text: list[str] = []
        self._named: ToolCall | None = None
        self._num_calls = 0

    def reply(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a complete reply."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)], finish_reason
        content, calls = (None, parse_required(text)) if self.mode == "required" else parse_tool_calls(text, self.parser)
        if not calls:
            return text, [], finish_reason
        return content, calls, "tool_calls" if finish_reason == "stop" else finish_reason

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Stream deltas (`delta` objects) for new text."""
        if not text:
            return []
        if self.mode == "named":
            out = []
            if self._named is None:
                self._named = ToolCall(self.name, "")
                out.append({"tool_calls": [{**self._named.delta(0), "function": {"name": self.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self.mode == "required":
            self._text.append(text)
            return []
        content, calls = self._stream.feed(text)
        return self._deltas(content, calls)

    def finish(self, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        if self.mode == "named":
            return [], finish_reason
        if self.mode == "required":
            text = "".join(self._text)
            calls = parse_required(text)
            deltas = self._deltas("" if calls else text, calls)
        else:
            deltas = self._deltas(*self._stream.finish())
        if self._num_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return deltas, finish_reason

    def _deltas(self, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = [{"content": content}] if content else []
        for c in calls:
            out.append({"tool_calls": [c.delta(self._num_calls)]})
            self._num_calls += 1
        return out
