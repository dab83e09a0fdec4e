"""Images on the worker: the encoder's programs (one per window bucket, planned and warmed like
the step's), the cache of its outputs by image hash, and a step's multimodal inputs.

A step's image rows come from the cache: an image is encoded the first time a span reaches
its tokens, and its [num_tokens, 1 + D, E] rows (the input row and Qwen3-VL's D DeepStack rows
of each token) stay on the host (LRU, bounded in bytes) for the later chunks of the same
prefill and for other requests with the same image, so chunked prefill never encodes an image
twice while its rows are cached.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import gemma3_vision
from jaxserve.models.config import VisionConfig
from jaxserve.models.metadata import MultimodalMetadata
from jaxserve.models.qwen_vision import (
    encode_jit,
    slot_inputs,
    slots_per_window,
    vision_layout,
    window_buckets,
)
from jaxserve.worker.buckets import pick


class EncoderCache:
    """Encoder outputs by image hash, least recently used first out, at most `max_bytes`.
    An entry larger than the whole budget is still returned to its caller, never kept."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._rows: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> np.ndarray | None:
        with self._lock:
            rows = self._rows.get(key)
            if rows is None:
                self.misses += 1
                return None
            self._rows.move_to_end(key)
            self.hits += 1
            return rows

    def put(self, key: str, rows: np.ndarray) -> None:
        with self._lock:
            if key in self._rows or rows.nbytes > self.max_bytes:
                return
            while self._rows and self.nbytes + rows.nbytes > self.max_bytes:
                _, old = self._rows.popitem(last=False)
                self.nbytes -= old.nbytes
            self._rows[key] = rows
            self.nbytes += rows.nbytes

    def __len__(self) -> int:
        return len(self._rows)


@dataclasses.dataclass
class VisionRunner:
    """The image encoder on this runner's devices. `params` are placed once (replicated
    under a mesh); `executables` hold the warmed programs by window count."""

    vc: VisionConfig
    params: dict[str, jax.Array]
    dtype: Any  # the decoder's activations' dtype: what the image rows are cast to
    cache: EncoderCache
    sharding: Any = None
    executables: dict[int, Any] = dataclasses.field(default_factory=dict)
    buckets: tuple[int, ...] = ()
    num_encoded: int = 0  # images run through the encoder (cache misses that encoded)

    def __post_init__(self) -> None:
        self.buckets = encoder_buckets(self.vc)

    def rows(self, image: Any) -> np.ndarray:
        """The image's [num_tokens, 1 + D, E] rows (an `ImageItem`): each token's input row, then
        its D DeepStack rows (Qwen3-VL); cached, or encoded now."""
        rows = self.cache.get(image.hash)
        if rows is None:
            rows = self.encode(image.pixel_values, image.grid_thw)
            if rows.shape[0] != image.num_tokens:
                raise ValueError(f"image {image.hash[:12]}: the encoder gave {rows.shape[0]} rows for "
                                 f"{image.num_tokens} placeholder tokens")
            self.cache.put(image.hash, rows)
        return rows

    def encode(self, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> np.ndarray:
        if self.vc.kind == "gemma3":  # one image per program, every image the same shape
            inputs = jax.device_put({"patches": pixel_values[None]}, self.sharding)
            exe = self.executables.get(1)
            out = exe(self.params, inputs) if exe is not None else \
                gemma3_vision.encode_jit(self.params, inputs, vc=self.vc)
            self.num_encoded += 1
            return np.asarray(out)[0].astype(self.dtype)  # [tokens, 1, E]
        layout = vision_layout(grid_thw, self.vc)
        windows = pick(self.buckets, layout.num_windows)
        inputs = jax.device_put(slot_inputs(pixel_values, layout, windows, self.vc), self.sharding)
        exe = self.executables.get(windows)
        out = exe(self.params, inputs) if exe is not None else encode_jit(self.params, inputs, vc=self.vc)
        self.num_encoded += 1
        return np.asarray(out)[layout.token_rows].astype(self.dtype)


def vision_dtype(platform: str, dtype: Any) -> Any:
    """The encoder's dtype: f32 on CPU (XLA:CPU's bf16 dot is ~10x slower than its f32 one),
    else the decoder's."""
    return jnp.float32 if platform == "cpu" else dtype


def encoder_buckets(vc: VisionConfig) -> tuple[int, ...]:
    """The encoder's program sizes: window counts (Qwen), or one image (Gemma 3)."""
    return (1,) if vc.kind == "gemma3" else window_buckets(vc)


def lower_encoder(vc: VisionConfig, params: dict[str, Any], windows: int, sharding: Any = None) -> Any:
    """Compiles the encoder for `windows` windows (Gemma 3: images, always 1) over abstract
    params and inputs."""
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    if vc.kind == "gemma3":
        patches = sds((windows, gemma3_vision.num_patches(vc), vc.patch_dim), jnp.float32)
        return gemma3_vision.encode_jit.lower(params, {"patches": patches}, vc=vc).compile()
    n = windows * slots_per_window(vc)
    inputs = {"pixels": sds((n, vc.patch_dim), jnp.float32), "positions": sds((n, 2), jnp.int32),
              "valid": sds((n,), jnp.bool_)}
    if vc.kind == "qwen3_vl":
        inputs.update(pos_index=sds((n, 4), jnp.int32), pos_weight=sds((n, 4), jnp.float32))
    return encode_jit.lower(params, inputs, vc=vc).compile()


def multimodal_inputs(scheduled: list[Any], requests: dict[str, Any], T: int, hidden_size: int, dtype: Any,
                      vision: VisionRunner | None) -> dict[str, np.ndarray]:
    """A step's `MultimodalMetadata` fields on the host: each image token's encoder row and
    each token's (t, h, w) positions, spans in batch order as `BatchBuilder` lays them out.
    `requests`: the runner's per-request state (`CachedRequestState.multimodal`)."""
    D = len(vision.vc.deepstack_visual_indexes) if vision is not None else 0
    bidirectional = vision is not None and vision.vc.bidirectional_images
    until = np.zeros(T, np.int32)  # Gemma 3: an image token sees its image's last token (0: causal)
    embeds = np.zeros((T, hidden_size), dtype)
    deepstack = np.zeros((D, T, hidden_size), dtype)
    is_embed = np.zeros(T, bool)
    pos = np.zeros((3, T), np.int32)
    row = 0
    for sr in scheduled:
        n = sr.num_tokens
        st = requests.get(sr.request_id)
        mm = getattr(st, "multimodal", None)
        if mm is None:
            pos[:, row:row + n] = np.arange(sr.start, sr.start + n)
        else:
            pos[:, row:row + n] = mm.positions(sr.start, n)
            for image in mm.images:
                lo, hi = max(sr.start, image.offset), min(sr.start + n, image.end)
                if lo >= hi:
                    continue
                if vision is None:
                    raise ValueError("a request with images reached a runner without an image encoder")
                rows = vision.rows(image)[lo - image.offset:hi - image.offset]  # [k, 1 + D, E]
                at = slice(row + lo - sr.start, row + hi - sr.start)
                embeds[at] = rows[:, 0]
                deepstack[:, at] = np.swapaxes(rows[:, 1:], 0, 1)
                is_embed[at] = True
                until[at] = image.end - 1
        row += n
    out = {"embeds": embeds, "deepstack": deepstack, "is_embed": is_embed, "mrope_positions": pos}
    return out | {"attend_until": until} if bidirectional else out


def abstract_multimodal(T: int, hidden_size: int, dtype: Any, num_deepstack: int = 0,
                        sharding: Any = None, bidirectional: bool = False) -> MultimodalMetadata:
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sharding)  # noqa: E731
    return MultimodalMetadata(embeds=sds((T, hidden_size), dtype), is_embed=sds((T,), jnp.bool_),
                              mrope_positions=sds((3, T), jnp.int32),
                              deepstack=sds((num_deepstack, T, hidden_size), dtype),
                              attend_until=sds((T,), jnp.int32) if bidirectional else None)
