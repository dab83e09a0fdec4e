"""Qwen2.5-VL and Qwen3-VL: greedy parity with transformers' generate on tiny random checkpoints with
synthetic images (one image, two, images of different sizes in one batch, chunked prefill
through an image), the encoder once per image and its cache bounded, prefix hits on the same
image and none on another, no compilation after warmup, and bad image inputs refused by name
while the engine keeps serving. (Image decoding and preprocessing: test_multimodal_inputs.)"""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from logprob_checks import check_greedy_close, top_from_array, top_k_of  # noqa: E402

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
Image = pytest.importorskip("PIL.Image")

IMAGE, START, END = 250, 248, 249
MAX_NEW = 8
# max_pixels 28*28*80: a program of at most a few windows; larger images are resized down.
PREPROCESSOR = {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 80, "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2}
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, token_buckets=(16,), page_size=4, max_model_len=256,
              num_pages=160, max_logprobs=5, structured_outputs=False, compilation_cache_dir=None, dtype="float32",
              strict_compile_guard=True, limit_mm_per_prompt={"image": 2})


SPECIALS = {248: "<|vision_start|>", 249: "<|vision_end|>", 250: "<|image_pad|>", 251: "<|video_pad|>",
            252: "<|im_start|>", 253: "<|im_end|>", 254: "<unk>", 255: "<pad>"}
# Qwen2-VL's chat template in small: an image part is its vision markers around one placeholder.
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {% if m.content is string %}{{ m.content }}"
                 "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<|vision_start|><|image_pad|>"
                 "<|vision_end|>{% else %}{{ c.text }}{% endif %}{% endfor %}{% endif %} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def _save_tokenizer(path) -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0" .. "t247" and the specials)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(248)} | {text: i for i, text in SPECIALS.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS.values()])
    tok.save(str(pathlib.Path(path) / "tokenizer.json"))
    (pathlib.Path(path) / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<pad>", "unk_token": "<unk>"}))


def _image(w: int, h: int, seed: int):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8))


def _save(path) -> object:
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1], window_size=112),
        image_token_id=IMAGE, video_token_id=251, vision_start_token_id=START, vision_end_token_id=END,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(3)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval().float()
    with torch.no_grad():  # sharp logits: greedy picks are not near-ties
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "visual" not in name:
                p.mul_(3.0)
    model.save_pretrained(path)
    (pathlib.Path(path) / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    _save_tokenizer(path)
    return model


def _hf_greedy(model, ids: list[int], images: list, max_new: int = MAX_NEW, preprocessor: dict = PREPROCESSOR):
    """transformers' generate on the placeholders expanded as its processor expands them."""
    from jaxserve.multimodal.qwen_vl_preprocess import QwenVLImageConfig, preprocess_image

    cfg = QwenVLImageConfig.from_preprocessor_config(preprocessor)
    done = [preprocess_image(im, cfg) for im in images]
    expanded, k = [], 0
    for t in ids:
        expanded += [IMAGE] * done[k].num_tokens if t == IMAGE else [t]
        k += t == IMAGE
    x = torch.tensor([expanded])
    kw = {}
    if done:
        kw = dict(pixel_values=torch.from_numpy(np.concatenate([d.pixel_values for d in done])),
                  image_grid_thw=torch.tensor([d.grid_thw for d in done]), mm_token_type_ids=(x == IMAGE).int())
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                             pad_token_id=0, **kw)
    logp = torch.log_softmax(torch.stack(out.scores)[:, 0].float(), -1).numpy()
    return out.sequences[0, len(expanded):].tolist(), logp, len(expanded)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from jaxserve import LLM

    path = tmp_path_factory.mktemp("qwen2_5_vl") / "tiny"
    hf = _save(path)
    return hf, LLM(model=str(path), **ENGINE)


def _prompt(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


# Qwen3-VL: patch 16, mean/std 0.5, DeepStack from two of three blocks, interleaved M-RoPE.
PREPROCESSOR3 = {"min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 80, "patch_size": 16, "merge_size": 2,
                 "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


@pytest.fixture(scope="module")
def vl3(tmp_path_factory):
    from jaxserve import LLM

    path = tmp_path_factory.mktemp("qwen3_vl") / "tiny"
    cfg = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}, bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 2]),
        image_token_id=IMAGE, video_token_id=251, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False)
    torch.manual_seed(4)
    model = transformers.Qwen3VLForConditionalGeneration(cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "visual" not in name:
                p.mul_(3.0)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR3))
    return model, LLM(model=str(path), **{**ENGINE, "num_pages": 96})


def test_qwen3_vl_greedy_matches_transformers_with_deepstack_and_chunks(vl3):
    """Qwen3-VL: DeepStack rows into the first two decoder layers and interleaved M-RoPE; one
    image, two of different sizes, a text prompt, and a 50-token image through 16-token chunks
    (its DeepStack rows split across steps as its embeddings are); a prefix hit on the same image."""
    from jaxserve import SamplingParams

    hf, llm = vl3
    small, wide, tall = _image(96, 128, 20), _image(320, 160, 21), _image(70, 220, 22)
    prompts = [([5, 6, START, IMAGE, END, 7, 8], [small]),
               ([5, START, IMAGE, END, 11, START, IMAGE, END, 12], [wide, tall]),
               ([3, 4, 5, 6, 7], [])]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outs = llm.generate([_prompt(ids, ims) for ids, ims in prompts], params, use_tqdm=False)
    for i, ((ids, ims), out) in enumerate(zip(prompts, outs)):
        _check(out, _hf_greedy(hf, ids, ims, preprocessor=PREPROCESSOR3), f"qwen3_vl prompt {i}")
    again = llm.generate([_prompt(*prompts[1])], params, use_tqdm=False)[0]
    assert again.usage.cached_tokens >= len(outs[1].prompt_token_ids) - 4
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert llm.engine.runner.guard.compiles_after_warmup == 0


def _check(llm_out, ref, name):
    want, want_logp, n_prompt = ref
    got = llm_out.outputs[0].token_ids
    assert len(llm_out.prompt_token_ids) == n_prompt, name
    check_greedy_close(want, top_from_array(want_logp), got, top_k_of(llm_out.outputs[0].logprobs), name=name,
                       top_k=5)


def test_greedy_matches_transformers_with_images(vl):
    """One image, two, images of different sizes beside a text-only prompt in one batch; the
    50-token image runs through 16-token chunks (chunked prefill splits its rows)."""
    from jaxserve import SamplingParams

    hf, llm = vl
    small, wide, tall = _image(84, 112, 0), _image(280, 140, 1), _image(60, 200, 2)
    prompts = [([5, 6, START, IMAGE, END, 7, 8], [small]),
               ([5, START, IMAGE, END, 11, START, IMAGE, END, 12], [wide, tall]),
               ([9, START, IMAGE, END, 3], [tall]),
               ([3, 4, 5, 6, 7], [])]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    runner = llm.engine.runner
    encoded = runner.vision.num_encoded
    outs = llm.generate([_prompt(ids, ims) for ids, ims in prompts], params, use_tqdm=False)
    for i, ((ids, ims), out) in enumerate(zip(prompts, outs)):
        _check(out, _hf_greedy(hf, ids, ims), f"prompt {i}")
    assert runner.vision.num_encoded - encoded == 3  # small, wide, tall: each once, the chunks from the cache
    assert runner.guard.compiles_after_warmup == 0


def test_prefix_hit_on_the_same_image_and_none_on_another(vl):
    from jaxserve import SamplingParams

    hf, llm = vl
    text = [7, 8, 9, 10, 11, 12, 13, 14, START, IMAGE, END, 20, 21]
    first, other = _image(112, 112, 5), _image(112, 112, 6)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    a = llm.generate([_prompt(text, [first])], params, use_tqdm=False)[0]
    again = llm.generate([_prompt(text, [first])], params, use_tqdm=False)[0]
    swapped = llm.generate([_prompt(text, [other])], params, use_tqdm=False)[0]
    n_prompt = len(a.prompt_token_ids)
    assert again.usage.cached_tokens >= n_prompt - 4  # every full block of the prompt (page_size 4)
    assert swapped.usage.cached_tokens <= 8  # the 9 text tokens before the image: 2 full blocks at most
    assert again.outputs[0].token_ids == a.outputs[0].token_ids
    _check(a, _hf_greedy(hf, text, [first]), "first image")
    _check(swapped, _hf_greedy(hf, text, [other]), "another image behind the same text")


def test_bad_image_inputs_are_refused_by_name_and_the_engine_keeps_serving(vl):
    from jaxserve import SamplingParams

    _, llm = vl
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    good = _image(56, 56, 9)
    cases = [
        (_prompt([START, IMAGE, END], [b"\x89PNG\r\n\x1a\n-truncated"]), "multi_modal_data.image[0]"),
        (_prompt([START, IMAGE, END, IMAGE, IMAGE], [good] * 3), "limit_mm_per_prompt"),
        (_prompt([START, IMAGE, END], [good, good]), "placeholder"),
        (_prompt([START, IMAGE, END], ["file:///etc/passwd"]), "multi_modal_data.image[0]"),
        (_prompt([START, IMAGE, END], ["http://example.com/cat.png"]), "allowed-media-domains"),
    ]
    for prompt, needle in cases:
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            llm.generate([prompt], params, use_tqdm=False)
    out = llm.generate([_prompt([START, IMAGE, END, 4], [good])], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    assert not llm.engine.has_unfinished_requests()


def _data_url(image) -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_openai_client_sends_a_base64_image_to_the_server_and_bad_parts_are_400s(vl):
    """The official client's chat call with an image_url part gets the batch API's greedy answer
    for the same conversation; a corrupt image, an SVG, a URL of a host not allowed and too
    many images are each a 400 naming the content part, and the server keeps serving."""
    import openai
    from server_harness import ServerThread

    from jaxserve.config.engine_config import EngineConfig
    from server.app import ServerOptions

    _, llm = vl
    engine = llm.engine
    srv = ServerThread(EngineConfig(model=engine.config.model), ServerOptions(
        host="127.0.0.1", port=0, metrics_port=0, http_port=0, log_interval=0), engine=engine)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.server.http_port}/v1", api_key="none", max_retries=0)
        picture = _image(140, 84, 11)
        content = [{"type": "text", "text": "t5 t6"}, {"type": "image_url", "image_url": {"url": _data_url(picture)}},
                   {"type": "text", "text": "t7"}]
        name = client.models.list().data[0].id
        reply = client.chat.completions.create(model=name, max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": content}])
        ids = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "t5 t6"}, {"type": "image"},
                                          {"type": "text", "text": "t7"}]}],
            tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ids.count(IMAGE) == 1
        want = batch_text(srv, ids, picture)
        assert reply.choices[0].message.content == want
        assert reply.usage.prompt_tokens == len(ids) - 1 + 15  # 140x84 -> 10x6 patches -> 15 tokens
        bad = [({"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="}, "messages[0].content[1]"),
               ({"url": "data:image/svg+xml;base64,PHN2Zy8+"}, "messages[0].content[1]"),
               ({"url": "https://example.com/cat.png"}, "messages[0].content[1]")]
        for image_url, param in bad:
            parts = [content[0], {"type": "image_url", "image_url": image_url}]
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=name, max_tokens=2, messages=[{"role": "user", "content": parts}])
            assert e.value.body["param"] == param and "base64" not in e.value.body["message"].split(":", 1)[-1]
        many = [content[1]] * 3
        with pytest.raises(openai.BadRequestError, match="limit_mm_per_prompt"):
            client.chat.completions.create(model=name, max_tokens=2, messages=[{"role": "user", "content": many}])
        again = client.chat.completions.create(model=name, max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": content}])
        assert again.choices[0].message.content == want
        _check_grpc(srv, ids, picture, want)
        metrics = httpx_get(f"http://127.0.0.1:{srv.server.http_port}/metrics")
        counts = dict(re.findall(r"^jaxserve:(mm_\w+) ([0-9.e+]+)$", metrics, re.M))
        assert float(counts["mm_images_encoded_total"]) >= 1 and float(counts["mm_encoder_cache_hits_total"]) >= 3
    finally:
        srv.close()


def _check_grpc(srv, ids, picture, want: str) -> None:
    """gRPC: image bytes beside a token-id prompt (one placeholder, expanded by the engine) and
    in a chat message; corrupt bytes are INVALID_ARGUMENT naming the field."""
    import io

    import grpc

    from server.proto import jaxserve_pb2 as pb
    from server.proto import jaxserve_pb2_grpc as pb_grpc

    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    params = pb.SamplingParams(max_tokens=4, temperature=0.0)
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.JaxServeStub(ch)
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), images=[buf.getvalue()], sampling_params=params)
        assert "".join(d.text for r in stub.Generate(req, timeout=60) for d in r.outputs) == want
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="t5 t6", images=[buf.getvalue()])])
        got = list(stub.Generate(pb.GenerateRequest(chat=chat, sampling_params=params), timeout=60))
        assert got[-1].finished and got[-1].usage.prompt_tokens > 15
        bad = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), images=[b"\x89PNG broken"], sampling_params=params)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad, timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "images[0]" in e.value.details()


def httpx_get(url: str) -> str:
    import httpx

    r = httpx.get(url, timeout=30)
    assert r.status_code == 200, r.text
    return r.text


def batch_text(srv, ids, picture) -> str:
    from server_harness import batch_generate

    from jaxserve import SamplingParams

    out = batch_generate(srv, [{"prompt_token_ids": ids, "multi_modal_data": {"image": [picture]}}],
                         SamplingParams(temperature=0, max_tokens=4))
    return out[0].outputs[0].text


def test_encoder_matches_transformers_vision_tower_over_padded_window_slots(vl):
    """Windows padded to fixed slots give transformers' packed windows, for grids of one to six
    windows, through the runner's warmed programs (six windows run in the 8-window one)."""
    from jaxserve.models import qwen_vision as qv

    hf, llm = vl
    vision = llm.engine.runner.vision
    for grid in [(1, 4, 4), (1, 8, 12), (1, 20, 10), (1, 2, 6)]:
        px = np.random.RandomState(sum(grid)).randn(grid[1] * grid[2], vision.vc.patch_dim).astype(np.float32)
        with torch.no_grad():
            want = hf.model.visual(torch.from_numpy(px), grid_thw=torch.tensor([grid])).pooler_output.numpy()
        got = vision.encode(px, grid)[:, 0]
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=str(grid))
    assert qv.vision_layout((1, 20, 10), vision.vc).num_windows == 6 and 8 in vision.buckets
    assert llm.engine.runner.guard.compiles_after_warmup == 0


def test_encoder_cache_is_bounded_and_least_recently_used_goes_first():
    from jaxserve.worker.vision import EncoderCache

    cache = EncoderCache(max_bytes=3 * 400)
    rows = {k: np.full((10, 10), i, np.float32) for i, k in enumerate("abcd")}  # 400 bytes each
    for k in "abc":
        cache.put(k, rows[k])
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("d", rows["d"])
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("d") is not None
    assert cache.nbytes <= cache.max_bytes and len(cache) == 3
    cache.put("huge", np.zeros((100, 100), np.float32))  # larger than the budget: never kept
    assert cache.get("huge") is None and len(cache) == 3


def test_text_model_refuses_images():
    from jaxserve.engine.input_processor import InputError, InputLimits, InputProcessor

    proc = InputProcessor(InputLimits(vocab_size=256, max_model_len=64, max_logprobs=5, max_n=4))
    with pytest.raises(InputError, match="takes no images"):
        proc.image_prompt([1, 2, 3], [(b"png", "multi_modal_data.image[0]")])


def test_processor_kwargs_bound_the_images_and_the_encoder_programs(vl):
    """`mm_processor_kwargs` replaces the checkpoint's resize bounds: a lower max_pixels means
    fewer tokens per image and a smaller largest encoder program; other keys are refused."""
    from jaxserve.config.engine_config import EngineConfig, vision_windows
    from jaxserve.engine.llm_engine import Engine
    from jaxserve.loading import load_model

    _, llm = vl
    loaded = load_model(llm.engine.config.model)
    small = Engine._load(EngineConfig(mm_processor_kwargs={"max_pixels": 28 * 28 * 16}), loaded).config
    assert small.vision.max_pixels == 28 * 28 * 16 and loaded.config.vision.max_pixels == 28 * 28 * 80
    assert vision_windows(small)[-1] < vision_windows(loaded.config)[-1]
    with pytest.raises(ValueError, match="only min_pixels and max_pixels"):
        EngineConfig(mm_processor_kwargs='{"fps": 2}')


def test_llm_chat_takes_image_parts_as_the_openai_api_does(vl):
    """`LLM.chat` with an `image_url` part (a data URL) and a PIL `image_pil` part answers as
    `generate` on the same template ids and images."""
    from jaxserve import SamplingParams

    _, llm = vl
    a, b = _image(84, 84, 30), _image(112, 56, 31)
    params = SamplingParams(temperature=0, max_tokens=4)
    content = [{"type": "text", "text": "t5"}, {"type": "image_url", "image_url": {"url": _data_url(a)}},
               {"type": "image_pil", "image_pil": b}, {"type": "text", "text": "t6"}]
    chat = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False)[0]
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "t5"}, {"type": "image"}, {"type": "image"},
                                      {"type": "text", "text": "t6"}]}],
        tokenize=True, add_generation_prompt=True, return_dict=False)
    plain = llm.generate([_prompt(ids, [a, b])], params, use_tqdm=False)[0]
    assert chat.prompt_token_ids == plain.prompt_token_ids and IMAGE in chat.prompt_token_ids
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids
