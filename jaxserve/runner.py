"""The model runner: owns the device params and the paged KV cache, runs jitted ragged steps.

`nnx.split` happens once; each step is a plain `jax.jit` over a pure function. Two jits keep
the number of compiled shapes O(m + n) rather than O(m * n):

- the backbone, keyed on the token bucket T only (its per-sequence metadata always has the
  full `max_reqs` rows), with the KV cache donated so it is updated in place;
- the head (logits of the sampled rows + sampler), keyed on the request bucket R and the few
  static sampler variants.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_kernels
from jaxserve.batch import StepArrays
from jaxserve.loading import LoadedModel
from jaxserve.models.llama import LlamaForCausalLM, init_kv_cache
from jaxserve.models.metadata import AttentionMetadata
from jaxserve.sampler import SamplerFlags, SamplerOutput, SamplingTensors, sample

SWAP_BUCKETS = (8, 64, 512)  # blocks per swap copy call (lists are padded up or split)


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
        num_host_pages: int = 0,
        attention_backend: str = "auto",
    ):
        self.config = loaded.config
        self.page_size = page_size
        self.num_pages = num_pages
        params = jax.tree.map(jnp.asarray, loaded.params)
        model = LlamaForCausalLM(loaded.config, params)
        self.graphdef, self.state = nnx.split(model)
        self.dtype = params["embed"].dtype
        self.kv_cache = init_kv_cache(loaded.config, num_pages, page_size, self.dtype)
        self.attention_backend = attention_backend
        # Host-side swap pool, same layout as the device cache: [L, H, S, Hkv, D] each.
        shape = (self.config.num_layers, max(num_host_pages, 0), page_size, self.config.num_kv_heads,
                 self.config.head_dim)
        self.host_k = np.zeros(shape, self.dtype) if num_host_pages else None
        self.host_v = np.zeros(shape, self.dtype) if num_host_pages else None
        self._gather_pages = jax.jit(lambda kv, ids: (kv[0][:, ids], kv[1][:, ids]))
        self._scatter_pages = jax.jit(
            lambda kv, ids, k, v: (kv[0].at[:, ids].set(k), kv[1].at[:, ids].set(v)), donate_argnums=(0,)
        )

    # ------------------------------------------------------------------ host API
    @staticmethod
    def device_inputs(arrays: StepArrays) -> tuple[Any, ...]:
        """One host-to-device transfer of the step's arrays."""
        host = (arrays.token_ids, arrays.positions, arrays.slot_mapping, arrays.cu_q_lens,
                arrays.kv_lens, arrays.block_tables, arrays.num_seqs, arrays.logits_indices)
        tok, pos, slots, cu, kv, tables, nseq, lidx = jax.device_put(host)
        md = AttentionMetadata(slot_mapping=slots, cu_q_lens=cu, kv_lens=kv, block_tables=tables, num_seqs=nseq)
        return tok, pos, md, lidx

    def run_backbone(self, arrays: StepArrays) -> jax.Array:
        """Runs the layers over the step; returns the sampled rows' hidden states [max_reqs, E]."""
        tok, pos, md, lidx = self.device_inputs(arrays)
        h_last, self.kv_cache = _backbone_jit(self.graphdef, self.attention_backend, self.state,
                                              self.kv_cache, tok, pos, md, lidx)
        return h_last

    def sample(self, h_last: jax.Array, tensors: SamplingTensors, num_rows: int,
               flags: SamplerFlags) -> SamplerOutput:
        return _head_jit(self.graphdef, self.state, h_last, tensors, num_rows=num_rows, flags=flags)

    def forward(self, arrays: StepArrays) -> jax.Array:
        """Logits [max_reqs, V] (f32) of each sequence's last token; for tests and tools."""
        h_last = self.run_backbone(arrays)
        return _logits_jit(self.graphdef, self.state, h_last, num_rows=h_last.shape[0])

    def forward_numpy(self, arrays: StepArrays) -> np.ndarray:
        return np.asarray(self.forward(arrays))[: arrays.num_reqs]

    # ------------------------------------------------------------------ swap preemption
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device pages to host pages: [(device_page, host_page), ...]."""
        for dev, host in _chunks([(d, h) for d, h in pairs]):
            k, v = self._gather_pages(self.kv_cache, jnp.asarray(dev))
            n = len(host)
            self.host_k[:, host] = np.asarray(k)[:, :n]
            self.host_v[:, host] = np.asarray(v)[:, :n]

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host pages back to device pages: [(host_page, device_page), ...]."""
        for dev, host in _chunks([(d, h) for h, d in pairs]):
            n = len(host)
            size = len(dev)
            k = np.zeros((self.host_k.shape[0], size) + self.host_k.shape[2:], self.host_k.dtype)
            v = np.zeros_like(k)
            k[:, :n] = self.host_k[:, host]
            v[:, :n] = self.host_v[:, host]
            self.kv_cache = self._scatter_pages(self.kv_cache, jnp.asarray(dev), k, v)

    def warmup_swap(self) -> None:
        """Compiles the swap copies for every chunk size (padding targets the null page)."""
        if self.host_k is None:
            return
        for size in SWAP_BUCKETS:
            ids = jnp.zeros(size, jnp.int32)
            k, v = self._gather_pages(self.kv_cache, ids)
            self.kv_cache = self._scatter_pages(self.kv_cache, ids, k, v)


# ---------------------------------------------------------------------- pure step functions
# Module-level jits with the graph definition as a static argument: runners of the same model
# and shapes share compiled executables (and the persistent compilation cache keys).


def _backbone(graphdef, attention_backend, state, kv_cache, token_ids, positions, md, logits_indices):
    model = nnx.merge(graphdef, state)
    return model(
        token_ids, positions, kv_cache, md, logits_indices,
        attention_fn=functools.partial(pallas_kernels.ragged_paged_attention, backend=attention_backend),
        kv_update_fn=functools.partial(pallas_kernels.update_kv_cache, backend=attention_backend),
    )


def _logits(graphdef, state, h_last, *, num_rows):
    model = nnx.merge(graphdef, state)
    return model.compute_logits(h_last[:num_rows])  # [R, V]


def _head(graphdef, state, h_last, tensors, *, num_rows, flags):
    return sample(_logits(graphdef, state, h_last, num_rows=num_rows), tensors, **flags._asdict())


_backbone_jit = jax.jit(_backbone, static_argnums=(0, 1), donate_argnums=(3,))
_logits_jit = jax.jit(_logits, static_argnums=(0,), static_argnames=("num_rows",))
_head_jit = jax.jit(_head, static_argnums=(0,), static_argnames=("num_rows", "flags"))


def _chunks(pairs: list[tuple[int, int]]):
    """Splits (device_page, host_page) pairs into chunks, the device ids padded to a swap
    bucket with the null page 0, so only `len(SWAP_BUCKETS)` shapes are ever compiled."""
    step = SWAP_BUCKETS[-1]
    for i in range(0, len(pairs), step):
        chunk = pairs[i : i + step]
        size = next(b for b in SWAP_BUCKETS if b >= len(chunk))
        dev = np.zeros(size, np.int32)
        dev[: len(chunk)] = [d for d, _ in chunk]
        yield dev, [h for _, h in chunk]
