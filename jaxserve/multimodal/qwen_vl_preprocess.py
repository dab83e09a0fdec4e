"""Qwen2-VL / Qwen2.5-VL / Qwen3-VL image preprocessing in numpy, bit-identical to
transformers' `Qwen2VLImageProcessorPil` (the processor all three families map to).

The vision tower consumes an image as a flat list of patches: the image is resized so each
side is a multiple of `patch_size * merge_size` and the pixel count lies in
[min_pixels, max_pixels], scaled to [0, 1], normalised per channel, and cut into
`patch_size` x `patch_size` patches. The single frame is repeated `temporal_patch_size`
times because the patch embedding is a 3-D convolution built for video. Rows are ordered
so that each `merge_size` x `merge_size` block of neighbouring patches is contiguous: the
merger after the vision tower concatenates those rows into one language-model token, so
the order is part of the model, not a layout choice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from jaxserve.multimodal.images import ImageInputError, image_hash, to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # transformers refuses anything more elongated
_RESCALE_FACTOR = 1 / 255
_BICUBIC = 3  # PILImageResampling.BICUBIC, the value checkpoints store as "resample"
# Preprocessor-config switches whose only value this implementation reproduces.
_FIXED_KEYS = {
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": _BICUBIC,
}


@dataclass(frozen=True)
class QwenVLImageConfig:
    """The image processor's parameters. Defaults are transformers' class defaults
    (Qwen2-VL); Qwen2.5-VL checkpoints override max_pixels, Qwen3-VL ones use
    patch_size=16, mean=std=0.5 and a larger pixel range."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"QwenVLImageConfig.{name} must be a positive integer, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"QwenVLImageConfig.min_pixels ({self.min_pixels}) exceeds max_pixels ({self.max_pixels})"
            )
        object.__setattr__(self, "image_mean", _three_floats("image_mean", self.image_mean))
        object.__setattr__(self, "image_std", _three_floats("image_std", self.image_std))
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"QwenVLImageConfig.image_std must be non-zero, got {self.image_std}")

    @property
    def factor(self) -> int:
        """What both resized sides are a multiple of: one merged token spans this many pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Width of a `pixel_values` row: channels x frames x patch pixels."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_preprocessor_config(cls, d: Mapping[str, Any]) -> QwenVLImageConfig:
        """Reads a checkpoint's `preprocessor_config.json` as transformers 5.25 does.

        The pixel range comes from `size` ({"shortest_edge": min, "longest_edge": max};
        given at all, it replaces the defaults whole), then top-level `min_pixels` /
        `max_pixels` (Qwen2/2.5-VL checkpoints) override the matching edge. A `size` left
        without both edges is an error (transformers fails at the first image). Switches
        that would change the pipeline (no resize, another resample filter, ...) are refused
        rather than silently ignored."""
        for key, expected in _FIXED_KEYS.items():
            if key in d and d[key] != expected:
                raise ValueError(f"preprocessor_config {key}={d[key]!r} is not supported (only {expected!r})")
        factor = d.get("rescale_factor")
        if factor is not None and not math.isclose(factor, _RESCALE_FACTOR, rel_tol=1e-9):
            raise ValueError(f"preprocessor_config rescale_factor={factor!r} is not supported (only 1/255)")
        shortest, longest = _pixel_range(d)
        return cls(
            patch_size=_get(d, "patch_size", cls.patch_size),
            temporal_patch_size=_get(d, "temporal_patch_size", cls.temporal_patch_size),
            merge_size=_get(d, "merge_size", cls.merge_size),
            min_pixels=shortest,
            max_pixels=longest,
            image_mean=_channel_values(d.get("image_mean"), OPENAI_CLIP_MEAN),
            image_std=_channel_values(d.get("image_std"), OPENAI_CLIP_STD),
        )


def _get(d: Mapping[str, Any], key: str, default: int) -> int:
    """A JSON null means "the default", as a None keyword argument does in transformers."""
    value = d.get(key)
    return default if value is None else value


def _pixel_range(d: Mapping[str, Any]) -> tuple[int, int]:
    size = d.get("size")
    if size is None:
        size = {"shortest_edge": QwenVLImageConfig.min_pixels, "longest_edge": QwenVLImageConfig.max_pixels}
    if not isinstance(size, Mapping):
        raise ValueError(f"preprocessor_config size must be a mapping with shortest_edge/longest_edge, got {size!r}")
    size = dict(size)
    if d.get("min_pixels") is not None:
        size["shortest_edge"] = d["min_pixels"]
    if d.get("max_pixels") is not None:
        size["longest_edge"] = d["max_pixels"]
    if not size.get("shortest_edge") or not size.get("longest_edge"):
        raise ValueError(
            "preprocessor_config needs a pixel range: size.shortest_edge and size.longest_edge, "
            f"or min_pixels and max_pixels (got size={d.get('size')!r})"
        )
    return size["shortest_edge"], size["longest_edge"]


def _channel_values(value: Any, default: tuple[float, float, float]) -> tuple[float, float, float]:
    """Per-channel values as stored in a config: a list, or one number for all channels."""
    if value is None:
        return default
    if isinstance(value, int | float):
        return (float(value),) * 3
    return tuple(value)


def _three_floats(name: str, value: Any) -> tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"QwenVLImageConfig.{name} must be three numbers, got {value!r}") from None
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ValueError(f"QwenVLImageConfig.{name} must be three finite numbers, got {value!r}")
    return values  # type: ignore[return-value]


def smart_resize(
    height: int,
    width: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
    *,
    where: str = "image",
) -> tuple[int, int]:
    """The (height, width) transformers resizes an image to: each side rounded to a multiple of
    `factor`, then, if the area left [min_pixels, max_pixels], both sides scaled by one
    factor (floored when shrinking, ceiled when growing) so the aspect ratio survives.

    The float expressions follow transformers' evaluation order, so every size rounds the
    same way; a one-token difference would misalign the prompt's placeholders. An image
    smaller than `factor` is upscaled to min_pixels, as transformers 5.25 does (older
    releases refused it). More elongated than 200:1 is refused, as transformers does."""
    if height <= 0 or width <= 0:
        raise ImageInputError(where, f"image has no pixels ({width}x{height})")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ImageInputError(
            where,
            f"image is {width}x{height}, an aspect ratio of {ratio:.0f}:1; "
            f"the vision encoder accepts at most {MAX_ASPECT_RATIO}:1",
        )
    h_bar = round(height / factor) * factor  # round() is half-to-even, like transformers'
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    # Neither side can be 0 here: a side that rounds to 0 makes the area 0 < min_pixels
    # (min_pixels >= 1 is enforced by QwenVLImageConfig), and the ceil branch gives >= factor.
    return h_bar, w_bar


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image ready for the vision encoder, and what the prompt needs to know about it.

    `num_tokens` is how many placeholder tokens the prompt must hold for this image; `hash`
    keys the encoder-output and prefix caches (see `image_hash`)."""

    pixel_values: np.ndarray  # [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] float32
    grid_thw: tuple[int, int, int]  # (1, resized_h // patch_size, resized_w // patch_size)
    num_tokens: int  # t * h * w // merge_size**2
    hash: str


def preprocess_image(
    image: Image.Image,
    cfg: QwenVLImageConfig,
    *,
    hash: str | None = None,  # shadows the builtin: the name ProcessedImage uses
    where: str = "image",
) -> ProcessedImage:
    """Resize, rescale, normalise and patchify one image the way transformers'
    Qwen2-VL PIL-backend processor does, bit for bit. `hash` saves re-hashing when the
    caller already has `image_hash(image)`."""
    rgb = to_rgb(image)
    resized_h, resized_w = smart_resize(
        rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels, where=where
    )
    # Always resized, even to the same size (Pillow then copies), as transformers does.
    resized = rgb.resize((resized_w, resized_h), resample=Image.Resampling.BICUBIC)
    pixels = rescale_and_normalize(np.asarray(resized), cfg)  # [H, W, 3] float32
    patches = _patchify(pixels, cfg)  # [gh * gw, 3 * t * p * p]
    grid_thw = (1, resized_h // cfg.patch_size, resized_w // cfg.patch_size)
    num_tokens = grid_thw[0] * grid_thw[1] * grid_thw[2] // cfg.merge_size**2
    return ProcessedImage(
        pixel_values=patches,
        grid_thw=grid_thw,
        num_tokens=num_tokens,
        hash=image_hash(rgb) if hash is None else hash,
    )


def rescale_and_normalize(pixels: np.ndarray, cfg: Any) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [H, W, 3]. The rescale is done in float64 and rounded to
    float32 once, and the normalisation in float32 with float32 mean/std: transformers'
    exact dtype sequence, which is what makes the result bit-identical rather than close."""
    scaled = (pixels.astype(np.float64) * _RESCALE_FACTOR).astype(np.float32)
    mean = np.asarray(cfg.image_mean, dtype=np.float32)
    std = np.asarray(cfg.image_std, dtype=np.float32)
    return (scaled - mean) / std


def _patchify(pixels: np.ndarray, cfg: QwenVLImageConfig) -> np.ndarray:
    """float32 [H, W, C] -> [gh * gw, C * t * p * p], rows in merge-block order: block
    (bh, bw) row-major, inside it its m x m patches row-major; each row holds channel,
    then frame, then the p x p pixels."""
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, channels = pixels.shape
    gh, gw = height // p, width // p
    chw = pixels.transpose(2, 0, 1)  # [C, H, W]
    blocks = chw.reshape(channels, gh // m, m, p, gw // m, m, p)  # [C, bh, mh, ph, bw, mw, pw]
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [bh, bw, mh, mw, C, ph, pw]
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # [.., C, t, ph, pw]
    return np.ascontiguousarray(frames).reshape(gh * gw, channels * t * p * p)
