"""Model loading: GGUF files, HF directories (config.json + safetensors), orbax checkpoints."""

from jaxserve.loading.errors import (
    CheckpointError,
    MissingTensorError,
    ModelFileNotFoundError,
    UnsupportedQuantizationError,
)
from jaxserve.loading.loader import LoadedModel, load_model, load_model_config

__all__ = ["CheckpointError", "LoadedModel", "MissingTensorError", "ModelFileNotFoundError",
           "UnsupportedQuantizationError", "load_model", "load_model_config"]
