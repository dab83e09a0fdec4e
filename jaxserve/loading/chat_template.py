"""Chat templates rendered as transformers renders them, without importing transformers.

Importing transformers costs ~0.7 s of every start on a 2-core VM, and a server needs from it only
the Jinja environment its templates are written for. This module rebuilds that environment
(sandboxed, `trim_blocks`/`lstrip_blocks`, loop controls, the `{% generation %}` tag, the
`tojson`, `raise_exception` and `strftime_now` helpers, namespaces that refuse dunder names) and
the message preparation transformers does before rendering (None-valued keys dropped, reasoning
fields aliased, inputs reduced to plain JSON data, `continue_final_message`). Templates come from
checkpoints, which are untrusted: everything renders in jinja2's immutable sandbox.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

# Names a message's reasoning is passed under; templates read the first (gpt-oss's read `thinking`).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def select_template(templates: str | dict[str, str] | None, chat_template: str | None,
                    tools: list[Any] | None) -> str:
    """The template to render: the caller's (a template, or the name of one of the model's), else
    the model's, else its `tool_use` template when tools are given and it has one, else `default`."""
    if isinstance(templates, dict):
        if chat_template is not None and chat_template in templates:
            return templates[chat_template]
        if chat_template is None:
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError("this model has several chat templates and none is named 'default'; name one of "
                             f"{sorted(templates)}")
    if chat_template is not None:
        return chat_template
    if templates is None:
        raise ValueError("this model has no chat template")
    return templates


def render_chat(template: str, messages: list[Any], *, tools: list[Any] | None = None,
                documents: list[Any] | None = None, add_generation_prompt: bool = False,
                continue_final_message: bool | str = False, **kwargs: Any) -> str:
    """One conversation rendered to text (special-token strings included, not yet tokenized)."""
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    chat = [_without_none(m) for m in messages]
    chat = _alias_reasoning(_plain(chat))
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, template, field)
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    rendered = _compile(template).render(messages=chat, tools=_plain(_tool_schemas(tools)),
                                         documents=_plain(documents),
                                         add_generation_prompt=add_generation_prompt, **_plain(kwargs))
    if final is not None:
        rendered = _cut_at_tag(rendered, final)
    return rendered


def _without_none(message: Any) -> dict[str, Any]:
    message = _as_dict(message)
    if not isinstance(message, dict):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    return {k: v for k, v in message.items() if v is not None}


def _as_dict(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return value.model_dump()
    return value


def _plain(value: Any) -> Any:
    """Only plain JSON data reaches a template: rich objects have methods the sandbox does not know
    are dangerous, so anything else becomes a placeholder naming its type."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and type(value).__module__ == "numpy":  # numpy scalars
        return _plain(value.item())
    as_dict = _as_dict(value)
    if as_dict is not value:
        return _plain(as_dict)
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in chat:
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out


def _tool_schemas(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    schemas = []
    for t in tools:
        if isinstance(t, dict):
            schemas.append(t)
        elif callable(t):  # a Python function: its schema from type hints and docstring (rare; worth the import)
            from transformers.utils import get_json_schema

            schemas.append(get_json_schema(t))
        else:
            raise ValueError("tools must be JSON schemas (dicts) or functions with type hints and a docstring")
    return schemas


def _tag_final_message(chat: list[dict[str, Any]], template: str, field: str) -> str:
    """Marks the end of the last message so the rendered text can be cut there (the model then
    continues that message instead of starting a new turn). Returns the message's text."""
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but the chat template does not read it')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if isinstance(block, dict) and "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message is set but the chat template dropped part of the final message")
    at = rendered.rindex(tag)
    if rendered[at: at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
        for inference keeps the body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """Namespaces refuse underscore names, which reach interpreter internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")

    class Dict:
        """`dict(...)` for templates, without the class itself (its attributes reach internals)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters, which no chat template wants
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = Dict()
    env.globals["namespace"] = Namespace
    return env.from_string(template)
