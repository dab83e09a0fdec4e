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


# A template touching what transformers' environment adds: tojson with options, namespaces, loop
# controls, raise_exception, the generation tag, reasoning fields, tools, documents and a kwarg.
FEATURE_TEMPLATE = (
    "{%- set ns = namespace(n=0) -%}"
    "{%- if tools %}TOOLS {{ tools | tojson(indent=1, sort_keys=true) }}\n{% endif -%}"
    "{%- if documents %}{% for d in documents %}DOC {{ d.title }}: {{ d.text }}\n{% endfor %}{% endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'bad' %}{{ raise_exception('bad role') }}{% endif -%}"
    "{%- if m.role == 'skip' %}{% continue %}{% endif -%}"
    "{%- set ns.n = ns.n + 1 -%}"
    "<|im_start|>{{ m.role }}\n"
    "{%- if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif -%}"
    "{%- if m.content is string %}{{ m.content }}{% else %}{% for b in m.content %}{{ b.text }}{% endfor %}{% endif -%}"
    "{%- if 'tool_calls' in m %}CALLS {{ m.tool_calls | tojson }}{% endif -%}"
    "{%- if m.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif -%}"
    "<|im_end|>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif -%}"
    "COUNT={{ ns.n }} BOS={{ bos_token }}"
)
CHATS = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🤖 <|im_end|>"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "tool_calls": None},
     {"role": "skip", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "and "},
                                                                    {"type": "text", "text": "3+3?"}]}],
    [{"role": "user", "content": "think"}, {"role": "assistant", "reasoning": "hmm", "content": "ok"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city: ü",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _outcome(fn):
    """What a call gives, or the kind of error it raises (a template that cannot render a chat
    must fail for both tokenizers alike)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        return ("raised", "bad role" in str(e))


def _same_chat(ours, theirs, template=None):
    def both(conv, **kw):
        return (_outcome(lambda: ours.apply_chat_template(conv, chat_template=template, **kw)),
                _outcome(lambda: theirs.apply_chat_template(conv, chat_template=template, **kw)))

    rendered = 0
    for chat in CHATS:
        for kw in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                   {"add_generation_prompt": True, "tools": TOOLS, "enable_thinking": False},
                   {"documents": [{"title": "T", "text": "body"}]}):
            for extra in ({"tokenize": False}, {"return_dict": False}):
                a, b = both(chat, **kw, **extra)
                assert a == b, (chat, kw)
                rendered += not isinstance(a, tuple)
        cont = chat if chat[-1]["role"] == "assistant" else chat + [{"role": "assistant", "content": "The "}]
        a, b = both(cont, continue_final_message=True, tokenize=False)
        assert a == b
    assert rendered >= 8  # most chats render: the comparison is not of two errors
    bad_template = template or FEATURE_TEMPLATE
    for bad in ([{"role": "bad", "content": "x"}], []):
        assert _outcome(lambda b=bad: ours.apply_chat_template(b, chat_template=bad_template)) == \
            _outcome(lambda b=bad: theirs.apply_chat_template(b, chat_template=bad_template))


def _same_tokenizer(ours, theirs, strings):
    assert type(ours).__name__ == "FastTokenizer"
    for text in strings:
        for add in (True, False):
            ids = theirs(text, add_special_tokens=add)["input_ids"]
            assert ours(text, add_special_tokens=add)["input_ids"] == ids, text
            assert ours.encode(text, add_special_tokens=add) == theirs.encode(text, add_special_tokens=add)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours(strings[:5])["input_ids"] == theirs(strings[:5])["input_ids"]
    assert ours(strings[0]).input_ids == theirs(strings[0]).input_ids  # attribute access, as BatchEncoding
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id", "eos_token", "bos_token",
                 "all_special_ids", "all_special_tokens", "special_tokens_map", "vocab_size", "chat_template"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    ids = theirs("a <|im_start|> b")["input_ids"]
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(ids, skip_special_tokens=True) == theirs.convert_ids_to_tokens(
        ids, skip_special_tokens=True)
    assert ours.convert_tokens_to_ids(["<|im_start|>", "hello", "not-a-token-xyz"]) == theirs.convert_tokens_to_ids(
        ["<|im_start|>", "hello", "not-a-token-xyz"])


def test_hf_dir_tokenizer_equals_transformers_without_importing_it(hf_smollm_tokenizer, tmp_path):
    """A directory whose tokenizer_config names transformers' generic fast class is read without
    transformers, and behaves as transformers' tokenizer does on the same files: ids, decoding,
    special tokens, vocabulary and chat templates (the model's and one using every helper
    transformers' template environment adds), also after the config adds a bos/eos
    post-processor, an added token, the clean-up rule, or named templates in chat_template.jinja."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from jaxserve.loading.tokenizer import tokenizer_from_hf_dir

    hf_smollm_tokenizer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] in ("TokenizersBackend", "PreTrainedTokenizerFast")
    strings = _varied_strings(60)
    ours, hf = tokenizer_from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    _same_tokenizer(ours, hf, strings)
    _same_chat(ours, hf)
    _same_chat(ours, hf, FEATURE_TEMPLATE)

    probe = ("import sys; from jaxserve.loading.tokenizer import tokenizer_from_hf_dir as f; "
             f"t = f({str(tmp_path)!r}); t.apply_chat_template([{{'role': 'user', 'content': 'x'}}]); "
             "t.decode(t('hi')['input_ids']); print(type(t).__name__, 'transformers' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.split() == ["FastTokenizer", "False"]

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        **config, "add_bos_token": True, "add_eos_token": True, "bos_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": True, "chat_template": hf.chat_template,
        "added_tokens_decoder": {**config.get("added_tokens_decoder", {}),
                                 "49152": {"content": "<tool_x>", "special": True, "lstrip": False, "rstrip": False,
                                           "normalized": False, "single_word": False}}}))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    ours, hf = tokenizer_from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    _same_tokenizer(ours, hf, strings[:20] + ["x <tool_x> y", "Hello , world ."])
    assert 49152 in ours("x <tool_x>")["input_ids"] and ours.bos_token == "<|endoftext|>"
    _same_chat(ours, hf)

    saved = tmp_path / "saved"
    ours.save_pretrained(str(saved))
    _same_tokenizer(tokenizer_from_hf_dir(str(saved)), AutoTokenizer.from_pretrained(str(saved)), strings[:10])

    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    named = [{"name": "default", "template": config.get("chat_template") or hf.chat_template},
             {"name": "tool_use", "template": FEATURE_TEMPLATE}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    ours, hf = tokenizer_from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template == hf.chat_template and isinstance(ours.chat_template, dict)
    _same_chat(ours, hf)
    assert ours.padding_side == hf.padding_side  # the rest of transformers' API, built on first use

    (tmp_path / "chat_template.jinja").write_text(named[0]["template"])
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(FEATURE_TEMPLATE)
    ours, hf = tokenizer_from_hf_dir(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template == hf.chat_template and set(ours.chat_template) == {"default", "tool_use"}
    _same_chat(ours, hf)

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    assert type(tokenizer_from_hf_dir(str(tmp_path))).__name__ == type(
        AutoTokenizer.from_pretrained(str(tmp_path))).__name__ == "GPT2Tokenizer"
