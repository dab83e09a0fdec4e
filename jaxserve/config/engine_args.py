"""Engine settings as command-line flags: one flag per `EngineConfig` field.

A leaf module (it imports only the config) shared by every command that builds an engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing

from jaxserve.config.engine_config import EngineConfig

# Shorter spellings of a few flags (the field's own flag works too).
ALIASES = {"compiled_dir": ("--compiled",)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (`--max-num-seqs`, `--no-enable-prefix-caching`, ...)."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        flag = ("--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ()))
        hint = hints[f.name]
        if hint is bool:
            p.add_argument(*flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif typing.get_origin(hint) is tuple:  # tuple[int, ...] or tuple[str, ...]
            p.add_argument(*flag, type=typing.get_args(hint)[0], nargs="*", default=())
        else:
            args = typing.get_args(hint)
            base = next((a for a in args if a is not type(None)), hint)
            if typing.get_origin(base) is typing.Literal:
                p.add_argument(*flag, choices=typing.get_args(base), default=f.default)
            else:
                conv = base if base in (int, float, str) else str
                p.add_argument(*flag, type=conv, default=f.default, dest=f.name)


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineConfig)}
    for f in dataclasses.fields(EngineConfig):
        if isinstance(f.default, tuple):
            kwargs[f.name] = tuple(kwargs[f.name] or ())
    return EngineConfig(**kwargs)
