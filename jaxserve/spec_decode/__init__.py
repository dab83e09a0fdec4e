"""Speculative decoding: proposers that draft tokens for decoding sequences, which the target
model verifies in the same ragged step (docs/speculative_decoding.md).

A proposer is anything with `propose(candidates: Sequence[DraftCandidate]) -> dict[str,
list[int]]` (request id -> draft ids, at most each candidate's `max_drafts`); the scheduler
makes room for the drafts and the runner verifies them, so a new method (a draft model, an
EAGLE head) plugs in here without touching either.
"""

from __future__ import annotations

from typing import Protocol

from jaxserve.config.speculative import SpeculativeConfig
from scheduler import DraftCandidate


class Proposer(Protocol):
    def propose(self, candidates: list[DraftCandidate]) -> dict[str, list[int]]: ...


def make_ngram_proposer(config: SpeculativeConfig) -> Proposer:
    from jaxserve.spec_decode.ngram import NgramProposer

    return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)


__all__ = ["Proposer", "SpeculativeConfig", "make_ngram_proposer"]
