"""Weight updates in place (RL rollouts): a second checkpoint of the same shapes gives what a
fresh engine on it gives, with nothing compiled; bad sources change nothing."""

from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config.engine_config import EngineConfig
from scheduler import SamplingParams

TINY = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=32, page_size=4, max_model_len=64,
            max_logprobs=2, structured_outputs=False, compilation_cache_dir=None, warmup_threads=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny Llama checkpoints of the same shapes (different seeds), and the second's tensors
    (the first's as `checkpoints.first_tensors`)."""
    torch = pytest.importorskip("torch")
    import transformers

    paths, tensors, all_tensors = [], None, []
    for seed in (0, 1):
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = transformers.LlamaForCausalLM(cfg)
        path = tmp_path_factory.mktemp(f"ckpt{seed}")
        model.save_pretrained(path)
        paths.append(str(path))
        tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        all_tensors.append(tensors)
    _FIRST.update(all_tensors[0])
    return paths, tensors


_FIRST: dict = {}  # the first checkpoint's tensors (filled by the fixture)


def _outputs(engine) -> list:
    prompts = [[5, 9, 17, 3, 8, 1], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)
    ids = [engine.add_prompt(None, params, prompt_token_ids=p) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (c.token_ids, [round(e[t].logprob, 4) for t, e in zip(c.token_ids, c.logprobs)])
    return [done[i] for i in ids]


def test_an_update_reproduces_a_fresh_engine_with_nothing_compiled(checkpoints):
    from jaxserve.engine.llm_engine import Engine

    (first, second), tensors = checkpoints
    want = _outputs(Engine(EngineConfig(model=second, **TINY)))
    engine = Engine(EngineConfig(model=first, strict_compile_guard=True, **TINY))
    engine.warmup()
    before = _outputs(engine)
    assert before != want  # the two checkpoints differ: the test can fail
    engine.add_prompt(None, SamplingParams(max_tokens=30), prompt_token_ids=[1, 2, 3], request_id="in-flight")
    engine.step()
    assert engine.update_weights(second) == 1
    assert not engine.has_unfinished_requests() and engine.scheduler.stats().num_used_blocks == 0
    assert _outputs(engine) == want
    assert engine.update_weights({k: v for k, v in tensors.items()}) == 2  # the same weights, from memory
    assert _outputs(engine) == want
    assert engine.update_weights(first) == 3
    assert _outputs(engine) == before
    assert engine.runner.guard.compiles_after_warmup == 0


def test_a_bad_source_names_the_tensor_and_changes_nothing(checkpoints, tmp_path):
    from jaxserve.engine.llm_engine import Engine

    (first, _), tensors = checkpoints
    engine = Engine(EngineConfig(model=first, **TINY))
    want = _outputs(engine)
    bad = dict(tensors)
    bad["model.layers.1.mlp.down_proj.weight"] = np.zeros((32, 48), np.float32)
    with pytest.raises(ValueError, match=r"tensor .model.layers.1.mlp.down_proj.weight. has shape \(32, 48\), "
                                         r"expected \(32, 64\)"):
        engine.update_weights(bad)
    with pytest.raises(ValueError, match="holds no tensor of this model"):
        engine.update_weights({})
    with pytest.raises(FileNotFoundError):
        engine.update_weights(str(tmp_path / "nothing-here"))
    assert engine.weights_version == 0 and _outputs(engine) == want


def test_sleep_frees_device_memory_and_wake_up_serves_the_same(checkpoints):
    """Level 1 frees the KV cache, level 2 the weights too (the live device arrays shrink by
    as much); asleep, the batch API refuses requests and an update lands in the host copy;
    awake, outputs are a fresh engine's, with nothing compiled."""
    import jax

    from jaxserve.engine.llm_engine import Engine

    (first, second), _ = checkpoints
    fresh_second = _outputs(Engine(EngineConfig(model=second, **TINY)))  # before the guard counts
    engine = Engine(EngineConfig(model=first, strict_compile_guard=True, **TINY))
    engine.warmup()
    want = _outputs(engine)
    awake = engine.runner.device_bytes()
    assert awake["weights"] > 0 and awake["kv_cache"] > 0

    def live() -> int:
        return sum(x.nbytes for x in jax.live_arrays())

    before = live()
    engine.sleep(1)
    assert engine.runner.device_bytes() == {"weights": awake["weights"], "kv_cache": 0}
    assert before - live() >= awake["kv_cache"]
    with pytest.raises(RuntimeError, match="asleep"):
        engine.add_prompt(None, SamplingParams(), prompt_token_ids=[1, 2])
    engine.sleep(2)
    assert engine.runner.device_bytes() == {"weights": 0, "kv_cache": 0}
    assert before - live() >= awake["kv_cache"] + awake["weights"]
    engine.wake_up()
    assert engine.runner.device_bytes() == awake and _outputs(engine) == want
    engine.sleep(2)
    engine.update_weights(second)  # into the host copy
    assert engine.runner.device_bytes()["weights"] == 0
    engine.wake_up()
    assert _outputs(engine) == fresh_second
    with pytest.raises(ValueError, match="sleep level must be 1"):
        engine.sleep(3)
    assert engine.runner.guard.compiles_after_warmup == 0


def test_a_partial_update_changes_exactly_the_tensors_given(checkpoints):
    """Two tensors of the second checkpoint (layer 0's q_proj, a slice of the fused qkv, and
    layer 1's down_proj, one layer of a stacked array) into an engine on the first: it then
    answers as a fresh engine on the first checkpoint with just those two replaced."""
    from jaxserve.engine.llm_engine import Engine

    (first, _), second = checkpoints
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"]
    mixed = {**_FIRST, **{n: second[n] for n in names}}
    want = _outputs(_engine_from(mixed, first))
    engine = Engine(EngineConfig(model=first, **TINY))
    before = _outputs(engine)
    assert engine.update_weights({n: second[n] for n in names}) == 1
    assert _outputs(engine) == want != before
    with pytest.raises(ValueError, match=r"not of this model: \['model.layers.0.self_attn.q_proj.weigth'\]"):
        engine.update_weights({"model.layers.0.self_attn.q_proj.weigth": second[names[0]]})
    assert engine.weights_version == 1


def _engine_from(tensors: dict, config_path: str):
    """A fresh engine on the first checkpoint, then fully updated to `tensors`."""
    from jaxserve.engine.llm_engine import Engine

    engine = Engine(EngineConfig(model=config_path, **TINY))
    engine.update_weights(tensors)
    return engine
