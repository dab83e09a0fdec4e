"""Two processes on 127.0.0.1 with gloo collectives: the leader's generate matches a single
process, and killing the follower makes the leader unhealthy within seconds, without a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from server_harness import free_port

CHILD = os.path.join(os.path.dirname(__file__), "multihost_child.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("torch")
    from hf_reference import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_mh"), 2)


def _spawn(model, coordinator, n, pid, mode, log=None, *extra):
    out = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen([sys.executable, "-u", CHILD, model, coordinator, str(n), str(pid), mode, *extra],
                            stdout=out, stderr=subprocess.STDOUT, text=True)


def _last_json(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    assert lines, text[-3000:]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def single_env(tmp_path_factory) -> dict[str, str]:
    """The single-process children's environment: one compilation cache for both checkpoints
    (same shapes, same programs), so the second loads what the first compiled."""
    return {**os.environ, "MULTIHOST_TEST_CACHE": str(tmp_path_factory.mktemp("mh_cache"))}


@pytest.fixture(scope="module")
def single_process_tokens(tiny_model, single_env):
    single = subprocess.run([sys.executable, CHILD, tiny_model, "-", "1", "0", "generate"],
                            capture_output=True, text=True, timeout=300, env=single_env)
    assert single.returncode == 0, single.stderr[-3000:]
    return _last_json(single.stdout)["tokens"]


def test_two_processes_match_single_process_and_update_weights_together(tiny_model, single_process_tokens,
                                                                      single_env, tmp_path):
    """Then a weight update: a path no process can read is refused by all (nothing changes,
    the group keeps serving), another checkpoint is taken by both, and the group answers as
    one process on that checkpoint does, with nothing compiled."""
    from hf_reference import save_tiny_llama

    second = save_tiny_llama(tmp_path / "second", 2, seed=1)
    single = subprocess.run([sys.executable, CHILD, second, "-", "1", "0", "generate"],
                            capture_output=True, text=True, timeout=300, env=single_env)
    assert single.returncode == 0, single.stderr[-3000:]
    coordinator = f"127.0.0.1:{free_port()}"
    follower = _spawn(tiny_model, coordinator, 2, 1, "update", None, second)
    leader = _spawn(tiny_model, coordinator, 2, 0, "update", None, second)
    try:
        out_leader, _ = leader.communicate(timeout=300)
        out_follower, _ = follower.communicate(timeout=60)
    finally:
        for p in (leader, follower):
            p.kill()
    result = _last_json(out_leader)
    assert result["tokens"] == single_process_tokens
    assert "/no/such/weights" in result["refused"] and result["version"] == 1
    assert "not supported on a multi-host engine" in result["sleep_refused"]
    assert result["tokens_after_update"] == _last_json(single.stdout)["tokens"] != single_process_tokens
    assert result["compiles_after_warmup"] == 0
    assert "FOLLOWER DONE" in out_follower and "not applied" in out_follower
    # Each process read its half of the projections and vocabulary (and the norms), at start
    # and at the update: the slices its device holds.
    for out in (out_leader, out_follower):
        shares = [int(s) for s in re.findall(r"read [\d.]+ GB, (\d+)% of the checkpoint", out)]
        assert len(shares) == 2 and all(s < 55 for s in shares), out[-3000:]


def _wait_for(log, needle: str, timeout: float) -> tuple[bool, str, float]:
    """Polls a child's log file until it holds `needle`; bounded in time."""
    t0 = time.time()
    text = ""
    while time.time() - t0 < timeout:
        with open(log) as f:
            text = f.read()
        if needle in text:
            return True, text, time.time() - t0
        time.sleep(0.1)
    return False, text, time.time() - t0


def test_dead_follower_makes_leader_unhealthy(tiny_model, tmp_path):
    coordinator = f"127.0.0.1:{free_port()}"
    logs = {pid: str(tmp_path / f"p{pid}.log") for pid in (0, 1)}
    follower = _spawn(tiny_model, coordinator, 2, 1, "watch", logs[1])
    leader = _spawn(tiny_model, coordinator, 2, 0, "watch", logs[0])
    try:
        for pid in (0, 1):
            ok, seen, _ = _wait_for(logs[pid], "READY", 240)
            assert ok, seen[-3000:]
        follower.send_signal(signal.SIGKILL)
        ok, seen, waited = _wait_for(logs[0], "UNHEALTHY", 20)
        print(f"leader unhealthy {waited:.1f} s after the follower was killed")
        assert ok, seen[-3000:]
        assert waited < 10
        assert leader.poll() is None  # still up, reporting its state
    finally:
        for p in (leader, follower):
            p.kill()
            p.wait(timeout=30)


def test_grpc_generate_served_by_two_processes(tiny_model, single_process_tokens, tmp_path):
    """`jaxserve serve` as leader + follower: a gRPC Generate streams the single-process
    tokens; SIGTERM drains the leader, which stops the follower; both exit 0."""

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from server.proto import jaxserve_pb2 as pb
    from server.proto import jaxserve_pb2_grpc as pb_grpc

    coordinator = f"127.0.0.1:{free_port()}"
    flags = ["--model", tiny_model, "--coordinator", coordinator, "--num-processes", "2", "--tensor-parallel-size",
             "2", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--num-pages", "64",
             "--max-model-len", "128", "--max-logprobs", "0", "--compilation-cache-dir", "none",
             "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--http-port", "0", "--log-interval", "0",
             "--dtype", "float32", "--no-warmup"]  # ignored across hosts: the leader warms up in step with its followers
    logs = {pid: tmp_path / f"serve{pid}.log" for pid in (0, 1)}
    procs = {pid: subprocess.Popen([sys.executable, "-u", "-m", "jaxserve.cli", "serve", *flags, "--process-id",
                                    str(pid)], stdout=open(logs[pid], "w"), stderr=subprocess.STDOUT)
             for pid in (1, 0)}
    try:
        ok, text, _ = _wait_for(str(logs[0]), "listening on", 120)
        assert ok, text[-3000:]
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+)", text).group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            t0 = time.time()
            while time.time() - t0 < 240:
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
            else:
                raise AssertionError(logs[0].read_text()[-3000:])
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 9, 13, 2, 7]), sampling_params=pb.SamplingParams(
                temperature=0.0, max_tokens=10, ignore_eos=True))
            tokens = [t for r in pb_grpc.JaxServeStub(ch).Generate(req, timeout=120) for d in r.outputs
                      for t in d.token_ids]
        assert tokens == single_process_tokens[0]
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0, logs[0].read_text()[-3000:]
        assert procs[1].wait(timeout=60) == 0, logs[1].read_text()[-3000:]
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=30)
