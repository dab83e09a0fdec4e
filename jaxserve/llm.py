"""The Python batch API, shaped like vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxserve.config.engine_config import EngineConfig
from jaxserve.engine.input_processor import apply_chat_template
from jaxserve.engine.llm_engine import Engine
from jaxserve.engine.outputs import OutputKind, RequestOutput
from jaxserve.lora.request import LoRARequest
from scheduler import SamplingParams

PromptType = str | dict[str, Any]


class LLM:
    """Offline generation over the engine. `LLM()` loads the embedded SmolLM2 model;
    `LLM(model=PATH)` a GGUF file, an HF directory or a jaxserve (orbax) checkpoint.
    Any other keyword is an `EngineConfig` field."""

    def __init__(self, model: str | None = None, *, warmup: bool = True, **engine_kwargs: Any):
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs))
        self._counter = 0
        if warmup:
            self.warmup()

    def warmup(self, progress: bool = True):
        """Compiles every planned step shape now (a cache load when the persistent compilation
        cache is warm), so generation never waits on the compiler. Returns a WarmupReport."""
        return self.engine.warmup(progress=progress)

    def update_weights(self, source: Any) -> int:
        """New weights without a restart or a recompile (`Engine.update_weights`): an HF
        directory, a jaxserve checkpoint, a GGUF file or {HF tensor name: array}. Returns the
        new `weights_version`."""
        return self.engine.update_weights(source)

    @property
    def weights_version(self) -> int:
        """How many times the weights were updated since the engine started."""
        return self.engine.weights_version

    def sleep(self, level: int = 1) -> None:
        """Frees the KV cache's device memory (level 2: the weights' too, kept on the host)."""
        self.engine.sleep(level)

    def wake_up(self) -> None:
        self.engine.wake_up()

    def load_lora(self, lora_request: LoRARequest) -> None:
        """Reads and registers an adapter ahead of its first request (optional: `generate`
        loads an adapter it has not seen)."""
        self.engine.load_lora(lora_request)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; returns outputs in input order.

        A prompt is a string or `{"prompt_token_ids": [...]}` (or `{"prompt": "..."}`).
        `lora_request`: one adapter for every prompt, or a list matching them (None: the base
        model).
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompts)} prompts"
                )
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, params, lora in zip(prompts, params_list, loras):
                ids.append(self._add(prompt, params, lora))
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them."""
        proc = self.engine.input_processor
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in convs:
            messages, images = _chat_images(list(c))
            proc.check_messages(messages)
            ids = apply_chat_template(proc.tokenizer, messages, add_generation_prompt)
            prompts.append({"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images
                           else {"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _add(self, prompt: PromptType, params: SamplingParams, lora: LoRARequest | None = None) -> str:
        rid = f"llm-{self._counter}"
        self._counter += 1
        final = OutputKind.FINAL_ONLY  # only finished outputs are read: no step snapshots the others
        if isinstance(prompt, str):
            return self.engine.add_prompt(prompt, params, request_id=rid, output_kind=final, lora_request=lora)
        images = _images(prompt) if isinstance(prompt, dict) else []
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return self.engine.add_prompt(None, params, prompt_token_ids=prompt["prompt_token_ids"], request_id=rid,
                                          output_kind=final, lora_request=lora, images=images)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.engine.add_prompt(prompt["prompt"], params, request_id=rid, output_kind=final,
                                          lora_request=lora, images=images)
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req")
        try:
            while len(results) < len(ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine stopped with requests unfinished")
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = _cumulative(out)
                        bar.update(1)
        finally:
            bar.close()
        return [results[i] for i in ids]


def _cumulative(out: RequestOutput) -> RequestOutput:
    """Batch callers want whole outputs; drop the per-step deltas."""
    comps = [dataclasses.replace(c, delta_text="", delta_token_ids=[], delta_logprobs=None) for c in out.outputs]
    return dataclasses.replace(out, outputs=comps)


def _images(prompt: dict[str, Any]) -> list[Any]:
    """A prompt's images as vLLM takes them: `multi_modal_data={"image": image or [images]}`."""
    data = prompt.get("multi_modal_data")
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"multi_modal_data must be a dict like {{'image': [...]}}, got {type(data).__name__}")
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: only 'image' is supported, got {sorted(unknown)}")
    images = data.get("image", [])
    return list(images) if isinstance(images, list | tuple) else [images]


def _chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """Messages whose content parts hold images (OpenAI's `image_url` parts, vLLM's
    `image_pil` and `{"type": "image", "image": ...}`) as the chat template reads them
    (`{"type": "image"}` in place), and the images in order."""
    images: list[Any] = []
    out = []
    for m in messages:
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
            elif kind == "image_pil":
                images.append(part.get("image_pil"))
            elif kind == "image" and "image" in part:
                images.append(part["image"])
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images
