"""Shared fixtures: the embedded SmolLM2 model, loaded once per session.

Also the test environment: JAX runs on the host CPU (JAX_PLATFORMS=cpu, also for the
servers tests start), and the libtpu that `make install-test` puts in .venv/accel/tpu is
importable, so compile-only TPU targets work without libtpu in the run environment; likewise
the CUDA plugin and ptxas in .venv/accel/cuda for compile-only GPU targets (this process
only: JAX_PLATFORMS=cpu keeps the plugin from looking for a driver).
"""

from __future__ import annotations

import os
import pathlib
import sys

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compile-only TPU targets need no chip: libtpu may load in this process and in the children
# tests start (`jaxserve compile` compiles in child processes) while one holds its single-user
# lockfile, instead of failing with ABORTED. Set here, not by whichever module imports first,
# so that a test file run alone behaves as in the whole suite.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
_ACCEL_TPU = pathlib.Path(__file__).resolve().parents[1] / ".venv" / "accel" / "tpu"
if _ACCEL_TPU.is_dir() and str(_ACCEL_TPU) not in sys.path:
    sys.path.append(str(_ACCEL_TPU))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(_ACCEL_TPU)) if p)
_ACCEL_CUDA = _ACCEL_TPU.parent / "cuda"
if _ACCEL_CUDA.is_dir() and str(_ACCEL_CUDA) not in sys.path:
    sys.path.append(str(_ACCEL_CUDA))


MATRIX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16",
                "avx_vnni", "avx2")


def pytest_report_header(config) -> list[str]:
    """Which machine a log came from: the CPU, its matrix-unit flags and the paths the native
    CPU kernels were built for (rounding differs between them, so a red near-tie names its CPU).
    Also the memory-map limit: the whole suite in one process loads ~1,000 XLA:CPU executables
    of ~120 maps each, and under Linux's default (65530) XLA crashes late in the run."""
    lines = [_cpu_line()]
    try:
        from pallas_kernels.quantized_matmul import cpu as qmm_cpu
        from pallas_kernels.ragged_paged_attention import cpu as attn_cpu

        lines.append(f"native CPU kernels: quantized matmul {qmm_cpu.isa()}, attention {attn_cpu.isa()}")
    except Exception as e:  # noqa: BLE001 - a header never stops the run
        lines.append(f"native CPU kernels: unknown ({e})")
    try:
        limit = int(pathlib.Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return lines
    if limit < 262144:
        lines.append(f"WARNING: vm.max_map_count is {limit}; a full run may crash XLA (raise it to 262144)")
    else:
        lines.append(f"vm.max_map_count: {limit}")
    return lines


def _cpu_line() -> str:
    model, flags = "unknown CPU", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    have = [f for f in MATRIX_FLAGS if f in flags]
    return f"CPU: {model} ({os.cpu_count()} cores); matrix units: {' '.join(have) or 'none of ' + ' '.join(MATRIX_FLAGS)}"


@pytest.fixture(scope="module")
def no_persistent_cache_writes():
    """For modules that compile for compile-only TPU/GPU devices: their executables cannot be
    loaded back from the persistent cache (no client for those devices), so none is written."""
    from jaxserve.compilation.aot import no_cache_writes

    with no_cache_writes():
        yield


@pytest.fixture(scope="session")
def smollm_path() -> str:
    from jaxserve.loading.loader import embedded_model_path

    return embedded_model_path()


@pytest.fixture(scope="session")
def smollm(smollm_path):
    from jaxserve.loading import load_model

    return load_model(smollm_path, dtype="float32")


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    """transformers' own GGUF load of the same file (dequantized by transformers, torch f32)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path), dtype="float32"
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm_tokenizer(smollm_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(smollm_path), gguf_file=os.path.basename(smollm_path)
    )


@pytest.fixture(scope="session")
def hf_greedy_refs(smollm, hf_smollm):
    """transformers' greedy 32-token continuations (tokens, logprobs) of hf_reference.PROMPTS,
    computed once for every end-to-end test."""
    from hf_reference import HF_MAX_NEW, PROMPTS, hf_greedy

    return [hf_greedy(hf_smollm, smollm.tokenizer(p)["input_ids"], HF_MAX_NEW) for p in PROMPTS]


@pytest.fixture(scope="session")
def _warm_engines():
    """Warmed-up engines by configuration: modules with equal `SMALL` dicts share one."""
    engines: dict = {}
    yield engines
    for e in engines.values():
        e.close()


@pytest.fixture(scope="module")
def warm_engine(request, smollm, _warm_engines):
    """A warmed-up engine configured by the test module's `SMALL` dict."""
    from jaxserve.config.engine_config import EngineConfig
    from jaxserve.engine.llm_engine import Engine

    key = tuple(sorted(request.module.SMALL.items()))
    if key not in _warm_engines:
        e = Engine(EngineConfig(**request.module.SMALL), loaded=smollm)
        e.warmup()
        _warm_engines[key] = e
    return _warm_engines[key]


@pytest.fixture
def engine(warm_engine):
    """The module's engine, handed to each test idle, with no KV block held and an empty
    prefix cache, whatever the previous test left."""
    yield warm_engine
    hand_back_idle(warm_engine)


def hand_back_idle(engine) -> None:
    """After a test on a module-shared engine: nothing in flight, no KV block held (a leak
    fails the test), and an empty prefix cache, so the next test starts from the same state."""
    engine.abort_all()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.stats().num_used_blocks == 0, "the test leaked KV blocks"
    engine.reset_prefix_cache()


# Random PEFT adapters of the embedded model (made with peft on a copy of transformers' model)
# and peft's greedy continuations: the embedded server loads "sql-lora" at start.
LORA_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
LORA_MAX_NEW = 8


@pytest.fixture(scope="session")
def smollm_adapters(hf_smollm, smollm, tmp_path_factory):
    """{name: (path, [(tokens, logprobs [N, V]) per LORA_PROMPTS])}, plus "base"."""
    import copy

    peft = pytest.importorskip("peft")
    import torch
    from hf_reference import hf_greedy

    out = {}
    ids = [smollm.tokenizer(p)["input_ids"] for p in LORA_PROMPTS]
    for seed, (name, r, targets) in enumerate((("sql-lora", 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
                                               ("chat-lora", 4, ["gate_proj", "up_proj", "down_proj"]))):
        torch.manual_seed(seed)
        pm = peft.get_peft_model(copy.deepcopy(hf_smollm), peft.LoraConfig(
            r=r, lora_alpha=r, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(3.0)
        path = tmp_path_factory.mktemp(name)
        pm.save_pretrained(path)
        pm.eval()
        out[name] = (str(path), [hf_greedy(pm, x, LORA_MAX_NEW) for x in ids])
        if "base" not in out:
            with pm.disable_adapter():
                out["base"] = (None, [hf_greedy(pm, x, LORA_MAX_NEW) for x in ids])
    return out


# The embedded model behind a real server (gRPC, HTTP and metrics ports), shared by the gRPC
# and the OpenAI HTTP tests so that the model is loaded and warmed up once.
EMBEDDED_SERVER_KEY = "test-key-123"


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory, smollm_adapters):
    """It records its request trace (`--record-request-trace`) to `s.request_trace`, and
    serves LoRA adapters (two slots; "sql-lora" loaded at start)."""
    from server_harness import ServerThread

    from jaxserve.config.engine_config import EngineConfig
    from server.app import ServerOptions

    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_pages=128, max_model_len=512,
                       enable_lora=True, max_loras=2, max_lora_rank=8)
    trace = str(tmp_path_factory.mktemp("trace") / "requests.jsonl")
    s = ServerThread(cfg, ServerOptions(host="127.0.0.1", port=0, metrics_port=0, http_port=0,
                                        api_key=EMBEDDED_SERVER_KEY, max_queued_requests=24, log_interval=0,
                                        request_trace=trace,
                                        lora_modules=(("sql-lora", smollm_adapters["sql-lora"][0]),)))
    s.request_trace = trace
    yield s
    s.close()


@pytest.fixture(scope="session")
def harmony_vocab(tmp_path_factory):
    """A folder holding openai-harmony's o200k_base vocabulary (written from the quicktok-v1
    wheel: no network), named by TIKTOKEN_ENCODINGS_BASE for the rest of the session."""
    from harmony_vocab import write_o200k_base

    try:
        import quicktok  # noqa: F401
    except ImportError:
        pytest.skip("quicktok-v1 is not installed (`pip install quicktok-v1`, in the test extra): "
                    "without it openai-harmony's vocabulary cannot be written offline")
    folder = tmp_path_factory.mktemp("harmony_vocab")
    write_o200k_base(folder)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(folder))
        yield folder
