"""Exceptions that name what is wrong with a model file, so users need not read a traceback."""

from __future__ import annotations

from jaxserve.models.config import UnsupportedModelError


class ModelFileNotFoundError(FileNotFoundError):
    """The model path does not exist or holds none of the files jaxserve can load."""


class CheckpointError(ValueError):
    """A model file exists but is corrupt, truncated or inconsistent with its config."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent from the checkpoint."""


class UnsupportedQuantizationError(UnsupportedModelError):
    """The checkpoint is quantized with a method or scheme jaxserve does not load."""
