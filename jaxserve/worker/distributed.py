"""Multi-host serving: `jax.distributed`, a leader that broadcasts each step, followers that
run the same jitted step, and heartbeats so a dead peer makes the leader unhealthy.

Process 0 (the leader) runs the scheduler, the runner's input stage and the front end. Each
step is broadcast once, before it runs, as a fixed-size header plus one fixed-size int32
payload holding the batch and the sampling rows (and a second one with the penalty history
and the logit-bias rows, only when a row needs the full sampler variant, and a third with
the token bitmasks, only when a row has structured output): one compiled
broadcast per size class, primed at warmup, so serving compiles nothing. Every process then
runs the same SPMD executables over the global mesh. Followers loop on `run_follower` until
the leader sends STOP.

A dead follower surfaces two ways, both without a hang: the leader's next collective fails
at once (gloo reports the reset connection), and an idle leader's heartbeat monitor sees the
follower's heartbeat go stale within `heartbeat_timeout_s`. Either marks the engine
unhealthy (health NOT_SERVING, new requests refused) while the leader stays up, so an
orchestrator can see it and restart the whole group. JAX runs with recoverability on, so the
coordination service does not kill the survivors outright.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from jaxserve.worker.batch import StepArrays
from jaxserve.worker.sampler import SamplerFlags, SamplingTensors
from scheduler.request import MAX_LOGIT_BIAS

logger = logging.getLogger(__name__)

OP_NOOP, OP_STEP, OP_STOP, OP_UPDATE_WEIGHTS = 0, 1, 3, 4
HEADER_SIZE = 8  # [op, T, R, variant index, has penalties, num_reqs, num_tokens, has bitmask]


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator_address: str
    num_processes: int
    process_id: int
    heartbeat_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.num_processes < 2:
            raise ValueError(f"num_processes must be >= 2 for multi-host serving, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, {self.num_processes}), got {self.process_id}")
        if not self.coordinator_address or ":" not in self.coordinator_address:
            raise ValueError(f"coordinator must be HOST:PORT, got {self.coordinator_address!r}")


_initialized = False


def initialize(dc: DistributedConfig) -> None:
    """`jax.distributed.initialize`, with gloo collectives when the processes run on CPUs."""
    global _initialized
    if _initialized:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Without recoverability JAX's coordination service terminates every process as soon as
    # one dies; with it the leader lives on, reports NOT_SERVING and lets the orchestrator
    # decide (and a drain can still answer the clients it holds).
    jax.config.update("jax_enable_recoverability", True)
    # JAX's preemption service installs its own SIGTERM handler, which would swallow the
    # server's graceful drain.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        dc.coordinator_address, dc.num_processes, dc.process_id,
        heartbeat_timeout_seconds=max(2, int(dc.heartbeat_timeout_s)),
    )
    _initialized = True


def _broadcast(x: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


class StepChannel:
    """Packs runner calls into fixed-size int32 buffers and broadcasts them from the leader."""

    def __init__(self, max_tokens: int, max_reqs: int, max_pages_per_seq: int, num_stop_ids: int,
                 penalty_width: int, variants: tuple[SamplerFlags, ...], bitmask_width: int = 1,
                 num_kv_groups: int = 1):
        self.max_tokens, self.max_reqs, self.width = max_tokens, max_reqs, max_pages_per_seq
        self.num_kv_groups = num_kv_groups  # layer groups: [G * T] slots (`max_pages_per_seq` is the whole row)
        self.variants = variants
        self.backbone_size = ((2 + num_kv_groups) * max_tokens + (max_reqs + 1) + max_reqs * (2 + max_pages_per_seq)
                              + 1)
        self._scalar_fields = [f.name for f in dataclasses.fields(SamplingTensors) if f.name not in
                               ("stop_token_ids", "penalty_token_ids", "bias_token_ids", "bias_values",
                                "token_bitmask")]
        self.sample_size = max_reqs * (len(self._scalar_fields) + num_stop_ids)
        # The full variant's payload: penalty history, then the logit-bias ids and values.
        self.penalty_width = penalty_width
        self.penalty_size = max_reqs * (penalty_width + 2 * MAX_LOGIT_BIAS)
        self.bitmask_size = max_reqs * bitmask_width

    # -------------------------------------------------------------- broadcast primitives
    def _send(self, header: list[int], payloads: list[np.ndarray]) -> None:
        h = np.zeros(HEADER_SIZE, np.int32)
        h[: len(header)] = header
        _broadcast(h)
        for p in payloads:
            _broadcast(p)

    def prime(self) -> None:
        """Compiles each broadcast size class, and the vote of `all_agree` (both sides run
        this at warmup)."""
        for size in (HEADER_SIZE, self.step_size, self.penalty_size, self.bitmask_size):
            _broadcast(np.zeros(size, np.int32))
        self.all_agree(True)

    # -------------------------------------------------------------- weight updates
    def send_update_weights(self, path: str) -> None:
        """Tells every follower to load the weights at `path` (each reads its own copy)."""
        raw = np.frombuffer(path.encode(), np.uint8).astype(np.int32)
        if len(raw) > self.step_size:
            raise ValueError(f"update_weights: the path is longer than {self.step_size} bytes")
        buf = np.zeros(self.step_size, np.int32)
        buf[: len(raw)] = raw
        self._send([OP_UPDATE_WEIGHTS, len(raw)], [buf])

    def recv_update_weights(self, header: np.ndarray) -> str:
        buf = _broadcast(np.zeros(self.step_size, np.int32))
        return bytes(buf[: int(header[1])].astype(np.uint8)).decode()

    @staticmethod
    def all_agree(ok: bool) -> bool:
        """True when every process says `ok` (a collective: every process must call it)."""
        from jax.experimental import multihost_utils

        return bool(np.asarray(multihost_utils.process_allgather(np.asarray([int(ok)], np.int32))).min())

    @property
    def step_size(self) -> int:
        return self.backbone_size + self.sample_size

    # -------------------------------------------------------------- one step
    def send_step(self, a: StepArrays, t: SamplingTensors, rows: int, flags: SamplerFlags) -> None:
        buf = np.zeros(self.step_size, np.int32)
        self._pack_backbone(a, buf[: self.backbone_size])
        self._pack_sample(t, rows, buf[self.backbone_size :])
        payloads = [buf]
        if flags.use_penalties:
            pen = np.zeros(self.penalty_size, np.int32)
            for o, rows_of in zip(self._full_offsets(), (t.penalty_token_ids, t.bias_token_ids, t.bias_values)):
                part = np.asarray(rows_of)[:rows]
                pen[o : o + part.size] = part.ravel().view(np.int32)
            payloads.append(pen)
        if flags.use_bitmask:
            mask = np.zeros(self.bitmask_size, np.int32)
            part = np.asarray(t.token_bitmask)[:rows]
            mask[: part.size] = part.ravel()
            payloads.append(mask)
        header = [OP_STEP, len(a.token_ids), rows, self.variants.index(flags), int(flags.use_penalties),
                  a.num_reqs, a.num_tokens, int(flags.use_bitmask)]
        self._send(header, payloads)

    def recv_step(self, header: np.ndarray, tensors_by_rows: dict[int, SamplingTensors]
                  ) -> tuple[StepArrays, SamplingTensors, int, SamplerFlags]:
        T, rows, n_reqs, n_tok = int(header[1]), int(header[2]), int(header[5]), int(header[6])
        flags = self.variants[int(header[3])]
        buf = _broadcast(np.zeros(self.step_size, np.int32))
        arrays = self._unpack_backbone(buf[: self.backbone_size], T, n_reqs, n_tok)
        into = tensors_by_rows[rows]
        self._unpack_sample(buf[self.backbone_size :], rows, into)
        if header[4]:
            pen = _broadcast(np.zeros(self.penalty_size, np.int32))
            for o, dst in zip(self._full_offsets(), (into.penalty_token_ids, into.bias_token_ids, into.bias_values)):
                width = dst.shape[1]
                dst[:rows] = pen[o : o + rows * width].view(dst.dtype).reshape(rows, width)
        if header[7]:
            mask = _broadcast(np.zeros(self.bitmask_size, np.int32))
            width = into.token_bitmask.shape[1]
            into.token_bitmask[:rows] = mask[: rows * width].reshape(rows, width)
        return arrays, into, rows, flags

    def _full_offsets(self) -> tuple[int, int, int]:
        """Where the penalty ids, the bias ids and the bias values start in the full payload."""
        R = self.max_reqs
        return 0, R * self.penalty_width, R * (self.penalty_width + MAX_LOGIT_BIAS)

    def _pack_backbone(self, a: StepArrays, buf: np.ndarray) -> None:
        T, M = len(a.token_ids), self.max_tokens
        for i, p in enumerate((a.token_ids, a.positions)):
            buf[i * M : i * M + T] = p
        buf[2 * M : 2 * M + a.slot_mapping.size] = a.slot_mapping
        o = (2 + self.num_kv_groups) * M
        for p in (a.cu_q_lens, a.kv_lens, a.logits_indices, a.block_tables.ravel(), a.num_seqs):
            buf[o : o + p.size] = p.ravel()
            o += p.size

    def _unpack_backbone(self, buf: np.ndarray, T: int, n_reqs: int, n_tok: int) -> StepArrays:
        M, G = self.max_tokens, self.num_kv_groups
        tok, pos = (buf[i * M : i * M + T].copy() for i in range(2))
        slots = buf[2 * M : 2 * M + G * T].copy()
        o = (2 + G) * M
        R = self.max_reqs
        out = []
        for n in (R + 1, R, R, R * self.width, 1):
            out.append(buf[o : o + n].copy())
            o += n
        cu, kv, lidx, tables, nseq = out
        return StepArrays(tok, pos, slots, cu, kv, tables.reshape(R, self.width), nseq, lidx, n_tok, n_reqs)

    def _pack_sample(self, t: SamplingTensors, rows: int, buf: np.ndarray) -> None:
        o = 0
        for name in self._scalar_fields:
            a = np.asarray(getattr(t, name))[:rows]
            buf[o : o + rows] = a.view(np.int32) if a.dtype.itemsize == 4 else a.astype(np.int32)
            o += self.max_reqs
        stops = np.asarray(t.stop_token_ids)[:rows]
        buf[o : o + stops.size] = stops.ravel()

    def _unpack_sample(self, buf: np.ndarray, rows: int, into: SamplingTensors) -> None:
        o = 0
        for name in self._scalar_fields:
            dst = getattr(into, name)
            src = buf[o : o + rows]
            dst[:rows] = src.view(dst.dtype) if dst.dtype.itemsize == 4 else src.astype(dst.dtype)
            o += self.max_reqs
        S = into.stop_token_ids.shape[1]
        into.stop_token_ids[:rows] = buf[o : o + rows * S].reshape(rows, S)

    def send_stop(self) -> None:
        self._send([OP_STOP], [])

    def recv_header(self) -> np.ndarray:
        return _broadcast(np.zeros(HEADER_SIZE, np.int32))


def exit_follower(code: int = 0) -> None:
    """Ends a follower process once the leader has stopped it, skipping the atexit
    `jax.distributed.shutdown()`: that RPC goes to the coordination service hosted by the
    leader, which may already be gone, and a failed RPC aborts the process."""
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_follower(runner, channel: StepChannel, tensors_by_rows: dict[int, SamplingTensors],
                 update_weights: Callable[[str], object] | None = None) -> None:
    """A follower's loop: receive each step from the leader and run it, until STOP;
    `update_weights(path)` takes part in a weight update the leader started."""
    while True:
        header = channel.recv_header()
        op = int(header[0])
        if op == OP_STOP:
            return
        if op == OP_STEP:
            arrays, tensors, rows, flags = channel.recv_step(header, tensors_by_rows)
            runner.run_step(arrays, tensors, rows, flags).token_ids.block_until_ready()
        elif op == OP_UPDATE_WEIGHTS:
            path = channel.recv_update_weights(header)
            try:
                update_weights(path)
            except ValueError as e:  # refused everywhere: the leader reports it; keep serving
                logger.warning("weight update from %s not applied: %s", path, e)


class PeerMonitor:
    """Heartbeats through the jax.distributed key-value store. Every process writes its own;
    the leader watches the followers' and calls `on_dead(reason)` once when one goes stale."""

    def __init__(self, dc: DistributedConfig, on_dead: Callable[[str], None], interval_s: float = 0.25):
        from jax._src import distributed as jd

        self._client = jd.global_state.client
        self._dc = dc
        self._on_dead = on_dead
        self._interval = interval_s
        self._stop = threading.Event()
        self._fired = False
        self._threads = [threading.Thread(target=self._beat, name="jaxserve-heartbeat", daemon=True)]
        if dc.process_id == 0:
            self._threads.append(threading.Thread(target=self._watch, name="jaxserve-peer-monitor", daemon=True))

    def start(self) -> PeerMonitor:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def say_goodbye(self) -> None:
        """A follower that got STOP: tell the leader it is about to exit."""
        self._client.key_value_set(f"jaxserve/goodbye/{self._dc.process_id}", "1", allow_overwrite=True)

    def wait_for_goodbyes(self, timeout_s: float) -> None:
        """The leader after STOP: wait (bounded) for every follower's goodbye, then a moment
        for their processes to end before the coordination service goes down with us."""
        deadline = time.time() + timeout_s
        for pid in range(1, self._dc.num_processes):
            while time.time() < deadline:
                try:
                    if self._client.key_value_try_get(f"jaxserve/goodbye/{pid}"):
                        break
                except Exception:  # not set yet
                    pass
                time.sleep(0.05)
        time.sleep(0.5)

    def _beat(self) -> None:
        key = f"jaxserve/heartbeat/{self._dc.process_id}"
        while not self._stop.is_set():
            try:
                self._client.key_value_set(key, repr(time.time()), allow_overwrite=True)
            except Exception:  # the coordination service is gone: nothing left to tell
                return
            self._stop.wait(self._interval)

    def _watch(self) -> None:
        start = time.time()
        while not self._stop.wait(self._interval):
            now = time.time()
            for pid in range(1, self._dc.num_processes):
                try:
                    value = self._client.key_value_try_get(f"jaxserve/heartbeat/{pid}")
                    age = now - float(value)
                except Exception:
                    age = now - start  # not written yet
                if age > self._dc.heartbeat_timeout_s:
                    self._fire(f"process {pid} sent no heartbeat for {age:.1f} s")
                    return

    def _fire(self, reason: str) -> None:
        if not self._fired:
            self._fired = True
            logger.error("multi-host peer lost: %s", reason)
            self._on_dead(reason)
