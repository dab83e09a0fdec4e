"""Prometheus metrics with vLLM's names under the `jaxserve:` prefix.

Latency histograms and token / request counters are updated by the engine thread as outputs
come out of `Engine.step()`. Scheduler gauges and the scheduler's own cumulative counters
(preemptions, prefix-cache queries and hits) are read at scrape time from the latest
`EngineSnapshot`, so a scrape never touches the engine from another thread.

Each server has its own `CollectorRegistry`, so several servers (or tests) in one process
never clash.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import jax
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

logger = logging.getLogger(__name__)

P = "jaxserve:"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FILL_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], Any] | None = None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            P + "time_to_first_token_seconds", "Time to first token (arrival to first output token).",
            buckets=TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            P + "inter_token_latency_seconds", "Time between successive outputs of a request.",
            buckets=ITL_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            P + "request_time_per_output_token_seconds", "Mean time per output token after the first, per request.",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            P + "e2e_request_latency_seconds", "Arrival to finish, per request.",
            buckets=REQUEST_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            P + "request_queue_time_seconds", "Arrival to first scheduling, per request.",
            buckets=REQUEST_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(
            P + "iteration_tokens_total", "Tokens computed per engine step (prefill and decode).",
            buckets=ITERATION_TOKEN_BUCKETS, registry=r)
        self.scheduled_tokens = Counter(
            P + "scheduled_tokens", "Tokens computed, by phase: prefill chunks or decodes.", ["phase"], registry=r)
        self.step_token_fill = Histogram(
            P + "step_token_fill", "Per step, real tokens / the padded token bucket the step ran in (1: no padding).",
            buckets=FILL_BUCKETS, registry=r)
        self.tenant_prompt_tokens = Counter(
            P + "tenant_prompt_tokens", "Prompt tokens of finished requests, by tenant.", ["tenant"], registry=r)
        self.tenant_cached_prompt_tokens = Counter(
            P + "tenant_cached_prompt_tokens",
            "Prompt tokens of finished requests found in the prefix cache, by tenant (hit rate: / tenant_prompt_tokens).",
            ["tenant"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Generated tokens.", registry=r)
        self.request_success = Counter(
            P + "request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r)
        self.compilations_after_warmup = Counter(
            P + "compilations_after_warmup", "XLA compilations after warmup finished (should stay 0).",
            registry=r)
        self.stream_idle_aborts = Counter(
            P + "stream_idle_aborts", "Streams aborted because the client read nothing for stream_idle_timeout.",
            registry=r)
        self.auth_failures = Counter(P + "auth_failures", "Calls refused for a missing or wrong API key.", registry=r)
        self.tokenize_requests = Counter(P + "tokenize_requests", "Tokenize calls answered (gRPC and HTTP).",
                                         registry=r)
        self.http_requests = Counter(
            P + "http_requests", "OpenAI HTTP API calls by endpoint and status.", ["endpoint", "status"], registry=r)
        self.requests_refused = Counter(
            P + "requests_refused", "Calls refused with RESOURCE_EXHAUSTED (HTTP 429), by the limit they hit.", ["limit"],
            registry=r)
        self.frontend_jobs_pending = Gauge(
            P + "frontend_jobs_pending", "Tokenization / chat-template jobs queued or running.", registry=r)
        self.engine_thread_alive = Gauge(
            P + "engine_thread_alive", "1 while the engine thread runs; 0 once it has stopped.", registry=r)
        self._engine_thread: threading.Thread | None = None
        if snapshot is not None:
            r.register(_SnapshotCollector(snapshot))
        _install_compile_listener(self)

    def set_engine_thread(self, thread: threading.Thread) -> None:
        """Called once warmup is done: from now on every XLA compilation on the engine thread
        (the only thread that runs the engine) is a recompilation, counted and logged."""
        self._engine_thread = thread
        self.engine_thread_alive.set_function(lambda: float(thread.is_alive()))

    def set_frontend(self, pool: Any) -> None:
        self.frontend_jobs_pending.set_function(lambda: float(pool.pending))

    def on_compile(self, duration_s: float) -> None:
        if self._engine_thread is not None and threading.current_thread() is self._engine_thread:
            self.compilations_after_warmup.inc()
            logger.warning("XLA compilation after warmup (%.2f s): a shape was not warmed up", duration_s)

    @property
    def num_compilations_after_warmup(self) -> int:
        return int(self.compilations_after_warmup._value.get())

    def observe_step(self, timing: Any) -> None:
        """Called by the engine thread after each step that computed tokens (a `StepTiming`)."""
        if not timing.num_tokens:
            return
        self.iteration_tokens.observe(timing.num_tokens)
        self.scheduled_tokens.labels(phase="decode").inc(timing.num_decode_tokens)
        self.scheduled_tokens.labels(phase="prefill").inc(timing.num_tokens - timing.num_decode_tokens)
        if timing.padded_tokens:
            self.step_token_fill.observe(timing.num_tokens / timing.padded_tokens)

    def observe_finished(self, out: Any) -> None:
        """Called by the engine thread for each finished `RequestOutput`."""
        m = out.metrics
        if m.first_token_time is not None:
            self.time_to_first_token.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e_request_latency.observe(m.finished_time - m.arrival_time)
            n = out.usage.completion_tokens
            if m.first_token_time is not None and n > 1:
                self.time_per_output_token.observe((m.finished_time - m.first_token_time) / (n - 1))
        if m.first_scheduled_time is not None:
            self.request_queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.prompt_tokens.inc(out.usage.prompt_tokens)
        tenant = out.request_id.split("/", 1)[0] if "/" in out.request_id else ""
        self.tenant_prompt_tokens.labels(tenant=tenant).inc(out.usage.prompt_tokens)
        self.tenant_cached_prompt_tokens.labels(tenant=tenant).inc(out.usage.cached_tokens)
        reason = out.outputs[0].finish_reason if out.outputs else None
        self.request_success.labels(finished_reason=reason or "unknown").inc()


class _SnapshotCollector:
    """Scheduler gauges and counters, read from the engine's latest snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], Any]):
        self._snapshot = snapshot

    def collect(self):
        snap = self._snapshot()
        if snap is None:
            return
        st = snap.stats
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", st.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", st.num_waiting),
            ("num_requests_swapped", "Requests swapped out to host memory.", st.num_swapped),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks held by requests (0..1).", st.kv_usage),
            ("kv_cache_used_blocks", "KV-cache blocks held by requests.", st.num_used_blocks),
            ("kv_cache_cached_free_blocks",
             "Free KV-cache blocks that still hold reusable prefix K/V (not leaked).", st.num_cached_free_blocks),
            ("kv_cache_free_blocks", "Free KV-cache blocks (cached ones included).", st.num_free_blocks),
            ("kv_cache_total_blocks", "Usable KV-cache blocks.", st.num_total_blocks),
            ("num_requests_in_flight", "Requests streaming to clients.", snap.num_streams),
        ):
            yield GaugeMetricFamily(P + name, doc, value=value)
        pre = CounterMetricFamily(P + "num_preemptions", "Preemptions by mode.", labels=["mode"])
        for mode in ("recompute", "swap"):
            pre.add_metric([mode], st.preemptions.get(mode, 0))
        yield pre
        yield CounterMetricFamily(P + "prefix_cache_queries", "Prefix-cache queries (tokens).",
                                  value=st.prefix_cache_queries)
        yield CounterMetricFamily(P + "prefix_cache_hits", "Prefix-cache hits (tokens).",
                                  value=st.prefix_cache_hits)
        yield CounterMetricFamily(P + "engine_steps", "Engine steps run.", value=snap.num_steps)
        if snap.lora is not None:
            yield from _lora_metrics(snap.lora)
        enc = snap.encoder
        if enc is not None:  # a vision-language model's image encoder and its output cache
            yield CounterMetricFamily(P + "mm_images_encoded", "Images run through the image encoder.",
                                      value=enc["images_encoded"])
            yield CounterMetricFamily(P + "mm_encoder_cache_hits", "Encoder-cache lookups that found the image.",
                                      value=enc["cache_hits"])
            yield CounterMetricFamily(P + "mm_encoder_cache_misses", "Encoder-cache lookups that did not.",
                                      value=enc["cache_misses"])
            yield GaugeMetricFamily(P + "mm_encoder_cache_bytes", "Host bytes the encoder cache holds.",
                                    value=enc["cache_bytes"])
        spec = snap.spec_decode
        if spec is not None:  # vLLM's names
            yield CounterMetricFamily(P + "spec_decode_num_drafts", "Sequences that carried speculative drafts.",
                                      value=spec.num_drafts)
            yield CounterMetricFamily(P + "spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                      value=spec.num_draft_tokens)
            yield CounterMetricFamily(P + "spec_decode_num_accepted_tokens", "Draft tokens kept.",
                                      value=spec.num_accepted_tokens)
            per = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens kept, by position in the draft.", labels=["position"])
            for i, n in enumerate(spec.accepted_per_position):
                per.add_metric([str(i)], n)
            yield per


def _lora_metrics(lora: dict[str, Any]):
    """vLLM's `lora_requests_info` gauge (the adapters running and waiting as labels, the
    scrape's wall time as the value), per-adapter counts and the adapter loads into slots."""
    info = GaugeMetricFamily(P + "lora_requests_info", "LoRA adapters of the running and waiting requests.",
                             labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    info.add_metric([",".join(lora["running"]), ",".join(lora["waiting"]), str(lora["max_loras"])], time.time())
    yield info
    requests = CounterMetricFamily(P + "lora_requests", "Requests admitted, by LoRA adapter.", labels=["lora_name"])
    tokens = CounterMetricFamily(P + "lora_generation_tokens", "Tokens generated, by LoRA adapter.",
                                 labels=["lora_name"])
    for name, (n_req, n_tok) in sorted(lora["stats"].items()):
        requests.add_metric([name], n_req)
        tokens.add_metric([name], n_tok)
    yield requests
    yield tokens
    yield CounterMetricFamily(P + "lora_slot_loads", "LoRA adapters written into a device slot (slot misses).",
                              value=lora["num_loads"])


# jax.monitoring listeners are process-wide: install one and fan out to live servers.
_sinks: weakref.WeakSet[ServerMetrics] = weakref.WeakSet()
_installed = False
_install_lock = threading.Lock()


def _on_event_duration(event: str, duration_s: float, **_: Any) -> None:
    if event == COMPILE_EVENT:
        for sink in list(_sinks):
            sink.on_compile(duration_s)


def _install_compile_listener(sink: ServerMetrics) -> None:
    global _installed
    with _install_lock:
        _sinks.add(sink)
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_event_duration)
            _installed = True
