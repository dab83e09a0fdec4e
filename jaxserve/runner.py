"""The model runner: owns the device params and the paged KV cache, runs jitted ragged steps.

`nnx.split` happens once; the step is a plain `jax.jit` over a pure function of
(params state, kv cache, step arrays) with the cache donated, so it is updated in place.
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


class ModelRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
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
        self.attention_fn = functools.partial(pallas_kernels.ragged_paged_attention, backend=attention_backend)
        self.kv_update_fn = functools.partial(pallas_kernels.update_kv_cache, backend=attention_backend)
        self._forward = jax.jit(self._forward_impl, donate_argnums=(1,))

    def _forward_impl(self, state, kv_cache, token_ids, positions, md, logits_indices):
        model = nnx.merge(self.graphdef, state)
        return model(
            token_ids, positions, kv_cache, md, logits_indices,
            attention_fn=self.attention_fn, kv_update_fn=self.kv_update_fn,
        )

    @staticmethod
    def device_inputs(arrays: StepArrays) -> tuple[Any, ...]:
        """One host-to-device transfer of the step's arrays."""
        host = (arrays.token_ids, arrays.positions, arrays.slot_mapping, arrays.cu_q_lens,
                arrays.kv_lens, arrays.block_tables, arrays.num_seqs, arrays.logits_indices)
        dev = jax.device_put(host)
        tok, pos, slots, cu, kv, tables, nseq, lidx = dev
        md = AttentionMetadata(slot_mapping=slots, cu_q_lens=cu, kv_lens=kv, block_tables=tables, num_seqs=nseq)
        return tok, pos, md, lidx

    def forward(self, arrays: StepArrays) -> jax.Array:
        """Runs one step; returns logits [R, V] (f32) of each sequence's last token."""
        tok, pos, md, lidx = self.device_inputs(arrays)
        logits, self.kv_cache = self._forward(self.state, self.kv_cache, tok, pos, md, lidx)
        return logits

    def forward_numpy(self, arrays: StepArrays) -> np.ndarray:
        return np.asarray(self.forward(arrays))[: arrays.num_reqs]
