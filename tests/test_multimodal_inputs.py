"""Image inputs for vision-language models: every hostile input is refused with an
ImageInputError naming the field and never echoing the payload, good inputs decode to the
RGB transformers would see, and the Qwen-VL preprocessing matches transformers' own
processor bit for bit. Local only: remote fetches go to an http.server on 127.0.0.1."""

from __future__ import annotations

import base64
import http.server
import io
import pickle
import struct
import threading
import time
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from jaxserve.multimodal import images as images_mod
from jaxserve.multimodal.images import (
    ImageInputError,
    ImageLimits,
    decode_image,
    fetch_url,
    image_hash,
    load_image,
    parse_data_url,
)
from jaxserve.multimodal.qwen_vl_preprocess import (
    ProcessedImage,
    QwenVLImageConfig,
    preprocess_image,
    smart_resize,
)

WHERE = "messages[0].content[1]"
LIMITS = ImageLimits()
QWEN3_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN25_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


def _random_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "LA": 2}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels)  # the mode follows from the channel count
    assert image.mode == mode
    return image


def _encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def _png_header_only(width: int, height: int) -> bytes:
    """A valid PNG signature and IHDR declaring width x height, then a few bytes of IDAT:
    ~60 bytes on disk however large the canvas it claims."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    idat = zlib.compress(b"\0" * 16)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _refused(excinfo: pytest.ExceptionInfo, *fragments: str) -> str:
    message = str(excinfo.value)
    assert message.startswith(f"{WHERE}: "), message
    assert excinfo.value.where == WHERE
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---------------------------------------------------------------------------------------------
# Limits and the error type


def test_limits_validate_and_normalize():
    limits = ImageLimits(formats=("png", "jpeg"), allowed_domains=frozenset({"Images.Example.COM"}))
    assert limits.formats == ("PNG", "JPEG")
    assert limits.allowed_domains == frozenset({"images.example.com"})
    for bad in (
        {"max_bytes": 0},
        {"max_pixels": -1},
        {"max_pixels": True},
        {"fetch_timeout_s": 0},
        {"fetch_timeout_s": float("inf")},
        {"formats": ()},
        {"formats": ("PNG", "NOTAFORMAT")},
        {"formats": "PNG"},
        {"allowed_domains": "example.com"},  # would become a set of letters
        {"allowed_domains": frozenset({"https://example.com"})},
    ):
        with pytest.raises(ValueError, match="ImageLimits"):
            ImageLimits(**bad)


def test_error_survives_pickling():
    err = pickle.loads(pickle.dumps(ImageInputError(WHERE, "truncated or corrupt image")))
    assert (err.where, err.reason) == (WHERE, "truncated or corrupt image")
    assert str(err) == f"{WHERE}: truncated or corrupt image"


# ---------------------------------------------------------------------------------------------
# Decoding: refusals


def test_truncated_png_refused():
    png = _encode(_random_image(64, 64))
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(png[: len(png) // 2], LIMITS, WHERE)
    _refused(excinfo, "truncated or corrupt image")


def test_corrupt_pixel_data_refused():
    png = bytearray(_encode(_random_image(64, 64)))
    start = png.index(b"IDAT") + 4
    png[start : start + 200] = bytes(200)  # header intact, compressed stream destroyed
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(bytes(png), LIMITS, WHERE)
    _refused(excinfo, "truncated or corrupt image")


@pytest.mark.parametrize(
    "data",
    [
        b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"><rect width="10" height="10"/></svg>',
        b"\x00\x01\x02 definitely not an image",
        _encode(_random_image(8, 8), "TIFF"),  # Pillow decodes TIFF, but it is not allowed
    ],
    ids=["svg", "garbage", "tiff"],
)
def test_unsupported_formats_refused(data):
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(data, LIMITS, WHERE)
    _refused(excinfo, "unsupported image format", "PNG, JPEG, WEBP, GIF, BMP")


def test_header_declaring_too_many_pixels_refused_before_decoding(monkeypatch):
    """7000 x 7000 = 49 MP: over our 36 MP limit, under Pillow's own bomb threshold, so this
    is our check; it must run before load() (which would allocate 147 MB)."""
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self))
    data = _png_header_only(7000, 7000)
    assert len(data) < 100
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(data, LIMITS, WHERE)
    _refused(excinfo, "7000x7000", "over the limit of 36,000,000 pixels")
    assert loads == []


def test_decompression_bomb_refused_without_allocating():
    """100000 x 100000 (30 GB decoded) in ~60 bytes: Pillow's own check fires inside open."""
    data = _png_header_only(100_000, 100_000)
    start = time.perf_counter()
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(data, ImageLimits(max_pixels=10**12), WHERE)
    assert time.perf_counter() - start < 1.0
    _refused(excinfo, "decompression-bomb")
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(data, LIMITS, WHERE)
    _refused(excinfo, "decompression-bomb")


def test_pillow_bomb_warning_maps_to_error():
    """10000 x 10000 is between Pillow's warning (89 MP) and error (179 MP) thresholds."""
    data = _png_header_only(10_000, 10_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(ImageInputError) as excinfo:
            decode_image(data, LIMITS, WHERE)
    _refused(excinfo, "decompression-bomb")
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(ImageInputError) as excinfo:
        decode_image(data, LIMITS, WHERE)
    _refused(excinfo, "over the limit of 36,000,000 pixels")


def test_oversize_and_empty_bytes_refused():
    png = _encode(_random_image(32, 32))
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(png, ImageLimits(max_bytes=len(png) - 1), WHERE)
    _refused(excinfo, f"{len(png):,} bytes", f"limit of {len(png) - 1:,} bytes")
    at_limit = decode_image(png, ImageLimits(max_bytes=len(png)), WHERE)
    assert np.array_equal(np.asarray(at_limit), np.asarray(_random_image(32, 32)))
    with pytest.raises(ImageInputError) as excinfo:
        decode_image(b"", LIMITS, WHERE)
    _refused(excinfo, "empty")


def test_pil_source_over_max_pixels_refused():
    with pytest.raises(ImageInputError) as excinfo:
        load_image(Image.new("RGB", (200, 100)), ImageLimits(max_pixels=19_999), WHERE)
    _refused(excinfo, "200x100")


# ---------------------------------------------------------------------------------------------
# Decoding: what good inputs become


@pytest.mark.parametrize("fmt,kwargs", [("PNG", {}), ("BMP", {}), ("WEBP", {"lossless": True})])
def test_lossless_round_trip(fmt, kwargs):
    image = _random_image(37, 53)
    decoded = decode_image(_encode(image, fmt, **kwargs), LIMITS, WHERE)
    assert decoded.mode == "RGB"
    assert np.array_equal(np.asarray(decoded), np.asarray(image))


def test_jpeg_decodes_like_pillow():
    data = _encode(_random_image(40, 60), "JPEG", quality=90)
    decoded = decode_image(data, LIMITS, WHERE)
    assert decoded.size == (60, 40)
    assert np.array_equal(np.asarray(decoded), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def test_exif_orientation_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    data = _encode(_random_image(20, 40), "JPEG", exif=exif.tobytes())
    assert decode_image(data, LIMITS, WHERE).size == (20, 40)  # stored 40 wide, shown 20 wide


def _transparent_inputs() -> list[Image.Image]:
    rgba = _random_image(24, 31, "RGBA", seed=1)
    palette = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8) % 16).convert("P")
    palette.info["transparency"] = 3
    return [rgba, _random_image(9, 13, "LA", seed=2), palette]


@pytest.mark.parametrize("index", range(3), ids=["RGBA", "LA", "P+tRNS"])
def test_transparency_composited_like_transformers(index):
    convert_to_rgb = pytest.importorskip("transformers.image_transforms").convert_to_rgb
    image = _transparent_inputs()[index]
    png = _encode(image)
    expected = convert_to_rgb(Image.open(io.BytesIO(png)), return_numpy=True)
    assert np.array_equal(np.asarray(decode_image(png, LIMITS, WHERE)), expected)
    assert np.array_equal(np.asarray(load_image(image, LIMITS, WHERE)), expected)


def test_gif_first_frame_with_transparency():
    convert_to_rgb = pytest.importorskip("transformers.image_transforms").convert_to_rgb
    palette = [0, 0, 0, 255, 0, 0, 0, 0, 255]  # 0: black (made transparent), 1: red, 2: blue
    first, second = Image.new("P", (16, 12), 1), Image.new("P", (16, 12), 2)
    for frame in (first, second):
        frame.putpalette(palette)
    first.paste(0, (0, 0, 8, 12))  # left half transparent
    data = _encode(first, "GIF", save_all=True, append_images=[second], transparency=0, optimize=False)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    decoded = np.asarray(decode_image(data, LIMITS, WHERE))
    assert np.array_equal(decoded, convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True))
    assert (decoded[:, :8] == 255).all()  # transparent black composited on white
    assert (decoded[:, 8:] == (255, 0, 0)).all()  # the first frame's red, not the second's blue


def test_image_hash():
    image = _random_image(20, 30)
    from_png = decode_image(_encode(image), LIMITS, WHERE)
    assert image_hash(from_png) == image_hash(image) == image_hash(image.convert("RGBA"))
    pixels = np.asarray(image).copy()
    pixels[19, 29, 2] ^= 1
    assert image_hash(Image.fromarray(pixels)) != image_hash(image)
    flat = np.asarray(image).reshape(-1)
    wide, tall = (Image.fromarray(flat.reshape(h, w, 3)) for h, w in ((20, 30), (30, 20)))
    assert image_hash(wide) != image_hash(tall)  # same bytes, different shape
    assert len(image_hash(image)) == 64


# ---------------------------------------------------------------------------------------------
# data: URLs


def test_data_url_round_trip():
    image = _random_image(10, 12)
    png = _encode(image)
    for url in (_data_url(png), _data_url(png).replace("data:image/png;base64", "DATA:Image/PNG;BASE64"),
                _data_url(png, "image/png;name=cat.png"), " " + _data_url(png) + "\n"):
        assert np.array_equal(np.asarray(load_image(url, LIMITS, WHERE)), np.asarray(image))
    assert parse_data_url(_data_url(png), LIMITS, WHERE) == png


def test_data_url_refusals_never_echo_the_payload():
    payload = base64.b64encode(_encode(_random_image(16, 16))).decode()
    cases = {
        f"data:image/png;base64,{payload[:-4]}!!!!": "not valid base64",
        f"data:image/png;base64,{payload[:-1]}": "not valid base64",  # bad padding
        f"data:image/png;base64,{payload[:40]}\n{payload[40:]}": "not valid base64",  # strict: no whitespace
        f"data:image/png;base64,{payload[:-4]}é": "not valid base64",
        "data:text/plain;base64,aGVsbG8=": "'text/plain' is not an image type",
        f"data:image/png,{payload}": "must be base64-encoded",
        f"data:{payload[:30]};base64,{payload}": "(unrecognised) is not an image type",
        f"data:image/png;base64{payload}": "malformed data: URL",
        "data:image/png;base64,": "empty",
    }
    for url, fragment in cases.items():
        with pytest.raises(ImageInputError) as excinfo:
            load_image(url, LIMITS, WHERE)
        message = _refused(excinfo, fragment)
        assert payload[:16] not in message and payload[-16:-4] not in message
        if fragment == "not valid base64":  # no chained cause for a traceback to print
            assert excinfo.value.__cause__ is None and excinfo.value.__suppress_context__


def test_data_url_size_checked_before_decoding(monkeypatch):
    def no_decoding(*args, **kwargs):
        raise AssertionError("the payload was decoded")

    monkeypatch.setattr(images_mod.base64, "b64decode", no_decoding)
    with pytest.raises(ImageInputError) as excinfo:
        parse_data_url(_data_url(bytes(300)), ImageLimits(max_bytes=100), WHERE)
    _refused(excinfo, "over the limit of 100 bytes")


def test_data_url_decoded_size_bounded():
    """13 bytes encode to 20 base64 characters, which also encode 15 bytes: the length check
    lets them through and the decoded size must catch them."""
    limits = ImageLimits(max_bytes=14)
    assert parse_data_url(_data_url(bytes(14)), limits, WHERE) == bytes(14)
    with pytest.raises(ImageInputError) as excinfo:
        parse_data_url(_data_url(bytes(15)), limits, WHERE)
    _refused(excinfo, "15 bytes, over the limit of 14 bytes")


# ---------------------------------------------------------------------------------------------
# Other sources


@pytest.mark.parametrize(
    "source,fragment",
    [
        ("file:///etc/passwd", "file: URLs are refused"),
        ("FILE:///etc/passwd", "file: URLs are refused"),
        ("/etc/passwd", "local paths are refused"),
        ("ftp://127.0.0.1/cat.png", "expected a data:image"),
        ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg==",
         "bare base64 must be wrapped"),
        (12345, "unsupported image source of type int"),
    ],
)
def test_other_sources_refused(source, fragment):
    with pytest.raises(ImageInputError) as excinfo:
        load_image(source, LIMITS, WHERE)
    message = _refused(excinfo, fragment)
    assert "passwd" not in message and "iVBORw0KGgo" not in message


@pytest.mark.parametrize(
    "url,fragment",
    [
        ("http://example.com/cat.png?token=secret", "'example.com', which is not listed"),
        ("https://127.0.0.1@evil.example/cat.png", "'evil.example', which is not listed"),
        ("file:///etc/passwd", "must use http or https"),
        ("ftp://127.0.0.1/cat.png", "must use http or https"),
        ("http:///cat.png", "has no host"),
        ("http://127.0.0.1:99999/cat.png", "malformed image URL"),
    ],
)
def test_url_refused_before_connecting(url, fragment):
    limits = ImageLimits(allowed_domains=frozenset({"127.0.0.1"}))
    with pytest.raises(ImageInputError) as excinfo:
        fetch_url(url, limits, WHERE)
    message = _refused(excinfo, fragment)
    assert "secret" not in message and "cat.png" not in message
    if "not listed" in fragment:
        assert "--allowed-media-domains" in message


# ---------------------------------------------------------------------------------------------
# http(s) fetching against a local server

PNG_IMAGE = _random_image(12, 20, seed=3)
PNG_BYTES = _encode(PNG_IMAGE)
TRICKLE_FOR_S = 5.0  # how long the slow handlers would go on; the client gives up far sooner


class _Handler(http.server.BaseHTTPRequestHandler):
    hosts: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        _Handler.hosts.append(self.headers.get("Host", ""))
        port = self.server.server_address[1]
        try:
            route = {
                "/img.png": lambda: self._send(PNG_BYTES),
                "/big": lambda: self._send(bytes(5000)),
                "/big-streamed": lambda: self._send(bytes(5000), length=False),
                "/short": lambda: self._send(PNG_BYTES[:10], length=len(PNG_BYTES)),
                "/missing": lambda: self.send_error(404),
                "/redirect-away": lambda: self._redirect(f"http://localhost:{port}/img.png"),
                "/redirect-home": lambda: self._redirect("/img.png"),
                "/redirect-loop": lambda: self._redirect("/redirect-loop"),
                "/slow-body": self._slow_body,
                "/slow-headers": self._slow_headers,
            }[self.path]
            route()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up, as it should

    def _send(self, body: bytes, length: bool | int = True) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if length is not False:
            self.send_header("Content-Length", str(len(body) if length is True else length))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _trickle(self, byte: bytes) -> None:
        stop = time.monotonic() + TRICKLE_FOR_S
        while time.monotonic() < stop:
            self.wfile.write(byte)
            self.wfile.flush()
            time.sleep(0.02)

    def _slow_body(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self._trickle(b"x")

    def _slow_headers(self) -> None:
        self.wfile.write(b"HTTP/1.0 200 OK\r\nX-Slow: ")
        self._trickle(b"a")


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _local_limits(**kwargs) -> ImageLimits:
    return ImageLimits(allowed_domains=frozenset({"127.0.0.1"}), fetch_timeout_s=0.5, **kwargs)


def test_fetch_allowed_host(server):
    assert fetch_url(f"{server}/img.png", _local_limits(), WHERE) == PNG_BYTES
    image = load_image(f"{server}/img.png", _local_limits(), WHERE)
    assert np.array_equal(np.asarray(image), np.asarray(PNG_IMAGE))
    assert fetch_url(f"{server}/redirect-home", _local_limits(), WHERE) == PNG_BYTES


def test_fetch_host_match_is_case_insensitive(server):
    limits = ImageLimits(allowed_domains=frozenset({"LocalHost"}), fetch_timeout_s=2.0)
    url = server.replace("127.0.0.1", "LOCALHOST") + "/img.png"
    assert fetch_url(url, limits, WHERE) == PNG_BYTES


@pytest.mark.parametrize("path", ["/slow-body", "/slow-headers"])
def test_fetch_deadline_stops_a_trickle(server, path):
    start = time.monotonic()
    with pytest.raises(ImageInputError) as excinfo:
        fetch_url(f"{server}{path}", _local_limits(), WHERE)
    elapsed = time.monotonic() - start
    _refused(excinfo, "'127.0.0.1' took longer than 0.5 s")
    assert elapsed < 1.5, elapsed  # the deadline, not the per-read timeout or the trickle's end


@pytest.mark.parametrize("path", ["/big", "/big-streamed"])
def test_fetch_oversized_download_refused(server, path):
    with pytest.raises(ImageInputError) as excinfo:
        fetch_url(f"{server}{path}", _local_limits(max_bytes=1000), WHERE)
    _refused(excinfo, "over the limit of 1,000 bytes")


def test_fetch_redirect_to_other_host_refused(server):
    _Handler.hosts.clear()
    with pytest.raises(ImageInputError) as excinfo:
        fetch_url(f"{server}/redirect-away", _local_limits(), WHERE)
    _refused(excinfo, "redirected to 'localhost', which is not listed", "--allowed-media-domains")
    assert all(host.startswith("127.0.0.1") for host in _Handler.hosts), _Handler.hosts


@pytest.mark.parametrize(
    "path,fragment",
    [("/missing", "HTTP 404"), ("/short", "ended early"), ("/redirect-loop", "HTTP 302")],
)
def test_fetch_failures_named(server, path, fragment):
    with pytest.raises(ImageInputError) as excinfo:
        fetch_url(f"{server}{path}", _local_limits(), WHERE)
    _refused(excinfo, "127.0.0.1", fragment)


def test_fetch_connection_refused():
    limits = ImageLimits(allowed_domains=frozenset({"127.0.0.1"}), fetch_timeout_s=2.0)
    with pytest.raises(ImageInputError) as excinfo:
        fetch_url("http://127.0.0.1:1/cat.png", limits, WHERE)
    _refused(excinfo, "fetching the image from '127.0.0.1' failed")


# ---------------------------------------------------------------------------------------------
# Qwen-VL preprocessing against transformers


@pytest.fixture(scope="module")
def hf_qwen2_vl():
    """transformers' PIL-backend processor: it resizes with Pillow, so parity is exact. (The
    torchvision one is not importable here; this is the one AutoImageProcessor picks then.)"""
    return pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")


def _hf_processor(module, config: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module.Qwen2VLImageProcessorPil.from_dict(dict(config))


def test_smart_resize_matches_transformers(hf_qwen2_vl):
    sides = [1, 3, 13, 14, 27, 28, 29, 42, 55, 56, 100, 333, 641, 1000, 1999, 4096, 9000]
    ranges = [(28, 56 * 56, 28 * 28 * 1280), (28, 3136, 12845056), (32, 65536, 16777216), (32, 4096, 100_000)]
    for factor, lo, hi in ranges:
        for h in sides:
            for w in sides:
                if max(h, w) / min(h, w) > 200:
                    with pytest.raises(ValueError):
                        hf_qwen2_vl.smart_resize(h, w, factor, lo, hi)
                    with pytest.raises(ImageInputError) as excinfo:
                        smart_resize(h, w, factor, lo, hi, where=WHERE)
                    _refused(excinfo, "aspect ratio", "200:1")
                else:
                    expected = hf_qwen2_vl.smart_resize(h, w, factor, lo, hi)
                    assert smart_resize(h, w, factor, lo, hi) == expected, (h, w, factor)


PREPROCESS_CASES = {
    # name: (height, width, mode, preprocessor config)
    "plain": (224, 336, "RGB", {}),
    "hits_max_pixels": (1100, 1300, "RGB", {}),  # 1.43 MP > 1,003,520: shrunk
    "hits_min_pixels": (20, 30, "RGB", {}),  # 600 px < 3,136: grown
    "elongated_rgba": (50, 900, "RGBA", QWEN25_CONFIG),
    "already_target_size": (224, 448, "RGB", QWEN25_CONFIG),  # resize is the identity
    "qwen3_min_pixels": (300, 200, "RGB", QWEN3_CONFIG),  # 60,000 < 65,536
    "qwen3_max_pixels": (700, 500, "RGB", {**QWEN3_CONFIG, "size": {"shortest_edge": 4096, "longest_edge": 200_000}}),
}


@pytest.mark.parametrize("name", PREPROCESS_CASES)
def test_preprocess_matches_transformers(hf_qwen2_vl, name):
    height, width, mode, config = PREPROCESS_CASES[name]
    image = _random_image(height, width, mode, seed=height)
    expected = _hf_processor(hf_qwen2_vl, config)(image, return_tensors="np")
    cfg = QwenVLImageConfig.from_preprocessor_config(config)
    got = preprocess_image(image, cfg)
    assert isinstance(got, ProcessedImage)
    assert got.grid_thw == tuple(int(v) for v in expected["image_grid_thw"][0])
    assert got.pixel_values.dtype == np.float32 == expected["pixel_values"].dtype
    assert got.pixel_values.shape == (got.grid_thw[1] * got.grid_thw[2], cfg.patch_dim)
    # Bit-identical: same Pillow resize, same float64 -> float32 rescale, same float32 normalise.
    assert np.array_equal(got.pixel_values, expected["pixel_values"])
    assert got.num_tokens == got.grid_thw[1] * got.grid_thw[2] // cfg.merge_size**2
    hf_patches = _hf_processor(hf_qwen2_vl, config).get_number_of_image_patches(height, width)
    assert got.num_tokens * cfg.merge_size**2 == hf_patches
    assert got.hash == image_hash(image)
    assert preprocess_image(image, cfg, hash="given").hash == "given"


def test_patch_order_against_independent_reference():
    """The row layout as Qwen2-VL's original processor wrote it (frames stacked first, one
    9-D transpose), on an image already at its target size, so only the layout is tested
    and a change in transformers' own formulation cannot hide a change here."""
    cfg = QwenVLImageConfig(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64, max_pixels=10_000)
    image = _random_image(24, 40, seed=9)  # multiples of factor 8, within range
    assert smart_resize(24, 40, cfg.factor, cfg.min_pixels, cfg.max_pixels) == (24, 40)
    scaled = (np.asarray(image).astype(np.float64) / 255).astype(np.float32)
    normalized = (scaled - np.float32(cfg.image_mean)) / np.float32(cfg.image_std)  # [H, W, C]
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    frames = np.stack([normalized.transpose(2, 0, 1)] * t)  # [t, C, H, W]
    gh, gw = 24 // p, 40 // p
    x = frames.reshape(1, t, 3, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    reference = x.reshape(gh * gw, 3 * t * p * p)
    got = preprocess_image(image, cfg)
    assert got.grid_thw == (1, gh, gw) and got.num_tokens == gh * gw // 4
    np.testing.assert_allclose(got.pixel_values, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "config",
    [
        {},
        QWEN25_CONFIG,
        QWEN3_CONFIG,
        {"size": {"longest_edge": 1_000_000, "shortest_edge": 5000}, "min_pixels": 3136, "max_pixels": 12845056},
        {"size": {"min_pixels": 1, "max_pixels": 2}, "min_pixels": 3136, "max_pixels": 12845056},
        {"max_pixels": 500_000},
        {"image_mean": 0.5, "image_std": 0.25, "patch_size": 16},
        {"do_resize": True, "resample": 3, "rescale_factor": 0.00392156862745098, "do_convert_rgb": True},
    ],
    ids=["empty", "qwen2.5", "qwen3", "size+pixels", "legacy-size+pixels", "max-only", "scalar-mean",
         "explicit-defaults"],
)
def test_config_read_like_transformers(hf_qwen2_vl, config):
    hf = _hf_processor(hf_qwen2_vl, config)
    cfg = QwenVLImageConfig.from_preprocessor_config(config)
    mean = hf.image_mean if isinstance(hf.image_mean, list | tuple) else [hf.image_mean] * 3
    std = hf.image_std if isinstance(hf.image_std, list | tuple) else [hf.image_std] * 3
    assert (cfg.min_pixels, cfg.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)
    assert cfg.patch_size == hf.patch_size and cfg.merge_size == hf.merge_size
    assert cfg.temporal_patch_size == hf.temporal_patch_size
    assert cfg.image_mean == tuple(mean) and cfg.image_std == tuple(std)


@pytest.mark.parametrize(
    "config,fragment",
    [
        ({"size": {"min_pixels": 3136, "max_pixels": 12845056}}, "needs a pixel range"),
        ({"size": {"longest_edge": 500_000}}, "needs a pixel range"),
        ({"do_resize": False}, "do_resize=False"),
        ({"resample": 2}, "resample=2"),
        ({"rescale_factor": 1.0}, "rescale_factor"),
        ({"min_pixels": 10_000, "max_pixels": 5_000}, "exceeds max_pixels"),
        ({"patch_size": 0}, "patch_size"),
        ({"image_std": [0.5, 0.0, 0.5]}, "non-zero"),
        ({"image_mean": [0.5, 0.5]}, "three"),
    ],
)
def test_config_refusals(config, fragment):
    with pytest.raises(ValueError) as excinfo:
        QwenVLImageConfig.from_preprocessor_config(config)
    assert fragment in str(excinfo.value)


def test_preprocess_refuses_extreme_aspect_ratio():
    with pytest.raises(ImageInputError) as excinfo:
        preprocess_image(Image.new("RGB", (4020, 20)), QwenVLImageConfig(), where=WHERE)
    _refused(excinfo, "4020x20", "201:1")
