"""Time from `jaxserve serve` to SERVING: cold, warm compilation cache, and `--compiled`.

Each start is a fresh process timed end to end (interpreter and JAX start, model load,
warmup or executable load, ports bound) until the server logs that it serves; the server is
then stopped. "cold" uses an empty compilation cache; "warm" the same cache again; "compiled"
the serialized executables `jaxserve compile --target cpu --out DIR` wrote for the same flags
(that compile is timed too, but is not part of any start). Prints each start's phases and the
warm/cold ratios.

    .venv/bin/python scripts/bench_startup.py [--repeats 2] [engine flags, e.g. --max-num-seqs 64]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CLI = [sys.executable, "-m", "jaxserve.cli"]


def start_once(flags: list[str], timeout: float = 900.0) -> dict[str, float]:
    """Seconds to SERVING, and the model-load and warmup phases the server logged."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--metrics-port", "0", "--http-port", "0", *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out: dict[str, float] = {}
    try:
        for line in proc.stderr:
            if m := re.search(r"model loaded in ([\d.]+) s", line):
                out["model_load_s"] = float(m.group(1))
            if m := re.search(r"warmup done in ([\d.]+) s", line):
                out["warmup_s"] = float(m.group(1))
            if " serving " in line:
                out["to_serving_s"] = time.perf_counter() - t0
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
        raise RuntimeError(f"the server did not reach SERVING (exit {proc.returncode})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="starts per warm mode (median reported)")
    args, engine_flags = ap.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = os.path.join(tmp, "xla")
        compiled = os.path.join(tmp, "compiled")
        with_cache = ["--compilation-cache-dir", cache, *engine_flags]
        cold = start_once(with_cache)
        warm = [start_once(with_cache) for _ in range(args.repeats)]
        t0 = time.perf_counter()
        subprocess.run([*CLI, "compile", "--target", "cpu", "--out", compiled, "--quiet", *engine_flags],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        compile_s = time.perf_counter() - t0
        loaded = [start_once(["--compilation-cache-dir", "none", "--compiled", compiled, *engine_flags])
                  for _ in range(args.repeats)]

    def show(name: str, runs: list[dict[str, float]]) -> float:
        med = statistics.median(r["to_serving_s"] for r in runs)
        load = statistics.median(r.get("model_load_s", 0.0) for r in runs)
        warmup = statistics.median(r.get("warmup_s", 0.0) for r in runs)
        print(f"{name:28} to SERVING {med:6.1f} s (model load {load:5.1f} s, warmup/load executables "
              f"{warmup:5.1f} s; {len(runs)} start(s), median)")
        return med

    print(f"engine flags: {' '.join(engine_flags) or '(defaults)'}")
    c = show("cold (empty cache)", [cold])
    w = show("warm compilation cache", warm)
    k = show("--compiled (serialized)", loaded)
    print(f"`jaxserve compile --target cpu --out`: {compile_s:.1f} s (once, ahead of the starts)")
    print(f"warm / cold: {w / c:.2f}; compiled / cold: {k / c:.2f}")


if __name__ == "__main__":
    main()
