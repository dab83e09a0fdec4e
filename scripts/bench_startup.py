"""Start-up: weight loading against the storage, and time from `jaxserve serve` to SERVING.

Loading (`--part load`): writes a random ~0.92 B-parameter bf16 Llama checkpoint in two
safetensors shards with a tokenizer once (`--checkpoint-dir`), then times, each in a fresh process, numpy
reading the same files into fresh memory, `load_model(dir, dtype="bfloat16")` and
`LLM(model=dir, dtype="bfloat16", warmup=False)`; prints GB/s against numpy's and peak RSS
over the process's RSS before loading, against the checkpoint's size, and where the time went
(weights; tokenizer; params to device; KV cache; the runner's whole construction). Then what process 0 of
a 2- and a 4-process group (one device each) reads of the same checkpoint: its slices.

Starts (`--part start`): fresh `jaxserve serve` processes timed end to end (interpreter and
JAX start, model load, warmup or executable load, ports bound) until the server logs that it
serves, then one completion (1 token) over HTTP: the time to first token after SERVING.
"cold" has an empty compilation cache; "warm" the same cache again (the saved executables
load, nothing is traced); "warm, persistent cache only" the same with
`--no-reuse-executables` (every shape traced and lowered, then loaded from JAX's cache);
"--compiled" the executables of `jaxserve compile --target cpu --out DIR`; "cold,
--serve-while-compiling" an empty cache again, SERVING once the first tier of shapes is
compiled (the first request then runs within its limits).

    .venv/bin/python scripts/bench_startup.py [--part load|start|all] [--repeats 2] [engine flags]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np

CLI = [sys.executable, "-m", "jaxserve.cli"]


# ---------------------------------------------------------------------- loading
CKPT_CONFIG = {  # a Llama shape of ~0.92 B parameters (1.85 GB in bf16), with SmolLM2's vocabulary
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
    "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 49152,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def _tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
    return out


CKPT_MARKER = "done-v2"  # v2: SmolLM2's vocabulary and its tokenizer files


def write_checkpoint(path: str, shards: int = 2) -> int:
    """A random bf16 checkpoint in `shards` safetensors files, with the embedded model's
    tokenizer files (tokenizer.json, tokenizer_config.json with its chat template), written
    once; its data bytes."""
    shapes = _tensor_shapes(CKPT_CONFIG)
    total = sum(math.prod(s) * 2 for s in shapes.values())
    if os.path.isfile(os.path.join(path, CKPT_MARKER)):
        return total
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    names = list(shapes)
    per_shard = math.ceil(len(names) / shards)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k * per_shard:(k + 1) * per_shard]
        header, offset = {}, 0
        for n in part:
            nbytes = math.prod(shapes[n]) * 2
            header[n] = {"dtype": "BF16", "shape": list(shapes[n]), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[n] = file
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(os.path.join(path, file), "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for n in part:  # small finite values (bf16 bit patterns around 2^-6)
                f.write(rng.integers(0x3c00, 0x3d00, math.prod(shapes[n]), dtype=np.uint16).tobytes())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CKPT_CONFIG, f)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxserve.loading import gguf_loader, loader, tokenizer

    meta = gguf_loader.GGUFFile(loader.embedded_model_path()).metadata
    tokenizer.tokenizer_from_gguf_metadata(meta).save_pretrained(path)
    open(os.path.join(path, CKPT_MARKER), "w").close()
    return total


_LOAD_CHILD = """
import json, os, resource, sys, time
import numpy as np
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
path, what = sys.argv[1], sys.argv[2]
files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
extra = {}
if what == "numpy":
    base = rss(); t0 = time.perf_counter()
    arrays = [np.fromfile(f, np.uint8) for f in files]
elif what.startswith("part"):  # process 0 of a group of N, one device each (tp=N)
    import ml_dtypes
    from jaxserve.loading.hf_loader import _SafetensorsIndex, hf_config, load_hf_params
    from jaxserve.worker.parallel import process_load_part
    cfg = hf_config(path)
    base = rss(); t0 = time.perf_counter()
    index = _SafetensorsIndex(path)
    params = load_hf_params(path, cfg, ml_dtypes.bfloat16, index=index,
                            part=process_load_part(cfg, int(what[4:]), [0]))
    extra = {"read": index.bytes_read}
else:
    if what == "load":
        from jaxserve.loading import load_model
    else:
        import jax
        from jaxserve.llm import LLM
    base = rss(); t0 = time.perf_counter()
    if what == "load":
        m = load_model(path, dtype="bfloat16")
        extra = {"split": m.seconds}
    else:
        llm = LLM(model=path, dtype="bfloat16", warmup=False, num_pages=16, max_model_len=512,
                  compilation_cache_dir=None)
        extra = {"split": llm.engine.startup_seconds}
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "peak_over_start": peak - base, **extra}))
"""


def measure_loading(path: str, repeats: int) -> None:
    nbytes = write_checkpoint(path)
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(f) for f in files)
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # into the page cache
    t0 = time.perf_counter()
    subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)
    cat_gbs = size / (time.perf_counter() - t0) / 1e9

    def run(what: str) -> dict[str, float]:
        res = subprocess.run([sys.executable, "-c", _LOAD_CHILD, path, what], capture_output=True, text=True,
                             timeout=1800)
        if res.returncode != 0:
            raise RuntimeError(f"{what} failed:\n{res.stderr[-3000:]}")
        return json.loads(res.stdout.strip().splitlines()[-1])

    rows = {what: [run(what) for _ in range(repeats)] for what in ("numpy", "load", "llm")}
    print(f"checkpoint: {nbytes / 1e9:.2f} GB of bf16 tensors in {len(files)} safetensors shards ({path})")
    print(f"cat from the page cache: {cat_gbs:.2f} GB/s")
    numpy_gbs = None
    for what, label in (("numpy", "numpy.fromfile (fresh memory)"), ("load", "load_model(dtype=bfloat16)"),
                        ("llm", "LLM(dtype=bfloat16, warmup=False)")):
        sec = statistics.median(r["seconds"] for r in rows[what])
        peak = statistics.median(r["peak_over_start"] for r in rows[what])
        gbs = size / sec / 1e9
        numpy_gbs = numpy_gbs or gbs
        print(f"{label:36} {sec:6.2f} s  {gbs:5.2f} GB/s ({gbs / numpy_gbs:4.0%} of numpy's)  peak RSS over start "
              f"{peak / 1e9:5.2f} GB ({peak / size:4.2f}x the checkpoint)  [median of {repeats}]")
        if "split" in rows[what][0]:  # medians of each part
            parts = {k: statistics.median(r["split"][k] for r in rows[what]) for k in rows[what][0]["split"]}
            print(" " * 38 + "  ".join(f"{k} {v:.2f} s" for k, v in parts.items()))
    for n in (2, 4):  # what one process of a multi-host group reads: its devices' slices
        runs = [run(f"part{n}") for _ in range(repeats)]
        sec = statistics.median(r["seconds"] for r in runs)
        read = runs[0]["read"]
        print(f"{f'one process of {n} (tp={n}), its slices':36} {sec:6.2f} s  read {read / 1e9:5.2f} GB "
              f"({read / nbytes:4.0%} of the checkpoint; {read / sec / 1e9:5.2f} GB/s)  [median of {repeats}]")


# ---------------------------------------------------------------------- starts
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_token_seconds(port: int) -> float:
    """One completion of one token over the OpenAI API, timed from the request."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": 1}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        json.load(r)
    return time.perf_counter() - t0


def start_once(flags: list[str], timeout: float = 900.0) -> dict[str, float]:
    """Seconds to SERVING, the model-load and warmup phases the server logged, and the first
    request's time to its token."""
    port = _free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--metrics-port", "0", "--http-port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    tail: list[str] = []
    out: dict[str, float] = {}
    try:
        for line in proc.stderr:
            tail = [*tail[-20:], line]
            if m := re.search(r"model loaded in ([\d.]+) s", line):
                out["model_load_s"] = float(m.group(1))
            if m := re.search(r"warmup done in ([\d.]+) s", line):
                out["warmup_s"] = float(m.group(1))
            if " serving " in line:
                out["to_serving_s"] = time.perf_counter() - t0
                out["first_token_s"] = _first_token_seconds(port)
                break
            if time.perf_counter() - t0 > timeout:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    if "to_serving_s" not in out:
        raise RuntimeError(f"the server did not reach SERVING (exit {proc.returncode}):\n{''.join(tail)}")
    if proc.returncode != 0:
        raise RuntimeError(f"the server exited with status {proc.returncode} when stopped")
    return out


def measure_starts(engine_flags: list[str], repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "xla")
        compiled = os.path.join(tmp, "compiled")
        with_cache = ["--compilation-cache-dir", cache, *engine_flags]
        early = start_once(["--compilation-cache-dir", os.path.join(tmp, "xla-early"), "--serve-while-compiling",
                            *engine_flags])
        cold = start_once(with_cache)
        warm = [start_once(with_cache) for _ in range(repeats)]
        persistent = [start_once([*with_cache, "--no-reuse-executables"]) for _ in range(repeats)]
        t0 = time.perf_counter()
        subprocess.run([*CLI, "compile", "--target", "cpu", "--out", compiled, "--quiet", *engine_flags],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        compile_s = time.perf_counter() - t0
        loaded = [start_once(["--compilation-cache-dir", "none", "--compiled", compiled, *engine_flags])
                  for _ in range(repeats)]

    def show(name: str, runs: list[dict[str, float]]) -> float:
        def med(k: str) -> float:
            return statistics.median(r.get(k, 0.0) for r in runs)

        print(f"{name:30} to SERVING {med('to_serving_s'):6.1f} s (model load {med('model_load_s'):5.1f} s, "
              f"warmup/load executables {med('warmup_s'):5.1f} s); first token after SERVING "
              f"{med('first_token_s'):5.2f} s  [{len(runs)} start(s), median]")
        return med("to_serving_s")

    print(f"engine flags: {' '.join(engine_flags) or '(defaults)'}")
    c = show("cold (empty cache)", [cold])
    e = show("cold, --serve-while-compiling", [early])
    w = show("warm (saved executables)", warm)
    p = show("warm, persistent cache only", persistent)
    k = show("--compiled DIR", loaded)
    print(f"`jaxserve compile --target cpu --out`: {compile_s:.1f} s (once, ahead of the starts)")
    print(f"warm / cold: {w / c:.2f}; persistent cache only / cold: {p / c:.2f}; compiled / cold: {k / c:.2f}; "
          f"serving while compiling / cold: {e / c:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("load", "start", "all"), default="all")
    ap.add_argument("--repeats", type=int, default=2, help="runs per measurement (median reported)")
    ap.add_argument("--checkpoint-dir", default=os.path.join(tempfile.gettempdir(), "jaxserve-bench-checkpoint"),
                    help="where the random checkpoint is written (once) for --part load")
    args, engine_flags = ap.parse_known_args()
    if args.part in ("load", "all"):
        measure_loading(args.checkpoint_dir, args.repeats)
    if args.part in ("start", "all"):
        measure_starts(engine_flags, args.repeats)


if __name__ == "__main__":
    main()
