"""Structured outputs on the embedded model: JSON schemas (property-based), regex, choice and
Lark grammars through the masked sampler variants, mixed with unconstrained requests,
under preemption, and bad specs."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from logprob_checks import check_outputs_close

from jaxserve.worker.sampler import SamplingTensors, apply_bitmask, bitmask_width, sample_jit
from scheduler import SamplingParams
from scheduler.structured_params import StructuredOutputsParams

# The same engine as test_engine_semantics (conftest shares engines of equal configs).
SMALL = dict(max_num_seqs=8, max_num_batched_tokens=64, num_pages=96, max_model_len=256)
PROMPT = "Reply with a JSON object.\n"


def run(engine, requests: list[tuple[str, SamplingParams]]):
    """Runs requests to completion together; returns their final outputs in order."""
    ids = [engine.add_prompt(p, sp) for p, sp in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


# ---------------------------------------------------------------------- the sampler
def test_bitmask_masks_logits_and_leaves_unmasked_rows_bit_identical():
    rng = np.random.default_rng(0)
    r, v = 4, 70
    logits = rng.normal(size=(r, v)).astype(np.float32)
    t = SamplingTensors.neutral(r, 2, 8, vocab_size=v)
    allowed = rng.random((r, v)) < 0.3
    allowed[1] = True  # row 1 unconstrained
    bits = np.zeros((r, bitmask_width(v) * 32), np.uint8)
    bits[:, :v] = allowed
    t.token_bitmask[:] = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    masked = np.asarray(apply_bitmask(logits, t.token_bitmask))
    np.testing.assert_array_equal(np.isfinite(masked), allowed)
    for greedy in (True, False):
        t.temperature[:] = 0.0 if greedy else 0.9
        on = sample_jit(logits, t, all_greedy=greedy, use_penalties=not greedy, use_top_k_top_p=not greedy,
                        use_bitmask=True)
        off = sample_jit(logits, t, all_greedy=greedy, use_penalties=not greedy, use_top_k_top_p=not greedy)
        ids = np.asarray(on.token_ids)
        assert all(allowed[i, ids[i]] for i in range(r))
        assert ids[1] == np.asarray(off.token_ids)[1]
        if greedy:
            np.testing.assert_array_equal(ids, np.where(allowed, logits, -np.inf).argmax(-1))


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="structured_outputs.json: not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="unknown fields"):
        SamplingParams(structured_outputs={"regexp": "a"})
    a = StructuredOutputsParams(json='{"type": "object", "required": ["a"]}')
    b = StructuredOutputsParams(json={"required": ["a"], "type": "object"})
    assert a.key == b.key  # one compiled grammar for both spellings


# ---------------------------------------------------------------------- property-based JSON
_NAMES = st.text("abcdefghij_", min_size=1, max_size=8)


def _leaf():
    return st.one_of(
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-1000, 1000), st.integers(0, 5000)),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.builds(lambda vals: {"enum": vals}, st.lists(st.text("xyz", min_size=1, max_size=4), min_size=1,
                                                        max_size=4, unique=True)),
        st.just({"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"}),
    )


def _object(children):
    def build(props, data):
        names = list(props)
        required = data.draw(st.lists(st.sampled_from(names), unique=True)) if names else []
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return st.builds(build, st.dictionaries(_NAMES, children, min_size=1, max_size=4), st.data())


def _schemas():
    return st.recursive(
        _leaf(),
        lambda children: st.one_of(
            _object(children),
            st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children,
                      st.integers(1, 3)),
            st.builds(lambda alts: {"anyOf": alts}, st.lists(children, min_size=2, max_size=2)),
        ),
        max_leaves=6,
    ).map(lambda s: s if s.get("type") == "object" else
          {"type": "object", "properties": {"value": s}, "required": ["value"], "additionalProperties": False})


SEEN_SCHEMAS: set[str] = set()


# 8 batches of 7 (each batch one engine run; no shrinking: a failing schema is printed whole)
@settings(max_examples=8, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(schemas=st.lists(_schemas(), min_size=7, max_size=7, unique_by=lambda s: json.dumps(s, sort_keys=True)))
def test_random_json_schemas_always_validate(warm_engine, schemas):
    engine = warm_engine
    compiles = engine.compiles_after_warmup  # the engine is shared: count this test's own
    SEEN_SCHEMAS.update(json.dumps(s, sort_keys=True) for s in schemas)
    try:
        reqs = [(PROMPT, SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=96,
                                        structured_outputs={"json": s})) for i, s in enumerate(schemas)]
        outs = run(engine, reqs)
        completed = 0
        for s, o in zip(schemas, outs):
            c = o.outputs[0]
            assert c.finish_reason in ("stop", "length"), (s, c.finish_reason, o.error)
            if c.finish_reason == "stop":  # `length` may cut the JSON short, as in vLLM
                jsonschema.validate(json.loads(c.text), s)
                completed += 1
        assert completed >= len(schemas) - 2, completed
        assert engine.compiles_after_warmup == compiles
    finally:
        from conftest import hand_back_idle

        hand_back_idle(engine)


def test_the_random_schemas_were_many_and_distinct():
    assert len(SEEN_SCHEMAS) >= 50, len(SEEN_SCHEMAS)  # runs after the property test above


# ---------------------------------------------------------------------- the other kinds
def test_regex_choice_grammar_and_unconstrained_in_one_batch(engine):
    compiles = engine.compiles_after_warmup
    alone = run(engine, [("The capital of France is", SamplingParams(temperature=0, max_tokens=12, logprobs=3))])[0]
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    reqs = [
        ("My phone number is", SamplingParams(temperature=0.7, seed=3, max_tokens=20,
                                              structured_outputs={"regex": r"\d{3}-\d{4}"})),
        ("Is water wet? Answer:", SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8,
                                                 structured_outputs={"choice": ["yes", "no", "maybe"]})),
        ("A tuple of numbers:", SamplingParams(temperature=0, max_tokens=40, structured_outputs={"grammar": lark})),
        ("The capital of France is", SamplingParams(temperature=0, max_tokens=12, logprobs=3)),
        ("Any JSON:", SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json_object": True})),
    ]
    regex, choice, grammar, free, obj = run(engine, reqs)
    assert re.fullmatch(r"\d{3}-\d{4}", regex.outputs[0].text)
    assert len(choice.outputs) == 2 and all(c.text in ("yes", "no", "maybe") for c in choice.outputs)
    if grammar.outputs[0].finish_reason == "stop":
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*\)", grammar.outputs[0].text)
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3})*,?", grammar.outputs[0].text)
    if obj.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.outputs[0].text), dict)
    # an unconstrained request is untouched by sharing masked steps (its tokens up to a near-tie:
    # another batch shape may round otherwise; the mask's own bit-exactness is tested above)
    check_outputs_close([alone.outputs[0]], [free.outputs[0]])
    assert engine.compiles_after_warmup == compiles


def test_constrained_requests_survive_preemption(engine):
    before = engine.scheduler.stats().preemptions["recompute"]
    pattern = r"(\d{2}, ){50}\d{2}"  # ~200 tokens each: 8 of them outgrow the 95-page cache
    reqs = [(f"List {i}: ", SamplingParams(temperature=0.5, seed=i, max_tokens=230,
                                           structured_outputs={"regex": pattern})) for i in range(8)]
    outs = run(engine, reqs)
    assert engine.scheduler.stats().preemptions["recompute"] > before
    for o in outs:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch(pattern, o.outputs[0].text), o.outputs[0]


def test_bad_specs_are_refused_and_others_keep_running(engine):
    for spec, field in (({"json": {"type": "frobnicate"}}, "json"), ({"regex": "a(b"}, "regex"),
                        ({"grammar": "start: nothing_defined"}, "grammar")):
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field}"):
            engine.input_processor.compile_grammar(SamplingParams(structured_outputs=spec))
    # A spec queued without validation fails when its compile finishes; the others still run.
    bad, good = run(engine, [("x", SamplingParams(structured_outputs={"regex": "(unclosed"})),
                             ("The sky is", SamplingParams(temperature=0, max_tokens=4))])
    assert bad.outputs[0].finish_reason == "error" and "structured_outputs.regex" in bad.error
    assert bad.error_param == "structured_outputs" and good.error_param is None  # the request's own input
    assert good.outputs[0].finish_reason == "length"


def test_a_grammar_that_allows_no_token_ends_with_an_error(engine):
    # After "ok" the grammar only allows EOS, which min_tokens bans: nothing is left to sample.
    out = run(engine, [("Say ok:", SamplingParams(temperature=0, max_tokens=10, min_tokens=5,
                                                  structured_outputs={"choice": ["ok"]}))])[0]
    assert out.outputs[0].finish_reason == "error"
    assert "allowed no token" in out.error and out.outputs[0].text == "ok"
    assert out.error_param == "structured_outputs"


def test_multi_host_step_carries_the_bitmask(monkeypatch):
    """The leader's broadcast of a masked step, replayed to a follower: same rows, same flags."""
    from jaxserve.worker import distributed
    from jaxserve.worker.batch import BatchBuilder, SequenceSpan
    from jaxserve.worker.compile_plan import sampler_variants
    from jaxserve.worker.input_batch import STOP_ID_WIDTH

    sent: list[np.ndarray] = []
    monkeypatch.setattr(distributed, "_broadcast", lambda x: sent.append(x.copy()) or x)
    v, rows, variants = 100, 4, sampler_variants(0)
    ch = distributed.StepChannel(16, 4, 2, STOP_ID_WIDTH, 32, variants, bitmask_width(v))
    arrays = BatchBuilder(16, 4, 2, 8).build([SequenceSpan(np.arange(1, 4, dtype=np.int32), 0, np.array([1, 0]))],
                                             16, 4)
    leader = SamplingTensors.neutral(rows, STOP_ID_WIDTH, 32, vocab_size=v)
    leader.token_bitmask[1] = np.arange(bitmask_width(v), dtype=np.int32) * 7 - 5
    flags = next(f for f in variants if f.use_bitmask and f.all_greedy)
    ch.send_step(arrays, leader, rows, flags)
    replay = iter(sent[1:])  # the header was read by the follower's loop
    monkeypatch.setattr(distributed, "_broadcast", lambda x: next(replay))
    follower = {rows: SamplingTensors.neutral(rows, STOP_ID_WIDTH, 32, vocab_size=v)}
    _, got, got_rows, got_flags = ch.recv_step(sent[0], follower)
    assert got_rows == rows and got_flags == flags
    np.testing.assert_array_equal(got.token_bitmask, leader.token_bitmask)
