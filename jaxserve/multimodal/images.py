"""Turning an image a client sent (raw bytes, a `data:` URL, an http(s) URL or a PIL object)
into an RGB PIL image, treating every byte as hostile.

Everything here runs on the host with numpy and Pillow only. The limits are checked in the
order that keeps a bad input cheap: the encoded size before decoding base64 or reading a
download, the declared width x height from the header before any pixel is decoded (so a
decompression bomb costs a header read), the remote host before a socket is opened, and a
wall-clock deadline over the whole download, redirects included.

Every refusal is an `ImageInputError` that names the offending input with the caller's
`where` ("messages[0].content[1]") and never echoes image bytes, base64 text or full URLs
(a query string may carry a token); remote hosts are named.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import io
import math
import re
import socket
import ssl
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

ImageSource = Image.Image | bytes | bytearray | memoryview | str

_DATA_URL_HEADER_MAX = 256  # "image/png;base64" and a few parameters fit easily
_MAX_REDIRECTS = 5
_READ_CHUNK = 64 * 1024
_MEDIA_TOP_LEVEL = frozenset(
    {"application", "audio", "font", "image", "message", "model", "multipart", "text", "video"}
)
_MEDIA_TYPE = re.compile(r"^([a-z]+)/[a-z0-9.+-]{1,40}$")


class ImageInputError(ValueError):
    """An image input the server refuses; `str()` is "<where>: <reason>", safe to return to
    the client as is (no image bytes, no base64, no full URL)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason

    def __reduce__(self) -> tuple[type[ImageInputError], tuple[str, str]]:
        # The default reduce would call __init__ with the formatted message only; errors
        # cross process boundaries (engine core -> API server), so keep both fields.
        return (type(self), (self.where, self.reason))


@dataclass(frozen=True)
class ImageLimits:
    """What the server accepts per image. The defaults admit any photo a client plausibly
    sends (36 MP, 20 MiB) while refusing inputs whose decode alone would exhaust memory.
    `allowed_domains` is empty by default: remote fetches are an SSRF risk, so an operator
    has to name each host (`--allowed-media-domains`)."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 36_000_000
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    fetch_timeout_s: float = 10.0
    allowed_domains: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        _require_positive_int("max_bytes", self.max_bytes)
        _require_positive_int("max_pixels", self.max_pixels)
        timeout = self.fetch_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            math.isfinite(timeout) and timeout > 0
        ):
            raise ValueError(f"ImageLimits.fetch_timeout_s must be a positive number of seconds, got {timeout!r}")
        object.__setattr__(self, "formats", _normalize_formats(self.formats))
        object.__setattr__(self, "allowed_domains", _normalize_domains(self.allowed_domains))


def _require_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ImageLimits.{name} must be a positive integer, got {value!r}")


def _normalize_formats(formats: Iterable[str]) -> tuple[str, ...]:
    """Upper-cased and checked against Pillow's registered decoders now, because
    `Image.open(formats=...)` raises a bare KeyError per request for an unknown name."""
    if isinstance(formats, str):
        raise ValueError(f"ImageLimits.formats must be a sequence of format names, not the string {formats!r}")
    names = tuple(str(f).upper() for f in formats)
    if not names:
        raise ValueError("ImageLimits.formats must name at least one image format")
    Image.init()
    unknown = [n for n in names if n not in Image.OPEN]
    if unknown:
        raise ValueError(
            f"ImageLimits.formats names formats Pillow cannot decode: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(Image.OPEN))})"
        )
    return names


def _normalize_domains(domains: Iterable[str]) -> frozenset[str]:
    """Lower-cased bare host names; a string would silently become a set of characters and a
    URL would never match a host, so both are refused here rather than at the first fetch."""
    if isinstance(domains, str):
        raise ValueError(f"ImageLimits.allowed_domains must be a collection of host names, not the string {domains!r}")
    hosts = set()
    for domain in domains:
        host = str(domain).strip().lower()
        if not host or any(c in host for c in "/@?# \t") or "://" in host:
            raise ValueError(f"ImageLimits.allowed_domains entries must be bare host names, got {domain!r}")
        hosts.add(host)
    return frozenset(hosts)


# ---------------------------------------------------------------------------------------------
# Decoding


def decode_image(data: bytes, limits: ImageLimits, where: str) -> Image.Image:
    """Decodes encoded image bytes into an RGB image (the first frame of an animation).

    The declared size is checked between `Image.open` (which reads only the header) and
    `load()`, so a small file that declares a huge canvas is refused before any pixel buffer
    is allocated. EXIF orientation is applied, as transformers' `load_image` and image viewers
    do, so the model sees the picture the user saw."""
    if not isinstance(data, bytes):
        data = bytes(data)  # bytearray / memoryview: one copy, so Pillow sees an immutable buffer
    if not data:
        raise ImageInputError(where, "image data is empty")
    if len(data) > limits.max_bytes:
        raise ImageInputError(where, f"image is {len(data):,} bytes, over the limit of {limits.max_bytes:,} bytes")
    image = _open_header(data, limits, where)
    with image:
        _check_pixel_count(image.width, image.height, limits, where)
        try:
            image.load()  # decodes frame 0 only; later GIF/WebP frames are never read
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise _pillow_bomb_error(where) from exc
        except Exception as exc:  # noqa: BLE001 - Pillow raises many types on hostile data
            raise ImageInputError(where, "truncated or corrupt image") from exc
        return to_rgb(_upright(image))  # a new image: `image` is closed on leaving the block


def _open_header(data: bytes, limits: ImageLimits, where: str) -> Image.Image:
    """Identifies the format from the allowed decoders only (an SVG or a TIFF is never handed
    to a parser the operator did not enable). Pillow's own bomb check also fires here; when
    warnings are errors its warning arrives as an exception, mapped the same way."""
    try:
        return Image.open(io.BytesIO(data), formats=limits.formats)
    except UnidentifiedImageError as exc:
        raise ImageInputError(
            where, f"unsupported image format or not an image (accepted: {', '.join(limits.formats)})"
        ) from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise _pillow_bomb_error(where) from exc
    except Exception as exc:  # noqa: BLE001 - a plugin may fail on a damaged header
        raise ImageInputError(where, "truncated or corrupt image") from exc


def _pillow_bomb_error(where: str) -> ImageInputError:
    """Pillow's own check (`Image.MAX_IMAGE_PIXELS`) fired before ours could: it runs inside
    `Image.open`, and raises rather than warns above twice its limit."""
    return ImageInputError(
        where, f"image exceeds the decompression-bomb limit of {Image.MAX_IMAGE_PIXELS:,} pixels"
    )


def _upright(image: Image.Image) -> Image.Image:
    """A copy turned by its EXIF orientation. A damaged EXIF block does not make the pixels
    unusable (transformers' processor ignores EXIF altogether), so it means "no rotation"."""
    try:
        return ImageOps.exif_transpose(image)
    except Exception:  # noqa: BLE001 - EXIF parsing of hostile metadata
        return image.copy()


def _check_pixel_count(width: int, height: int, limits: ImageLimits, where: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageInputError(where, f"image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageInputError(
            where,
            f"image is {width}x{height} = {width * height:,} pixels, over the limit of {limits.max_pixels:,} pixels",
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in mode RGB, transparency composited onto white.

    This is transformers' `convert_to_rgb` rule (what its Qwen2-VL processor applies): an
    image counts as transparent if it has an alpha band or a `transparency` entry (a palette
    or RGB PNG with tRNS, a GIF); anything else is a plain `convert("RGB")`. Compositing on
    white rather than dropping alpha matters: transparent pixels often hold black."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if image.mode == "RGB":
        return image
    return image.convert("RGB")


def image_hash(image: Image.Image) -> str:
    """A hex SHA-256 identifying the pixels the model will see, for the encoder and prefix
    caches. Hashing decoded RGB (not the encoded bytes) makes a PNG and the equal PIL object
    share cache entries; the mode and size are framed in so equal byte strings of different
    shapes differ. Images that differ only where they are fully transparent map to the same
    RGB and therefore, correctly, to the same hash."""
    rgb = to_rgb(image)
    digest = hashlib.sha256()
    digest.update(b"jaxserve-image-v1\0")
    digest.update(rgb.mode.encode("ascii") + b"\0")
    digest.update(struct.pack("<II", rgb.width, rgb.height))
    digest.update(rgb.tobytes())  # [H, W, 3] uint8, row-major
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# data: URLs


def parse_data_url(url: str, limits: ImageLimits, where: str) -> bytes:
    """The bytes of a `data:image/<subtype>;base64,<payload>` URL.

    Only base64 image URLs are accepted (percent-encoded binary is refused), the base64 is
    decoded strictly (no whitespace, URL-safe alphabet or bad padding), and its length is
    checked before decoding so an oversized payload costs no allocation."""
    if url[:5].lower() != "data:":
        raise ImageInputError(where, "not a data: URL")
    header, comma, payload = url[5 : 5 + _DATA_URL_HEADER_MAX + 1].partition(",")
    if not comma:
        raise ImageInputError(where, "malformed data: URL (expected data:image/<type>;base64,<data>)")
    payload = url[5 + len(header) + 1 :]
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0]
    if not media_type.startswith("image/") or media_type == "image/":
        raise ImageInputError(where, f"data: URL media type {_describe_media_type(media_type)} is not an image type")
    if len(params) < 2 or params[-1] != "base64":
        raise ImageInputError(where, "data: URL must be base64-encoded (data:image/<type>;base64,<data>)")
    max_chars = 4 * ((limits.max_bytes + 2) // 3)
    if len(payload) > max_chars:
        raise ImageInputError(where, f"image data is over the limit of {limits.max_bytes:,} bytes")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        # No cause attached: the payload never travels with the error, not even in a traceback.
        raise ImageInputError(where, "data: URL payload is not valid base64") from None
    if not data:
        raise ImageInputError(where, "data: URL payload is empty")
    if len(data) > limits.max_bytes:
        raise ImageInputError(where, f"image is {len(data):,} bytes, over the limit of {limits.max_bytes:,} bytes")
    return data


def _describe_media_type(media_type: str) -> str:
    """The media type quoted only when it looks like one; otherwise the client probably put
    payload text there, which must not be echoed."""
    match = _MEDIA_TYPE.match(media_type)
    if match and match.group(1) in _MEDIA_TOP_LEVEL:
        return repr(media_type)
    if not media_type:
        return "(missing)"
    return "(unrecognised)"


# ---------------------------------------------------------------------------------------------
# http(s) URLs


def fetch_url(url: str, limits: ImageLimits, where: str) -> bytes:
    """Downloads an image from a host the operator allowed.

    The host of the URL and of every redirect must be in `limits.allowed_domains` (exact,
    case-insensitive). `fetch_timeout_s` bounds each socket operation and is also a deadline
    over the whole exchange, redirects included: a server trickling headers or body a byte
    at a time is cut off when it passes (see `_Deadline`). At most `max_bytes + 1` bytes are
    read, so an oversized body is detected without buffering it."""
    host = _allowed_host(url, limits, where)
    deadline = _Deadline(limits.fetch_timeout_s)
    opener = _opener(limits, where, deadline)
    try:
        request = urllib.request.Request(url, headers={"User-Agent": "jaxserve", "Accept": "image/*"})
        with deadline, opener.open(request, timeout=limits.fetch_timeout_s) as response:
            return _read_body(response, limits, where, deadline, host)
    except ImageInputError:
        raise
    except urllib.error.HTTPError as exc:
        exc.close()
        raise ImageInputError(where, f"fetching the image from {host!r} failed: HTTP {exc.code}") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        if deadline.expired:
            raise _timeout_error(where, host, limits) from None
        reason = getattr(exc, "reason", None)
        detail = type(reason).__name__ if isinstance(reason, BaseException) else type(exc).__name__
        raise ImageInputError(where, f"fetching the image from {host!r} failed ({detail})") from exc


def _allowed_host(url: str, limits: ImageLimits, where: str, *, redirect: bool = False) -> str:
    """The URL's host if it may be fetched. The message names the host, never the URL."""
    what = "redirect target" if redirect else "URL"
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a malformed port
    except ValueError:
        raise ImageInputError(where, f"malformed image {what}") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ImageInputError(where, f"image {what} must use http or https")
    host = parts.hostname
    if not host:
        raise ImageInputError(where, f"image {what} has no host")
    if host not in limits.allowed_domains:
        verb = "redirected to" if redirect else "from"
        raise ImageInputError(
            where,
            f"remote image URLs are refused unless --allowed-media-domains lists the host "
            f"(image {verb} {host!r}, which is not listed)",
        )
    return host


def _timeout_error(where: str, host: str, limits: ImageLimits) -> ImageInputError:
    return ImageInputError(
        where, f"fetching the image from {host!r} took longer than {limits.fetch_timeout_s:g} s"
    )


def _read_body(
    response: http.client.HTTPResponse,
    limits: ImageLimits,
    where: str,
    deadline: _Deadline,
    host: str,
) -> bytes:
    """The body, in `read1` steps: one socket read each, so a trickle returns control to the
    deadline check instead of blocking inside a buffered read that waits for a full chunk."""
    declared = response.headers.get("Content-Length", "").strip()
    if declared.isdigit() and int(declared) > limits.max_bytes:
        raise ImageInputError(
            where, f"the image at {host!r} is {int(declared):,} bytes, over the limit of {limits.max_bytes:,} bytes"
        )
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = response.read1(min(_READ_CHUNK, limits.max_bytes + 1 - total))
        if deadline.passed():
            raise _timeout_error(where, host, limits)
        if not chunk:
            break
        total += len(chunk)
        if total > limits.max_bytes:
            raise ImageInputError(where, f"the image at {host!r} is over the limit of {limits.max_bytes:,} bytes")
        chunks.append(chunk)
    if response.length:  # bytes the Content-Length promised but the connection never sent
        raise ImageInputError(where, f"the download from {host!r} ended early")
    return b"".join(chunks)


class _Deadline:
    """A wall-clock limit over one fetch. A timer shuts every connected socket of the fetch
    down at the deadline, which wakes a `recv` blocked reading headers or body, plain or TLS;
    a socket timeout alone only bounds the gap between two bytes. The TCP connect and TLS
    handshake happen before the socket is registered: they get the time left as their
    per-operation timeout."""

    def __init__(self, seconds: float) -> None:
        self._expires_at = time.monotonic() + seconds
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.expired = False
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        with self._lock:
            self._sockets.clear()

    def passed(self) -> bool:
        return self.expired or time.monotonic() >= self._expires_at

    def remaining(self) -> float:
        return max(0.0, self._expires_at - time.monotonic())

    def register(self, sock: socket.socket | None) -> None:
        if sock is None:
            return
        with self._lock:
            if not self.expired:
                self._sockets.append(sock)
                return
        _shutdown(sock)

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    """Shuts the descriptor down without touching an SSLSocket's Python-level state, which the
    thread blocked in `recv` is still using (SSLSocket.shutdown would drop its SSL object)."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed, or never connected


class _WatchedHTTPConnection(http.client.HTTPConnection):
    """An HTTPConnection whose socket the deadline can shut down; connect() gets only the
    time left, not a fresh full timeout per redirect hop."""

    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        self.timeout = max(0.001, min(self.timeout, self._deadline.remaining()))
        super().connect()
        self._deadline.register(self.sock)


class _WatchedHTTPSConnection(http.client.HTTPSConnection):
    """The HTTPS twin of `_WatchedHTTPConnection` (the wrapped TLS socket is registered)."""

    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = deadline

    def connect(self) -> None:
        self.timeout = max(0.001, min(self.timeout, self._deadline.remaining()))
        super().connect()
        self._deadline.register(self.sock)


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPConnection, req, deadline=self._deadline)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        self._tls = ssl.create_default_context()
        super().__init__(context=self._tls)
        self._deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedHTTPSConnection, req, context=self._tls, deadline=self._deadline)


class _AllowListRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host, and never reads a redirect's body (a
    hostile server could make that body endless; urllib would buffer all of it)."""

    max_redirections = _MAX_REDIRECTS

    def __init__(self, limits: ImageLimits, where: str) -> None:
        super().__init__()
        self._limits = limits
        self._where = where

    def redirect_request(
        self,
        req: urllib.request.Request,
        fp: Any,
        code: int,
        msg: str,
        headers: Any,
        newurl: str,
    ) -> urllib.request.Request | None:
        try:
            _allowed_host(newurl, self._limits, self._where, redirect=True)
            new = super().redirect_request(req, fp, code, msg, headers, newurl)
        except BaseException:
            fp.close()
            raise
        if new is not None:
            fp.close()  # urllib then reads b"" from it instead of the whole body
        return new


def _opener(limits: ImageLimits, where: str, deadline: _Deadline) -> urllib.request.OpenerDirector:
    """An opener with http and https only: no file:, ftp: or data: handlers to fall into, and
    the redirect handler that checks each hop's host."""
    opener = urllib.request.OpenerDirector()
    for handler in (
        urllib.request.ProxyHandler(),
        _HTTPHandler(deadline),
        _HTTPSHandler(deadline),
        urllib.request.HTTPDefaultErrorHandler(),
        _AllowListRedirects(limits, where),
        urllib.request.HTTPErrorProcessor(),
    ):
        opener.add_handler(handler)
    return opener


# ---------------------------------------------------------------------------------------------
# Any source


def load_image(source: ImageSource, limits: ImageLimits, where: str) -> Image.Image:
    """An RGB image from whatever a request carried: a PIL image, encoded bytes, a
    `data:image/...;base64,` URL or an http(s) URL of an allowed host. Local paths and
    `file://` URLs are refused: a client must never make the server read its own disk."""
    if isinstance(source, Image.Image):
        _check_pixel_count(source.width, source.height, limits, where)
        try:
            return to_rgb(source)  # may decode now: a PIL image opened from a file is lazy
        except Exception as exc:  # noqa: BLE001 - Pillow raises many types on bad data
            raise ImageInputError(where, "truncated or corrupt image") from exc
    if isinstance(source, bytes | bytearray | memoryview):
        return decode_image(bytes(source), limits, where)
    if not isinstance(source, str):
        raise ImageInputError(where, f"unsupported image source of type {type(source).__name__}")
    text = source.strip()
    scheme = text.split(":", 1)[0].lower() if ":" in text[:16] else ""
    if scheme == "data":
        return decode_image(parse_data_url(text, limits, where), limits, where)
    if scheme in ("http", "https"):
        return decode_image(fetch_url(text, limits, where), limits, where)
    if scheme == "file":
        raise ImageInputError(where, "file: URLs are refused; send the image as a data: URL or an http(s) URL")
    raise ImageInputError(
        where,
        "expected a data:image/<type>;base64,<data> URL or an http(s) URL "
        "(bare base64 must be wrapped in a data: URL; local paths are refused)",
    )
