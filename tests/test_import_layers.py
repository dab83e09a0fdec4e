"""jaxserve's folders are stages along a request's path, and imports only go down them: the
engine uses the worker, the worker uses the models, never the other way. A new import that
climbs (a model importing the runner, the worker importing the engine, anything below the
root importing `jaxserve.llm`) fails here, as `test_server_has_no_import_circle` guards
`server/`."""

from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jaxserve")

# Each sub-package and the sub-packages it may import (its own modules always).
ALLOWED = {
    "models": set(),
    "structured": set(),
    "multimodal": set(),
    "loading": {"models"},
    "lora": {"models", "loading"},
    "worker": {"models", "loading", "lora", "structured"},
    "config": {"models", "worker"},
    "compilation": {"models", "loading", "lora", "worker", "config"},
    "spec_decode": {"models", "loading", "lora", "worker", "config", "compilation"},
    "engine": {"models", "structured", "multimodal", "loading", "lora", "worker", "config", "compilation",
               "spec_decode"},
    "tuning": {"models", "structured", "multimodal", "loading", "lora", "worker", "config", "compilation",
               "spec_decode", "engine"},
}


def _imports(path: str) -> list[tuple[int, str]]:
    """(line, module) for every import of a jaxserve module, module-level or inside functions."""
    out = []
    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "jaxserve":  # `from jaxserve import x`: x is a module or a root name
                out += [(node.lineno, f"jaxserve.{a.name}") for a in node.names]
            elif node.module.startswith("jaxserve."):
                out.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("jaxserve")]
    return out


def layer_violations(root: str = ROOT) -> list[str]:
    bad = []
    for dirpath, _, files in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        if rel == "." or "__pycache__" in rel:
            continue
        package = rel.split(os.sep)[0]
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            for line, module in _imports(path):
                parts = module.split(".")
                target = parts[1] if len(parts) > 1 else ""
                if target == package:
                    continue
                if target not in ALLOWED:
                    bad.append(f"{os.path.relpath(path, root)}:{line} imports {module}: a root module, above every folder")
                elif target not in ALLOWED.get(package, set()):
                    bad.append(f"{os.path.relpath(path, root)}:{line} imports {module}: {package}/ may not import {target}/")
    return sorted(bad)


def test_every_folder_is_in_the_layer_map():
    folders = {d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)) and d != "__pycache__"}
    assert folders == set(ALLOWED), f"folders not in ALLOWED (or gone): {folders ^ set(ALLOWED)}"


def test_imports_go_down_the_request_path_only():
    assert layer_violations() == []


def test_the_layer_check_sees_a_climbing_import(tmp_path):
    """The check itself can fail: a model importing the runner, a worker importing a root module."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "bad.py").write_text("def f():\n    from jaxserve.worker.runner import ModelRunner\n")
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "ok.py").write_text("from jaxserve.models.bad import f\nimport jaxserve.llm\n")
    assert layer_violations(str(tmp_path)) == [
        "models/bad.py:2 imports jaxserve.worker.runner: models/ may not import worker/",
        "worker/ok.py:2 imports jaxserve.llm: a root module, above every folder"]
