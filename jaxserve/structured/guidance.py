"""The llguidance backend: JSON schemas, regexes, choices and Lark (or GBNF) grammars.

llguidance computes a step's masks lazily over the tokenizer's trie (~1-2 ms per row for
JSON on one core, rows in parallel on its own threads, outside the GIL), so masks for a
whole batch are filled while the device runs the step's layers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxserve.structured.backend import GrammarError, Matcher
from scheduler.structured_params import StructuredOutputsParams

# JSON is emitted as `json.dumps` writes it (", " and ": "): flexible whitespace lets small
# models loop on newlines, and a fixed form is what they saw most in training.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Tokens of a new grammar walked at compile time (GuidanceBackend._probe).
_PROBE_TOKENS = 8


class GuidanceMatcher:
    __slots__ = ("_m",)

    def __init__(self, m: Any):
        self._m = m

    def accept_token(self, token_id: int) -> bool:
        return self._m.consume_token(int(token_id))

    def count_valid(self, token_ids: Sequence[int]) -> int:
        return self._m.validate_tokens([int(t) for t in token_ids])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    @property
    def error(self) -> str | None:
        return self._m.get_error() or None if self._m.is_error() else None


class GuidanceGrammar:
    """A compiled grammar: a matcher in its start state that each request copies."""

    def __init__(self, template: Any):
        self._template = template

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self._template.deep_copy())


class GuidanceBackend:
    """`tokenizer` is a transformers fast tokenizer; `vocab_size` the model's (its logits'
    width, which may exceed the tokenizer's); `eos_token_id` the token that ends a
    grammar's output.

    The tokenizer is serialised here, on the caller's thread (the engine's constructor):
    the worker that builds llguidance's tokenizer later must not touch the transformers
    object the engine thread detokenizes with (its Rust core is not shareable across
    threads).
    """

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None):
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._spec: str | None = None
        self._spec_error: str | None = None
        try:  # only the serialisation here (~0.02 s); the JSON edit waits for first use (~0.13 s at 49k tokens)
            self._spec = tokenizer.backend_tokenizer.to_str()
        except AttributeError:
            self._spec_error = f"structured outputs need a fast (tokenizers) tokenizer, got {type(tokenizer).__name__}"
        self._tokenizer: Any = None  # the llguidance tokenizer (~0.5 s to build): on first use
        self._executor: Any = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        self._ll_tokenizer()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                if self._spec is None:
                    raise GrammarError(self._spec_error)
                spec = json.loads(self._spec)
                spec["padding"] = spec["truncation"] = None  # as llguidance.hf does on its copy
                try:
                    self._tokenizer = llguidance.LLTokenizer(json.dumps(spec), n_vocab=self._vocab_size,
                                                             eos_token=self._eos)
                except ValueError as e:
                    raise GrammarError(f"structured outputs: llguidance cannot use this tokenizer: {e}") from None
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def compile(self, spec: StructuredOutputsParams) -> GuidanceGrammar:
        import llguidance

        tok = self._ll_tokenizer()
        grammar = _grammar_text(spec)
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"structured_outputs.{spec.kind}: {_first_line(m.get_error())}")
        self._probe(m, spec)
        return GuidanceGrammar(m)

    def _probe(self, template: Any, spec: StructuredOutputsParams) -> None:
        """Walks the grammar's first tokens (each time the lowest allowed id) on a copy: some
        grammars compile and then fail at the first steps (a schema whose required property
        is its own object overflows the parser), and that must be the client's 400 at
        admission, not a failure while the request runs."""
        import llguidance.numpy as lnp

        m = template.deep_copy()
        bitmask = np.zeros((1, (self._vocab_size + 31) // 32), np.int32)
        for _ in range(_PROBE_TOKENS):
            lnp.fill_next_token_bitmask_par(self._executor, [(m, 0)], bitmask)
            allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
            if m.is_error() or (allowed.size and not m.consume_token(int(allowed[0]))) or m.is_error():
                raise GrammarError(f"structured_outputs.{spec.kind}: {_first_line(m.get_error() or 'rejected')} "
                                   "(found while checking the grammar's first tokens)")
            if allowed.size == 0 or m.is_stopped() or (self._eos is not None and allowed[0] == self._eos):
                return

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        import llguidance.numpy as lnp

        if not rows:
            return
        self._ll_tokenizer()
        lnp.fill_next_token_bitmask_par(self._executor, [(m._m, i) for m, i in rows], bitmask)


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a spec (validity is checked when a matcher is built)."""
    import llguidance

    LL = llguidance.LLMatcher
    kind = spec.kind
    try:
        if kind == "json":
            return LL.grammar_from_json_schema(json.dumps(spec.json), defaults=_JSON_OPTIONS)
        if kind == "json_object":
            return LL.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if kind == "regex":
            return LL.grammar_from_regex(spec.regex)
        if kind == "choice":
            return LL.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF converted to it
    except ValueError as e:
        raise GrammarError(f"structured_outputs.{kind}: {_first_line(str(e))}") from None


def _first_line(msg: str) -> str:
    """llguidance errors carry a multi-line source excerpt; the first lines say what is wrong."""
    lines = [ln for ln in msg.strip().splitlines() if ln.strip()]
    return " ".join(ln.strip() for ln in lines[:3])[:500]
