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


def _server_import_graph() -> dict[str, set[str]]:
    """server module -> the server modules it imports (anywhere in the file, lazy ones too)."""
    pattern = re.compile(r"^\s*(?:from\s+(server(?:\.\w+)*)\s+import\s+([\w, ]+)|import\s+(server(?:\.\w+)*))",
                         re.MULTILINE)
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "server").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for m in pattern.finditer(path.read_text()):
            base = m.group(1) or m.group(3)
            names = [n.strip() for n in (m.group(2) or "").split(",") if n.strip()]
            subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            deps.update(subs or ([base] if base in modules else []))
        graph[name] = deps - {name}
    return graph


def test_server_has_no_import_circle():
    graph = _server_import_graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert graph["server.grpc_front"] and "server.app" not in graph["server.http_api.routes"]


def test_fronts_reach_the_engine_only_through_the_core():
    """The gRPC servicer and the OpenAI routes hold a ServingCore and nothing under it."""
    # (`jaxserve.engine.*` is the engine package: its modules, not the core's engine object)
    forbidden = re.compile(r"(?<!jaxserve)\.(engine|metrics|loop_runner|frontend|admission|tokenizer)\b")
    fronts = [ROOT / "server" / "grpc_front.py", *(ROOT / "server" / "http_api").glob("*.py")]
    offenders = [f"{p.name}: {m.group(0)}" for p in fronts for m in forbidden.finditer(p.read_text())]
    assert not offenders, offenders
