"""ESTIMATES, not measurements: lower-bound decode step times on TPU chips from bytes read.

No TPU runs here, so no speed is claimed. For a decode step of B sequences at a context of
`ctx` tokens, every chip must at least read its share of the weights once and the K/V of the
live pages once (the lanes layout, padding lanes included); at the chip's HBM bandwidth
(Pallas' `tpu_info`) that gives a floor on the step time and a ceiling on tokens/s. Real
steps are slower (kernel efficiency, the logits, collectives under TP, host overhead).

MoE models read only the experts a step routes to: with B tokens each picking k of X
experts, assuming uniform routing, a layer touches X * (1 - (1 - k/X)^B) experts on average
(the grouped matmul skips empty groups). Sliding-window layers (Gemma) read at most their
window of K/V.

    PYTHONPATH=.venv/accel/tpu JAX_PLATFORMS=cpu python scripts/estimate_tpu_decode.py
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from jaxserve.compilation.targets import Target, tpu_info  # noqa: E402
from jaxserve.loading import load_model_config  # noqa: E402
from jaxserve.models.config import ModelConfig  # noqa: E402
from jaxserve.models.llama import expected_param_shapes  # noqa: E402
from jaxserve.worker.parallel import tp_model_config  # noqa: E402
from pallas_kernels.kv_layout import lanes_width  # noqa: E402

DATA = os.path.join(os.path.dirname(__file__), "..", "tests", "data")
LLAMA_8B = os.path.join(DATA, "llama3_8b_config.json")
QWEN3_30B_A3B = os.path.join(DATA, "qwen3_30b_a3b_config.json")
GEMMA3_27B = os.path.join(DATA, "gemma3_27b_config.json")
EXPERT_WEIGHTS = ("expert_gate", "expert_up", "expert_down")
BF16 = 2


def weight_bytes_per_chip(cfg: ModelConfig, tp: int, batch: int) -> int:
    """bf16 weights one chip reads per step (sharded layers and vocab; norms counted as
    sharded too, a rounding error). An untied embedding table is only gathered from: left out.
    Routed experts count with the fraction of experts a batch touches (uniform routing)."""
    shapes = expected_param_shapes(tp_model_config(cfg, tp))
    if "lm_head" in shapes:
        shapes = {k: v for k, v in shapes.items() if k != "embed"}
    experts = {k: shapes["layers"].pop(k) for k in EXPERT_WEIGHTS if k in shapes["layers"]}
    leaves = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    dense = sum(math.prod(s) for s in leaves)
    touched = 1 - (1 - cfg.num_experts_per_tok / cfg.num_experts) ** batch if experts else 0.0
    routed = sum(math.prod(s) for s in experts.values()) * touched
    return int((dense + routed) * BF16 / tp)


def kv_bytes_per_chip(cfg: ModelConfig, tp: int, batch: int, ctx: int, page: int = 16) -> int:
    rank = tp_model_config(cfg, tp)
    lanes = lanes_width(rank.num_kv_heads // tp, rank.head_dim)
    tokens = sum(math.ceil(min(ctx, w or ctx) / page) * page for w in cfg.windows())  # over layers
    return 2 * batch * tokens * lanes * BF16  # K and V


def main() -> None:
    models = {"SmolLM2-135M": (load_model_config(None), (1,)),
              "Llama-3-8B shape": (load_model_config(LLAMA_8B), (1, 4)),
              "Qwen3-30B-A3B shape": (load_model_config(QWEN3_30B_A3B), (8,)),
              "Gemma-3-27B shape": (load_model_config(GEMMA3_27B), (8,))}
    print("ESTIMATE (lower bound from HBM bytes; no TPU measured): decode step, bf16, lanes-layout cache")
    print(f"{'chip':5} {'model':19} {'TP':>2} {'B':>3} {'ctx':>5} {'weights MB':>10} {'K/V MB':>8} "
          f"{'floor ms':>8} {'<= tok/s':>9}  fits one chip's HBM")
    for chip in ("v5e", "v6e"):
        bw = tpu_info(chip).mem_bw_bytes_per_second * tpu_info(chip).num_cores
        hbm = Target("tpu", chip, 1).hbm_bytes()
        for name, (cfg, tps) in models.items():
            for tp in tps:
                for batch in (1, 8, 64):
                    w = weight_bytes_per_chip(cfg, tp, batch)
                    for ctx in (256, 1024, 4096):
                        kv = kv_bytes_per_chip(cfg, tp, batch, ctx)
                        floor = (w + kv) / bw
                        fits = "yes" if w + kv < hbm else "no (needs more chips)"
                        print(f"{chip:5} {name:19} {tp:2d} {batch:3d} {ctx:5d} {w / 1e6:10.0f} {kv / 1e6:8.1f} "
                              f"{floor * 1e3:8.3f} {batch / floor:9.0f}  {fits}")
        print(f"  ({chip}: {bw / 1e9:.0f} GB/s HBM per chip, from Pallas tpu_info)")


if __name__ == "__main__":
    main()
