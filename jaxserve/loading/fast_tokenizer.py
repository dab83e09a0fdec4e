"""The serving path's tokenizer: a `tokenizers.Tokenizer` with the special tokens, chat template
and decoding rules of transformers' generic fast tokenizer, without importing transformers.

transformers' import costs ~0.7 s of every start on a 2-core VM (a third of loading a 1.85 GB
checkpoint), and the engine needs from it only what is here: encode, decode, special tokens,
the vocabulary and the chat template. Everything else a user may call on `LLM.get_tokenizer()`
(transformers' full tokenizer API) is answered by a `PreTrainedTokenizerFast` built on first
use from the same tokenizer, so code written for vLLM's tokenizer keeps working.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from jaxserve.loading.chat_template import render_chat, select_template

SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                            "mask_token")
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


class Encoding(dict):
    """What encoding returns: a dict (`out["input_ids"]`) that also reads as attributes
    (`out.input_ids`), as transformers' BatchEncoding does."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class FastTokenizer:
    """transformers' `PreTrainedTokenizerFast` behaviour for what serving calls; any other attribute
    is delegated to a real `PreTrainedTokenizerFast` built on first use."""

    def __init__(self, backend: Any, special_tokens: dict[str, str | None], chat_template: str | dict[str, str] | None,
                 clean_up_tokenization_spaces: bool = False, name_or_path: str = ""):
        backend.no_truncation()  # transformers truncates and pads only when a call asks to
        backend.no_padding()
        self._backend = backend
        self._special = {k: v for k, v in special_tokens.items() if k in SPECIAL_TOKEN_ATTRIBUTES and v is not None}
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.name_or_path = name_or_path
        self._hf: Any = None

    # ------------------------------------------------------------------ encoding
    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **kwargs: Any) -> Encoding:
        if kwargs:  # padding, truncation, tensors, offsets: transformers' own implementation
            return self._transformers()(text, add_special_tokens=add_special_tokens, **kwargs)
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens=add_special_tokens)
            return Encoding(input_ids=ids, attention_mask=[1] * len(ids))
        encs = self._backend.encode_batch(list(text), add_special_tokens=add_special_tokens)
        return Encoding(input_ids=[e.ids for e in encs], attention_mask=[e.attention_mask for e in encs])

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return self._transformers().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    # ------------------------------------------------------------------ decoding
    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **kwargs: Any) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        elif isinstance(token_ids, dict):
            token_ids = token_ids["input_ids"]
        ids = token_ids if isinstance(token_ids, list) else [int(t) for t in token_ids]  # numpy ids from users
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        # transformers skips the clean-up for BPE models: it was written for WordPiece and deletes real spaces
        if clean and type(self._backend.model).__name__ != "BPE":
            for a, b in _CLEANUPS:
                text = text.replace(a, b)
        return text

    def batch_decode(self, sequences: list[list[int]], skip_special_tokens: bool = False, **kwargs: Any) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens, **kwargs) for s in sequences]

    # ------------------------------------------------------------------ vocabulary
    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(t) for t in tokens]

    def _token_id(self, token: str) -> int | None:
        i = self._backend.token_to_id(token)
        if i is None and "unk_token" in self._special:
            return self._backend.token_to_id(self._special["unk_token"])
        return i

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | None | list[str]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(i) for i in ids if i not in special]

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def backend_tokenizer(self) -> Any:
        return self._backend

    # ------------------------------------------------------------------ special tokens
    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    @property
    def all_special_tokens(self) -> list[str]:
        return list(dict.fromkeys(self._special.values()))

    @property
    def all_special_ids(self) -> list[int]:
        return [i for i in (self._backend.token_to_id(t) for t in self.all_special_tokens) if i is not None]

    def _special_id(self, attr: str) -> int | None:
        tok = self._special.get(attr)
        return None if tok is None else self._token_id(tok)

    bos_token = property(lambda self: self._special.get("bos_token"))
    eos_token = property(lambda self: self._special.get("eos_token"))
    unk_token = property(lambda self: self._special.get("unk_token"))
    pad_token = property(lambda self: self._special.get("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    # ------------------------------------------------------------------ chat
    def get_chat_template(self, chat_template: str | None = None, tools: list[Any] | None = None) -> str:
        return select_template(self.chat_template, chat_template, tools)

    def apply_chat_template(self, conversation: list[Any], tools: list[Any] | None = None,
                            documents: list[Any] | None = None, chat_template: str | None = None,
                            add_generation_prompt: bool = False, continue_final_message: bool | str = False,
                            tokenize: bool = True, return_dict: bool = True, **kwargs: Any) -> Any:
        if any(k in kwargs for k in ("padding", "truncation", "max_length", "return_tensors", "tokenizer_kwargs",
                                     "return_assistant_tokens_mask", "sanitize_control_tokens")):
            return self._transformers().apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, return_dict=return_dict, **kwargs)
        template = self.get_chat_template(chat_template, tools)
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        texts = [render_chat(template, list(c), tools=tools, documents=documents,
                             add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message, **{**self._special, **kwargs})
                 for c in (conversation if batched else [conversation])]
        if not tokenize:
            return texts if batched else texts[0]
        out = self(texts if batched else texts[0], add_special_tokens=False)
        return out if return_dict else out["input_ids"]

    # ------------------------------------------------------------------ files
    def save_pretrained(self, directory: str) -> tuple[str, ...]:
        """transformers' layout (tokenizer.json and tokenizer_config.json naming the generic fast
        class), so that transformers and this module read it back alike."""
        os.makedirs(directory, exist_ok=True)
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "clean_up_tokenization_spaces": self.clean_up_tokenization_spaces, **self._special}
        if self.chat_template is not None:
            config["chat_template"] = (self.chat_template if isinstance(self.chat_template, str) else
                                       [{"name": k, "template": v} for k, v in self.chat_template.items()])
        paths = (os.path.join(directory, "tokenizer.json"), os.path.join(directory, "tokenizer_config.json"))
        self._backend.save(paths[0])
        with open(paths[1], "w") as f:
            json.dump(config, f, indent=1, ensure_ascii=False)
        return paths

    # ------------------------------------------------------------------ the rest of transformers' API
    def _transformers(self) -> Any:
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(
                tokenizer_object=copy.deepcopy(self._backend), chat_template=self.chat_template,
                clean_up_tokenization_spaces=self.clean_up_tokenization_spaces, name_or_path=self.name_or_path,
                **self._special)
        return self._hf

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy/pickle probes and half-built instances: never build transformers' tokenizer
            raise AttributeError(name)
        return getattr(self._transformers(), name)

    def __repr__(self) -> str:
        return f"FastTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)}, special={self._special})"
