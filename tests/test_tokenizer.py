"""Our GGUF-built tokenizer against transformers' GGUF tokenizer on varied strings."""

from __future__ import annotations

import copy
import random
import re

import pytest

BASE = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "", " ", "  ", "\n", "\n\n\t",
    "héllo wörld ça va? naïve café", "日本語のテキストです。", "中文测试，标点符号！", "한국어 문장입니다",
    "Привет, как дела?", "مرحبا بالعالم", "emoji 🤖🎉👍🏽 and 👨‍👩‍👧‍👦 family", "math: ∑ x² ≤ ∞ ± π",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = b[i]; }",
    "    indented\n\tTabbed\r\nCRLF", "numbers 1234567890 3.14159 -42 1e-10 0xFF",
    "URL https://example.com/path?q=1&r=2#frag", "<|im_start|>user\nhi<|im_end|>\n",
    "special <|endoftext|> inside", "multiple     spaces      here", "trailing spaces   ",
    "MiXeD CaSe WoRdS", "don't won't it's we're they've I'm you'll he'd", "a" * 100,
    "JSON: {\"key\": [1, 2, {\"nested\": null}], \"b\": true}", "<html><body>tag</body></html>",
    "émoji at end 🙂", "zero\u200bwidth joiner\u200d", "combining e\u0301 accents",
]


def _varied_strings(n: int = 300) -> list[str]:
    rng = random.Random(0)
    alphabet = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n\t.,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`") + [
        "é", "ß", "ø", "日", "本", "🤖", "  ", "\n\n", "  \n", "’", "—", "…"]
    out = list(BASE)
    while len(out) < n:
        k = rng.randint(1, 60)
        s = "".join(rng.choice(alphabet) for _ in range(k))
        if rng.random() < 0.3:
            s = rng.choice(BASE) + s
        out.append(s)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer_smollm_pre(hf_smollm_tokenizer):
    """transformers' GGUF tokenizer with the pre-tokenizer the file names (`smollm`).

    transformers builds plain GPT-2 byte-level splitting for the `smollm` pre type; llama.cpp and
    the original SmolLM2 tokenizer split every digit first. The two differ only where whitespace
    runs precede a digit; we follow the file.
    """
    from tokenizers import pre_tokenizers

    tok = copy.deepcopy(hf_smollm_tokenizer)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tok


@pytest.mark.parametrize("chunk", range(3))
def test_gguf_tokenizer_matches_transformers(smollm, hf_smollm_tokenizer, hf_tokenizer_smollm_pre, chunk):
    strings = _varied_strings()[chunk::3]
    ours = smollm.tokenizer
    for s in strings:
        a = ours(s, add_special_tokens=True)["input_ids"]
        b = hf_tokenizer_smollm_pre(s, add_special_tokens=True)["input_ids"]
        assert a == b, f"ids differ for {s!r}: {a} vs {b}"
        plain = hf_smollm_tokenizer(s, add_special_tokens=True)["input_ids"]
        if plain != a:  # only the digit pre-split may differ from transformers' plain GPT-2 split
            assert re.search(r"\s\d", s), f"unexpected difference for {s!r}: {a} vs {plain}"
        assert ours.decode(a) == hf_smollm_tokenizer.decode(plain) == s


def test_tokenizer_special_ids_and_chat_template(smollm):
    tok = smollm.tokenizer
    assert tok.eos_token_id == smollm.config.eos_token_id == 2
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert "<|im_start|>user\nhi<|im_end|>" in text


def test_hf_dir_with_the_generic_fast_class_loads_as_autotokenizer_does(smollm, tmp_path):
    """A directory whose tokenizer_config names the generic fast class is read by that class
    directly (no AutoTokenizer import chain): the same class, ids, decoding and chat template
    as AutoTokenizer's; another class still goes through AutoTokenizer."""
    import json

    from transformers import AutoTokenizer

    from jaxserve.loading.tokenizer import tokenizer_from_hf_dir

    smollm.tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    ours, auto = tokenizer_from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(ours) is type(auto)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🤖 <|im_end|>"}]
    for text in BASE:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        assert ours.decode(auto(text)["input_ids"]) == auto.decode(auto(text)["input_ids"])
    assert ours.apply_chat_template(chat, add_generation_prompt=True) == auto.apply_chat_template(
        chat, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (
        auto.eos_token_id, auto.bos_token_id, auto.all_special_ids)

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(tokenizer_from_hf_dir(str(tmp_path))).__name__ == type(
        AutoTokenizer.from_pretrained(str(tmp_path))).__name__ == "GPT2Tokenizer"
