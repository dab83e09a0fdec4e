"""The grammar-engine interface structured outputs are built on.

A backend compiles a `StructuredOutputsParams` spec into a `CompiledGrammar` (once per
distinct spec: the manager caches it), hands each constrained sequence its own `Matcher`,
and fills the token bitmask rows of a step for many matchers at once. `llguidance`
(`jaxserve.structured.guidance`) is the one implementation; another engine only has to
provide these three types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from scheduler.structured_params import StructuredOutputsParams


class GrammarError(ValueError):
    """A spec that cannot be compiled; the message names the field and what is wrong."""


class Matcher(Protocol):
    """One sequence's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advances over a sampled token; False if the grammar did not allow it (the matcher
        is then in its error state for good)."""
        ...

    def count_valid(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order from the current state, the grammar allows
        (nothing is consumed): where a speculative draft must end."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        ...

    @property
    def error(self) -> str | None:
        ...


class CompiledGrammar(Protocol):
    def new_matcher(self) -> Matcher:
        ...


class GrammarBackend(Protocol):
    name: str

    def prepare(self) -> None:
        """One-time setup (the tokenizer's token trie); compile does it if not done yet."""
        ...

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Raises GrammarError for a spec the backend cannot compile."""
        ...

    def fill_bitmask(self, rows: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
        """Writes each matcher's allowed next tokens into its row of `bitmask` [R, W] int32."""
        ...
