"""Tokenization and chat templating on a small worker pool, off the engine thread.

A 16k-character prompt takes ~7 ms to encode and its chat template ~20 ms on this class of
CPU; on the engine thread that is a stall of every stream. The pool runs them beside the
engine instead (the tokenizers library releases the GIL while it encodes). Each worker has
its own copy of the tokenizer, since a fast tokenizer's settings are not safe to share
between threads. The backlog is bounded in characters queued or being tokenized (what the
CPU time of the queue grows with): a job that would pass `max_backlog_chars` is refused at
once (RESOURCE_EXHAUSTED) instead of queueing without limit, unless its owner (the tenant)
has no job pending. So a burst of short prompts passes, a flood of long ones is refused, and
one tenant's flood never refuses another tenant's request.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxserve.engine.input_processor import apply_chat_template, conversation_chars


class FrontendBusy(Exception):
    """Too many tokenization jobs queued; the message says how many."""


class FrontendPool:
    def __init__(self, tokenizer: Any, threads: int = 2, max_backlog_chars: int = 1_000_000,
                 chat_template: str | None = None):
        if threads < 1 or max_backlog_chars < 1:
            raise ValueError("frontend threads and max_backlog_chars must be >= 1")
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # overrides the model's (--chat-template)
        self.max_backlog_chars = max_backlog_chars
        self.pending = 0  # jobs queued or running (event-loop thread only)
        self.backlog_chars = 0  # their characters
        self._pending_by_owner: dict[str, int] = {}
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxserve-frontend", initializer=_lower_priority)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _tok(self) -> Any:
        tok = getattr(self._local, "tokenizer", None)
        if tok is None:
            tok = self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return tok

    async def _run(self, owner: str, chars: int, fn: Any, *args: Any) -> Any:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: send token_ids")
        mine = self._pending_by_owner.get(owner, 0)
        if mine and self.backlog_chars + chars > self.max_backlog_chars:
            raise FrontendBusy(f"the tokenizer backlog is {self.backlog_chars} characters in {self.pending} jobs; "
                               f"{chars} more is over tokenizer_backlog_chars {self.max_backlog_chars}: retry later")
        self._pending_by_owner[owner] = mine + 1
        self.pending += 1
        self.backlog_chars += chars
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        finally:
            self.pending -= 1
            self.backlog_chars -= chars
            left = self._pending_by_owner[owner] - 1
            if left:
                self._pending_by_owner[owner] = left
            else:
                del self._pending_by_owner[owner]

    async def encode(self, text: str, owner: str = "", add_special_tokens: bool = True) -> list[int]:
        return await self._run(owner, len(text), self._encode, text, add_special_tokens)

    async def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, owner: str = "",
                   continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
                   messages_without_tool_support: list[dict[str, Any]] | None = None) -> list[int]:
        """`tools` go to the template; when it ignores them (its prompt does not change), the
        prompt is `messages_without_tool_support` instead (the tools written into it)."""
        chars = conversation_chars(messages)
        return await self._run(owner, chars, self._chat, messages, add_generation_prompt, continue_final_message,
                               tools, messages_without_tool_support)

    async def render(self, render: Callable[[], list[int]], messages: list[dict[str, Any]], owner: str = "") -> list[int]:
        """A conversation a front renders itself (`PromptInput.render`), under the same backlog
        as the chat template: rendering a long one costs the same CPU."""
        return await self._run(owner, conversation_chars(messages), render)

    async def run(self, fn: Callable[..., Any], *args: Any, owner: str = "", cost_chars: int = 0) -> Any:
        """Any other front-end work (decoding and resizing a request's images) on the pool,
        under the same backlog: `cost_chars` is what it counts as."""
        return await self._run(owner, cost_chars, fn, *args)

    async def decode(self, token_ids: list[int], owner: str = "", skip_special_tokens: bool = False) -> str:
        return await self._run(owner, len(token_ids), self._decode, token_ids, skip_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self._tok()(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, continue_final_message: bool,
              tools: list[dict[str, Any]] | None = None,
              messages_without_tool_support: list[dict[str, Any]] | None = None) -> list[int]:
        ids = apply_chat_template(self._tok(), messages, add_generation_prompt, self.chat_template,
                                  continue_final_message, tools)
        if tools and messages_without_tool_support is not None and ids == apply_chat_template(
                self._tok(), messages, add_generation_prompt, self.chat_template, continue_final_message):
            ids = apply_chat_template(self._tok(), messages_without_tool_support, add_generation_prompt,
                                      self.chat_template, continue_final_message)
        return ids

    def _decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok().decode(token_ids, skip_special_tokens=skip_special_tokens)


FRONTEND_NICE = 10


def _lower_priority() -> None:
    """Worker threads run at a lower CPU priority than the engine (Linux: per-thread nice), so
    that a flood of tokenization takes CPU from idle time first, not from the engine's steps."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), FRONTEND_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the normal priority
        pass
