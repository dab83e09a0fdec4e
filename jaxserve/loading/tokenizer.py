"""Tokenizers: rebuilt from GGUF metadata (vocab, merges, special ids, chat template), or read
from an HF directory's tokenizer files. Always a transformers `PreTrainedTokenizerFast`."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxserve.loading.errors import CheckpointError

# Pre-tokenizer split patterns by llama.cpp's `tokenizer.ggml.pre` name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "qwen2": _QWEN2_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4


def _byte_level_pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre in _SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in ("smollm", "starcoder"):
        # SmolLM/StarCoder vocabularies were learned with every digit its own pre-token.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Any:
    """A `PreTrainedTokenizerFast` equivalent to the GGUF file's byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [])
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types) if ty == _CONTROL
    ])
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types) if ty == _USER_DEFINED
    ])

    def special(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    bos = special("bos")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        clean_up_tokenization_spaces=False,
    )
    template = meta.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    return fast


# tokenizer_config.json classes that AutoTokenizer resolves to transformers' generic fast
# tokenizer (read from tokenizer.json, no model-specific code), e.g. Llama 3's.
_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_from_hf_dir(path: str) -> Any:
    """The directory's tokenizer, as AutoTokenizer builds it. When tokenizer_config.json names
    the generic fast class (and tokenizer.json is there), that class is used directly:
    AutoTokenizer resolves to the same class, but its import chain pulls in torch where it is
    installed (1-2 s of start-up on a 2-core VM; the generic class alone imports in ~0.7 s)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    if _tokenizer_class(path) in _GENERIC_FAST and os.path.exists(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer  # seconds to import: only when there is a tokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_class(path: str) -> str | None:
    """tokenizer_config.json's `tokenizer_class` (None: absent or unreadable; AutoTokenizer
    then decides)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    return cls if isinstance(cls, str) else None
