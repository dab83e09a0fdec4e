"""Compile time of the backbone step: the 30-layer embedded model against a 1-layer cut of it.

Layers are stacked and run with `jax.lax.scan`, so compiling 30 layers should cost about what
one layer costs. Prints both times and their ratio.

    .venv/bin/python scripts/compile_time.py [--tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax

from jaxserve.loading import load_model
from jaxserve.worker.batch import BatchBuilder
from jaxserve.worker.runner import ModelRunner


def compile_seconds(loaded, tokens: int, backend: str) -> float:
    runner = ModelRunner(loaded, num_pages=64, page_size=16, attention_backend=backend)
    arrays = BatchBuilder(tokens, 8, 16, 16).build([], tokens, 8)
    t0 = time.perf_counter()
    runner.run_backbone(arrays)[0].block_until_ready()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--attention-backend", default="reference")
    args = ap.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    full = load_model(None, "float32")
    one = dataclasses.replace(
        full,
        config=dataclasses.replace(full.config, num_layers=1),
        params={**full.params, "layers": {k: v[:1] for k, v in full.params["layers"].items()}},
    )
    t1 = compile_seconds(one, args.tokens, args.attention_backend)
    t30 = compile_seconds(full, args.tokens, args.attention_backend)
    print(f"backbone compile + first run, T={args.tokens}: 1 layer {t1:.2f} s, "
          f"{full.config.num_layers} layers {t30:.2f} s (ratio {t30 / t1:.2f})")


if __name__ == "__main__":
    main()
