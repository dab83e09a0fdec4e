"""Incremental detokenizer tests on real byte-level BPE tokenizers trained in-process."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxserve.engine.detokenizer import DetokenizerDelta, IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Café au lait, naïve façade, résumé, São Paulo, Zürich, Ångström.",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
    "Emoji: 😀🎉👍🏽 and family 👨‍👩‍👧 plus flags 🇫🇷🇯🇵 and ✨sparkles✨.",
    "def main(x: int) -> int:\n    return {'a': [1, 2, 3]}[x]  # comment\n",
    "   leading spaces, trailing spaces   and\ttabs\n\nnew lines",
    "Mixed: naïve 日本 😀 code() {}; \"quotes\" 'single' — dashes – ellipsis…",
]


def _corpus() -> list[str]:
    rng = random.Random(0)
    words = " ".join(TEXTS).split()
    lines = [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(300)]
    return lines + TEXTS


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A tiny ByteLevel BPE (GPT-2/SmolLM style): rare characters stay split into bytes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:],
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A sentencepiece-style BPE whose decoder strips the first token's leading space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=800, special_tokens=["<unk>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    """Feed ids in the given chunk sizes, then flush; return every delta's text."""
    deltas, i = [], 0
    for n in chunks:
        deltas.append(detok.update(ids[i : i + n]).text)
        i += n
    assert i >= len(ids)
    deltas.append(detok.flush().text)
    return deltas


def _prompt(tok) -> list[int]:
    return tok.encode("A prompt that ends in a word", add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer))
    deltas = _stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detok.output_text == text
    assert detok.num_output_tokens == len(ids)


def test_random_chunks_match_decode(tokenizer, metaspace_tokenizer):
    rng = random.Random(1)
    for tok in (tokenizer, metaspace_tokenizer):
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            chunks = []
            while sum(chunks) < len(ids):
                chunks.append(rng.randint(1, 5))
            prompt = _prompt(tok)
            detok = IncrementalDetokenizer(tok, prompt)
            # The text the ids add after the prompt (a first-token space is kept).
            expected = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
            assert "".join(_stream(detok, ids, chunks)) == expected


def test_leading_space_of_first_output_token(metaspace_tokenizer):
    tok = metaspace_tokenizer
    prompt = tok.encode("Hello", add_special_tokens=False)
    full = tok.encode("Hello world again", add_special_tokens=False)
    assert full[: len(prompt)] == prompt
    out = full[len(prompt) :]
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(_stream(detok, out, [1] * len(out)))
    assert text == " world again"  # the space survives although decode(out) drops it
    assert IncrementalDetokenizer(tok, []).update(out).text == tok.decode(out)


def test_emoji_split_across_tokens_never_yields_replacement_char(tokenizer):
    text = "🎉👍🏽👨‍👩‍👧🇯🇵日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(tokenizer.encode("🎉", add_special_tokens=False)) > 1  # really split
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([i]).text for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert deltas.count("") > 0  # some tokens had to wait for the rest of a character
    assert "".join(deltas) + detok.flush().text == text


def test_incomplete_trailing_char_flushes_like_decode(tokenizer):
    ids = tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]  # cut mid-emoji
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.update([i]).text for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush().text == tokenizer.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(tokenizer, skip):
    a = tokenizer.encode("Hello world", add_special_tokens=False)
    b = tokenizer.encode(" café 日本", add_special_tokens=False)
    im_end, eos = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    ids = a + [im_end] + b + [eos]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    text = "".join(_stream(detok, ids, [1] * len(ids)))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is (not skip)


def _stream_with_stop(tokenizer, text, stop, include=False, chunk=1):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, _prompt(tokenizer), stop=stop, include_stop_str_in_output=include
    )
    deltas: list[DetokenizerDelta] = []
    for i in range(0, len(ids), chunk):
        deltas.append(detok.update(ids[i : i + chunk]))
        if deltas[-1].stop_str is not None:
            break
    return detok, deltas


def test_stop_string_across_token_boundaries_is_truncated(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "fox jumps"
    assert len(tokenizer.encode(stop, add_special_tokens=False)) > 1
    for chunk in (1, 3):
        detok, deltas = _stream_with_stop(tokenizer, text, [stop], chunk=chunk)
        assert deltas[-1].stop_str == stop and detok.finished
        assert detok.output_text == "The quick brown "
        assert "".join(d.text for d in deltas) == "The quick brown "
        assert detok.update([1, 2, 3]) == DetokenizerDelta("", stop)  # finished
        assert detok.flush().text == ""


def test_include_stop_str_in_output(tokenizer):
    detok, deltas = _stream_with_stop(
        tokenizer, "Zürich, Ångström. More text", ["ström"], include=True
    )
    assert detok.output_text == "Zürich, Ångström"
    assert deltas[-1].stop_str == "ström"


def test_earliest_stop_string_wins_and_unicode_stop(tokenizer):
    text = "Emoji: 😀🎉👍🏽 and family"
    detok, deltas = _stream_with_stop(tokenizer, text, ["family", "🎉👍"])
    assert deltas[-1].stop_str == "🎉👍"
    assert detok.output_text == "Emoji: 😀"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["dog!", "lazy cat"])
    for i in ids:
        delta = detok.update([i])
        assert delta.stop_str is None
        # Never emit a suffix that could still become "dog!" or "lazy cat".
        assert not detok.output_text.endswith(("d", "do", "dog", "l", "la", "laz", "lazy"))
    assert detok.output_text == "The quick brown fox jumps over the lazy "
    assert detok.flush() == DetokenizerDelta("dog", None)
    assert detok.output_text == text


def test_window_stays_small(tokenizer):
    ids = tokenizer.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, _prompt(tokenizer), stop=["never appears"])
    for i in ids:
        detok.update([i])
        assert len(detok._ids) <= 8  # only tokens since the last emitted character
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids)
