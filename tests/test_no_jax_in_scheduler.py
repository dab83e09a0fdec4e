"""scheduler/ is pure Python + numpy: importing it must never pull in jax."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_importing_scheduler_does_not_import_jax():
    code = (
        "import sys\n"
        "import scheduler, scheduler.scheduler, scheduler.kv_cache_manager\n"
        "import scheduler.block_pool, scheduler.prefix_cache, scheduler.request\n"
        "import scheduler.config, scheduler.outputs, scheduler.stats, scheduler.queues\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib', 'flax')))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr


def test_no_jax_import_statements_in_scheduler_sources():
    pattern = re.compile(r"^\s*(import|from)\s+(jax|jaxlib|flax|jaxserve)\b", re.MULTILINE)
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "scheduler").rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert not offenders, f"jax (or jaxserve) imported in {offenders}"


def _importers(package: str, targets: str) -> list[str]:
    pattern = re.compile(rf"^\s*(import|from)\s+({targets})\b", re.MULTILINE)
    return [str(p.relative_to(ROOT)) for p in (ROOT / package).rglob("*.py") if pattern.search(p.read_text())]


def test_imports_flow_one_way():
    """scheduler -> jaxserve -> server/scripts; pallas_kernels is a leaf. The CLI finds the
    server's subcommands through an entry point, never by importing it."""
    assert not _importers("jaxserve", "server|scripts")
    assert not _importers("pallas_kernels", "scheduler|jaxserve|server|scripts")
    assert not _importers("server", "scripts")
