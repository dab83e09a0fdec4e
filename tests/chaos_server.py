"""A server process for the chaos tests that must end a process: `--kill-engine-on ID` makes
the engine thread's output handling raise when the request with that id produces output (an
error outside the step, which stops the loop); otherwise a plain server. Prints the log that
`jaxserve serve` prints; exits with serve()'s status."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from jaxserve.config.engine_config import EngineConfig
from server import engine_loop
from server.app import ServerOptions, serve


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kill-engine-on", default=None)
    ap.add_argument("--shutdown-timeout", type=float, default=10.0)
    ns = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if ns.kill_engine_on:
        real = engine_loop.EngineLoop._process

        def process(self, outputs):
            if any(o.request_id.endswith("/" + ns.kill_engine_on) for o in outputs):
                raise RuntimeError("injected fault in the engine loop")
            return real(self, outputs)

        engine_loop.EngineLoop._process = process
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, num_pages=128, max_model_len=512)
    opts = ServerOptions(host="127.0.0.1", port=0, metrics_port=-1, http_port=-1, log_interval=0, warmup=False,
                         shutdown_timeout=ns.shutdown_timeout)
    return asyncio.run(serve(cfg, opts))


if __name__ == "__main__":
    sys.exit(main())
