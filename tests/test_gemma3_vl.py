"""Gemma 3 with images: greedy parity with transformers' generate on a tiny random
`Gemma3ForConditionalGeneration` (SigLIP tower, pooling projector, image tokens attending to
each other in both directions, a sliding window smaller than an image), images never split
across prefill chunks, the encoder's rows and the preprocessing equal transformers', and a
step budget smaller than an image refused by name."""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from logprob_checks import check_greedy_close, top_from_array, top_k_of  # noqa: E402

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

BOI, EOI, SOFT = 290, 291, 292
TOKENS_PER_IMAGE = 16  # 112-px images, 14-px patches: an 8 x 8 grid pooled 2 x 2
MAX_NEW = 8
SPECIALS = {BOI: "<start_of_image>", EOI: "<end_of_image>", SOFT: "<image_soft_token>", 293: "<start_of_turn>",
            294: "<end_of_turn>", 295: "<unk>", 296: "<pad>", 297: "<bos>"}
CHAT_TEMPLATE = ("{% for m in messages %}<start_of_turn>{{ m.role }} {% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<start_of_image>{% else %}{{ c.text }}"
                 "{% endif %}{% endfor %}{% endif %} <end_of_turn> {% endfor %}"
                 "{% if add_generation_prompt %}<start_of_turn>model {% endif %}")
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(32,), page_size=4, max_model_len=256,
              num_pages=160, max_logprobs=5, structured_outputs=False, compilation_cache_dir=None, dtype="float32",
              strict_compile_guard=True, limit_mm_per_prompt={"image": 2})


def _save_tokenizer(path: pathlib.Path) -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(BOI)} | {text: i for i, text in SPECIALS.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS.values()])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": "<end_of_turn>",
        "pad_token": "<pad>", "unk_token": "<unk>"}))


def _image(w: int, h: int, seed: int):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from jaxserve import LLM

    path = tmp_path_factory.mktemp("gemma3_vl") / "tiny"
    cfg = transformers.Gemma3Config(
        # a sliding window (8) smaller than an image (16 tokens): the window still bounds an
        # image token's view from below, as transformers' mask does
        text_config=dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention"],
                         max_position_embeddings=1024),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=112, patch_size=14),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=SOFT)
    torch.manual_seed(7)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval().float()
    with torch.no_grad():  # sharp logits (greedy picks are not near-ties); a projector that matters
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "vision_tower" not in name:
                p.mul_(3.0)
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "size": {"height": 112, "width": 112},
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 2, "do_pan_and_scan": False}))
    _save_tokenizer(path)
    return model, LLM(model=str(path), **ENGINE), path


def _hf_pixels(images):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    proc = Gemma3ImageProcessorPil(size={"height": 112, "width": 112}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return proc(images, return_tensors="pt")["pixel_values"]


def _expand(ids):
    out = []
    for t in ids:
        out += [BOI, *[SOFT] * TOKENS_PER_IMAGE, EOI] if t == BOI else [t]
    return out


def _hf_greedy(model, ids, images):
    x = torch.tensor([_expand(ids)])
    kw = {}
    if images:
        kw = dict(pixel_values=_hf_pixels(images), token_type_ids=(x == SOFT).long())
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                             pad_token_id=0, **kw)
    logp = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1).numpy()
    return out.sequences[0, x.shape[1]:].tolist(), logp, x.shape[1]


def _prompt(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def _check(llm_out, ref, name):
    want, want_logp, n_prompt = ref
    assert len(llm_out.prompt_token_ids) == n_prompt, name
    check_greedy_close(want, top_from_array(want_logp), llm_out.outputs[0].token_ids,
                       top_k_of(llm_out.outputs[0].logprobs), name=name, top_k=5)


def test_preprocessing_and_encoder_rows_equal_transformers(gemma):
    """Patches from the PIL backend's pixels exactly (resize, rescale, normalise); the tower,
    pooling, norm and projection through the warmed program within 1e-5."""
    from jaxserve.multimodal.gemma3_preprocess import Gemma3ImageConfig, preprocess_gemma3_image

    hf, llm, _ = gemma
    images = [_image(150, 90, 1), _image(64, 200, 2)]
    want_pixels = _hf_pixels(images).numpy()  # [N, 3, 112, 112]
    cfg = Gemma3ImageConfig(image_size=112, patch_size=14, tokens_per_image=TOKENS_PER_IMAGE)
    vision = llm.engine.runner.vision
    for i, im in enumerate(images):
        got = preprocess_gemma3_image(im, cfg)
        patches = want_pixels[i].reshape(3, 8, 14, 8, 14).transpose(1, 3, 0, 2, 4).reshape(64, 3 * 14 * 14)
        np.testing.assert_array_equal(got.pixel_values, patches)
        assert got.num_tokens == TOKENS_PER_IMAGE
        rows = vision.encode(got.pixel_values, got.grid_thw)  # [tokens, 1, E]
        with torch.no_grad():
            ref = hf.model.get_image_features(torch.from_numpy(want_pixels[i:i + 1]))
        ref = getattr(ref, "pooler_output", ref)
        np.testing.assert_allclose(rows[:, 0], np.asarray(ref).reshape(TOKENS_PER_IMAGE, -1), atol=1e-5, rtol=1e-5)
    assert 1 in vision.executables  # the one encoder program was planned and warmed


def test_greedy_matches_transformers_with_bidirectional_images(gemma):
    """One image, two, and a text prompt in one batch; an image that would straddle the
    32-token step boundary runs whole in the next step."""
    from jaxserve import SamplingParams

    hf, llm, _ = gemma
    one, two, three = _image(112, 112, 3), _image(200, 80, 4), _image(90, 160, 5)
    prompts = [([5, 6, BOI, 7, 8], [one]),
               ([5, *range(10, 30), BOI, 11, BOI, 12], [two, three]),  # the first image starts at 22
               ([3, 4, 5, 6, 7], [])]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate([_prompt(ids, ims) for ids, ims in prompts], params, use_tqdm=False)
    for i, ((ids, ims), out) in enumerate(zip(prompts, outs)):
        _check(out, _hf_greedy(hf, ids, ims), f"prompt {i}")
    assert llm.engine.runner.guard.compiles_after_warmup == 0


def test_image_tokens_attend_both_ways_as_transformers_does(gemma):
    """Prompt logprobs through the image (its tokens' logits depend on the image's later
    tokens): equal to transformers' forward with its bidirectional image mask within 2e-3,
    while transformers' causal-only forward is off by more than 0.1 there."""
    from jaxserve import SamplingParams

    hf, llm, _ = gemma
    ids, image = [5, 6, BOI, 7, 8], _image(112, 112, 3)
    out = llm.generate([_prompt(ids, [image])], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    x = torch.tensor([_expand(ids)])
    assert out.prompt_token_ids == x[0].tolist()
    got = np.array([entry[tok].logprob for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])
    with torch.no_grad():
        logits = {bidi: hf(input_ids=x, pixel_values=_hf_pixels([image]),
                           **({"token_type_ids": (x == SOFT).long()} if bidi else {})).logits[0]
                  for bidi in (True, False)}
    want = {bidi: torch.log_softmax(v.float(), -1)[torch.arange(x.shape[1] - 1), x[0, 1:]].numpy()
            for bidi, v in logits.items()}
    np.testing.assert_allclose(got, want[True], atol=2e-3)
    assert np.abs(want[False] - want[True]).max() > 0.1


def test_prefix_hit_and_chat(gemma):
    """The same image behind the same text hits the prefix cache with the same tokens; a chat
    message with an image part renders `<start_of_image>` and answers as its token-id prompt."""
    from jaxserve import SamplingParams

    hf, llm, _ = gemma
    im = _image(120, 120, 6)
    ids = [7, 8, 9, 10, 11, 12, 13, 14, 15, BOI, 20, 21]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    a = llm.generate([_prompt(ids, [im])], params, use_tqdm=False)[0]
    again = llm.generate([_prompt(ids, [im])], params, use_tqdm=False)[0]
    assert again.usage.cached_tokens >= len(a.prompt_token_ids) - 4
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    _check(a, _hf_greedy(hf, ids, [im]), "first")
    chat = llm.chat([{"role": "user", "content": [{"type": "text", "text": "t7 t8"},
                                                  {"type": "image_pil", "image_pil": im}]}], params, use_tqdm=False)[0]
    tok = llm.engine.tokenizer
    rendered = tok("<start_of_turn>user t7 t8<start_of_image> <end_of_turn> <start_of_turn>model",
                   add_special_tokens=False)["input_ids"]
    assert chat.prompt_token_ids == _expand(rendered)
    _check(chat, _hf_greedy(hf, rendered, [im]), "chat")


def test_a_step_smaller_than_an_image_is_refused_by_name(gemma):
    from jaxserve import LLM

    with pytest.raises(ValueError, match="max_num_batched_tokens.*16 tokens in one step"):
        LLM(model=str(gemma[2]), **{**ENGINE, "max_num_batched_tokens": 8, "token_buckets": (8,)})


def test_text_only_mode_serves_the_language_model_as_gemma3_text(gemma):
    """`limit_mm_per_prompt=0`: the decoder alone, as the Gemma 3 text family (which takes
    tensor parallelism and LoRA), with the same tokens as the image engine on text; an image
    is refused by name."""
    from jaxserve import LLM, SamplingParams

    _, llm, path = gemma
    text = LLM(model=str(path), **{**ENGINE, "limit_mm_per_prompt": 0})
    assert text.engine.model_config.architecture == "gemma3" and text.engine.model_config.vision is None
    assert text.engine.runner.vision is None
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [3, 4, 5, 6, 7, 8]
    want = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert text.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="takes no images"):
        text.generate([_prompt([5, BOI], [_image(50, 50, 9)])], params, use_tqdm=False)


_TP_CHILD = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
sys.path.insert(0, TESTS_DIR)
from logprob_checks import top_k_of
from jaxserve import LLM, SamplingParams
import test_gemma3_vl as g
import test_qwen_vl as q

result = {}
params = SamplingParams(temperature=0, max_tokens=g.MAX_NEW, ignore_eos=True, logprobs=5)
for name, path, engine, prompt in [
        ("gemma3_vl", sys.argv[1], g.ENGINE, g._prompt([5, 6, g.BOI, 7, 8], [g._image(112, 112, 3)])),
        ("qwen2_5_vl", sys.argv[2], q.ENGINE, q._prompt([5, 6, q.START, q.IMAGE, q.END, 7, 8], [q._image(84, 112, 0)]))]:
    llm = LLM(model=path, **{**engine, "tensor_parallel_size": 2, "max_num_seqs": 2})
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    result[name] = [out.outputs[0].token_ids, top_k_of(out.outputs[0].logprobs), len(out.prompt_token_ids),
                    llm.engine.runner.guard.compiles_after_warmup]
print(json.dumps(result))
""".replace("TESTS_DIR", repr(str(pathlib.Path(__file__).parent)))


def test_tensor_parallel_with_images_gives_transformers_tokens(gemma, tmp_path):
    """Two virtual CPU devices, TP=2 (each device its heads; the encoder, the image rows and
    `attend_until` replicated): Gemma 3 and Qwen2.5-VL with an image give transformers' greedy
    tokens (vLLM's near-tie rule), nothing compiled after warmup."""
    import subprocess

    import test_qwen_vl as q

    hf, _, path = gemma
    qwen_path = tmp_path / "qwen2_5_vl"
    qwen = q._save(qwen_path)
    res = subprocess.run([sys.executable, "-c", _TP_CHILD, str(path), str(qwen_path)], capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    refs = {"gemma3_vl": _hf_greedy(hf, [5, 6, BOI, 7, 8], [_image(112, 112, 3)]),
            "qwen2_5_vl": q._hf_greedy(qwen, [5, 6, q.START, q.IMAGE, q.END, 7, 8], [q._image(84, 112, 0)])}
    for name, (want, want_logp, n_prompt) in refs.items():
        tokens, top, got_prompt, compiles = result[name]
        assert got_prompt == n_prompt and compiles == 0, name
        check_greedy_close(want, top_from_array(want_logp), tokens, top_k_of(top), name=f"{name} tp2", top_k=5)


def test_converted_checkpoint_keeps_the_image_encoder(gemma, tmp_path):
    """`jaxserve convert` saves the tower and projector beside the params; the orbax
    checkpoint restores the same config (vision included) and encoder weights."""
    from jaxserve.cli import main
    from jaxserve.loading import load_model

    src = str(gemma[2])
    assert main(["convert", src, str(tmp_path / "ckpt")]) == 0
    restored, original = load_model(str(tmp_path / "ckpt"), "float32"), load_model(src, "float32")
    assert restored.config == original.config and restored.config.vision is not None
    assert sorted(restored.vision) == sorted(original.vision)
    for name, arr in original.vision.items():
        np.testing.assert_array_equal(restored.vision[name], arr, err_msg=name)
