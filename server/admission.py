"""Admission by work, not by RPC: requests and tokens in flight, server-wide and per tenant.

A request's work is its prompt plus `n x max_tokens` (capped by what `max_model_len` leaves),
reserved when it is admitted and given back when the engine is done with it (finished,
aborted or failed), even if its client has not read the whole stream yet. A reservation that
would pass a token limit is refused, except when nothing else of that scope is in flight, so
a request larger than a limit still runs, alone. Refusals name the limit; a refusal by a
server-wide limit gives no server-wide counts (they would tell a tenant about the others'
load). Runs on the event loop's thread only.
"""

from __future__ import annotations

import dataclasses

from server.tenants import Tenant


def request_work(prompt_tokens: int, n: int, max_tokens: int, max_model_len: int) -> int:
    """Tokens a request may make the engine hold or compute: prompt + n x output tokens."""
    return prompt_tokens + n * max(0, min(max_tokens, max_model_len - prompt_tokens))


@dataclasses.dataclass
class Reservation:
    tenant: str
    work: int
    released: bool = False


@dataclasses.dataclass
class _Usage:
    requests: int = 0
    tokens: int = 0


class AdmissionRefused(Exception):
    """Over a limit; the message names the limit (RESOURCE_EXHAUSTED). `limit` is its short
    name, a label of the refusal counter."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


class Admission:
    def __init__(self, max_requests: int, max_tokens: int | None):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.total = _Usage()
        self._by_tenant: dict[str, _Usage] = {}

    def usage(self, tenant: str) -> tuple[int, int]:
        u = self._by_tenant.get(tenant, _Usage())
        return u.requests, u.tokens

    def reserve(self, tenant: Tenant, work: int) -> Reservation:
        """Reserves one request of `work` tokens or raises AdmissionRefused."""
        mine = self._by_tenant.setdefault(tenant.name, _Usage())
        if self.total.requests >= self.max_requests:
            raise AdmissionRefused(  # no server-wide counts: they would tell of other tenants' load
                f"server queue is full (max_num_seqs + max_queued_requests = {self.max_requests} requests "
                "in flight); retry later", "max_queued_requests")
        if tenant.max_requests is not None and mine.requests >= tenant.max_requests:
            raise AdmissionRefused(f"tenant {tenant.name}: {mine.requests} requests in flight, "
                                   f"its max_requests is {tenant.max_requests}", "tenant_max_requests")
        if self.max_tokens is not None and self.total.requests and self.total.tokens + work > self.max_tokens:
            raise AdmissionRefused(
                f"server work queue is full: {work} tokens of work for this request (prompt + n x max_tokens) "
                f"do not fit under max_queued_tokens {self.max_tokens} now; retry later", "max_queued_tokens")
        if tenant.max_tokens is not None and mine.requests and mine.tokens + work > tenant.max_tokens:
            raise AdmissionRefused(
                f"tenant {tenant.name}: {mine.tokens} tokens of work in flight + {work} for this request "
                f"(prompt + n x max_tokens) is over its max_tokens {tenant.max_tokens}", "tenant_max_tokens")
        for u in (self.total, mine):
            u.requests += 1
            u.tokens += work
        return Reservation(tenant.name, work)

    def release(self, r: Reservation) -> None:
        """Gives a reservation back; a second call does nothing."""
        if r.released:
            return
        r.released = True
        for u in (self.total, self._by_tenant[r.tenant]):
            u.requests -= 1
            u.tokens -= r.work
