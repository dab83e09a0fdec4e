"""Fill the persistent compilation cache for a given engine configuration.

Same flags as `jaxserve warmup` (every EngineConfig field), e.g.

    .venv/bin/python scripts/warmup_compile_cache.py --max-num-seqs 64 --max-num-batched-tokens 512 \\
        --compilation-cache-dir /var/cache/jaxserve --manifest warmup.json

Run it twice to see the cold and the warm (cached) start; the second prints every shape as a
cache hit.
"""

from __future__ import annotations

import sys

from jaxserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["warmup", *sys.argv[1:]]))
