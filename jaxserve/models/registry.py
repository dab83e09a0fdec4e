"""The model registry: one entry per model family, and the only place that knows them.

A family is what the rest of the engine needs to serve an architecture: how to read its config,
its model class, the shapes of its params, the checkpoint names of its weights (HF and GGUF),
how its weights split over a mesh, its KV cache, and what it supports. The loaders, the runner,
the memory planner and AOT compilation ask `family_of(config)`; none of them names a family.
Adding one is a module in `models/` that calls `register(ModelFamily(...))`, and its tests.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxserve.models.config import ModelConfig, UnsupportedModelError

MODEL_AXIS = "model"  # the mesh axis tensor parallelism splits (sharding rules name it)
# Modules that register the built-in families when first imported.
_BUILTIN_MODULES = ("jaxserve.models.llama_family", "jaxserve.models.deepseek_family", "jaxserve.models.gpt_oss",
                    "jaxserve.models.llama4", "jaxserve.models.gemma4", "jaxserve.models.qwen3_next",
                    "jaxserve.models.qwen_vl", "jaxserve.models.gemma3_vl")


@dataclasses.dataclass(frozen=True)
class ModelSupport:
    """What a family can be served with; the engine refuses the rest at start-up, by name."""

    lora: bool = True
    quantized_kv: bool = True
    spec_decode: bool = True
    tensor_parallel: bool = True
    expert_parallel: bool = False


@dataclasses.dataclass(frozen=True)
class WeightNames:
    """jaxserve param names -> a checkpoint's tensor names. `layers` holds a layer's names without
    its prefix (`layers.{i}.` in HF files, `blk.{i}.` in GGUF); `experts`, for HF files, the
    routed-expert names (router, expert module, gate, up, down) of one layer."""

    globals: Mapping[str, str]
    layers: Mapping[str, str]
    experts: tuple[str, str, str, str, str] | None = None
    # How a checkpoint without per-expert tensors stacks them: "halves" (transformers' Qwen /
    # Mixtral layout: `gate_up_proj` [X, 2I, E], gate then up; `down_proj` [X, E, I]) or
    # "interleaved" (gpt-oss: `gate_up_proj` [X, E, 2I], gate and up alternating columns;
    # `down_proj` [X, I, E]; `*_bias` beside them; MXFP4 `*_blocks` / `*_scales` when released)
    # or "halves_in_out" (Llama 4: `gate_up_proj` [X, E, 2I], gate then up; `down_proj` [X, I, E]).
    stacked_experts: str = "halves"


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    """The paged KV cache a family's attention reads and writes, as functions of its config."""

    shape: Callable[..., tuple[int, ...]]  # (cfg, num_pages, page_size, layout, tp) -> pool shape
    scales_shape: Callable[..., tuple[int, ...]]  # (cfg, num_pages, page_size, layout) -> quantized KV scales
    bytes_per_page: Callable[..., int]  # (cfg, page_size, dtype, layout, tp) -> bytes, for the planner
    init: Callable[..., Any]  # (cfg, num_pages, page_size, dtype, layout, ...) -> the zeroed pool
    # The pool is `page_arrays` arrays of pages [L, P, S, ...] (K and V: 2; a latent: 1), then,
    # when quantized, as many scale arrays.
    page_arrays: int = 2
    replicated: bool = False  # every tensor-parallel rank holds all of it (else split by KV head)
    # The page arrays' shapes when they differ (Gemma 4: a pool per attention kind), as `shape`
    # takes its arguments; None: `shape` for each.
    shapes: Callable[..., tuple[tuple[int, ...], ...]] | None = None
    # Hybrid models (Qwen3-Next, Qwen3.5): fixed-size per-sequence state pools after the page
    # arrays, as (cfg, num_slots) -> their shapes (f32, slot axis 1: [layers, slots, ...]);
    # `init` then takes `state_slots=`. None: pages only.
    state_shapes: Callable[..., tuple[tuple[int, ...], ...]] | None = None
    # Each state pool's axis split over the tensor-parallel ranks (its heads or channels).
    state_split_axes: tuple[int, ...] = ()
    # The model lays its cache out in layer groups when its config has windowed or chunked
    # layers (`ModelConfig.kv_layer_groups`): the pool's leading axis is then a group's layers.
    layer_groups: bool = False

    @property
    def recurrent(self) -> bool:
        """Whether the cache holds per-sequence state slots besides pages."""
        return self.state_shapes is not None

    def page_shapes(self, cfg: Any, num_pages: int, page_size: int, layout: str = "heads",
                    tp: int = 1) -> tuple[tuple[int, ...], ...]:
        """Every page array's shape."""
        if self.shapes is not None:
            return tuple(self.shapes(cfg, num_pages, page_size, layout, tp))
        return (self.shape(cfg, num_pages, page_size, layout, tp),) * self.page_arrays


@dataclasses.dataclass(frozen=True)
class ModelFamily:
    name: str
    architectures: tuple[str, ...]  # the `ModelConfig.architecture` values this family serves
    hf_architectures: Mapping[str, str]  # config.json `architectures` entry -> architecture
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    model_class: type  # (config, params, shards=, expert_parallel=, ...) -> an nnx module
    param_shapes: Callable[[ModelConfig], dict[str, Any]]  # unfused, unquantized
    hf_weight_names: Callable[[ModelConfig], WeightNames]
    kv_cache: KVCacheSpec
    layer_sharding: Mapping[str, tuple[Any, ...]]  # fused layer weight -> its PartitionSpec axes
    expert_parallel_sharding: Mapping[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    hf_model_types: Mapping[str, str] = dataclasses.field(default_factory=dict)  # configs without `architectures`
    gguf_architectures: Mapping[str, str] = dataclasses.field(default_factory=dict)
    config_from_gguf: Callable[..., ModelConfig] | None = None  # (metadata, tie_word_embeddings=)
    gguf_weight_names: Callable[[ModelConfig], WeightNames] | None = None
    gguf_permuted_qk: Callable[[ModelConfig], bool] = lambda cfg: False  # llama.cpp's q/k row order
    support: ModelSupport = ModelSupport()
    # The checkpoint layers each stacked layer weight holds (default: all; a family whose first
    # layers differ keeps their weights in shorter stacks).
    layer_ids: Callable[[ModelConfig, str], Sequence[int]] = lambda cfg, name: range(cfg.num_layers)
    attention: str = "paged_kv"  # "paged_kv": per-head K/V pages | "latent": MLA's latent pages
    # The loaded layer weights (host arrays) rearranged as the model computes with them, before
    # fusion and sharding (Qwen3-Next: conv channels grouped per key head); None: as loaded.
    serving_layers: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None


_FAMILIES: dict[str, ModelFamily] = {}
_builtins_loaded = False


def register(family: ModelFamily) -> ModelFamily:
    """Adds a family. An architecture or checkpoint name another family claims is refused."""
    _load_builtins()
    return _add(family)


def _add(family: ModelFamily) -> ModelFamily:
    for other in _FAMILIES.values():
        if other.name == family.name:
            raise ValueError(f"model family {family.name!r} is already registered")
        for field in ("architectures", "hf_architectures", "hf_model_types", "gguf_architectures"):
            clash = set(getattr(other, field)) & set(getattr(family, field))
            if clash:
                raise ValueError(f"model family {family.name!r}: {field} {sorted(clash)} already belong to "
                                 f"{other.name!r}")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Removes a family (tests that register a toy one clean up with this)."""
    _FAMILIES.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)


def add_builtin(family: ModelFamily) -> ModelFamily:
    """`register` for the built-in modules, which run while the registry loads them."""
    return _add(family)


def families() -> tuple[ModelFamily, ...]:
    _load_builtins()
    return tuple(_FAMILIES.values())


def supported_architectures() -> tuple[str, ...]:
    return tuple(a for f in families() for a in f.architectures)


def is_supported(architecture: str) -> bool:
    return architecture in supported_architectures()


def family_of(config: ModelConfig | str) -> ModelFamily:
    arch = config if isinstance(config, str) else config.architecture
    for f in families():
        if arch in f.architectures:
            return f
    raise UnsupportedModelError(f"unsupported architecture {arch!r}; supported: {sorted(supported_architectures())}")


def check_support(config: ModelConfig, *, lora: bool = False, quantized_kv: bool = False,
                  spec_decode: bool = False, tensor_parallel: bool = False, expert_parallel: bool = False) -> None:
    """Refuses, by name, an engine feature the model's family does not implement."""
    family = family_of(config)
    asked = {"lora": lora, "quantized_kv": quantized_kv, "spec_decode": spec_decode,
             "tensor_parallel": tensor_parallel, "expert_parallel": expert_parallel}
    missing = [k for k, on in asked.items() if on and not getattr(family.support, k)]
    if missing:
        raise UnsupportedModelError(f"{config.architecture} (model family {family.name!r}) does not support "
                                    f"{', '.join(missing)}")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """The config of an HF config.json, by the family that claims its `architectures` (else its
    `model_type`); an unknown one is refused naming those supported."""
    archs = list(hf.get("architectures") or [])
    for f in families():
        if any(a in f.hf_architectures for a in archs):
            return f.config_from_hf(hf)
    for f in families():
        if hf.get("model_type") in f.hf_model_types:
            return f.config_from_hf(hf)
    names = sorted(a for f in families() for a in f.hf_architectures)
    raise UnsupportedModelError(f"unsupported architecture {archs or hf.get('model_type')!r}; supported: {names}")


def config_from_gguf(meta: dict[str, Any], *, tie_word_embeddings: bool) -> ModelConfig:
    arch = meta.get("general.architecture")
    for f in families():
        if arch in f.gguf_architectures and f.config_from_gguf is not None:
            return f.config_from_gguf(meta, tie_word_embeddings=tie_word_embeddings)
    names = sorted(a for f in families() for a in f.gguf_architectures)
    raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r}; supported: {names}")
