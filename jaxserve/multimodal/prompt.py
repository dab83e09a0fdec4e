"""A prompt with images: the placeholder runs the images fill, and the 3-D rotary positions
(M-RoPE) of its tokens. Host-side and jax-free: the input processor builds a
`MultimodalPrompt` once per request; the scheduler hashes its images into the prefix-cache
blocks they cover, and the runner encodes them and reads the positions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class ImageItem:
    """One image of a prompt: its tokens are `[offset, offset + num_tokens)`, all the image
    placeholder id, whose input embeddings are the encoder's rows for `pixel_values`."""

    offset: int
    num_tokens: int
    hash: str  # the image's content hash: the encoder cache's key and the prefix cache's extra key
    pixel_values: np.ndarray  # [num_patches, patch_dim] f32, in the processor's row order
    grid_thw: tuple[int, int, int]

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclasses.dataclass(frozen=True)
class MultimodalPrompt:
    """What the runner keeps of a prompt's images: the images, in prompt order, and each prompt
    token's (t, h, w) rotary positions; a token past the prompt sits at its index + `mrope_delta`
    on all three axes."""

    images: tuple[ImageItem, ...]
    mrope_positions: np.ndarray  # [3, prompt_len] int32
    mrope_delta: int

    @property
    def keys(self) -> tuple[tuple[int, int, str], ...]:
        """(offset, num_tokens, hash) of each image: what the scheduler hashes into blocks."""
        return tuple((im.offset, im.num_tokens, im.hash) for im in self.images)

    def positions(self, start: int, n: int) -> np.ndarray:
        """[3, n] int32 positions of tokens start .. start + n - 1."""
        L = self.mrope_positions.shape[1]
        idx = np.arange(start, start + n)
        out = np.broadcast_to(idx + self.mrope_delta, (3, n)).astype(np.int32)
        inside = idx < L
        if inside.any():
            out[:, inside] = self.mrope_positions[:, idx[inside]]
        return out


def expand_placeholders(ids: Sequence[int], images: Sequence[Any], image_token_id: int, param: str, *,
                        placeholder_id: int | None = None, before: Sequence[int] = (),
                        after: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """Each lone placeholder in `ids` (`placeholder_id`, default `image_token_id`) becomes
    `before`, then `images[i].num_tokens` image tokens, then `after`, in order (what
    transformers' processor does to the text's placeholder before tokenizing, and what vLLM
    does to a token-id prompt; Gemma 3 frames its image tokens with its start/end-of-image
    tokens and blank lines). Returns the ids and each image's first image token's index.
    Raises ValueError naming `param` when the placeholders and images do not pair up."""
    placeholder = image_token_id if placeholder_id is None else placeholder_id
    slots = [i for i, t in enumerate(ids) if t == placeholder]
    if len(slots) != len(images):
        raise ValueError(f"{param}: the prompt has {len(slots)} image placeholder(s) (token id {placeholder}) "
                         f"for {len(images)} image(s)")
    out: list[int] = []
    offsets: list[int] = []
    prev = 0
    for slot, image in zip(slots, images):
        out.extend(ids[prev:slot])
        out.extend(before)
        offsets.append(len(out))
        out.extend([image_token_id] * image.num_tokens)
        out.extend(after)
        prev = slot + 1
    out.extend(ids[prev:])
    return out, offsets


def plain_positions(num_tokens: int) -> tuple[np.ndarray, int]:
    """The positions of a model without M-RoPE (Gemma 3): every axis is the token's index."""
    return np.broadcast_to(np.arange(num_tokens, dtype=np.int32), (3, num_tokens)).copy(), 0


def mrope_positions(num_tokens: int, images: Sequence[ImageItem], spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """Qwen2-VL's 3-D positions of a prompt ([3, num_tokens] int32, and the delta of the
    tokens after it): text advances all three axes by one per token; an image's tokens sit on
    its merged grid (t, row, column) offset by the position where the image starts, and the
    text after it starts past the image's largest side."""
    pos = np.zeros((3, num_tokens), np.int32)
    cur = 0  # the position the next token takes
    prev = 0  # the prompt index after the last image
    for im in sorted(images, key=lambda x: x.offset):
        n_text = im.offset - prev
        pos[:, prev:im.offset] = cur + np.arange(n_text)
        cur += n_text
        t, h, w = im.grid_thw
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + cur  # [3, t*gh*gw]
        if grid.shape[1] != im.num_tokens:
            raise ValueError(f"image at token {im.offset}: grid {im.grid_thw} gives {grid.shape[1]} tokens, "
                             f"the prompt holds {im.num_tokens}")
        pos[:, im.offset:im.end] = grid
        cur += max(gh, gw)
        prev = im.end
    pos[:, prev:] = cur + np.arange(num_tokens - prev)
    delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
    return pos, delta
