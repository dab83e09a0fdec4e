"""Tokenizers: rebuilt from GGUF metadata (vocab, merges, special ids, chat template), or read
from an HF directory's tokenizer files. A `FastTokenizer` (transformers' generic fast tokenizer's
behaviour without importing transformers) wherever the checkpoint's tokenizer is that generic
class; transformers' own class otherwise."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxserve.loading.errors import CheckpointError
from jaxserve.loading.fast_tokenizer import SPECIAL_TOKEN_ATTRIBUTES, FastTokenizer

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


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> FastTokenizer:
    """A tokenizer equivalent to the GGUF file's byte-level BPE tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

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
    specials = {"bos_token": bos, "eos_token": special("eos"), "unk_token": special("unknown"),
                "pad_token": special("padding")}
    return FastTokenizer(tok, specials, meta.get("tokenizer.chat_template") or None,
                         clean_up_tokenization_spaces=False, name_or_path=str(meta.get("general.name", "")))


# tokenizer_config.json classes that AutoTokenizer resolves to transformers' generic fast
# tokenizer (read from tokenizer.json, no model-specific code), e.g. Llama 3's.
_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_from_hf_dir(path: str) -> Any:
    """The directory's tokenizer, as AutoTokenizer builds it. When tokenizer_config.json names
    transformers' generic fast class (Llama 3's, Qwen's, SmolLM's, ...) and tokenizer.json is
    there, a `FastTokenizer` reads the same files without importing transformers (~0.7 s of
    start-up on a 2-core VM; AutoTokenizer's import chain can pull in torch, 1-2 s more)."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    config = _tokenizer_config(path)
    if (config is not None and config.get("tokenizer_class") in _GENERIC_FAST and not config.get("fix_mistral_regex")
            and os.path.exists(os.path.join(path, "tokenizer.json"))):
        return fast_tokenizer_from_hf_dir(path, config)
    from transformers import AutoTokenizer  # seconds to import: only when there is a tokenizer

    return AutoTokenizer.from_pretrained(path)


def fast_tokenizer_from_hf_dir(path: str, config: dict[str, Any]) -> FastTokenizer:
    """tokenizer.json with tokenizer_config.json applied as transformers' generic fast class applies
    it: added tokens the config declares, named special tokens (added as special where tokenizer.json
    lacks them), `split_special_tokens`, the clean-up rule, and the chat templates (the .jinja
    files first). Like transformers, it ignores `add_bos_token`/`add_eos_token` beside
    tokenizer.json, whose post-processor decides."""
    from tokenizers import AddedToken, Tokenizer, processors

    try:
        backend = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    except Exception as e:  # noqa: BLE001 - a malformed file: name it
        raise CheckpointError(f"cannot read {os.path.join(path, 'tokenizer.json')}: {e}") from None
    special_map = _read_json(os.path.join(path, "special_tokens_map.json")) or {}
    specials = {a: _token_text(config.get(a, special_map.get(a))) for a in SPECIAL_TOKEN_ATTRIBUTES}
    added = backend.get_added_tokens_decoder()
    have = {str(t.content) for t in added.values()}
    new = []
    for _, spec in sorted(((int(k), v) for k, v in (config.get("added_tokens_decoder") or {}).items())):
        if isinstance(spec, dict) and spec.get("content") not in have:
            new.append(AddedToken(spec["content"], single_word=spec.get("single_word", False),
                                  lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                                  normalized=spec.get("normalized", True), special=spec.get("special", False)))
            have.add(spec["content"])
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # transformers 5 also names them: {"image_token": "<image>", ...}
        extra = list(extra.values())
    for tok in [t for t in specials.values() if t] + [_token_text(t) for t in extra if _token_text(t)]:
        if tok not in have:
            new.append(AddedToken(tok, special=True))
            have.add(tok)
    if new:
        backend.add_tokens(new)
    if backend.post_processor is None:  # transformers ignores the config's add_bos/eos_token beside tokenizer.json
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    return FastTokenizer(backend, specials, _chat_template(path, config),
                         clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                         name_or_path=path)


def _chat_template(path: str, config: dict[str, Any]) -> str | dict[str, str] | None:
    """chat_template.jinja (the default) and additional_chat_templates/*.jinja (named) over the
    config's `chat_template` (a template, or a list of named ones)."""
    templates: dict[str, str] = {}
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra = os.path.join(path, "additional_chat_templates")
    for name in sorted(os.listdir(extra)) if os.path.isdir(extra) else ():
        if name.endswith(".jinja"):
            with open(os.path.join(extra, name), encoding="utf-8") as f:
                templates[name[: -len(".jinja")]] = f.read()
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template if isinstance(t, dict)}
    return template if isinstance(template, (str, dict)) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _tokenizer_config(path: str) -> dict[str, Any] | None:
    """tokenizer_config.json (None: absent or unreadable; AutoTokenizer then decides)."""
    return _read_json(os.path.join(path, "tokenizer_config.json"))
