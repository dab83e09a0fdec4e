"""`jaxserve compile`: every planned shape of an engine config, compiled for a target.

The params and the KV cache are abstract (`ShapeDtypeStruct`s sharded over the target's
devices), so a model is planned from its config alone: an 8B model's plan for a v5e-4 runs on
a laptop. Per shape the compiler's own memory analysis is kept; the plan's HBM per device is
resident params + KV cache + the largest temporaries of any one program, and a target "fits"
when every shape compiled (XLA:TPU refuses a program that needs more HBM than it allows) and
that total is within the HBM XLA allows. `out_dir` also gets the serialized executables and
a manifest; `load_compiled` installs them in a serving runner after checking that they were
built for this very program (versions, devices, model and engine settings).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import pickle
import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jaxserve.compilation.targets import Target, fp8_weights_unsupported, software_versions
from jaxserve.compilation.warmup import ShapeRecord, WarmupReport
from jaxserve.config.engine_config import EngineConfig, ResolvedConfig
from jaxserve.loading.loader import resolve_dtype
from jaxserve.lora.slots import slot_shapes, slot_specs
from jaxserve.models import gemma3_vision, qwen_vision
from jaxserve.models.config import ModelConfig
from jaxserve.models.fused import fused_layer_shapes
from jaxserve.models.quantization import (
    param_dtype,
    storage_dtype,
    with_scale_shapes,
)
from jaxserve.models.registry import family_of
from jaxserve.worker import parallel
from jaxserve.worker.compile_plan import CompilePlan, ShapeKey, variant_name
from jaxserve.worker.input_batch import InputBatch
from jaxserve.worker.kernel_choice import choose_kernels
from jaxserve.worker.runner import cpu_weight_layout
from jaxserve.worker.step_programs import StepPrograms, sds
from jaxserve.worker.vision import vision_dtype

MANIFEST = "manifest.json"
# A Pallas kernel in optimized HLO: its custom call (Mosaic / Triton) and the kernel's name.
KERNEL_MARKERS = {"tpu": ("tpu_custom_call", "ragged_paged_attention_tpu"),
                  "gpu": ("__gpu$xla.gpu.triton", "ragged_paged_attention_gpu")}
# The grouped matmul of MoE layers in optimized HLO: the Triton kernel, the CPU loop (else XLA's ragged dot).
GROUPED_MATMUL_MARKERS = {"pallas": "grouped_matmul_gpu", "cpu": "grouped_matmul_cpu"}


# ---------------------------------------------------------------------- the program
def program_fingerprint(model_config: ModelConfig, config: EngineConfig, resolved: ResolvedConfig,
                        tensor_parallel_size: int) -> dict[str, Any]:
    """Everything that decides the compiled programs; equal fingerprints, equal executables."""
    plan = resolved.plan
    return {
        "model": model_config.to_dict(),
        "dtype": resolved.dtype,
        "quantization": config.quantization,
        "quantize_lm_head": config.quantize_lm_head,
        "quantized_matmul_precision": resolved.quantized_matmul_precision,
        "kv_cache_dtype": resolved.kv_cache_dtype,
        "kv_layout": resolved.kv_layout,
        "tensor_parallel_size": tensor_parallel_size,
        "enable_expert_parallel": config.enable_expert_parallel,
        "attention_backend": config.attention_backend,
        "num_pages": resolved.num_pages,
        "num_host_pages": resolved.num_host_pages,
        "page_size": config.page_size,
        "max_pages_per_seq": resolved.scheduler.table_width,
        "max_model_len": resolved.max_model_len,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_logprobs": config.max_logprobs,
        "lora": [config.max_loras, config.max_lora_rank] if config.enable_lora else None,
        "row_tile": resolved.row_tile,
        "num_speculative_tokens": spec.num_speculative_tokens if (spec := config.speculative_config) else None,
        "shapes": [k.name for k in plan.shapes()],
    }


def abstract_programs(model_config: ModelConfig, config: EngineConfig, target: Target,
                      ) -> tuple[StepPrograms, ResolvedConfig]:
    """The engine's step programs for `target`'s devices over abstract params and cache."""
    tp = target.num_devices
    if config.tensor_parallel_size not in (1, tp):
        raise ValueError(f"tensor_parallel_size {config.tensor_parallel_size} differs from the target "
                         f"{target.name}'s {tp} devices (the model is sharded over all of them)")
    if config.quantization == "fp8":
        why = fp8_weights_unsupported(target.platform, target.chip)
        if why is not None:
            raise ValueError(f"target {target.name}: {why}")
    ep = config.enable_expert_parallel
    rank_config = parallel.tp_model_config(model_config, tp, ep)  # validates the split
    config = dataclasses.replace(config.with_platform_defaults(target.platform), tensor_parallel_size=tp)
    resolved = config.resolve(model_config, rank_config, platform=target.platform)
    devices = target.devices()
    dtype = resolve_dtype(resolved.dtype)
    if tp == 1:
        mesh, one = None, SingleDeviceSharding(devices[0])
        place, rep = (lambda spec: one), one
    else:
        mesh = parallel.build_mesh(tp, devices)
        place = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
        rep = parallel.replicated(mesh)
    family = family_of(rank_config)
    shapes = family.param_shapes(rank_config)  # KV heads already replicated up to tp
    shapes = with_scale_shapes(shapes, config.quantization, config.quantize_lm_head)
    shapes = {**shapes, "layers": fused_layer_shapes(shapes["layers"])}
    specs = parallel.param_specs(shapes, rank_config, tp, ep) if tp > 1 else jax.tree.map(
        lambda _: P(), shapes, is_leaf=_is_shape)
    tied = rank_config.tie_word_embeddings
    # One CPU device: the weights as the serving runner holds them (a bf16 or int8 tied
    # embedding [E, V], bf16 projections read by the native CPU matmul).
    native_dense, embed_columns = cpu_weight_layout(
        target.platform, tp, resolved.row_tile, rank_config, dtype,
        jnp.dtype(param_dtype("embed", config.quantization, config.quantize_lm_head, dtype, tied)),
        "embed_scale" in shapes, "lm_head" in shapes)
    if embed_columns:
        shapes = {**shapes, "embed": tuple(reversed(shapes["embed"]))}

    def leaf(path, shape, spec):
        name = path[-1].key
        return sds(shape, param_dtype(name, config.quantization, config.quantize_lm_head, dtype, tied), place(spec))

    params = jax.tree_util.tree_map_with_path(leaf, shapes, specs, is_leaf=_is_shape)
    graphdef, state = nnx.split(family.model_class(rank_config, params, shards=tp, expert_parallel=ep and tp > 1,
                                                 matmul_precision=resolved.quantized_matmul_precision,
                                                 row_tile=resolved.row_tile, kv_layout=resolved.kv_layout,
                                                 embed_columns=embed_columns,
                                                 **({"native_dense": True} if native_dense else {})))
    c = rank_config
    kv_dtype = jnp.dtype(resolved.kv_cache_dtype) if resolved.kv_cache_dtype is not None else dtype
    spec, quantized = family.kv_cache, resolved.kv_cache_dtype is not None
    shardings = ((one,) * (2 * spec.page_arrays) if mesh is None
                 else parallel.kv_cache_shardings(mesh, resolved.kv_layout, spec, quantized))
    kv_shapes = spec.page_shapes(c, resolved.num_pages, config.page_size, resolved.kv_layout, tp)
    kv_cache = tuple(sds(kv, kv_dtype, sh) for kv, sh in zip(kv_shapes, shardings[:spec.page_arrays]))
    if quantized:  # quantized pages carry f32 scales per token (and head)
        scales = spec.scales_shape(c, resolved.num_pages, config.page_size, resolved.kv_layout)
        kv_cache += tuple(sds(scales, jnp.float32, sh) for sh in shardings[spec.page_arrays:2 * spec.page_arrays])
    num_state_arrays = 0
    if spec.recurrent:  # a hybrid model's state pools (f32), after the pages
        states = spec.state_shapes(c, resolved.scheduler.num_state_slots)
        state_sh = (rep,) * len(states) if mesh is None else parallel.state_shardings(mesh, spec)
        kv_cache += tuple(sds(shape, jnp.float32, sh) for shape, sh in zip(states, state_sh))
        num_state_arrays = len(states)
    lora = None
    if config.enable_lora:  # the adapter slots, sharded like the projections they adapt
        lora_specs = slot_specs(c, parallel.MODEL_AXIS)
        lora = {k: sds(shape, dtype, place(lora_specs[k] if tp > 1 else P()))
                for k, shape in slot_shapes(c, config.max_loras, config.max_lora_rank).items()}
    vision = None
    if c.vision is not None:  # the image encoder's params, replicated like the step inputs
        vdtype = vision_dtype(target.platform, dtype)
        vision = {k: sds(shape, vdtype, rep) for k, shape in _vision_param_shapes(c.vision).items()}
    programs = StepPrograms(
        graphdef=graphdef, state=state, kv_cache=kv_cache, mesh=mesh, input_sharding=rep, index_sharding=rep,
        hidden_size=c.hidden_size, vocab_size=c.vocab_size, attention_backend=config.attention_backend,
        max_pages_per_seq=resolved.scheduler.table_width, lora=lora, num_state_arrays=num_state_arrays,
        num_kv_groups=resolved.scheduler.num_kv_groups,
        multimodal=c.vision is not None, vision=vision, vision_config=c.vision)
    return programs, resolved


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def per_device_bytes(tree) -> int:
    """Bytes one device holds of an abstract tree (each leaf's shard)."""
    return sum(math.prod(_shard_shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _shard_shape(x) -> tuple[int, ...]:
    """The shape one device holds of an abstract leaf (a numpy constant, RoPE's, has no sharding)."""
    sharding = getattr(x, "sharding", None)
    return tuple(sharding.shard_shape(x.shape)) if sharding is not None else tuple(x.shape)


# ---------------------------------------------------------------------- the report
@dataclasses.dataclass(frozen=True)
class ShapeResult:
    name: str
    kind: str
    size: int
    compiled: bool
    seconds: float
    attention: str | None  # backbone: "pallas" | "reference"
    hbm_bytes: int | None  # per device: arguments + outputs - aliased + temporaries
    temp_bytes: int | None
    cache_copies: int | None = None  # backbone, MTP passes: copies of >= one layer's KV pages (relayouts)
    weight_copies: int | None = None  # backbone, MTP passes: layer-weight slices copied out of the stacked params
    error: str | None = None
    file: str | None = None  # serialized executable, relative to the output directory
    experts: str | None = None  # MoE backbones: "pallas" (Triton) | "cpu" (CPU loop) | "xla" (ragged dot)
    delta_rule: str | None = None  # hybrid backbones: "pallas" (the Mosaic kernel) | "reference" (jnp loop)


@dataclasses.dataclass(frozen=True)
class CompileReport:
    target: Target
    device_kind: str
    capacity_bytes: int | None  # HBM XLA allows a program per device (None: host memory)
    params_bytes: int  # per device
    kv_cache_bytes: int  # per device
    kv_bytes_per_page: int  # per device, all layers, K and V
    num_pages: int
    attention: tuple[str, str]  # what the engine config selects on the target, and why
    fingerprint: dict[str, Any]
    shapes: tuple[ShapeResult, ...]
    versions: dict[str, str]
    wall_seconds: float
    experts: tuple[str, str] | None = None  # MoE: the grouped matmul the target runs, and why
    lora_bytes: int = 0  # per device, the LoRA adapter slots (counted in params_bytes too)
    state_bytes: int = 0  # per device, a hybrid model's state slots (beside the pages)
    vision_bytes: int = 0  # per device, a vision-language model's image encoder (counted in params_bytes too)
    encoder_cache_host_bytes: int = 0  # host memory of its encoder-output cache (mm_encoder_cache_gb)
    # The cache's layer groups (`SchedulerConfig.kv_groups`; empty: one plain cache): a page then
    # holds one group's layers, and a token of context costs one page slot per full group.
    kv_groups: tuple[tuple[str, int], ...] = ()

    def context_tokens(self, num_pages: int) -> int:
        """Tokens of K/V the pages hold: pages x page size for a plain cache. A cache in layer
        groups is counted filled with `max_model_len`-token sequences: each takes a page per
        page size of tokens in every full group, and in every bounded group no more than its
        window or chunk and one step's span reach (what the scheduler holds for it), so
        windows and chunks longer than `max_model_len` save nothing."""
        fp = self.fingerprint
        S = fp["page_size"]
        if not self.kv_groups:
            return num_pages * S
        M = fp["max_model_len"]
        n = -(-M // S)
        per_seq = sum(n if kind == "full" else min(n, -(-(size + fp["max_num_batched_tokens"]) // S) + 1)
                      for kind, size in self.kv_groups)
        return num_pages * M // per_seq

    @property
    def temp_bytes(self) -> int:
        return max((s.temp_bytes or 0 for s in self.shapes), default=0)

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.kv_cache_bytes + self.state_bytes + self.temp_bytes

    @property
    def all_compiled(self) -> bool:
        return all(s.compiled for s in self.shapes)

    @property
    def fits(self) -> bool:
        return self.all_compiled and (self.capacity_bytes is None or self.total_bytes <= self.capacity_bytes)

    @property
    def max_num_pages(self) -> int | None:
        """Largest cache (incl. the null page) that leaves room for the params and the
        largest temporaries, assuming temporaries do not grow with the cache (they do not:
        attention reads pages through block tables). None: unbounded (host memory)."""
        if self.capacity_bytes is None:
            return None
        free = self.capacity_bytes - self.params_bytes - self.state_bytes - self.temp_bytes
        return max(0, free // self.kv_bytes_per_page)

    def verdict(self) -> str:
        cap = self.capacity_bytes
        failed = [s for s in self.shapes if not s.compiled]
        if failed:
            return (f"does not fit: {len(failed)} of {len(self.shapes)} shapes failed to compile "
                    f"(first: {failed[0].name}: {failed[0].error})" + self._advice())
        if cap is None:
            return f"compiled for {self.target.name}: {_gb(self.total_bytes)} per device (host memory)"
        if self.total_bytes > cap:
            return (f"does not fit: params {_gb(self.params_bytes)} + KV cache {_gb(self.kv_cache_bytes)} + "
                    f"temporaries {_gb(self.temp_bytes)} = {_gb(self.total_bytes)} > {_gb(cap)} per device"
                    + self._advice())
        tokens = self.context_tokens(self.max_num_pages)
        grouped = f" in {len(self.kv_groups)} layer groups" if self.kv_groups else ""
        return (f"fits: {_gb(self.total_bytes)} of {_gb(cap)} per device; the largest cache that fits is "
                f"--num-pages {self.max_num_pages} ({tokens} tokens{grouped}, "
                f"{_gb(self.max_num_pages * self.kv_bytes_per_page)} per device)")

    def _advice(self) -> str:
        if self.capacity_bytes is None:
            return ""
        if self.params_bytes >= self.capacity_bytes:
            return (f"; the params alone take {_gb(self.params_bytes)} of {_gb(self.capacity_bytes)} per device: "
                    "use more chips (tensor parallelism) or a smaller dtype")
        return f"; at most --num-pages {self.max_num_pages} fits beside the params and temporaries"

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target.name,
            "platform": self.target.platform,
            "device_kind": self.device_kind,
            "num_devices": self.target.num_devices,
            "versions": self.versions,
            "fits": self.fits,
            "verdict": self.verdict(),
            "max_num_pages": self.max_num_pages,
            "num_pages": self.num_pages,
            "kv_groups": [list(g) for g in self.kv_groups],
            "kv_tokens": self.context_tokens(self.num_pages),
            "max_kv_tokens": None if self.max_num_pages is None else self.context_tokens(self.max_num_pages),
            "hbm_per_device": {
                "capacity_bytes": self.capacity_bytes,
                "params_bytes": self.params_bytes,
                "lora_bytes": self.lora_bytes,
                "kv_cache_bytes": self.kv_cache_bytes,
                "kv_bytes_per_page": self.kv_bytes_per_page,
                "state_bytes": self.state_bytes,
                "vision_bytes": self.vision_bytes,
                "temp_bytes": self.temp_bytes,
                "total_bytes": self.total_bytes,
            },
            "attention": {"implementation": self.attention[0], "reason": self.attention[1]},
            "experts": None if self.experts is None else {"implementation": self.experts[0],
                                                          "reason": self.experts[1]},
            "encoder_cache_host_bytes": self.encoder_cache_host_bytes,
            "program": self.fingerprint,
            "wall_seconds": round(self.wall_seconds, 2),
            "shapes": [dataclasses.asdict(s) for s in self.shapes],
        }

    def table(self) -> str:
        plugins = "".join(f", {k} {v}" for k, v in self.versions.items() if k not in ("jax", "jaxlib"))
        lines = [f"target {self.target.name} ({self.target.num_devices} x {self.device_kind}); jax "
                 f"{self.versions.get('jax')}{plugins}",
                 f"capacity per device: {_gb(self.capacity_bytes)} ({self.target.capacity_note()})",
                 f"attention: {self.attention[0]} ({self.attention[1]})",
                 *([f"experts: {self.experts[0]} ({self.experts[1]})"] if self.experts else []),
                 f"{'shape':28} {'compiled':>8} {'s':>6} {'attention':>10} {'HBM/device':>11} {'temps':>10} "
                 f"{'KV copies':>9} {'W copies':>8}"]
        for s in self.shapes:
            copies = "-" if s.cache_copies is None else str(s.cache_copies)
            weights = "-" if s.weight_copies is None else str(s.weight_copies)
            lines.append(f"{s.name:28} {'yes' if s.compiled else 'NO':>8} {s.seconds:6.1f} {s.attention or '-':>10} "
                         f"{_gb(s.hbm_bytes):>11} {_gb(s.temp_bytes):>10} {copies:>9} {weights:>8}")
        cap = _gb(self.capacity_bytes) if self.capacity_bytes is not None else "host memory"
        lines += [
            f"HBM per device: params {_gb(self.params_bytes)}"
            + (f" (LoRA slots {_gb(self.lora_bytes)})" if self.lora_bytes else "")
            + (f" (image encoder {_gb(self.vision_bytes)})" if self.vision_bytes else "")
            + f" + KV cache {_gb(self.kv_cache_bytes)} ({self.num_pages} pages x {_gb(self.kv_bytes_per_page)})"
            + (f" + state slots {_gb(self.state_bytes)}" if self.state_bytes else "")
            + f" + temporaries {_gb(self.temp_bytes)} = {_gb(self.total_bytes)} of {cap}",
            *([f"host memory: encoder-output cache up to {_gb(self.encoder_cache_host_bytes)} "
               "(mm_encoder_cache_gb)"] if self.encoder_cache_host_bytes else []),
            self.verdict(),
        ]
        copying = [s.name for s in self.shapes if s.cache_copies]
        if copying:
            lines.append(f"warning: {', '.join(copying)} copy the KV cache every step (a relayout XLA inserted; "
                         f"the cache layout is {self.fingerprint['kv_layout']})")
        weights = max((s.weight_copies or 0 for s in self.shapes), default=0)
        if weights:
            lines.append(f"note: the backbones copy up to {weights} weight slices per layer out of the stacked "
                         "params every step (XLA's layer scan), extra weight traffic a decode step pays")
            if self.experts is not None and not self.fingerprint.get("enable_expert_parallel"):
                lines.append("note: for a MoE model, --enable-expert-parallel keeps each expert's full width, "
                             "which XLA:TPU reads in place when the width split is not 128-lane aligned")
        return "\n".join(lines)


def _gb(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.3f} GiB" if n >= 2**26 else f"{n / 2**20:.2f} MiB"


# ---------------------------------------------------------------------- compiling
def compile_for_target(model_config: ModelConfig, config: EngineConfig, target: Target, *,
                       shapes: list[str] | None = None, out_dir: str | None = None, workers: int = 0,
                       progress: bool = False, on_start: Callable[[str], None] | None = None,
                       on_result: Callable[[ShapeResult], None] | None = None) -> CompileReport:
    """Compiles the planned shapes (all, or those named in `shapes`; `[]`: none, the HBM plan
    alone) for `target`. With a draft model (`speculative_config={"model": ...}`) its programs
    are compiled too and its params and KV pages are counted in the same HBM table (n-gram
    drafts need no programs beyond the plan's: they are more tokens and logits rows of the same
    buckets). `on_start(name)` / `on_result(result)` are called as each shape starts and ends
    (from the compile threads)."""
    spec = config.speculative_config
    model_config = dataclasses.replace(model_config, bounded_window_kv=config.bounded_window_kv)
    if spec is not None and spec.method == "mtp":  # the MTP layer: its weights, cache layer and programs
        model_config = model_config.with_mtp()
    if spec is None or spec.method != "draft_model":
        return _compile_plan(model_config, config, target, shapes=shapes, out_dir=out_dir, workers=workers,
                             progress=progress, on_start=on_start, on_result=on_result)
    if out_dir is not None:
        raise ValueError("jaxserve compile --out: a draft model's executables are not serialized yet (the engine "
                         "compiles or loads them from the persistent cache at warmup)")
    from jaxserve.loading import load_model_config

    report = _compile_plan(model_config, config, target, shapes=shapes, workers=workers, progress=progress)
    # The engine's draft runner: the target's buckets and page count, the greedy sampler only.
    draft_config = dataclasses.replace(
        config, model=spec.model, speculative_config=None, num_pages=report.num_pages, num_host_pages=0,
        preemption_mode="recompute", max_logprobs=0, structured_outputs=False)
    draft_plan = CompilePlan.from_config(draft_config, swap_enabled=False, platform=target.platform)
    greedy = [k.name for k in dataclasses.replace(draft_plan, prompt_logprobs_top=None).shapes()
              if k.kind != "head" or variant_name(k.flags) == "greedy"]
    draft = _compile_plan(load_model_config(spec.model), draft_config, target, shapes=greedy, workers=workers,
                          progress=progress)
    return dataclasses.replace(
        report, params_bytes=report.params_bytes + draft.params_bytes,
        kv_cache_bytes=report.kv_cache_bytes + draft.kv_cache_bytes,
        kv_bytes_per_page=report.kv_bytes_per_page + draft.kv_bytes_per_page,
        fingerprint={**report.fingerprint, "draft_model": draft.fingerprint},
        shapes=report.shapes + tuple(dataclasses.replace(s, name=f"draft {s.name}") for s in draft.shapes),
        wall_seconds=report.wall_seconds + draft.wall_seconds)


def _compile_plan(model_config: ModelConfig, config: EngineConfig, target: Target, *,
                  shapes: list[str] | None = None, out_dir: str | None = None, workers: int = 0,
                  progress: bool = False, on_start: Callable[[str], None] | None = None,
                  on_result: Callable[[ShapeResult], None] | None = None) -> CompileReport:
    t_start = time.perf_counter()
    config = config.with_platform_defaults(target.platform)
    programs, resolved = abstract_programs(model_config, config, target)
    keys = resolved.plan.shapes()
    if shapes is not None and not shapes:
        keys = []
    elif shapes:
        known = {k.name: k for k in keys}
        unknown = [s for s in shapes if s not in known]
        if unknown:
            raise ValueError(f"unknown shapes {unknown}: the plan has {', '.join(known)}")
        keys = [known[s] for s in shapes]
    tensors = InputBatch(resolved.plan.request_buckets, resolved.max_model_len, config.max_logprobs,
                         config.seed, vocab_size=programs.vocab_size).tensors
    device = target.devices()[0]
    kv = programs.kv_cache[0]
    rank_kv = kv.sharding.shard_shape(kv.shape)  # [L, P, S, Hkv, D] or [L, P, S, C] on one device
    page_dims, layer_elements = tuple(rank_kv[2:]), math.prod(rank_kv) // kv.shape[0]
    layer_weight_dims = _layer_weight_dims(programs.state, kv.shape[0])
    if out_dir is not None:
        os.makedirs(os.path.join(out_dir, "executables"), exist_ok=True)

    def one(key: ShapeKey) -> ShapeResult:
        if on_start is not None:
            on_start(key.name)
        result = compile_one(key)
        if on_result is not None:
            on_result(result)
        return result

    def compile_one(key: ShapeKey) -> ShapeResult:
        t0 = time.perf_counter()
        try:
            with jax.default_device(device):  # Pallas reads the chip generation from it
                exe = programs.lower(key, config.max_num_seqs, tensors.get(key.size))
        except Exception as e:  # noqa: BLE001 - reported per shape (an HBM overflow, say)
            return ShapeResult(key.name, key.kind, key.size, False, round(time.perf_counter() - t0, 2), None, None,
                               None, error=_first_line(e))
        seconds = round(time.perf_counter() - t0, 2)
        first = exe[0] if isinstance(exe, tuple) else exe
        attention = copies = experts = delta_rule = None
        if key.kind in ("backbone", "mtp", "mtp_chain"):  # the programs that run layers over the cache
            hlo = first.as_text()
            markers = KERNEL_MARKERS.get(target.platform)
            attention = "pallas" if markers and all(m in hlo for m in markers) else "reference"
            if model_config.is_moe:
                experts = next((k for k, m in GROUPED_MATMUL_MARKERS.items() if m in hlo), "xla")
            if model_config.linear_attention is not None:
                delta_rule = "pallas" if "chunked_delta_rule_tpu" in hlo else "reference"
            copies = cache_copies(hlo, page_dims, layer_elements)
            weights = weight_copies(hlo, layer_weight_dims)
        else:
            weights = None
        hbm, temp = _memory(exe)
        file = _serialize(out_dir, key, exe) if out_dir is not None else None
        return ShapeResult(key.name, key.kind, key.size, True, seconds, attention, hbm, temp, copies, weights,
                           file=file, experts=experts, delta_rule=delta_rule)

    workers = max(1, min(workers or os.cpu_count() or 1, len(keys)))
    results = []
    with no_cache_writes(not target.attached), concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for r in pool.map(one, keys):
            results.append(r)
            if progress:
                print(f"  {r.name}: {'compiled' if r.compiled else 'FAILED'} in {r.seconds:.1f} s", flush=True)
    rank = parallel.tp_model_config(model_config, target.num_devices, config.enable_expert_parallel)
    kernels = choose_kernels(
        target.platform, rank, num_devices=target.num_devices, expert_parallel=config.enable_expert_parallel,
        attention_backend=config.attention_backend, dtype=programs.dtype, kv_cache_dtype=resolved.kv_cache_dtype,
        device_kind=device.device_kind, weights_dtype=storage_dtype(config.quantization) if config.quantization else None,
        lora=config.enable_lora)
    n_states = programs.num_state_arrays
    pages = programs.kv_cache[:len(programs.kv_cache) - n_states]
    state_bytes = per_device_bytes(programs.kv_cache[len(pages):])  # a hybrid's state slots: not per page
    kv_bytes = per_device_bytes(pages)
    report = CompileReport(
        target=target, device_kind=device.device_kind, capacity_bytes=target.hbm_bytes(),
        params_bytes=(per_device_bytes(programs.state) + per_device_bytes(programs.lora or {})
                      + per_device_bytes(programs.vision or {})),
        lora_bytes=per_device_bytes(programs.lora or {}), kv_cache_bytes=kv_bytes,
        vision_bytes=per_device_bytes(programs.vision or {}),
        encoder_cache_host_bytes=int(config.mm_encoder_cache_gb * 2**30) if programs.vision is not None else 0,
        kv_bytes_per_page=kv_bytes // resolved.num_pages, num_pages=resolved.num_pages, attention=kernels.attention,
        fingerprint=program_fingerprint(model_config, config, resolved, target.num_devices),
        shapes=tuple(results), versions=target.versions(), wall_seconds=time.perf_counter() - t_start,
        experts=kernels.experts, state_bytes=state_bytes, kv_groups=resolved.scheduler.kv_groups)
    if out_dir is not None:
        with open(os.path.join(out_dir, MANIFEST), "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return report


@contextlib.contextmanager
def no_cache_writes(active: bool = True):
    """Executables of compile-only devices cannot be loaded back from the persistent cache
    (there is no client for their devices), so they are kept out of it: a process that has the
    cache enabled (a server, a test session) would otherwise fill it with unloadable entries."""
    if not active:
        yield
        return
    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)
    try:
        yield
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


_COPY = re.compile(r"= \w+\[([\d,]*)\]\S* copy(?:-start)?\(")


def cache_copies(hlo: str, page_dims: tuple[int, ...], min_elements: int) -> int:
    """Copy instructions in optimized HLO of a KV-cache-shaped buffer (trailing dims
    `page_dims`: (S, Hkv, D) or (S, C)) of at least `min_elements` elements (one layer's pages): a
    relayout of the cache, which a step must never pay for."""
    want = tuple(d for d in page_dims if d != 1)  # (a view with a size-1 head axis counts too)
    n = 0
    for m in _COPY.finditer(hlo):
        dims = tuple(int(d) for d in m.group(1).split(",") if d and int(d) != 1)
        n += dims[-len(want):] == want and math.prod(dims) >= min_elements
    return n


# A copy of one layer's dynamic slice: the ROOT of a slice fusion (XLA:GPU) or a relayout
# copy of a slice fusion's output (XLA:TPU, e.g. expert weights whose width is not lane-aligned).
# Also a loop fusion that materialises the slice (XLA:GPU, for a weight read by layer index
# from the stacked params; an in-place slice by address is a kCustom fusion instead).
_SLICE_COPY = re.compile(r"= \w+\[1,([\d,]+)\]\S* (?:copy\(%[\w.\-]*dynamic[-_]slice"
                         r"|fusion\([^)]*\), kind=kLoop, calls=%fused_dynamic_slice)")


def weight_copies(hlo: str, layer_weight_dims: set[tuple[int, ...]]) -> int:
    """Fusions in optimized HLO that copy one layer's slice of a stacked weight ([1, ...] of a
    per-device layer-weight shape) out of the params: each runs once per layer per step."""
    return sum(tuple(int(d) for d in m.group(1).split(",")) in layer_weight_dims for m in _SLICE_COPY.finditer(hlo))


def _layer_weight_dims(state, num_layers: int) -> set[tuple[int, ...]]:
    """Per-device shapes of one layer's slice of each stacked [L, ...] matrix parameter."""
    shapes = (_shard_shape(x) for x in jax.tree.leaves(state))
    return {s[1:] for s in shapes if len(s) >= 3 and s[0] == num_layers}


def _memory(exe) -> tuple[int | None, int | None]:
    """(HBM per device, temporaries) of one executable (a swap pair: the larger)."""
    pairs = []
    for e in exe if isinstance(exe, tuple) else (exe,):
        m = e.memory_analysis()
        if m is None:
            return None, None
        total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        pairs.append((total, m.temp_size_in_bytes))
    return max(p[0] for p in pairs), max(p[1] for p in pairs)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    m = re.search(r"(RESOURCE_EXHAUSTED: [^\n]*|Ran out of memory[^\n]*)", text)
    return (m.group(1) if m else text.splitlines()[0] if text else type(e).__name__)[:300]


def _file_name(key: ShapeKey) -> str:
    return "executables/" + re.sub(r"[^A-Za-z0-9_.+-]+", "_", key.name).strip("_") + ".xla"


def _serialize(out_dir: str, key: ShapeKey, exe) -> str:
    from jax.experimental.serialize_executable import serialize

    parts = [serialize(e) for e in (exe if isinstance(exe, tuple) else (exe,))]
    name = _file_name(key)
    with open(os.path.join(out_dir, name), "wb") as f:
        pickle.dump({"shape": key.name, "parts": parts}, f)
    return name


# ---------------------------------------------------------------------- loading
class CompiledMismatchError(ValueError):
    """The serialized executables were built for another program, target or software."""


def check_manifest(manifest: dict[str, Any], *, platform: str, num_devices: int, device_kind: str,
                   fingerprint: dict[str, Any], directory: str) -> None:
    """Raises CompiledMismatchError naming every difference between what the executables
    were compiled for and what this process would run."""
    problems = manifest_differences(manifest, platform=platform, num_devices=num_devices, device_kind=device_kind,
                                    fingerprint=fingerprint)
    if problems:
        raise CompiledMismatchError(f"the executables in {directory} do not match this server: " + "; ".join(problems)
                                    + ". Recompile with `jaxserve compile --out` and the same flags.")


def manifest_differences(manifest: dict[str, Any], *, platform: str, num_devices: int, device_kind: str,
                         fingerprint: dict[str, Any]) -> list[str]:
    """Each difference between what a manifest's executables were compiled for and what this
    process would run, in words (empty: they load here)."""
    problems = []
    theirs_v = manifest.get("versions", {})
    for k, v in software_versions(platform).items():
        if theirs_v.get(k) != v:
            problems.append(f"{k} {theirs_v.get(k)} (compiled) vs {v} (here)")
    if manifest.get("platform") != platform or manifest.get("num_devices") != num_devices:
        problems.append(f"target {manifest.get('target')} (compiled) vs {num_devices} {platform} device(s) (here)")
    elif manifest.get("device_kind") != device_kind:
        problems.append(f"device kind {manifest.get('device_kind')!r} (compiled) vs {device_kind!r} (here)")
    theirs = manifest.get("program", {})
    for k in sorted(set(theirs) | set(fingerprint)):
        if theirs.get(k) != fingerprint.get(k):
            if k in ("model", "shapes"):
                problems.append("the model differs" if k == "model" else "the planned shapes differ")
            else:
                problems.append(f"{k} {theirs.get(k)!r} (compiled) vs {fingerprint.get(k)!r} (here)")
    files = {s["name"] for s in manifest.get("shapes", []) if s.get("file")}
    missing = [name for name in fingerprint.get("shapes", []) if name not in files]
    if missing:
        problems.append(f"{len(missing)} planned shapes have no executable (first: {missing[0]})")
    return problems


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: --compiled expects the --out directory of `jaxserve compile`") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def load_compiled(directory: str, manifest: dict[str, Any], runner, keys: list[ShapeKey]) -> WarmupReport:
    """Deserializes the executable of each planned shape onto this process's devices and
    installs it in `runner` (nothing compiles). `manifest` was checked by `check_manifest`."""
    from jax.experimental.serialize_executable import deserialize_and_load

    by_name = {s["name"]: s["file"] for s in manifest["shapes"]}
    t_start = time.perf_counter()
    records = []
    for key in keys:
        t0 = time.perf_counter()
        path = os.path.join(directory, by_name[key.name])
        try:
            with open(path, "rb") as f:
                parts = pickle.load(f)["parts"]
            loaded = tuple(deserialize_and_load(*p) for p in parts)
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise CompiledMismatchError(f"cannot load the executable of {key.name} from {path}: {e}") from e
        runner.install(key, loaded if key.kind == "swap" else loaded[0])
        records.append(ShapeRecord(key.name, key.kind, key.size, variant_name(key.flags) if key.flags else None,
                                   round(time.perf_counter() - t0, 3), "loaded"))
    return WarmupReport(tuple(records), time.perf_counter() - t_start)


def _vision_param_shapes(vc: Any) -> dict[str, tuple[int, ...]]:
    """The image encoder's params, as its loader holds them, by encoder kind."""
    module = gemma3_vision if vc.kind == "gemma3" else qwen_vision
    return module.vision_param_shapes(vc)
