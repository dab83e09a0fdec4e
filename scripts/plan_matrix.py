"""The compile-only deployment matrix: `jaxserve compile` for the models and targets users deploy.

Each case runs `jaxserve compile --target T --model-config C` (compile-only TPU devices from
libtpu, compile-only GPUs from the CUDA plugin; nothing runs on an accelerator) in its own
process, which compiles every planned shape in an isolated child, and prints one row per
case: whether the plan fits, HBM per device used of the capacity, the KV cache the plan
holds (and the most that would fit), the programs that failed, and the wall seconds.

By default each case compiles its representative programs: every backbone (where the HBM
peak is), the largest logits, prompt-logprobs and sampler programs; `--all-shapes` compiles
the whole plan (hours on a 2-core host for the whole matrix).

    .venv/bin/python scripts/plan_matrix.py [--cases 8b-v5e-1,qwen3-30b-a3b-v6e-4] [--all-shapes]
                                            [engine flags, e.g. --max-model-len 8192]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
# name: (model config, target, extra flags)
CASES = {
    "8b-v5e-1": ("llama3_8b_config.json", "tpu:v5e-1", []),
    "8b-v5e-1-int8": ("llama3_8b_config.json", "tpu:v5e-1", ["--quantization", "int8"]),
    "8b-v6e-1": ("llama3_8b_config.json", "tpu:v6e-1", []),
    "8b-h100": ("llama3_8b_config.json", "gpu:h100", []),
    "70b-v5e-8": ("llama3_70b_config.json", "tpu:v5e-8", []),
    "70b-v6e-8": ("llama3_70b_config.json", "tpu:v6e-8", []),
    "70b-h100x8": ("llama3_70b_config.json", "gpu:h100x8", []),
    "qwen3-30b-a3b-v6e-4": ("qwen3_30b_a3b_config.json", "tpu:v6e-4", []),
    "gemma3-27b-v6e-4": ("gemma3_27b_config.json", "tpu:v6e-4", []),
    # DeepSeek-V3 (671 B): int8 weights on the smallest TPU slices that hold them, fp8 on 8 H200s
    "deepseek-v3-v5p-8-int8": ("deepseek_v3_config.json", "tpu:v5p-8",
                               ["--quantization", "int8", "--enable-expert-parallel"]),
    "deepseek-v3-v6e-32-int8": ("deepseek_v3_config.json", "tpu:v6e-32",
                                ["--quantization", "int8", "--enable-expert-parallel"]),
    "deepseek-v3-h200x8-fp8": ("deepseek_v3_config.json", "gpu:h200x8",
                               ["--quantization", "fp8", "--enable-expert-parallel"]),
    # the same with its MTP layer drafting (one more latent layer of pages, its passes compiled)
    "deepseek-v3-v5p-8-int8-mtp": ("deepseek_v3_config.json", "tpu:v5p-8",
                                   ["--quantization", "int8", "--enable-expert-parallel", "--speculative-config",
                                    '{"method": "mtp", "num_speculative_tokens": 1}']),
    # gpt-oss (117 B / 21 B params; its MXFP4 experts are decoded at load, so 1 byte a weight
    # at best): 120b in int8 on v6e-4 and v5e-8 and in fp8 on 2 H100s, 20b in int8 on one v6e
    # and in bf16 on one H100
    # (experts split whole: split by width, 2880 / 4 is not lane-aligned and XLA:TPU copies each
    # layer's experts, as test_moe_width_split_that_is_not_lane_aligned_is_reported_on_tpu shows)
    "gpt-oss-120b-v6e-4-int8": ("gpt_oss_120b_config.json", "tpu:v6e-4",
                                ["--quantization", "int8", "--enable-expert-parallel"]),
    "gpt-oss-120b-v5e-8-int8": ("gpt_oss_120b_config.json", "tpu:v5e-8",
                                ["--quantization", "int8", "--enable-expert-parallel"]),
    "gpt-oss-120b-h100x2-fp8": ("gpt_oss_120b_config.json", "gpu:h100x2", ["--quantization", "fp8"]),
    "gpt-oss-20b-v6e-1-int8": ("gpt_oss_20b_config.json", "tpu:v6e-1", ["--quantization", "int8"]),
    "gpt-oss-20b-h100": ("gpt_oss_20b_config.json", "gpu:h100", []),
    # Llama 4 Scout (108 B text params, 16 experts) in bf16 on v6e-8 and fp8 on 2 H100s;
    # Maverick (401 B, 128 experts) in int8 on v5p-8 (its 40 heads split 8 ways, not 16)
    "llama4-scout-v6e-8": ("llama4_scout_config.json", "tpu:v6e-8", []),
    "llama4-scout-h100x2-fp8": ("llama4_scout_config.json", "gpu:h100x2", ["--quantization", "fp8"]),
    "llama4-maverick-v5p-8-int8": ("llama4_maverick_config.json", "tpu:v5p-8",
                                    ["--quantization", "int8", "--enable-expert-parallel"]),
    # Gemma 4 (the configs of transformers' Gemma 4 conversion script): 31B dense (30.7 B params)
    # and 26B-A4B (25.2 B, 128 experts, 8 routed) on one v6e in int8, on v5e-4, and on one H100
    "gemma4-31b-v6e-1-int8": ("gemma4_31b_config.json", "tpu:v6e-1", ["--quantization", "int8"]),
    "gemma4-31b-v5e-4-int8": ("gemma4_31b_config.json", "tpu:v5e-4", ["--quantization", "int8"]),
    "gemma4-31b-h100-fp8": ("gemma4_31b_config.json", "gpu:h100", ["--quantization", "fp8"]),
    "gemma4-26b-a4b-v6e-1-int8": ("gemma4_26b_a4b_config.json", "tpu:v6e-1", ["--quantization", "int8"]),
    "gemma4-26b-a4b-v5e-4": ("gemma4_26b_a4b_config.json", "tpu:v5e-4", ["--enable-expert-parallel"]),
    "gemma4-26b-a4b-h100": ("gemma4_26b_a4b_config.json", "gpu:h100", []),
}


def compile_env() -> dict[str, str]:
    """JAX on the host CPU with libtpu and the CUDA plugin importable (`make install-test`)."""
    accel = [str(ROOT / ".venv" / "accel" / d) for d in ("tpu", "cuda")]
    path = os.pathsep.join([*accel, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def representative_shapes(name: str, flags: list[str]) -> list[str]:
    """Every backbone, and the largest logits, prompt-logprobs and sampler (the most
    options: top-k/top-p, penalties, logprobs) programs of the case's plan."""
    import argparse

    from jaxserve.compilation.targets import Target
    from jaxserve.config.engine_args import add_engine_args, engine_config_from_args
    from jaxserve.loading import load_model_config
    from jaxserve.worker.parallel import tp_model_config

    config_file, target_name, extra = CASES[name]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = engine_config_from_args(parser.parse_args([*extra, *flags]))
    target = Target.parse(target_name)
    mc = load_model_config(str(DATA / config_file))
    cfg = cfg.with_platform_defaults(target.platform)
    rank = tp_model_config(mc, target.num_devices, cfg.enable_expert_parallel)
    keys = cfg.resolve(mc, rank, platform=target.platform).plan.shapes()
    out = [k.name for k in keys if k.kind == "backbone"]
    for kind in ("logits", "prompt_logprobs", "mtp", "mtp_chain", "mtp_draft"):
        out += [max((k for k in keys if k.kind == kind), key=lambda k: k.size).name] if any(
            k.kind == kind for k in keys) else []
    heads = [k for k in keys if k.kind == "head"]
    out.append(max(heads, key=lambda k: (k.size, not k.flags.all_greedy, k.flags.use_penalties,
                                          k.flags.num_logprobs or 0, k.flags.use_bitmask)).name)
    return out


def run_case(name: str, flags: list[str], shapes: str | None) -> dict:
    config, target, extra = CASES[name]
    with tempfile.TemporaryDirectory() as tmp:
        manifest = os.path.join(tmp, "manifest.json")
        cmd = [sys.executable, "-m", "jaxserve.cli", "compile", "--target", target, "--model-config",
               str(DATA / config), "--manifest", manifest, "--quiet", *extra, *flags]
        if shapes:
            cmd += ["--shapes", shapes]
        t0 = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=compile_env(), timeout=3600)
        seconds = time.perf_counter() - t0
        if not os.path.isfile(manifest):
            return {"name": name, "error": (res.stderr.strip().splitlines() or ["no output"])[-1], "seconds": seconds}
        with open(manifest) as f:
            m = json.load(f)
    hbm = m["hbm_per_device"]
    failed = [s["name"] for s in m["shapes"] if not s["compiled"]]
    return {"name": name, "fits": m["fits"], "total": hbm["total_bytes"], "capacity": hbm["capacity_bytes"],
            # tokens of context every layer holds (a layer-grouped cache: divided among its full groups)
            "kv_tokens": m["kv_tokens"],
            "max_kv_tokens": m["max_kv_tokens"],
            "shapes": len(m["shapes"]), "failed": failed, "seconds": seconds}


def main() -> None:
    os.environ.update({k: v for k, v in compile_env().items() if k in ("JAX_PLATFORMS",)})
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from: {', '.join(CASES)}")
    ap.add_argument("--all-shapes", action="store_true", help="compile each case's whole plan")
    args, flags = ap.parse_known_args()
    names = args.cases.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}")
    print(f"engine flags: {' '.join(flags) or '(defaults)'}; "
          f"programs: {'the whole plan' if args.all_shapes else 'every backbone and the largest of the others'}")
    print("| case | fits | HBM per device | KV tokens (most that fit) | programs failed | compile s |")
    print("|---|---|---|---|---|---|")
    for name in names:
        r = run_case(name, flags, None if args.all_shapes else ";".join(representative_shapes(name, flags)))
        if "error" in r:
            print(f"| {name} | error: {r['error']} | | | | {r['seconds']:.0f} |", flush=True)
            continue
        gib = 2**30
        used = f"{r['total'] / gib:.2f} / {r['capacity'] / gib:.2f} GiB" if r["capacity"] else f"{r['total'] / gib:.2f} GiB"
        most = f" ({r['max_kv_tokens']:,})" if r["max_kv_tokens"] else ""
        failed = f"{len(r['failed'])} of {r['shapes']}" + (f": {', '.join(r['failed'][:3])}" if r["failed"] else "")
        print(f"| {name} | {'yes' if r['fits'] else 'no'} | {used} | {r['kv_tokens']:,}{most} | {failed} | "
              f"{r['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
