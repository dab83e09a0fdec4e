"""Every check on a request and every step that prepares it, in one place, before admission.

Both servers' fronts and the batch API (`LLM`, `Engine.add_prompt`) send what a client gave
through `InputProcessor`: prompt sizes, token ids against the vocabulary, room left within
`max_model_len` (and `max_tokens` filled from it when the client left it out), the logprobs
and `n` caps, stop lists, logit_bias ids, structured-output specs (compiled here, so a bad
schema is refused before the request is admitted), and the per-sequence seeds of an `n > 1`
request. The result, an `EngineRequest`, is what `Engine.add_request` takes: the engine
thread only checks that the id is free and queues it.

Errors are `InputError`s (a ValueError) whose `param` is the client's field path
(`prompt`, `messages`, `logprobs`, `structured_outputs`, ...); the message starts with the
same name, so the gRPC front (which has no `param`) and the HTTP front read the same.
Value ranges of single sampling fields stay with `SamplingParams` (checked when it is built).

Tokenization and chat templates run wherever the caller wants them (the server runs them on
its front-end pool, the batch API inline) through `encode` / `chat_ids` here, so the
checks around them are the same either way.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxserve.models.config import VisionConfig
from jaxserve.multimodal.gemma3_preprocess import Gemma3ImageConfig, preprocess_gemma3_image
from jaxserve.multimodal.images import ImageInputError, ImageLimits, load_image
from jaxserve.multimodal.prompt import (
    ImageItem,
    MultimodalPrompt,
    expand_placeholders,
    mrope_positions,
    plain_positions,
)
from jaxserve.multimodal.qwen_vl_preprocess import QwenVLImageConfig, preprocess_image
from jaxserve.worker.input_batch import MAX_STOP_TOKEN_IDS
from scheduler import SamplingParams
from scheduler.request import wrap_seed
from scheduler.structured_params import GrammarHandle

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_CHAT_MESSAGES = 1024


def conversation_chars(messages: Sequence[dict[str, Any]]) -> int:
    """A conversation's size in characters (roles and contents): what its template costs."""
    return sum(len(m.get("content") or "") + len(m["role"]) for m in messages)


class InputError(ValueError):
    """A request the engine cannot serve as given; `param` names the client's field and
    `code` says why in a word when a client may act on it (OpenAI's error `code`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclasses.dataclass(frozen=True)
class InputLimits:
    """What a request may ask for on this engine (and, for the servers, how big it may be)."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    max_n: int
    max_prompt_chars: int | None = None  # None: no character limit (the batch API)
    prompt_logprobs: bool = True  # False: refused (a multi-host engine does not score prompts yet)


@dataclasses.dataclass(frozen=True)
class ImageSupport:
    """How a vision-language engine takes images: its encoder's config, the processor's resize
    and normalisation, what an image may be (bytes, pixels, fetchable hosts), how many a prompt
    may hold (`limit_mm_per_prompt`), and how a placeholder expands: the `placeholder_id`
    token becomes `before`, the image's tokens, then `after` (Gemma 3 frames them with its
    start/end-of-image tokens and blank lines; Qwen's placeholder is the image token itself)."""

    vision: VisionConfig
    processor: QwenVLImageConfig | Gemma3ImageConfig
    limits: ImageLimits
    max_images: int
    placeholder_id: int
    before: tuple[int, ...] = ()
    after: tuple[int, ...] = ()

    @classmethod
    def for_model(cls, vision: VisionConfig, max_images: int, allowed_domains: Sequence[str] = (),
                  max_image_pixels: int = 36_000_000, blank_line_ids: Sequence[int] = ()) -> ImageSupport:
        """`blank_line_ids`: the tokenizer's ids of "\n\n" (Gemma 3's framing; its text
        prompts get them from the processor's string, token-id prompts from here)."""
        limits = ImageLimits(max_pixels=max_image_pixels, allowed_domains=frozenset(allowed_domains))
        if vision.kind == "gemma3":
            processor = Gemma3ImageConfig(image_size=vision.image_size, patch_size=vision.patch_size,
                                          tokens_per_image=vision.tokens_per_image, image_mean=vision.image_mean,
                                          image_std=vision.image_std)
            blank = tuple(int(t) for t in blank_line_ids)
            return cls(vision, processor, limits, max_images, placeholder_id=vision.vision_start_token_id,
                       before=(*blank, vision.vision_start_token_id), after=(vision.vision_end_token_id, *blank))
        processor = QwenVLImageConfig(
            patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels,
            image_mean=vision.image_mean, image_std=vision.image_std)
        return cls(vision, processor, limits, max_images, placeholder_id=vision.image_token_id)

    def preprocess(self, image: Any, where: str) -> Any:
        """A decoded image -> its `ProcessedImage` (patches, grid, token count, hash)."""
        if isinstance(self.processor, Gemma3ImageConfig):
            return preprocess_gemma3_image(image, self.processor, where=where)
        return preprocess_image(image, self.processor, where=where)


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    """A processed request: what `Engine.add_request` queues, with nothing left to check."""

    prompt: str | None  # the text, when the client sent text (outputs carry it back)
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # max_tokens filled in
    seeds: tuple[int, ...]  # one per sequence (len == params.n)
    grammar: GrammarHandle | None = None  # compiled (or compiling) structured-output grammar
    multimodal: MultimodalPrompt | None = None  # the prompt's images (placeholders already expanded)


class InputProcessor:
    """Checks and prepares requests for one engine. Thread-safe."""

    def __init__(self, limits: InputLimits, tokenizer: Any = None, structured: Any = None,
                 structured_unavailable: str | None = None, seed: int | None = None,
                 images: ImageSupport | None = None):
        self.limits = limits
        self.images = images  # None: a text-only model (image inputs are refused)
        self.tokenizer = tokenizer
        self.structured = structured  # a StructuredOutputManager, or None when off
        self._structured_unavailable = structured_unavailable  # why it is off
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()

    # ------------------------------------------------------------------ prompts
    def check_text(self, text: str, param: str = "prompt") -> None:
        if not text:
            raise InputError(f"{param}: the prompt must not be empty", param)
        self.check_chars(len(text), param)

    def check_chars(self, n: int, param: str) -> None:
        limit = self.limits.max_prompt_chars
        if limit is not None and n > limit:
            raise InputError(f"{param}: {n} characters is over the limit of {limit} (max_prompt_chars)", param)

    def check_messages(self, messages: Sequence[dict[str, Any]], param: str = "messages") -> None:
        """A conversation before its chat template: count, roles and size."""
        if not messages:
            raise InputError(f"{param}: must not be empty", param)
        if len(messages) > MAX_CHAT_MESSAGES:
            raise InputError(f"{param}: at most {MAX_CHAT_MESSAGES} messages, got {len(messages)}", param)
        for i, m in enumerate(messages):
            if not m.get("role"):
                raise InputError(f"{param}[{i}].role: must not be empty", f"{param}[{i}].role")
        self.check_chars(conversation_chars(messages), param)

    def check_token_ids(self, ids: Sequence[int], param: str = "prompt_token_ids") -> None:
        """Ids in the vocabulary (a detokenize call's input, or a prompt's)."""
        vocab = self.limits.vocab_size
        bad = [t for t in ids if not (isinstance(t, int | np.integer) and not isinstance(t, bool) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"{param}: token ids must be integers in [0, {vocab}), got {bad[:5]}", param)

    def check_prompt_ids(self, ids: Sequence[int], param: str = "prompt_token_ids") -> None:
        if len(ids) == 0:
            raise InputError(f"{param}: the prompt must not be empty", param)
        self.check_token_ids(ids, param)
        n, limit = len(ids), self.limits.max_model_len
        if n >= limit:
            raise InputError(f"{param}: the prompt is {n} tokens, which leaves no room for output within "
                             f"max_model_len {limit}", param, "context_length_exceeded")

    def check_room(self, num_prompt_tokens: int, max_tokens: int | None,
                   field_names: Mapping[str, str] | None = None) -> None:
        """A `max_tokens` the context cannot hold is the client's error (vLLM answers 400), not a
        request silently cut short: prompt + max_tokens must fit within max_model_len."""
        limit = self.limits.max_model_len
        if max_tokens is not None and num_prompt_tokens + max_tokens > limit:
            name = (field_names or {}).get("max_tokens", "max_tokens")
            raise InputError(
                f"'{name}' is too large: {max_tokens}. This model's maximum context length is {limit} tokens "
                f"and your request has {num_prompt_tokens} input tokens ({max_tokens} > {limit} - "
                f"{num_prompt_tokens}).", name, "context_length_exceeded")

    def encode(self, text: str, add_special_tokens: bool = True, tokenizer: Any = None,
               param: str = "prompt") -> list[int]:
        """The text's ids (`tokenizer`: a thread's own copy; default the engine's)."""
        self.check_text(text, param)
        tok = tokenizer if tokenizer is not None else self.tokenizer
        if tok is None:
            raise InputError(f"{param}: this model has no tokenizer; send token ids", param)
        return [int(t) for t in tok(text, add_special_tokens=add_special_tokens)["input_ids"]]

    # ------------------------------------------------------------------ images
    def image_prompt(self, ids: Sequence[int], images: Sequence[tuple[Any, str]],
                     param: str = "multi_modal_data") -> tuple[list[int], MultimodalPrompt | None]:
        """The prompt with each image placeholder expanded to its image's tokens, and its
        images decoded, resized and patched. `images`: (source, where) pairs in prompt order
        (`where` names the client's field, e.g. `messages[0].content[1]`); a source is a PIL
        image, encoded bytes, a data: URL or an allowed http(s) URL. Every failure is an
        InputError naming the part; nothing about the image's bytes is logged."""
        if not images:
            return list(ids), None
        support = self.images
        if support is None:
            raise InputError(f"{param}: this model takes no images (text only)", param)
        if len(images) > support.max_images:
            raise InputError(f"{param}: at most {support.max_images} image(s) per prompt (limit_mm_per_prompt), "
                             f"got {len(images)}", param)
        processed = []
        for source, where in images:
            try:
                image = load_image(source, support.limits, where)
                processed.append(support.preprocess(image, where))
            except ImageInputError as e:
                raise InputError(str(e), e.where) from None
        vc = support.vision
        try:
            expanded, offsets = expand_placeholders(ids, processed, vc.image_token_id, param,
                                                    placeholder_id=support.placeholder_id, before=support.before,
                                                    after=support.after)
        except ValueError as e:
            raise InputError(str(e), param) from None
        items = tuple(ImageItem(off, p.num_tokens, p.hash, p.pixel_values, p.grid_thw)
                      for off, p in zip(offsets, processed))
        if vc.kind == "gemma3":
            positions, delta = plain_positions(len(expanded))
        else:
            positions, delta = mrope_positions(len(expanded), items, vc.spatial_merge_size)
        return expanded, MultimodalPrompt(items, positions, delta)

    # ------------------------------------------------------------------ sampling
    def check_params(self, params: SamplingParams, field_names: Mapping[str, str] | None = None) -> None:
        """Caps and vocabulary checks that depend on this engine (ranges are SamplingParams').
        `field_names`: the client's names where its API differs (chat: logprobs -> top_logprobs)."""
        lim = self.limits
        if params.logprobs is not None and params.logprobs > lim.max_logprobs:
            name = (field_names or {}).get("logprobs", "logprobs")
            raise InputError(f"{name} must be <= {lim.max_logprobs} (max_logprobs), got {params.logprobs}", name)
        if params.prompt_logprobs is not None and not lim.prompt_logprobs:
            raise InputError("prompt_logprobs is not supported on a multi-host engine yet", "prompt_logprobs")
        if params.prompt_logprobs is not None and params.prompt_logprobs > lim.max_logprobs:
            raise InputError(f"prompt_logprobs must be <= {lim.max_logprobs} (max_logprobs), "
                             f"got {params.prompt_logprobs}", "prompt_logprobs")
        if params.n > lim.max_n:
            raise InputError(f"n must be <= {lim.max_n}, got {params.n}", "n")
        if len(params.stop) > MAX_STOP_STRINGS:
            raise InputError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(params.stop)}", "stop")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
            raise InputError(f"stop: each string must be at most {MAX_STOP_STRING_CHARS} characters", "stop")
        if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InputError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(params.stop_token_ids)}",
                             "stop_token_ids")
        bad_stop = [t for t in params.stop_token_ids if not 0 <= t < lim.vocab_size]
        if bad_stop:
            raise InputError(f"stop_token_ids must be in [0, {lim.vocab_size}), got {bad_stop[:5]}",
                             "stop_token_ids")
        bad_bias = [t for t in params.logit_bias or () if not t < lim.vocab_size]
        if bad_bias:
            raise InputError(f"logit_bias: token ids must be in [0, {lim.vocab_size}), got {bad_bias[:5]}",
                             "logit_bias")
        if params.structured_outputs is not None and self.structured is None:
            raise InputError(f"structured_outputs: not available ({self._structured_unavailable})",
                             "structured_outputs")

    def compile_grammar(self, params: SamplingParams, timeout_s: float | None = None,
                        param: str = "structured_outputs") -> GrammarHandle | None:
        """Compiles the request's grammar now (blocking up to `timeout_s`; cached for the
        engine) and returns its handle; a spec that does not compile is an InputError."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.structured is None:
            raise InputError(f"structured_outputs: not available ({self._structured_unavailable})", param)
        try:
            self.structured.validate(spec, timeout_s)
        except ValueError as e:
            raise InputError(str(e), param) from e
        return self.structured.grammar_for(spec)

    def seeds(self, params: SamplingParams) -> tuple[int, ...]:
        """Sequence i of a seeded request samples with `seed + i`; an unseeded one draws its
        seeds from the engine's generator (EngineConfig.seed), one per sequence."""
        if params.seed is not None:
            return tuple(wrap_seed(params.seed + i) for i in range(params.n))
        with self._rng_lock:
            return tuple(int(s) for s in self._rng.integers(0, 2**32, size=params.n))

    # ------------------------------------------------------------------ the whole request
    def process(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, prompt: str | None = None,
                fill_max_tokens: bool = False, grammar: GrammarHandle | None = None,
                param: str = "prompt_token_ids", field_names: Mapping[str, str] | None = None,
                params_checked: bool = False, multimodal: MultimodalPrompt | None = None) -> EngineRequest:
        """The engine's request for a tokenized prompt. `fill_max_tokens`: max_tokens becomes
        the room left within max_model_len (OpenAI's max_tokens left out).
        `grammar`: a handle from `compile_grammar` (the servers compile before admission, off
        their event loop); without one, the grammar starts compiling in the background and a
        spec that fails ends only its own request, with finish reason "error". `params_checked`:
        the caller ran `check_params` already (before tokenizing)."""
        self.check_prompt_ids(prompt_token_ids, param)
        if fill_max_tokens:
            params = dataclasses.replace(params, max_tokens=self.limits.max_model_len - len(prompt_token_ids))
        else:
            self.check_room(len(prompt_token_ids), params.max_tokens, field_names)
        if not params_checked:
            self.check_params(params, field_names)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.structured.grammar_for(params.structured_outputs)
        return EngineRequest(prompt=prompt, prompt_token_ids=tuple(int(t) for t in prompt_token_ids),
                             params=params, seeds=self.seeds(params), grammar=grammar, multimodal=multimodal)


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                        chat_template: str | None = None, continue_final_message: bool = False,
                        tools: list[dict[str, Any]] | None = None) -> list[int]:
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        raise ValueError("chat: this model has no chat template (give one with --chat-template); "
                         "send text or token_ids")
    kwargs: dict[str, Any] = {"continue_final_message": True} if continue_final_message else {}
    if tools:
        kwargs["tools"] = tools
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, chat_template=chat_template,
                                            add_generation_prompt=add_generation_prompt, return_dict=False,
                                            **kwargs)
    except Exception as e:  # noqa: BLE001 - template errors are the caller's input
        raise ValueError(f"chat: the chat template failed: {e}") from e
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]
