"""`jaxserve serve` and `jaxserve client`, added to the main CLI by `add_commands` (registered\nin the `jaxserve.commands` entry-point group)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time


def add_commands(sub: argparse._SubParsersAction) -> None:
    from jaxserve.config.engine_args import add_engine_args
    from server.app import ServerOptions
    from server.tenants import API_KEY_ENV

    d = ServerOptions()
    s = sub.add_parser("serve", help="run the gRPC server and the OpenAI HTTP API (SIGTERM drains and exits 0)")
    s.add_argument("--host", default=d.host, help="address to bind (0.0.0.0 for all interfaces)")
    s.add_argument("--port", type=int, default=d.port, help="gRPC port (0: any free port)")
    s.add_argument("--http-port", type=int, default=d.http_port,
                   help="port of the OpenAI-compatible HTTP API on --host (0: off)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model names the HTTP API accepts and lists (default: the model's path or name)")
    s.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to load at start, selected by `model: NAME` "
                        "(needs --enable-lora)")
    s.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) replacing the model's")
    s.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=d.tool_call_parser,
                   help="how the model writes tool calls, parsed for tool_choice 'auto' (default hermes: "
                        "<tool_call>{json}</tool_call>; llama3_json: the reply is the call's JSON)")
    s.add_argument("--metrics-host", default=d.metrics_host,
                   help="address of the /metrics endpoint (default 127.0.0.1: operators only)")
    s.add_argument("--metrics-port", type=int, default=d.metrics_port,
                   help="Prometheus /metrics HTTP port (0: any free port, -1: off)")
    a = s.add_argument_group("tenants and API keys (health and reflection stay open)")
    a.add_argument("--api-keys", metavar="FILE", default=None,
                   help="tenants: 'name key [max_requests=N] [max_tokens=N] [priority=LO:HI] [admin]' per line")
    a.add_argument("--api-key-file", metavar="FILE", default=None, help="one API key, read from FILE")
    a.add_argument("--api-key", default=None,
                   help=f"one API key (visible in the process list: prefer --api-key-file or ${API_KEY_ENV})")
    a.add_argument("--shared-prefix-cache", action="store_true",
                   help="tenants share cached prefixes (faster, but a tenant can tell what another sent)")
    a.add_argument("--priority-range", default=f"{d.priority_range[0]}:{d.priority_range[1]}", metavar="LO:HI",
                   help="client priorities are clamped into this range (lower runs first under --policy priority)")
    lim = s.add_argument_group("limits and connections")
    lim.add_argument("--max-queued-tokens", type=int, default=None,
                     help="work in flight, prompt + n x max_tokens summed over requests (default 4 x the KV cache)")
    lim.add_argument("--stream-idle-timeout", type=float, default=d.stream_idle_timeout,
                     help="seconds a client may read nothing before its stream is aborted")
    lim.add_argument("--max-concurrent-streams", type=int, default=d.max_concurrent_streams,
                     help="API calls one connection may have open; more get RESOURCE_EXHAUSTED naming it")
    lim.add_argument("--keepalive-time", type=float, default=d.keepalive_time,
                     help="seconds between keepalive pings on a connection")
    lim.add_argument("--keepalive-timeout", type=float, default=d.keepalive_timeout,
                     help="seconds a ping may stay unanswered before the connection is closed")
    lim.add_argument("--max-connection-idle", type=float, default=None,
                     help="close connections without calls for this many seconds")
    lim.add_argument("--max-connection-age", type=float, default=None,
                     help="close connections older than this many seconds (spreads clients over replicas)")
    lim.add_argument("--max-connection-age-grace", type=float, default=d.max_connection_age_grace,
                     help="seconds calls get to finish on a connection closed for its age")
    lim.add_argument("--max-open-calls", type=int, default=d.max_open_calls,
                     help="health / reflection calls (which need no key) open at once")
    lim.add_argument("--http-max-head-bytes", type=int, default=d.http_max_head_bytes,
                     help="HTTP request line + headers at most; past it 431 and the connection is closed")
    lim.add_argument("--http-head-timeout", type=float, default=d.http_head_timeout,
                     help="seconds an HTTP client has to send a request head; past it 408 and closed")
    lim.add_argument("--http-max-connections-per-peer", type=int, default=d.http_max_connections_per_peer,
                     help="HTTP connections one address may hold that have not sent an authenticated request; "
                          "past it the oldest such is closed (503) unless it sends one within 2 s of its start")
    lim.add_argument("--frontend-threads", type=int, default=None,
                     help="threads that tokenize and apply chat templates (default: a quarter of the cores, 1 to 4; "
                          "they take CPU from the engine)")
    lim.add_argument("--tokenizer-backlog-chars", type=int, default=d.tokenizer_backlog_chars,
                     help="characters queued for tokenization; calls past it get RESOURCE_EXHAUSTED")
    s.add_argument("--tls-cert-file", default=None, help="PEM certificate chain: serve TLS")
    s.add_argument("--tls-key-file", default=None, help="PEM private key for --tls-cert-file")
    s.add_argument("--tls-client-ca-file", default=None, help="PEM CA: require client certificates (mTLS)")
    s.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests that may wait beyond --max-num-seqs; more get RESOURCE_EXHAUSTED")
    s.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest text / chat prompt in characters (default 32 x max_model_len)")
    s.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="largest gRPC message accepted")
    s.add_argument("--log-interval", type=float, default=d.log_interval,
                   help="seconds between status log lines (0: off)")
    s.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every shape before serving")
    s.add_argument("--require-warm-cache", action="store_true",
                   help="refuse to start when any planned shape is not in the persistent compilation cache")
    s.add_argument("--record-request-trace", default=None, metavar="FILE",
                   help="append every admitted request (arrival time, prompt token ids, max_tokens) to FILE as "
                        "JSONL: the workload `jaxserve tune --trace FILE` replays. It holds the prompts' tokens.")
    add_engine_args(s)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser("client", help="stream a completion from a running server")
    c.add_argument("prompt")
    c.add_argument("--address", default=f"127.0.0.1:{d.port}")
    c.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--temperature", type=float, default=None)
    c.add_argument("--top-p", type=float, default=None)
    c.add_argument("--top-k", type=int, default=None)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--api-key", default=None, help="API key (default: $JAXSERVE_API_KEY)")
    c.add_argument("--tls-ca-file", default=None, help="PEM CA: connect with TLS")
    c.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    c.set_defaults(func=cmd_client)


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def cmd_serve(ns: argparse.Namespace) -> int:
    from jaxserve.config.engine_args import engine_config_from_args
    from server.app import ServerOptions, serve
    from server.tenants import parse_priority_range

    _setup_logging()
    cfg = engine_config_from_args(ns)
    if bool(ns.tls_cert_file) != bool(ns.tls_key_file):
        raise ValueError("--tls-cert-file and --tls-key-file go together")
    if ns.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    api_key, tenants = _keys_from_args(ns)
    for flag in ("stream_idle_timeout", "keepalive_time", "keepalive_timeout", "max_concurrent_streams",
                 "max_open_calls", "frontend_threads", "tokenizer_backlog_chars", "http_max_head_bytes",
                 "http_head_timeout", "http_max_connections_per_peer"):
        if getattr(ns, flag) is not None and getattr(ns, flag) <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0")
    if ns.max_queued_tokens is not None and ns.max_queued_tokens < 1:
        raise ValueError("--max-queued-tokens must be >= 1")
    if ns.http_port < 0:
        raise ValueError("--http-port must be >= 0 (0: off)")
    lora_modules = []
    for item in ns.lora_modules or ():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: NAME=PATH expected, got {item!r}")
        lora_modules.append((name, path))
    if lora_modules and not cfg.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    opts = ServerOptions(
        http_port=ns.http_port or -1, served_model_name=tuple(ns.served_model_name or ()),
        lora_modules=tuple(lora_modules),
        chat_template=_read_chat_template(ns.chat_template),
        tool_call_parser=ns.tool_call_parser,
        host=ns.host, port=ns.port, metrics_host=ns.metrics_host, metrics_port=ns.metrics_port,
        api_key=api_key, tenants=tenants, shared_prefix_cache=ns.shared_prefix_cache,
        priority_range=parse_priority_range(ns.priority_range, "--priority-range"),
        tls_cert_file=ns.tls_cert_file, tls_key_file=ns.tls_key_file,
        tls_client_ca_file=ns.tls_client_ca_file, max_queued_requests=ns.max_queued_requests,
        max_queued_tokens=ns.max_queued_tokens, stream_idle_timeout=ns.stream_idle_timeout,
        max_concurrent_streams=ns.max_concurrent_streams, keepalive_time=ns.keepalive_time,
        keepalive_timeout=ns.keepalive_timeout, max_connection_idle=ns.max_connection_idle,
        max_connection_age=ns.max_connection_age, max_connection_age_grace=ns.max_connection_age_grace,
        max_open_calls=ns.max_open_calls, frontend_threads=ns.frontend_threads,
        tokenizer_backlog_chars=ns.tokenizer_backlog_chars, http_max_head_bytes=ns.http_max_head_bytes,
        http_head_timeout=ns.http_head_timeout, http_max_connections_per_peer=ns.http_max_connections_per_peer,
        shutdown_timeout=ns.shutdown_timeout, max_prompt_chars=ns.max_prompt_chars,
        max_message_bytes=ns.max_message_bytes, log_interval=ns.log_interval, warmup=ns.warmup,
        require_warm_cache=ns.require_warm_cache, request_trace=ns.record_request_trace,
    )
    if cfg.num_processes > 1 and cfg.process_id != 0:
        # Multi-host follower: no gRPC port; run the leader's steps until it stops us.
        from jaxserve.engine.llm_engine import run_follower_process

        run_follower_process(cfg)
    try:
        return asyncio.run(serve(cfg, opts))
    except OSError as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # e.g. --require-warm-cache with a cold cache
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 3


def _read_chat_template(arg: str | None) -> str | None:
    """A file's contents, or the argument itself when it is not a file but looks like Jinja."""
    import os

    if arg is None:
        return None
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            return f.read()
    if "{" in arg:
        return arg
    raise ValueError(f"--chat-template: {arg!r} is neither a file nor a Jinja template")


def _keys_from_args(ns: argparse.Namespace) -> tuple[str | None, tuple]:
    """(single key, tenants) from --api-keys, --api-key-file, $JAXSERVE_API_KEY or --api-key."""
    import os

    from server.tenants import API_KEY_ENV, load_api_keys, read_single_key

    given = [f for f in ("api_keys", "api_key_file", "api_key") if getattr(ns, f)]
    if len(given) > 1:
        raise ValueError(f"give one of --api-keys, --api-key-file, --api-key (got {', '.join(given)})")
    if ns.api_keys:
        return None, tuple(load_api_keys(ns.api_keys))
    if ns.api_key_file:
        return read_single_key(ns.api_key_file), ()
    if ns.api_key:
        logging.getLogger("jaxserve.server").warning(
            "--api-key puts the key in the process list; prefer --api-key-file or $%s", API_KEY_ENV)
        return ns.api_key, ()
    return os.environ.get(API_KEY_ENV) or None, ()


def make_channel(address: str, tls_ca_file: str | None = None):
    import grpc

    if tls_ca_file:
        with open(tls_ca_file, "rb") as f:
            return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))
    return grpc.insecure_channel(address)


def cmd_client(ns: argparse.Namespace) -> int:
    import grpc

    from server.convert import sampling_params_to_proto
    from server.proto import jaxserve_pb2 as pb
    from server.proto import jaxserve_pb2_grpc as pb_grpc

    sp = sampling_params_to_proto(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                                  top_k=ns.top_k, seed=ns.seed)
    if ns.chat:
        req = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=ns.prompt)]),
                                 sampling_params=sp)
    else:
        req = pb.GenerateRequest(text=ns.prompt, sampling_params=sp)
    import os

    from server.tenants import API_KEY_ENV

    key = ns.api_key or os.environ.get(API_KEY_ENV)
    md = [("authorization", f"Bearer {key}")] if key else None
    t0 = time.perf_counter()
    ttft = None
    last = None
    with make_channel(ns.address, ns.tls_ca_file) as ch:
        stub = pb_grpc.JaxServeStub(ch)
        try:
            for resp in stub.Generate(req, metadata=md, timeout=ns.timeout):
                for d in resp.outputs:
                    if d.text:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        sys.stdout.write(d.text)
                        sys.stdout.flush()
                last = resp
        except grpc.RpcError as e:
            print(f"\njaxserve client: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    dt = time.perf_counter() - t0
    print()
    if last is not None:
        u = last.usage
        reason = last.outputs[0].finish_reason if last.outputs else ""
        print(f"[finish: {reason}, prompt {u.prompt_tokens}, completion {u.completion_tokens}, "
              f"cached {u.cached_tokens} tokens; TTFT {1000 * (ttft or dt):.0f} ms, total {dt:.2f} s]",
              file=sys.stderr)
    return 0
