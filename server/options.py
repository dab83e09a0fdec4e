"""The server's settings (`ServerOptions`, one validated set of flags) and its life-cycle
states; shared by the serving core and both fronts."""

from __future__ import annotations

import dataclasses

from server.tenants import Tenant

VERSION = "0.2.0"


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0: pick a free port
    metrics_host: str = "127.0.0.1"  # the metrics endpoint is for the operator, not for tenants
    metrics_port: int = 8001  # 0: pick a free port; -1: no metrics endpoint
    http_port: int = 8000  # the OpenAI-compatible HTTP API (same host); 0: pick a free port; -1: off
    served_model_name: tuple[str, ...] = ()  # names clients may give as `model`; the first is shown
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) LoRA adapters loaded at start
    chat_template: str | None = None  # a Jinja chat template that replaces the model's
    tool_call_parser: str = "hermes"  # the model's own tool-call format, for tool_choice "auto"
    api_key: str | None = None  # one key (tenant "default"); or `tenants` for several
    tenants: tuple[tuple[Tenant, str], ...] = ()  # (tenant, key) pairs: --api-keys FILE
    shared_prefix_cache: bool = False  # tenants share cached prefixes (and learn of each other's)
    priority_range: tuple[int, int] = (0, 100)  # client priorities are clamped into it
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # set: clients must present a certificate (mTLS)
    max_queued_requests: int = 256  # requests allowed to wait beyond max_num_seqs
    max_queued_tokens: int | None = None  # work in flight (prompt + n x max_tokens); None: 4 x KV cache
    stream_idle_timeout: float = 60.0  # a stream whose client reads nothing for this long is aborted
    max_concurrent_streams: int = 128  # API calls one connection may have open; more: RESOURCE_EXHAUSTED
    keepalive_time: float = 60.0  # seconds between server pings on an idle connection
    keepalive_timeout: float = 20.0  # a ping not acknowledged in this long closes the connection
    max_connection_idle: float | None = None  # close connections with no call for this long
    max_connection_age: float | None = None  # close connections older than this (load rebalancing)
    max_connection_age_grace: float = 30.0  # time calls get to finish once a connection is closed
    max_open_calls: int = 64  # health / reflection calls open at once (they need no key)
    http_max_head_bytes: int = 64 * 1024  # request line + headers; more: 431 and the connection closed
    http_head_timeout: float = 10.0  # seconds to send a request head; more: 408 and closed
    http_max_connections_per_peer: int = 64  # pending (no authenticated request yet) per address; more: oldest closed
    frontend_threads: int | None = None  # tokenization / chat-template workers; None: cores / 4 (1..4)
    tokenizer_backlog_chars: int = 1_000_000  # characters queued for tokenization; more: RESOURCE_EXHAUSTED
    shutdown_timeout: float = 30.0
    max_prompt_chars: int | None = None  # None: 32 x max_model_len
    max_message_bytes: int = 4 * 2**20
    log_interval: float = 1.0  # seconds between status lines; 0: off
    warmup: bool = True
    require_warm_cache: bool = False  # refuse to start when any planned shape missed the cache
    request_trace: str | None = None  # append each admitted request (arrival, prompt ids, max_tokens): `jaxserve tune --trace`

    def grpc_options(self) -> list[tuple[str, int]]:
        ms = lambda s: int(s * 1000)  # noqa: E731
        opts = [
            # gRPC itself refuses (RESOURCE_EXHAUSTED) only far past the limit; up to there the
            # handlers answer INVALID_ARGUMENT naming the oversized field (`_check_size`).
            ("grpc.max_receive_message_length", 4 * self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # No HTTP/2 stream limit: a client may open streams before the server's SETTINGS
            # reach it, and the transport resets the ones past the limit (UNAVAILABLE "Stream
            # removed", no reason). The interceptor refuses a connection's calls past
            # max_concurrent_streams instead, RESOURCE_EXHAUSTED naming the limit; a refused
            # call costs its headers and one small frame.
            ("grpc.max_concurrent_streams", 2**31 - 1),
            ("grpc.keepalive_time_ms", ms(self.keepalive_time)),
            ("grpc.keepalive_timeout_ms", ms(self.keepalive_timeout)),
            ("grpc.keepalive_permit_without_calls", 1),  # clients may keep idle connections alive
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # faster pings: GOAWAY
            ("grpc.http2.max_ping_strikes", 2),
        ]
        if self.max_connection_idle is not None:
            opts.append(("grpc.max_connection_idle_ms", ms(self.max_connection_idle)))
        if self.max_connection_age is not None:
            opts.append(("grpc.max_connection_age_ms", ms(self.max_connection_age)))
            opts.append(("grpc.max_connection_age_grace_ms", ms(self.max_connection_age_grace)))
        return opts


class ServerState:
    LOADING, SERVING, DRAINING, STOPPED = "loading", "serving", "draining", "stopped"
