"""Who is calling: tenants, their API keys and their limits.

A tenant is the unit of isolation. Its requests live in their own request-id namespace (an
Abort finds only the caller's own requests, and two tenants may use the same id), its
prompts hash into their own prefix-cache space (unless the server shares the cache), and it
has its own limits on requests in flight, on work in flight (tokens) and on the priorities
it may ask for.

Keys come from a file (`--api-keys FILE`, one tenant per line), from a file holding one key
(`--api-key-file`), from the `JAXSERVE_API_KEY` environment variable or from `--api-key`
(visible to every local user in the process list: a warning says so). Without any key the
server is open and every caller is the one tenant `default`.

The keys file:

    # name   key                       options
    alice    3f1c...e9                 max_requests=32 max_tokens=200000 priority=0:10
    batch    9a0b...77                 priority=5:100 loras=sql-lora,chat-lora
    ops      c2d4...01                 admin

`max_requests`: requests in flight (queued or running); `max_tokens`: their work, prompt +
n x max_tokens each; `priority=LO:HI`: the range a client's priority is clamped to (lower
runs first under `--policy priority`); `admin`: may read server-wide engine state
(GetServerInfo's scheduler figures and engine config, adapter loading); `loras=A,B`: the only
LoRA adapters the tenant may select (by default any loaded adapter; `loras=` none).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import stat
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger(__name__)

API_KEY_ENV = "JAXSERVE_API_KEY"
DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str
    max_requests: int | None = None  # requests in flight; None: only the server-wide limit
    max_tokens: int | None = None  # work in flight (prompt + n x max_tokens per request)
    priority_range: tuple[int, int] | None = None  # None: the server's --priority-range
    admin: bool = False
    loras: frozenset[str] | None = None  # the LoRA adapters it may use; None: any

    def may_use_lora(self, name: str) -> bool:
        return self.loras is None or name in self.loras

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"tenant name {self.name!r}: letters, digits, '_', '.', '-' (at most 64), "
                             "starting with a letter or digit")
        for field in ("max_requests", "max_tokens"):
            v = getattr(self, field)
            if v is not None and v < 1:
                raise ValueError(f"tenant {self.name}: {field} must be >= 1, got {v}")
        if self.priority_range is not None:
            check_priority_range(self.priority_range, f"tenant {self.name}: priority")

    def request_key(self, request_id: str) -> str:
        """The engine's id for this tenant's `request_id` ('/' never appears in a name)."""
        return f"{self.name}/{request_id}"

    def cache_salt(self, client_salt: str | None, shared_prefix_cache: bool) -> str | None:
        """The prefix-cache salt: the tenant's own space (within it the client's salt still
        splits it further), or only the client's salt when the cache is shared."""
        if shared_prefix_cache:
            return client_salt
        return f"tenant:{self.name}" + (f"\x1f{client_salt}" if client_salt is not None else "")


def check_priority_range(r: tuple[int, int], what: str) -> None:
    lo, hi = r
    if lo > hi:
        raise ValueError(f"{what}: range {lo}:{hi} has its low end above its high end")


def parse_priority_range(text: str, what: str = "priority range") -> tuple[int, int]:
    m = re.fullmatch(r"\s*(-?\d+)\s*:\s*(-?\d+)\s*", text)
    if not m:
        raise ValueError(f"{what}: expected LO:HI (integers), got {text!r}")
    r = (int(m.group(1)), int(m.group(2)))
    check_priority_range(r, what)
    return r


def _parse_option(tenant: dict[str, Any], opt: str, where: str) -> None:
    if opt == "admin":
        tenant["admin"] = True
        return
    key, sep, value = opt.partition("=")
    if not sep:
        raise ValueError(f"{where}: unknown option {opt!r} (max_requests=N, max_tokens=N, priority=LO:HI, "
                         "loras=A,B, admin)")
    if key in ("max_requests", "max_tokens"):
        if not re.fullmatch(r"\d+", value):
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        tenant[key] = int(value)
    elif key == "priority":
        tenant["priority_range"] = parse_priority_range(value, f"{where}: priority")
    elif key == "loras":
        tenant["loras"] = frozenset(n for n in value.split(",") if n)
    else:
        raise ValueError(f"{where}: unknown option {key!r} (max_requests, max_tokens, priority, loras, admin)")


def parse_api_keys(lines: Iterable[str], source: str = "api keys") -> list[tuple[Tenant, str]]:
    """`name key [options]` per line ('#' comments); raises ValueError naming the line."""
    out: list[tuple[Tenant, str]] = []
    names: set[str] = set()
    keys: set[str] = set()
    for lineno, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        parts = line.split()
        if len(parts) < 2:
            raise ValueError(f"{where}: expected 'name key [options]'")
        name, key, *opts = parts
        fields: dict[str, Any] = {"name": name}
        for opt in opts:
            _parse_option(fields, opt, where)
        try:
            tenant = Tenant(**fields)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if name in names:
            raise ValueError(f"{where}: tenant {name!r} appears twice")
        if key in keys:
            raise ValueError(f"{where}: tenant {name!r} reuses another tenant's key")
        names.add(name)
        keys.add(key)
        out.append((tenant, key))
    if not out:
        raise ValueError(f"{source}: no tenants (expected 'name key [options]' lines)")
    return out


def load_api_keys(path: str) -> list[tuple[Tenant, str]]:
    mode = os.stat(path).st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("%s is readable by other users (mode %o): chmod 600 it", path, stat.S_IMODE(mode))
    with open(path, encoding="utf-8") as f:
        return parse_api_keys(f, path)


def read_single_key(path: str) -> str:
    """A file that holds one key (the first non-empty line)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line.strip()
    raise ValueError(f"{path}: the file holds no API key")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class Authenticator:
    """Maps the key in a call's metadata to its tenant. Keys are kept only as SHA-256 digests
    and looked up by digest, so lookup time says nothing about a key's characters (only about
    a digest nobody can invert). With no keys every caller is the `default` tenant."""

    def __init__(self, tenants: list[tuple[Tenant, str]] | None = None):
        self.required = bool(tenants)
        self._by_digest = {_digest(k): t for t, k in tenants or ()}
        self.anonymous = Tenant(DEFAULT_TENANT, admin=True)
        self.tenants = [t for t, _ in tenants] if tenants else [self.anonymous]

    @classmethod
    def single_key(cls, key: str) -> Authenticator:
        return cls([(Tenant(DEFAULT_TENANT, admin=True), key)])

    def authenticate(self, metadata: Any) -> Tenant | None:
        """The caller's tenant, or None when a key is required and none matches."""
        if not self.required:
            return self.anonymous
        for k, v in metadata or ():
            if isinstance(v, bytes):
                continue
            if k == "authorization" and v.startswith("Bearer "):
                v = v[len("Bearer "):]
            elif k != "x-api-key":
                continue
            tenant = self._by_digest.get(_digest(v))
            if tenant is not None:
                return tenant
        return None
