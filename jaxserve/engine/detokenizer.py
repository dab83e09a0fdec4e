"""Incremental detokenization and stop strings for streaming outputs.

Decoding token by token is wrong for byte-level BPE: a character's UTF-8 bytes may be
split across tokens, and tokenizers drop or add spaces depending on what precedes a
token. So each update decodes a small window of recent tokens twice (the prefix/read
offset technique from HF text-generation-inference, also used by vLLM):

    prefix_text = decode(ids[prefix_offset:read_offset])   # already emitted
    new_text    = decode(ids[prefix_offset:])               # with the new tokens
    delta       = new_text[len(prefix_text):]

and emits nothing while ``new_text`` ends in U+FFFD (an incomplete character). The window
only covers tokens since the last emitted character, so per-call cost does not grow with
the output.

Stop strings are searched in the last ``max_len - 1`` characters plus the new text, so
they are found across token boundaries; as in vLLM, only once more than ``min_tokens``
tokens have been output (a stop string may still begin in earlier text). Text that could still be the start of a stop
string is held back until it is known not to be one; :meth:`flush` releases it when the
request finishes for another reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

# Prompt tokens decoded before the first output token, so its leading space is right.
_INITIAL_PREFIX_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    """The part of a tokenizer (transformers' or `FastTokenizer`) the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclasses.dataclass(frozen=True)
class DetokenizerDelta:
    """New text since the previous update; ``stop_str`` is set once a stop string matched."""

    text: str
    stop_str: str | None = None


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, honouring stop strings.

    After a stop string matches, the request is finished: later updates return empty
    deltas. ``output_text`` is everything emitted so far.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._min_tokens = min_tokens
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        # Longest text that must be kept for a match spanning old and new text.
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1

        # Only the prompt's last few tokens matter as decoding context.
        context = list(prompt_token_ids)[-_INITIAL_PREFIX_TOKENS:]
        self._ids: list[int] = context  # window tokens; trimmed as text is emitted
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._num_output_tokens = 0

        self._parts: list[str] = []  # emitted text
        self._joined: str | None = ""
        self._held = ""  # decoded but not emitted: might be the start of a stop string
        self._tail = ""  # last _tail_len chars of all decoded text, for the stop search
        self.stop_str: str | None = None

    @property
    def output_text(self) -> str:
        """All text emitted so far (held-back text excluded until released)."""
        if self._joined is None:
            self._joined = "".join(self._parts)
            self._parts = [self._joined]
        return self._joined

    @property
    def finished(self) -> bool:
        return self.stop_str is not None

    @property
    def num_output_tokens(self) -> int:
        return self._num_output_tokens

    def update(self, new_token_ids: Sequence[int]) -> DetokenizerDelta:
        """Add output tokens; return the text that can be emitted now."""
        if self.finished:
            return DetokenizerDelta("", self.stop_str)
        self._ids.extend(new_token_ids)
        self._num_output_tokens += len(new_token_ids)
        return self._process(self._decode_new(final=False), final=False)

    @property
    def _checking_stops(self) -> bool:
        return self._num_output_tokens > self._min_tokens

    def flush(self) -> DetokenizerDelta:
        """Finish: emit incomplete trailing bytes (as decode would) and held-back text."""
        if self.finished:
            return DetokenizerDelta("", self.stop_str)
        return self._process(self._decode_new(final=True), final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def _decode_new(self, *, final: bool) -> str:
        """Text of the tokens past read_offset, once it ends in a complete character."""
        if self._read_offset == len(self._ids) and not final:
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""  # e.g. a skipped special token
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""  # wait for the rest of the character
        delta = new_text[len(prefix_text) :]
        # Slide the window: drop tokens before the new prefix so ids stay short.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return delta

    def _process(self, delta: str, *, final: bool) -> DetokenizerDelta:
        """Stop-string search over held + new text; emit what is safe to emit."""
        pending = self._held + delta  # not yet emitted, in order
        match = self._find_stop(delta) if self._checking_stops else None
        if match is not None:
            stop_str, end_in_pending = match  # end of the stop string within pending
            cut = end_in_pending if self._include_stop else end_in_pending - len(stop_str)
            cut = max(cut, 0)  # the match began in text emitted while min_tokens held stops off
            self.stop_str = stop_str
            self._held = ""
            return self._emit(pending[:cut], stop_str)
        keep = 0 if final or not self._checking_stops else self._stop_prefix_len(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        self._tail = (self._tail + delta)[-self._tail_len :] if self._tail_len else ""
        return self._emit(pending[: len(pending) - keep], None)

    def _find_stop(self, delta: str) -> tuple[str, int] | None:
        """Earliest stop string ending in ``delta``, as (stop, end offset in held + delta)."""
        if not self._stop or not delta:
            return None
        window = self._tail + delta  # held text is the end of _tail
        best: tuple[int, str] | None = None
        for s in self._stop:
            start = window.find(s, max(0, len(self._tail) - len(s) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, s)
        if best is None:
            return None
        start, s = best
        # window ends where pending ends, so offsets convert by their lengths' difference.
        end_in_pending = start + len(s) - (len(window) - len(self._held) - len(delta))
        return s, end_in_pending

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        if self._include_stop or not self._stop:
            return 0  # an included stop string is emitted anyway; nothing to hide
        for n in range(min(len(text), self._tail_len), 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0

    def _emit(self, text: str, stop_str: str | None) -> DetokenizerDelta:
        if text:
            self._parts.append(text)
            self._joined = None
        return DetokenizerDelta(text, stop_str)


class TokenText:
    """id -> the token's text as OpenAI shows it in logprobs (one token decoded alone; a
    piece of a multi-byte character shows as U+FFFD, as in vLLM)."""

    def __init__(self, tokenizer: Tokenizer | None):
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id]) if self._tok is not None else str(token_id)
        return s
