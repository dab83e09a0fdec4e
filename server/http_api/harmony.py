"""gpt-oss's chat format ("harmony") on the OpenAI chat front: which models speak it, its
vocabulary, and the prompt of a chat request.

gpt-oss was trained on harmony, not on a Jinja chat template, and its replies are harmony
messages on channels (`analysis`: its reasoning, `commentary`: tool calls and preambles,
`final`: the answer). Following vLLM, the front renders the prompt with openai-harmony itself:

* a system message: harmony's model identity, the request's `reasoning_effort`, today's date,
  and the channels the reply may use (no `commentary` without function tools, as vLLM);
* a developer message, when there is something to say: the instructions of the request's
  system and developer messages, joined, and its `tools` as function tools;
* the conversation: user turns; earlier assistant turns as their `reasoning_content` on
  `analysis`, their text on `final` (on `commentary`, as a preamble, beside tool calls) and each
  tool call on `commentary` to `functions.NAME`; `tool` messages from `functions.NAME`;
* the assistant's turn, prompted (`render_conversation_for_completion`).

Which model speaks harmony is vLLM's rule: HF model_type "gpt_oss". openai-harmony needs the
o200k_base vocabulary: it downloads it on first use, or reads it from the folder named by
TIKTOKEN_ENCODINGS_BASE. The front loads it once, when the model is known; a gpt-oss server
that cannot load it does not start (`HarmonyUnavailable` says what to provide).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import os

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

from jaxserve.models.config import UnsupportedModelError
from jaxserve.models.registry import family_of
from server.errors import invalid
from server.http_api.protocol import ChatCompletionRequest, ChatMessage

GPT_OSS_MODEL_TYPE = "gpt_oss"
VOCAB_ENV = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # openai-harmony checks it
CALL_CONTENT_TYPE = "<|constrain|>json"  # how gpt-oss itself marks a call's JSON arguments
_EFFORT = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}


class HarmonyUnavailable(RuntimeError):
    """openai-harmony could not load its vocabulary; the message says what to provide."""


def speaks_harmony(architecture: str) -> bool:
    """Whether the served model (jaxserve's architecture name) is gpt-oss: its family reads HF
    configs of model_type "gpt_oss" (vLLM decides by that model_type)."""
    if architecture == GPT_OSS_MODEL_TYPE:
        return True
    try:
        family = family_of(architecture)
    except UnsupportedModelError:
        return False
    return family.hf_model_types.get(GPT_OSS_MODEL_TYPE) == architecture


def load_encoding() -> HarmonyEncoding:
    """gpt-oss's harmony encoding (loaded once per vocabulary folder: it takes ~0.3 s)."""
    return _load(os.environ.get(VOCAB_ENV))


@functools.lru_cache(maxsize=4)
def _load(vocab_dir: str | None) -> HarmonyEncoding:
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except HarmonyError as e:
        where = f"{VOCAB_ENV}={vocab_dir}" if vocab_dir else f"{VOCAB_ENV} is not set: it tried to download it"
        raise HarmonyUnavailable(
            f"gpt-oss's chat format (harmony) needs the o200k_base vocabulary and openai-harmony could not "
            f"load it ({where}): {e}. Offline, put {VOCAB_FILE} (sha256 {VOCAB_SHA256}, from "
            f"https://openaipublic.blob.core.windows.net/encodings/{VOCAB_FILE}) in a folder and set "
            f"{VOCAB_ENV} to that folder") from e


@dataclasses.dataclass(frozen=True)
class HarmonyPrompt:
    """A chat request as harmony messages, and the function names its reply may call."""

    conversation: Conversation
    tool_names: frozenset[str]

    def token_ids(self, encoding: HarmonyEncoding) -> list[int]:
        """The prompt's ids, the assistant's turn opened (runs on the tokenizer pool). A
        conversation harmony refuses is the client's error (ValueError: a 400 on `messages`)."""
        try:
            return encoding.render_conversation_for_completion(self.conversation, Role.ASSISTANT)
        except HarmonyError as e:
            raise ValueError(f"the conversation cannot be written in gpt-oss's chat format (harmony): {e}") from e


def check_request(req: ChatCompletionRequest) -> None:
    """Refuses, by name, what a harmony reply cannot honour (never silently dropped)."""
    if req.tool_mode in ("required", "named"):
        raise invalid("tool_choice: gpt-oss (harmony) decides its calls itself; use 'auto' or 'none'",
                      "tool_choice")
    if req.structured_spec() is not None:
        raise invalid(f"{req.structured_param}: not available for gpt-oss (harmony): a grammar over the whole "
                      "reply would break its channels", req.structured_param)
    if req.continue_final_message:
        raise invalid("continue_final_message: not available for gpt-oss (harmony)", "continue_final_message")
    if not req.add_generation_prompt:
        raise invalid("add_generation_prompt: gpt-oss (harmony) always prompts the assistant's turn",
                      "add_generation_prompt")


def harmony_prompt(req: ChatCompletionRequest, today: str | None = None) -> HarmonyPrompt:
    """The request's conversation in harmony (see the module's docstring). `today`: the
    conversation's start date (default: today's, as vLLM writes it)."""
    tools = req.tools if req.tool_mode != "none" else None
    system = SystemContent.new().with_conversation_start_date(today or datetime.date.today().isoformat())
    if req.reasoning_effort is not None:
        system = system.with_reasoning_effort(_EFFORT[req.reasoning_effort])
    if not tools:  # nothing to call: the reply has no commentary channel (vLLM does the same)
        system = system.with_required_channels([c for c in system.channel_config.valid_channels
                                                if c != "commentary"])
    messages = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [_text(m, i) for i, m in enumerate(req.messages) if m.role in ("system", "developer")]
    if instructions or tools:
        developer = DeveloperContent.new()
        if instructions:
            developer = developer.with_instructions("\n".join(instructions))
        if tools:
            developer = developer.with_function_tools([
                ToolDescription.new(t.function.name, t.function.description or "", t.function.parameters)
                for t in tools])
        messages.append(Message.from_role_and_content(Role.DEVELOPER, developer))
    call_names: dict[str, str] = {}  # tool call id -> function name, for the tool messages' authors
    for i, m in enumerate(req.messages):
        if m.role == "user":
            messages.append(Message.from_role_and_content(Role.USER, _text(m, i)))
        elif m.role == "assistant":
            messages += _assistant(m, i, call_names)
        elif m.role == "tool":
            result = Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{_tool_name(m, i, call_names)}"),
                                                     _text(m, i))
            messages.append(result.with_recipient("assistant").with_channel("commentary"))
    return HarmonyPrompt(Conversation.from_messages(messages),
                         frozenset(t.function.name for t in tools) if tools else frozenset())


def _assistant(m: ChatMessage, i: int, call_names: dict[str, str]) -> list[Message]:
    """An earlier assistant turn: its reasoning, its text, its calls."""
    out = []
    extra = m.model_extra or {}
    reasoning = extra.get("reasoning_content", extra.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise invalid(f"messages[{i}].reasoning_content: must be a string", f"messages[{i}].reasoning_content")
    if reasoning:
        out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
    text = _text(m, i)
    if text or not (out or m.tool_calls):
        out.append(Message.from_role_and_content(Role.ASSISTANT, text)
                   .with_channel("commentary" if m.tool_calls else "final"))
    for call in m.tool_calls or ():
        if call.id:
            call_names[call.id] = call.function.name
        out.append(Message.from_role_and_content(Role.ASSISTANT, call.function.arguments)
                   .with_channel("commentary").with_recipient(f"functions.{call.function.name}")
                   .with_content_type(CALL_CONTENT_TYPE))
    return out


def _tool_name(m: ChatMessage, i: int, call_names: dict[str, str]) -> str:
    """The function a tool message answers: its `name`, else that of the call it names."""
    if m.name:
        return m.name
    if m.tool_call_id in call_names:
        return call_names[m.tool_call_id]
    raise invalid(f"messages[{i}].tool_call_id: no earlier assistant tool call has the id {m.tool_call_id!r}; "
                  "gpt-oss needs the function's name (give it in `name`)", f"messages[{i}].tool_call_id")


def _text(m: ChatMessage, i: int) -> str:
    """A message's text: its text parts joined (other parts refused by name), as for templates."""
    return str(m.template_dict(i)["content"])
