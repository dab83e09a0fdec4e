"""gpt-oss's reply, parsed from its harmony tokens into OpenAI's chat fields as they come.

Each generated token goes through openai-harmony's `StreamableParser` (role: assistant). When a
message's header is complete, the message is given its place, once:

* on the `analysis` channel: `reasoning_content`;
* to `functions.NAME`, NAME one of the request's tools: a tool call (a new `call_...` id, the
  name, then the message's text as its `arguments`), and finish reason "tool_calls";
* anything else (`final`, a `commentary` preamble without recipient, a call to a function the
  request did not offer, which is kept as text, not dropped): `content`.

Streams and whole replies are made by the same parser: a whole reply is the concatenation of
the deltas, so they never disagree. Two messages of one field are joined by a newline (as
vLLM joins them). A token sequence harmony rejects ends the reply with a 500 (`ServeError`,
code "harmony_parse_error"); a stream sends it as its error event.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, Literal

from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamableParser, StreamState

from server.errors import ErrorKind, ServeError
from server.http_api.tools import ToolCall

logger = logging.getLogger("jaxserve.server")

Field = Literal["reasoning_content", "content", "call"]


@dataclasses.dataclass
class HarmonyReply:
    """One choice's reply. `feed` the generated ids as they come for stream deltas; the
    accumulated fields are the whole reply (`message`)."""

    encoding: HarmonyEncoding = dataclasses.field(repr=False)
    tool_names: frozenset[str]  # the functions the request offered (none: every call is text)
    request_id: str = ""  # for the log line of a parse failure
    reasoning: str | None = None
    content: str | None = None
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    _parser: StreamableParser = dataclasses.field(init=False, repr=False)
    _field: Field | None = dataclasses.field(default=None, init=False)  # the open message's; None between

    def __post_init__(self) -> None:
        self._parser = StreamableParser(self.encoding, role=Role.ASSISTANT)

    def feed(self, token_ids: Sequence[int]) -> list[dict[str, Any]]:
        """The stream deltas (`delta` objects) of newly generated ids, consecutive text of one
        field merged. Raises ServeError when the ids are not harmony."""
        deltas: list[dict[str, Any]] = []
        for token in token_ids:
            try:
                self._parser.process(token)
            except HarmonyError as e:
                logger.warning("request %s: the model's reply is not valid harmony: %s", self.request_id, e)
                raise ServeError(ErrorKind.INTERNAL, f"the model's reply is not valid harmony (gpt-oss's chat "
                                 f"format): {e}; the reply ends here", code="harmony_parse_error") from e
            if self._parser.state != StreamState.CONTENT:
                self._field = None
                continue
            if self._field is None:
                self._open(deltas)
            text = self._parser.last_content_delta
            if text:
                self._add(deltas, text)
        return deltas

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" for a reply that stopped after calling (the engine says "stop")."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def message(self) -> dict[str, Any]:
        """The whole reply as OpenAI's (and vLLM's) `message` object."""
        return {"role": "assistant", "content": self.content, "reasoning_content": self.reasoning,
                "refusal": None, "tool_calls": [c.json() for c in self.calls]}

    # ------------------------------------------------------------------ internals
    def _open(self, deltas: list[dict[str, Any]]) -> None:
        """A message's header is complete: give it its field (a call starts here)."""
        recipient = self._parser.current_recipient
        name = recipient.removeprefix("functions.") if recipient else None
        if recipient is not None and recipient.startswith("functions.") and name in self.tool_names:
            self._field = "call"
            call = ToolCall(name, "")
            self.calls.append(call)
            deltas.append({"tool_calls": [call.delta(len(self.calls) - 1)]})
            return
        self._field = "reasoning_content" if recipient is None and self._parser.current_channel == "analysis" \
            else "content"
        if self._value(self._field) is not None:  # a second message of this field
            self._add(deltas, "\n")
        else:
            self._set(self._field, "")

    def _add(self, deltas: list[dict[str, Any]], text: str) -> None:
        last = deltas[-1] if deltas else {}
        if self._field == "call":
            call, index = self.calls[-1], len(self.calls) - 1
            call.arguments += text
            prev = last.get("tool_calls", [{}])[0]
            if prev.get("index") == index:
                prev["function"]["arguments"] += text
            else:
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
            return
        self._set(self._field, self._value(self._field) + text)
        if self._field in last:
            last[self._field] += text
        else:
            deltas.append({self._field: text})

    def _value(self, field: Field) -> str | None:
        return self.reasoning if field == "reasoning_content" else self.content

    def _set(self, field: Field, value: str) -> None:
        if field == "reasoning_content":
            self.reasoning = value
        else:
            self.content = value
