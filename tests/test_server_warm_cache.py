"""`jaxserve serve --require-warm-cache` refuses to start on a cold compilation cache, naming
the missed shapes; having compiled them, it left the cache warm for the same flags."""

from __future__ import annotations

import subprocess
import sys

FLAGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "8", "--num-pages", "16", "--max-model-len", "64",
         "--max-logprobs", "0"]


def test_require_warm_cache(tmp_path):
    cache = str(tmp_path / "xla")
    cmd = [sys.executable, "-m", "jaxserve.cli"]
    cold = subprocess.run([*cmd, "serve", "--port", "0", "--metrics-port", "0", "--http-port", "0", "--require-warm-cache",
                           "--compilation-cache-dir", cache, *FLAGS], capture_output=True, text=True, timeout=300)
    assert cold.returncode == 3, cold.stderr[-2000:]
    assert "missed the compilation cache" in cold.stderr
    warm = subprocess.run([*cmd, "warmup", "--quiet", "--require-warm-cache", "--compilation-cache-dir", cache,
                           *FLAGS], capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr[-2000:]  # the serve attempt above filled the cache
    assert " 0 compiled" in warm.stdout
