"""The `jaxserve` command line: generate, warmup and convert here; other packages add their
subcommands (the server's `serve` and `client`) through the `jaxserve.commands` entry-point
group, so this module never imports them.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import sys
import time

from jaxserve.config.engine_args import add_engine_args, engine_config_from_args
from jaxserve.tuning.command import add_tune_args, cmd_tune

COMMANDS_ENTRY_POINTS = "jaxserve.commands"


def cmd_generate(ns: argparse.Namespace) -> int:
    from jaxserve.llm import LLM
    from scheduler import SamplingParams

    cfg = engine_config_from_args(ns)
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "model"}
    if cfg.num_processes > 1 and cfg.process_id != 0:  # a follower runs the leader's steps
        from jaxserve.engine.llm_engine import run_follower_process

        run_follower_process(cfg)
    llm = LLM(cfg.model, warmup=ns.warmup or cfg.num_processes > 1, **kwargs)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                            top_k=ns.top_k, seed=ns.seed_sampling)
    t0 = time.perf_counter()
    if ns.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in ns.prompts], params, use_tqdm=False)
    else:
        outs = llm.generate(ns.prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    ntok = 0
    for prompt, out in zip(ns.prompts, outs):
        comp = out.outputs[0]
        ntok += len(comp.token_ids)
        print(f"### {prompt}\n{comp.text}\n[finish: {comp.finish_reason}, {len(comp.token_ids)} tokens]")
    print(f"# {ntok} tokens in {dt:.2f} s ({ntok / dt:.1f} tok/s)", file=sys.stderr)
    llm.engine.close()
    return 0


def cmd_convert(ns: argparse.Namespace) -> int:
    from jaxserve.loading import load_model
    from jaxserve.loading.checkpoint import save_checkpoint

    t0 = time.perf_counter()
    loaded = load_model(ns.src, dtype=ns.dtype, quantization=ns.quantization, quantize_lm_head=ns.quantize_lm_head)
    t_convert = time.perf_counter() - t0
    save_checkpoint(ns.dst, loaded.config, loaded.params, loaded.dtype, loaded.tokenizer, loaded.vision)
    t_save = time.perf_counter() - t0 - t_convert
    t1 = time.perf_counter()
    load_model(ns.dst, dtype=ns.dtype)  # a quantized checkpoint restores quantized
    t_restore = time.perf_counter() - t1
    print(f"converted {ns.src} ({loaded.source}) -> {ns.dst}: load+convert {t_convert:.2f} s, "
          f"save {t_save:.2f} s, restore {t_restore:.2f} s ({t_convert / max(t_restore, 1e-9):.1f}x faster)")
    return 0


def cmd_warmup(ns: argparse.Namespace) -> int:
    from jaxserve.engine.llm_engine import Engine

    cfg = engine_config_from_args(ns)
    t0 = time.perf_counter()
    engine = Engine(cfg)
    t_load = time.perf_counter() - t0
    report = engine.warmup(progress=not ns.quiet)
    print(f"model load {t_load:.1f} s; warmup: {report.summary()}")
    print(f"compilation cache: {engine.cache_dir or 'disabled'}")
    if ns.manifest:
        report.write(ns.manifest, {"engine_config": dataclasses.asdict(cfg), "plan": {
            "token_buckets": engine.plan.token_buckets, "request_buckets": engine.plan.request_buckets}})
        print(f"manifest: {ns.manifest}")
    if ns.require_warm_cache and report.num_misses:
        print(f"jaxserve: error: {report.num_misses} shapes missed the compilation cache", file=sys.stderr)
        return 3
    return 0


def cmd_compile(ns: argparse.Namespace) -> int:
    from jaxserve.compilation.aot import compile_for_target
    from jaxserve.compilation.targets import Target
    from jaxserve.loading import load_model_config

    target = Target.parse(ns.target)
    cfg = engine_config_from_args(ns)
    model_config = load_model_config(ns.model_config or cfg.model)
    shapes = [s for s in ns.shapes.split(";") if s] if ns.shapes else None
    if ns.child_protocol:
        compile_for_target(model_config, cfg, target, shapes=shapes, out_dir=ns.out, workers=cfg.warmup_threads,
                           on_start=_report_start, on_result=_report_result)
        return 0
    spec = cfg.speculative_config
    if ns.isolate and (spec is None or spec.method != "draft_model"):
        report = _compile_isolated(ns, model_config, cfg, target, shapes)
    else:
        report = compile_for_target(model_config, cfg, target, shapes=shapes, out_dir=ns.out,
                                    workers=cfg.warmup_threads, progress=not ns.quiet)
    print(report.table())
    if ns.manifest:
        with open(ns.manifest, "w") as f:
            json.dump(report.to_json(), f, indent=1)
        print(f"manifest: {ns.manifest}")
    if ns.out:
        print(f"executables and manifest: {ns.out}")
    return 0 if report.fits else 4


def _report_start(name: str) -> None:
    from jaxserve.compilation.isolate import START, report_line

    report_line(START + name)


def _report_result(result) -> None:
    from jaxserve.compilation.isolate import RESULT, report_line

    report_line(RESULT + json.dumps(dataclasses.asdict(result)))


def _compile_isolated(ns: argparse.Namespace, model_config, cfg, target, shapes):
    """The plan's shapes compiled in child processes (`compilation/isolate.py`), then the
    HBM plan here, with every shape's result (a crash included) in it."""
    from jaxserve.compilation.aot import MANIFEST, ShapeResult, compile_for_target
    from jaxserve.compilation.isolate import compile_isolated
    from jaxserve.worker.parallel import tp_model_config

    config = cfg.with_platform_defaults(target.platform)
    rank = tp_model_config(model_config, target.num_devices, config.enable_expert_parallel)
    names = shapes or [k.name for k in config.resolve(model_config, rank, platform=target.platform).plan.shapes()]
    base = _without(ns.argv, ("--shapes", "--manifest"))
    workers = cfg.warmup_threads or max(1, os.cpu_count() or 1)

    def child(todo, n):
        return [sys.executable, "-m", "jaxserve.cli", *base, "--no-isolate", "--child-protocol",
                "--shapes", ";".join(todo), "--warmup-threads", str(n)]

    def show(r: dict) -> None:
        if not ns.quiet:
            print(f"  {r['name']}: {'compiled' if r['compiled'] else 'FAILED'} in {r['seconds']:.1f} s", flush=True)

    t0 = time.perf_counter()
    results = compile_isolated(names, child, workers, show)
    report = compile_for_target(model_config, cfg, target, shapes=[])  # the HBM plan, nothing compiled
    report = dataclasses.replace(report, shapes=tuple(ShapeResult(**r) for r in results),
                                 wall_seconds=time.perf_counter() - t0)
    if ns.out:
        with open(os.path.join(ns.out, MANIFEST), "w") as f:
            json.dump(report.to_json(), f, indent=1)
    return report


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `flags` and their values (`--flag VALUE` or `--flag=VALUE`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxserve", description="JAX LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate completions for prompts (offline)")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=False,
                   help="compile every planned shape before generating")
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser("warmup", help="compile every planned shape into the persistent compilation cache")
    w.add_argument("--manifest", default=None, help="write a JSON manifest of every shape here")
    w.add_argument("--require-warm-cache", action="store_true",
                   help="exit with status 3 when any shape missed the cache")
    w.add_argument("--quiet", action="store_true")
    add_engine_args(w)
    w.set_defaults(func=cmd_warmup)

    k = sub.add_parser("compile", help="compile every planned shape for a target (a TPU, or this host) and "
                                       "report its HBM plan; --out also writes the executables")
    k.add_argument("--target", required=True, help="tpu:<chip>-<chips> (tpu:v5e-1, tpu:v5e-4, tpu:v6e-8, ...) "
                   "or cpu[-<devices>]; the model is sharded over all of the target's devices")
    k.add_argument("--model-config", default=None,
                   help="an HF config.json to plan from without weights (default: --model's own config)")
    k.add_argument("--manifest", default=None, help="write the JSON manifest here")
    k.add_argument("--out", default=None, help="write the manifest and serialized executables to this "
                   "directory (for `jaxserve serve --compiled`)")
    k.add_argument("--shapes", default=None, help="compile only these planned shapes (names as printed, "
                   "';'-separated); the verdict then covers only their temporaries")
    k.add_argument("--quiet", action="store_true")
    k.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=True,
                   help="compile in a child process, so a compiler crash costs its shape (reported with the "
                        "compiler's message), not the plan")
    k.add_argument("--child-protocol", action="store_true", help=argparse.SUPPRESS)  # the isolated child
    add_engine_args(k)
    k.set_defaults(func=cmd_compile)

    t = sub.add_parser("tune", help="replay a workload with candidate scheduler settings and recommend the "
                                    "flags that meet a goal (throughput, ttft-p99=2s, ...)")
    add_tune_args(t)
    t.set_defaults(func=cmd_tune)

    c = sub.add_parser("convert", help="convert a GGUF file or HF directory to a jaxserve (orbax) checkpoint")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--quantization", default=None, choices=["int8", "fp8"],
                   help="store the linear layers quantized (default: as the source holds them)")
    c.add_argument("--quantize-lm-head", action="store_true", help="with --quantization: the LM head too")
    c.set_defaults(func=cmd_convert)

    for ep in sorted(importlib.metadata.entry_points(group=COMMANDS_ENTRY_POINTS), key=lambda e: e.name):
        ep.load()(sub)  # e.g. server.cli:add_commands (its heavy imports stay lazy)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # what an isolated compile hands its child
    try:
        return ns.func(ns)
    except (ValueError, FileNotFoundError) as e:
        print(f"jaxserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
