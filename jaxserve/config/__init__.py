"""Configuration: `EngineConfig`, one validated object for everything the engine runs with
(`engine_config`), its command-line form (`engine_args`) and speculative decoding's part
(`speculative`)."""

from jaxserve.config.engine_config import EngineConfig
from jaxserve.config.speculative import SpeculativeConfig

__all__ = ["EngineConfig", "SpeculativeConfig"]
