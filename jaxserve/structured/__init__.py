"""Structured outputs: grammars compiled off the engine thread, token bitmasks per step."""

from jaxserve.structured.backend import CompiledGrammar, GrammarBackend, GrammarError, Matcher
from jaxserve.structured.manager import GrammarFuture, StructuredOutputManager

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarError", "GrammarFuture", "Matcher",
           "StructuredOutputManager", "make_manager"]


def make_manager(tokenizer, vocab_size: int, eos_token_id: int | None) -> StructuredOutputManager:
    """The default (llguidance) manager for a model's tokenizer."""
    from jaxserve.structured.guidance import GuidanceBackend

    return StructuredOutputManager(GuidanceBackend(tokenizer, vocab_size, eos_token_id))
