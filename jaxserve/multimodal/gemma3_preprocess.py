"""Gemma 3's image preprocessing in numpy, as transformers' `Gemma3ImageProcessorPil` does it
without pan-and-scan: every image is resized (bilinear) to `image_size` x `image_size`, scaled
to [0, 1], normalised per channel (0.5 / 0.5 by default) and cut into row-major
`patch_size` x `patch_size` patches (channel, row, column within a row): the SigLIP patch
convolution's input order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from jaxserve.multimodal.images import image_hash, to_rgb
from jaxserve.multimodal.qwen_vl_preprocess import ProcessedImage, rescale_and_normalize


@dataclass(frozen=True)
class Gemma3ImageConfig:
    image_size: int = 896
    patch_size: int = 14
    tokens_per_image: int = 256
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        if self.image_size <= 0 or self.patch_size <= 0 or self.image_size % self.patch_size:
            raise ValueError(f"Gemma3ImageConfig: image_size {self.image_size} must be a positive multiple of "
                             f"patch_size {self.patch_size}")


def preprocess_gemma3_image(image: Image.Image, cfg: Gemma3ImageConfig, *, hash: str | None = None,
                            where: str = "image") -> ProcessedImage:
    """One image -> its [num_patches, 3 * p * p] float32 patches (row-major over the grid)."""
    del where  # every size is resized to the one square: nothing about the image is refused here
    rgb = to_rgb(image)
    s, p = cfg.image_size, cfg.patch_size
    resized = rgb.resize((s, s), resample=Image.Resampling.BILINEAR)
    pixels = rescale_and_normalize(np.asarray(resized), cfg)  # [S, S, 3] float32
    g = s // p
    patches = pixels.transpose(2, 0, 1).reshape(3, g, p, g, p).transpose(1, 3, 0, 2, 4).reshape(g * g, 3 * p * p)
    return ProcessedImage(pixel_values=np.ascontiguousarray(patches), grid_thw=(1, g, g),
                          num_tokens=cfg.tokens_per_image, hash=image_hash(rgb) if hash is None else hash)
