"""Multi-head latent attention on this CPU: the absorbed form over the latent cache against the
latent expanded to per-head keys and values.

Decode: B sequences of C context tokens, one query each, one layer's attention with
DeepSeek-V3's head shapes (`--heads`, 128 in the model; fewer fit a CPU run):
  absorbed  q . W_UK, then multi-query attention over the paged [c_kv | k_rope] rows (576
            lanes per token), then . W_UV: `models/deepseek.py`'s path;
  expanded  a cache of per-head keys [nope | rope] and values (values padded to the key width,
            as one paged-attention call reads them), plain attention.
Prefill: one chunk of T new tokens at the end of C context tokens:
  absorbed  as decode, T queries;
  expanded  the context's latents expanded by kv_b (C x 512 x H x 256 multiply-adds), then
            attention over per-head K/V (`mla_attention_expanded`).

Prints per-step medians, tokens/s and the KV bytes per token and layer of each cache.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import ragged_paged_attention
from pallas_kernels.mla_attention.ops import mla_attention_expanded, mla_paged_attention

DN, DR, DV, DL = 128, 64, 128, 512  # DeepSeek-V3: nope / rope / value head dims, latent rank


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line for line in out.splitlines() if line.startswith("Flags")), "")
    units = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return f"{name} ({', '.join(units)})"


def timed(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paged_metadata(B: int, C: int, q_len: int, S: int):
    pages_per_seq = -(-C // S)
    tables = np.arange(1, B * pages_per_seq + 1, dtype=np.int32).reshape(B, pages_per_seq)
    cu = np.arange(B + 1, dtype=np.int32) * q_len
    return (jnp.full((B,), C, jnp.int32), jnp.asarray(tables), jnp.asarray(cu), jnp.asarray([B], jnp.int32),
            B * pages_per_seq + 1)


def absorbed_attention(lens, tables, cu, n):
    """The engine's path over the latent pages for this batch's metadata, jitted."""
    @jax.jit
    def absorbed(q_nope, q_rope, latent, kv_b):
        q_lat = jnp.einsum("thd,lhd->thl", q_nope, kv_b[..., :DN])
        o = mla_paged_attention(jnp.concatenate([q_lat, q_rope], -1), latent, lens, tables, cu, n,
                                sm_scale=0.07, latent_dim=DL)
        return jnp.einsum("thl,lhv->thv", o, kv_b[..., DN:])

    return absorbed


def decode(B: int, C: int, H: int, S: int, dtype, reps: int, rng) -> dict[str, float]:
    lens, tables, cu, n, P = paged_metadata(B, C, 1, S)
    kv_b = jnp.asarray(rng.standard_normal((DL, H, DN + DV)) / np.sqrt(DL), dtype)
    q_nope = jnp.asarray(rng.standard_normal((B, H, DN)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((B, H, DR)), dtype)
    latent = jnp.asarray(rng.standard_normal((P, S, 1, DL + DR)), dtype)
    k_pages = jnp.asarray(rng.standard_normal((P, S, H, DN + DR)), dtype)
    v_pages = jnp.asarray(rng.standard_normal((P, S, H, DN + DR)), dtype)  # values padded to the key width

    absorbed = absorbed_attention(lens, tables, cu, n)
    @jax.jit
    def expanded(q_nope, q_rope, k_pages, v_pages):
        q = jnp.concatenate([q_nope, q_rope], -1)
        return ragged_paged_attention(q, k_pages, v_pages, lens, tables, cu, n, sm_scale=0.07)[..., :DV]

    return {"absorbed": timed(absorbed, q_nope, q_rope, latent, kv_b, reps=reps),
            "expanded": timed(expanded, q_nope, q_rope, k_pages, v_pages, reps=reps)}


def prefill(T: int, C: int, H: int, S: int, dtype, reps: int, rng) -> dict[str, float]:
    lens, tables, cu, n, P = paged_metadata(1, C, T, S)
    kv_b = jnp.asarray(rng.standard_normal((DL, H, DN + DV)) / np.sqrt(DL), dtype)
    q_nope = jnp.asarray(rng.standard_normal((T, H, DN)), dtype)
    q_rope = jnp.asarray(rng.standard_normal((T, H, DR)), dtype)
    latent = jnp.asarray(rng.standard_normal((P, S, 1, DL + DR)), dtype)
    c_kv = jnp.asarray(rng.standard_normal((C, DL)), dtype)
    k_rope = jnp.asarray(rng.standard_normal((C, DR)), dtype)

    absorbed = absorbed_attention(lens, tables, cu, n)
    expanded = jax.jit(functools.partial(mla_attention_expanded, sm_scale=0.07))
    return {"absorbed": timed(absorbed, q_nope, q_rope, latent, kv_b, reps=reps),
            "expanded": timed(expanded, q_nope, q_rope, c_kv, k_rope, kv_b, reps=reps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16, help="decode sequences")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunks", default="16,64,256,1024", help="prefill chunk lengths")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    dtype, rng, H, C = jnp.dtype(args.dtype), np.random.default_rng(0), args.heads, args.context
    size = dtype.itemsize
    print(f"CPU: {cpu_name()}; {jax.devices()[0].platform}, {args.dtype}, {H} heads, context {C}, "
          f"medians of {args.reps}")
    print(f"KV bytes per token and layer: latent {(DL + DR) * size}, expanded per-head K/V "
          f"{H * (DN + DR + DV) * size} ({H * (DN + DR + DV) / (DL + DR):.1f}x; as stored here, values padded: "
          f"{2 * H * (DN + DR) * size})")
    d = decode(args.batch, C, H, args.page_size, dtype, args.reps, rng)
    print(f"decode, {args.batch} seqs x 1 token, one layer's attention: absorbed {d['absorbed'] * 1e3:.2f} ms "
          f"({args.batch / d['absorbed']:.0f} tok/s), expanded {d['expanded'] * 1e3:.2f} ms "
          f"({args.batch / d['expanded']:.0f} tok/s); expanded/absorbed time {d['expanded'] / d['absorbed']:.2f}")
    for T in (int(x) for x in args.chunks.split(",")):
        p = prefill(T, max(C, T), H, args.page_size, dtype, args.reps, rng)
        print(f"prefill chunk {T} at context {max(C, T)}: absorbed {p['absorbed'] * 1e3:.1f} ms, expanded "
              f"{p['expanded'] * 1e3:.1f} ms; expanded/absorbed {p['expanded'] / p['absorbed']:.2f}")


if __name__ == "__main__":
    main()
