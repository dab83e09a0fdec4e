"""Chained block hashes for prefix caching.

The hash of block ``i`` is SHA-256 over (hash of block ``i - 1``, the block's token ids,
extra keys). Chaining makes a block's hash identify the *whole prefix* up to its end, so equal
hashes mean equal K/V. Extra keys (the request's ``cache_salt``) enter the first block and
are carried to every later block by the chain, so tenants with different salts never share a
block. SHA-256 rather than Python ``hash()``: the latter is cheap to collide on purpose and
would let one tenant poison or probe another's cache.

Only full blocks are hashed: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent of the first block; a fixed, versioned seed so hashes are stable across processes.
ROOT_HASH = hashlib.sha256(b"jaxserve.prefix_cache.v1").digest()

_sha256 = hashlib.sha256


def _encode_extra(extra_keys: tuple | None) -> bytes:
    if not extra_keys:
        return b""
    # repr of a tuple of str/int is unambiguous; length-prefix it so it cannot alias tokens.
    raw = repr(tuple(extra_keys)).encode()
    return struct.pack("<Q", len(raw)) + raw


def hash_block(
    parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> bytes:
    """SHA-256 of (parent hash, token ids as little-endian int64, encoded extra keys)."""
    h = _sha256(parent_hash if parent_hash is not None else ROOT_HASH)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(_encode_extra(extra_keys))
    return h.digest()


def extra_keys_for_block(block_index: int, cache_salt: str | None, lora_id: int = 0,
                         block_size: int = 0, mm_keys: Sequence[tuple[int, int, str]] = ()) -> tuple | None:
    """Extra keys of a block: the salt and the LoRA adapter go into the first block only (the
    chain carries them), so K/V computed under one adapter is never reused under another or
    the base model. An image's content hash goes into every block its placeholder tokens
    touch (`mm_keys`: (offset, num_tokens, hash) per image): its tokens are all the same id, so
    without it the same text with another image would hit."""
    keys: tuple = ()
    if block_index == 0:
        if cache_salt is not None:
            keys += ("salt", cache_salt)
        if lora_id:
            keys += ("lora", lora_id)
    if mm_keys:
        lo, hi = block_index * block_size, (block_index + 1) * block_size
        for offset, length, digest in mm_keys:
            if offset < hi and offset + length > lo:
                keys += ("image", digest)
    return keys or None


def extend_block_hashes(
    block_hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    max_blocks: int | None = None,
    lora_id: int = 0,
    mm_keys: Sequence[tuple[int, int, str]] = (),
) -> list[bytes]:
    """Append the hashes of full blocks of ``token_ids`` not yet in ``block_hashes``.

    Incremental: only newly full blocks are hashed. ``max_blocks`` stops early (the caller
    may only need the prompt's blocks). Returns ``block_hashes`` (mutated in place).
    """
    num_full = len(token_ids) // block_size
    if max_blocks is not None:
        num_full = min(num_full, max_blocks)
    i = len(block_hashes)
    parent = block_hashes[-1] if block_hashes else None
    while i < num_full:
        start = i * block_size
        parent = hash_block(
            parent, token_ids[start : start + block_size], extra_keys_for_block(i, cache_salt, lora_id, block_size, mm_keys)
        )
        block_hashes.append(parent)
        i += 1
    return block_hashes
