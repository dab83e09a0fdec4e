"""Speculative decoding with DeepSeek's multi-token-prediction layer (method "mtp").

A tiny random DeepSeek-V3 whose checkpoint carries an MTP layer (layer 3 after 3 decoder
layers, with its enorm / hnorm / eh_proj / shared head). The oracle for the drafts is the MTP
layer computed with transformers' own decoder layer over the target's final-normed hidden
states; the oracle for the outputs is transformers' greedy generate of the 3-layer model,
which speculative decoding must not change.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

K = 2  # drafts per step: the first from the target's hidden states, the second chained


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    return save_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ds")


# The attention projections of layer 3 scaled up in each family (see below).
_ATTENTION_OUT = {"deepseek_v3": ("o_proj", "kv_b_proj"), "glm4_moe": ("o_proj", "v_proj")}


def save_mtp_checkpoint(path, family: str = "deepseek_v3"):
    """(checkpoint dir, transformers target (3 layers), transformers model whose layer 3 is the
    MTP layer's decoder, the MTP layer's own tensors)."""
    import transformers
    from hf_reference import save_tiny_family
    from safetensors.numpy import load_file, save_file

    full = save_tiny_family(path, family, num_hidden_layers=4)
    tensors = load_file(str(path / "model.safetensors"))
    rng = np.random.default_rng(3)
    E = full.config.hidden_size
    own = {"enorm.weight": 1 + 0.2 * rng.standard_normal(E), "hnorm.weight": 1 + 0.2 * rng.standard_normal(E),
           "eh_proj.weight": 4 * rng.standard_normal((E, 2 * E)) / np.sqrt(2 * E),
           "shared_head.norm.weight": 1 + 0.2 * rng.standard_normal(E)}
    own = {k: v.astype(np.float32) for k, v in own.items()}
    tensors.update({f"model.layers.3.{k}": v for k, v in own.items()})
    # attention's share of the layer's output made large, so its positions decide the drafts
    for proj in _ATTENTION_OUT[family]:
        name = f"model.layers.3.self_attn.{proj}.weight"
        tensors[name] = tensors[name] * 4
        with torch.no_grad():
            getattr(full.model.layers[3].self_attn, proj).weight.mul_(4)
    # the checkpoint's copies of the shared embedding and head (not read: they are the model's)
    tensors["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    tensors["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=3, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config))
    target = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval().float()
    return str(path), target, full, {k: torch.tensor(v) for k, v in own.items()}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def mtp_reference_logits(target, full, own, history: list[int], drafts: list[int]) -> list[np.ndarray]:
    """The MTP head's logits for draft 1 (row t = N-2 pairs the target's h_t with token N-1)
    and each chained draft after `drafts` (row N-2+j pairs the layer's own output before with
    draft j), over the whole history at once, causally, with transformers' decoder layer."""
    eps = full.config.rms_norm_eps
    with torch.no_grad():
        ids = torch.tensor([history])
        h = target.model(ids).last_hidden_state[0]  # [N, E], final-normed
        emb = full.model.embed_tokens
        prev = h[:-1]  # h_t for t = 0..N-2
        nxt = list(history[1:])
        out = []
        for j in range(len(drafts) + 1):
            x = torch.cat([_rms(emb(torch.tensor(nxt)), own["enorm.weight"], eps),
                           _rms(prev, own["hnorm.weight"], eps)], -1) @ own["eh_proj.weight"].T
            T = x.shape[0]
            pos = torch.arange(T)[None]
            mask = torch.triu(torch.full((T, T), float("-inf")), 1)[None, None]
            y = full.model.layers[3](x[None], attention_mask=mask, position_ids=pos,
                                     position_embeddings=full.model.rotary_emb(x[None], pos))[0]  # [T, E]
            logits = full.lm_head(_rms(y[-1], own["shared_head.norm.weight"], eps))
            out.append(logits.numpy())
            if j < len(drafts):  # chain: the layer's output at the last row, then draft j+1
                prev, nxt = torch.cat([prev, y[-1:]]), nxt + [drafts[j]]
    return out


def _argmax_or_tie(logits: np.ndarray, token: int, what: str) -> None:
    """`token` is the argmax, or within float noise of it (vLLM's near-tie rule)."""
    assert logits[token] >= logits.max() - 1e-3 * max(1.0, abs(logits.max())), (
        f"{what}: drafted {token} (logit {logits[token]:.4f}), the reference's best is {int(logits.argmax())} "
        f"({logits.max():.4f})")


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def family_mtp_checkpoint(request, mtp_checkpoint, tmp_path_factory):
    """DeepSeek-V3's (latent attention) and GLM-4.5's (grouped-query attention, partial rotary)."""
    if request.param == "deepseek_v3":
        return mtp_checkpoint
    return save_mtp_checkpoint(tmp_path_factory.mktemp("mtp_glm") / "glm", request.param)


def test_mtp_drafts_equal_the_reference_and_outputs_equal_transformers(family_mtp_checkpoint):
    """Chunked prefill (16-token budget) and a prefix-cache hit: after every step, each
    sequence's drafts are the MTP layer's greedy tokens (the chained one included), and the
    greedy outputs are transformers' (drafts never change them). The random MTP layer's drafts
    are rarely kept, so request 1 is handed the right continuation as its drafts instead: its
    verified spans keep drafts, and the MTP pass after them must still draft from the right
    rows. Nothing compiles after warmup; no page is left held."""
    from hf_reference import hf_greedy

    from jaxserve import LLM, SamplingParams

    path, target, full, own = family_mtp_checkpoint
    llm = LLM(model=path, dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": K},
              num_pages=40, page_size=4, max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(8, 16),
              max_model_len=96, enable_prefix_caching=True, structured_outputs=False, compilation_cache_dir=None)
    engine = llm.engine
    shared = [1 + (7 * j) % 120 for j in range(10)]
    prompts = [shared + [3, 9, 27, 81, 5], [1 + (5 * j + 2) % 120 for j in range(21)], shared + [44, 2]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    wants = [hf_greedy(target, p, 10)[0] for p in prompts]
    propose = engine.proposer.propose

    def with_right_drafts_for_request_1(candidates):
        drafts = propose(candidates)
        for c in candidates:
            if c.request_id == "1":
                done = len(c.token_ids) - len(prompts[1])
                drafts["1"] = wants[1][done : done + min(K, c.max_drafts)]
        return drafts

    engine.proposer.propose = with_right_drafts_for_request_1
    outputs: dict[str, list[int]] = {}
    checked = [0] * K  # drafts compared, by position
    for i, p in enumerate(prompts[:2]):
        engine.add_prompt(None, params, prompt_token_ids=p, request_id=str(i))
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        for rid, (n, drafts) in engine.runner.mtp_drafts.items():
            st = engine.runner.input_batch.requests.get(rid)
            if st is None:
                continue
            history = st.prompt_token_ids + st.output_token_ids
            assert len(history) == n, f"request {rid}: drafts follow {n} tokens, the history has {len(history)}"
            ref = mtp_reference_logits(target, full, own, history, drafts[:-1])
            for j, (d, logits) in enumerate(zip(drafts, ref)):
                _argmax_or_tie(logits, d, f"step {step}, request {rid}, draft {j + 1}")
                checked[j] += 1
        step += 1
        if step == 3:  # the third prompt arrives once the first one's prefix is cached
            engine.add_prompt(None, params, prompt_token_ids=prompts[2], request_id="2")
    print("drafts compared by position", checked, "accepted", engine.spec_decode)
    assert checked[0] >= 20 and checked[1] >= 10, checked
    assert engine.scheduler.stats().prefix_cache_hits > 0, "no prefix-cache hit: the test proves nothing about it"
    counts = engine.spec_decode
    assert counts.num_draft_tokens > counts.num_drafts > 0  # chained drafts were verified too
    assert counts.num_accepted_tokens >= 6  # request 1's
    for i, want in enumerate(wants):
        assert outputs[str(i)] == want, f"prompt {i}: {outputs[str(i)]} != transformers' {want}"
    assert engine.compiles_after_warmup == 0
    assert engine.scheduler.stats().num_used_blocks == 0
    # the cache is updated in place by the step and the MTP passes (XLA:CPU once copied it whole
    # twice per program, relaying out the heads layout's size-1 axis)
    from jaxserve.compilation.aot import cache_copies

    pages = engine.runner.kv_cache[0].shape
    for key, exe in engine.runner.executables.items():
        if key.kind in ("backbone", "mtp", "mtp_chain"):
            assert cache_copies(exe.as_text(), pages[2:], math.prod(pages[1:])) == 0, key.name


def test_mtp_is_refused_by_name_where_it_cannot_run(mtp_checkpoint, tmp_path, smollm_path):
    import shutil

    from hf_reference import save_tiny_llama

    from jaxserve import LLM
    from jaxserve.config.speculative import SpeculativeConfig

    with pytest.raises(ValueError, match="method 'mtp' takes no model"):
        SpeculativeConfig.parse({"method": "mtp", "model": "/x"})
    save_tiny_llama(tmp_path / "llama", 2)
    with pytest.raises(ValueError, match="method 'mtp' is not supported for llama"):
        LLM(model=str(tmp_path / "llama"), speculative_config={"method": "mtp"})
    with pytest.raises(ValueError, match="from an HF checkpoint directory"):
        LLM(model=smollm_path, speculative_config={"method": "mtp"})
    path = tmp_path / "no_mtp"
    shutil.copytree(mtp_checkpoint[0], path)
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        LLM(model=str(path), speculative_config={"method": "mtp"})


_TP_CHILD = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
from jaxserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 2},
          num_pages=40, page_size=4, max_num_seqs=8, max_num_batched_tokens=16, token_buckets=(8, 16),
          max_model_len=96, tensor_parallel_size=2, enable_expert_parallel=True, structured_outputs=False,
          compilation_cache_dir=None)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
print(json.dumps([[o.outputs[0].token_ids for o in outs], llm.engine.spec_decode.num_draft_tokens,
                  llm.engine.compiles_after_warmup]))
"""


def test_mtp_under_tensor_and_expert_parallelism_keeps_transformers_outputs(mtp_checkpoint):
    """TP=2 with the experts split whole (EP=2): the MTP pass runs the per-shard latent
    attention and experts like the model's layers; the outputs stay transformers'."""
    import subprocess
    import sys

    from hf_reference import hf_greedy

    path, target, _, _ = mtp_checkpoint
    prompts = [[1 + (5 * j + 2) % 120 for j in range(21)], [3, 9, 27, 81, 5, 7]]
    res = subprocess.run([sys.executable, "-c", _TP_CHILD, path, json.dumps(prompts)], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    outputs, num_drafts, compiles = json.loads(res.stdout.strip().splitlines()[-1])
    assert num_drafts > 0 and compiles == 0
    for p, got in zip(prompts, outputs):
        assert got == hf_greedy(target, p, 10)[0]
