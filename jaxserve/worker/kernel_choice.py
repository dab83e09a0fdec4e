"""Which kernels a compiled program runs: one place for the engine and `jaxserve compile`.

The ops in `pallas_kernels` dispatch `backend="auto"` while a program is traced, by the
platform it is lowered for. `choose_kernels` asks the same predicates for one platform, model
shard and cache, so that the engine's log and the compile report say what the programs run
(attention, the MoE grouped matmuls, the reader of quantized weights), and asking builds
nothing. The native CPU kernels are built by `prepare_native_kernels`, an explicit step of
engine start-up: programs loaded from a compiled directory call them by name without ever
tracing the op.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pallas_kernels.grouped_matmul.ops import grouped_matmul_implementation
from pallas_kernels.kv_layout import lanes_width
from pallas_kernels.quantized_matmul.ops import quantized_matmul_implementation
from pallas_kernels.ragged_paged_attention.gpu import latent_block_q
from pallas_kernels.ragged_paged_attention.ops import attention_implementation


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    attention: tuple[str, str]  # ("pallas" | "native" | "reference", why)
    experts: tuple[str, str] | None = None  # MoE grouped matmuls ("pallas" | "cpu" | "xla", why); None: dense
    quantized_matmul: str | None = None  # "native: ..." | "reference: ..."; None: float weights
    lora: tuple[str, str] | None = None  # the LoRA delta's products (what, why); None: LoRA off


def prepare_native_kernels(platform: str, quantized_weights: bool = False,
                           bf16_weights: bool = False) -> dict[str, tuple[bool, str]]:
    """Builds and registers the native CPU kernels the engine uses (attention and the KV-cache
    row write; the CPU matmul with `quantized_weights` or `bf16_weights`) where this process
    compiles for its own CPU; {kernel: (available, why)}. Cached on disk by source and flags,
    so a warm start only loads them; a serialized executable naming one loads only after."""
    if platform != "cpu" or jax.default_backend() != "cpu":
        return {}
    from pallas_kernels.kv_cache_update import cpu as kv_write_cpu
    from pallas_kernels.quantized_matmul import cpu as quantized_cpu
    from pallas_kernels.ragged_paged_attention import cpu as attention_cpu

    out = {"attention": attention_cpu.available(), "kv_write": kv_write_cpu.available()}
    if quantized_weights or bf16_weights:
        ok, why = quantized_cpu.available()
        out["matmul"] = (ok, f"{why} ({quantized_cpu.isa()})" if ok else why)
    return out


def choose_kernels(platform: str, rank: Any, *, num_devices: int = 1, expert_parallel: bool = False,
                   attention_backend: str = "auto", dtype: Any, kv_cache_dtype: Any = None,
                   device_kind: str | None = None, weights_dtype: Any = None, lora: bool = False) -> KernelChoice:
    """The kernels of a program for `platform`. `rank` is the model config each rank computes
    with (`parallel.tp_model_config`: KV heads already replicated up to `num_devices`), so one
    device holds `1 / num_devices` of its heads (and of its experts' width unless
    `expert_parallel`). `dtype` is the model's, `kv_cache_dtype` the pages' when quantized,
    `device_kind` (e.g. "TPU v5 lite") where a chip generation matters, `weights_dtype` the
    storage dtype of quantized weights (None: float weights); `lora` whether the step applies
    LoRA adapters."""
    if attention_backend == "reference":
        attention = ("reference", "attention_backend='reference'")
    elif rank.mla is not None:  # absorbed MLA: multi-query attention over one latent row per token
        width = rank.mla.latent_width
        if platform == "tpu":  # the lanes layout: rows of C lanes, the query zero-padded to them
            lanes = lanes_width(1, width)
            attention = ("pallas", f"latent attention over {width}-wide rows: the tpu kernel, one KV head of {lanes} "
                                   "lanes (mla_attention.tpu_blocks)")
        elif platform in ("gpu", "cuda") and kv_cache_dtype is None and \
                latent_block_q(width, rank.num_heads // num_devices) is not None:
            attention = ("pallas", f"latent attention over {width}-wide rows: the gpu kernel, one KV head "
                                   f"(query blocks of {latent_block_q(width, rank.num_heads // num_devices)} tokens)")
        else:
            impl, why = attention_implementation(platform, 1, width, dtype, rank.num_heads // num_devices,
                                                 kv_cache_dtype=kv_cache_dtype, device_kind=device_kind)
            attention = (impl, f"latent attention over {width}-wide rows: {why}")
    else:
        attention = attention_implementation(platform, rank.num_kv_heads // num_devices, rank.head_dim, dtype,
                                             rank.num_heads // num_devices, kv_cache_dtype=kv_cache_dtype,
                                             device_kind=device_kind)
    experts = None
    if rank.is_moe:
        width = rank.moe_intermediate_size // (1 if expert_parallel else num_devices)
        gate_up = grouped_matmul_implementation(platform, rank.hidden_size, 2 * width, dtype, weights_dtype)
        down = grouped_matmul_implementation(platform, width, rank.hidden_size, dtype, weights_dtype)
        experts = gate_up if gate_up[0] != "pallas" else down
    quantized = quantized_matmul_implementation(platform, weights_dtype) if weights_dtype is not None else None
    return KernelChoice(attention, experts, quantized, _LORA if lora else None)


# One formulation everywhere (jaxserve/models/lora.py): the compiled step on TPU v5e and H200
# (compile-only) adds no per-token copy of adapter weights (tests/test_lora.py).
_LORA = ("xla", "every slot's low-rank product as two dense dots, masked per token; XLA's dots on every platform")
