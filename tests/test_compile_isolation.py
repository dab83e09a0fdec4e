"""`jaxserve compile` survives a compiler crash: the shapes compile in a child process, a
child that dies costs only the shape it was compiling (reported with the compiler's last
words), and the other shapes complete, those in flight beside it retried alone."""

from __future__ import annotations

import sys
import textwrap

import pytest

from jaxserve.compilation.isolate import compile_isolated

# A stand-in for the compile child: it reports each shape as the real one does and dies with
# SIGSEGV (after a compiler-like message) on the shapes named in CRASH; with two workers the
# shapes go out two at a time, so a crash leaves a companion unfinished.
FAKE_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    shapes, workers, crash = sys.argv[1].split(";"), int(sys.argv[2]), set(sys.argv[3].split(";"))
    for i in range(0, len(shapes), workers):
        batch = shapes[i:i + workers]
        for s in batch:
            print("JAXSERVE-COMPILE-START " + s, flush=True)
        for s in batch:
            if s in crash:
                print("F0000 sparse_core_codegen.cc:123] Check failed: offset < limit", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGSEGV)
            print("JAXSERVE-COMPILE-RESULT " + json.dumps({"name": s, "kind": s.split("[")[0], "size": 1,
                  "compiled": True, "seconds": 0.1, "attention": None, "hbm_bytes": 1, "temp_bytes": 1}), flush=True)
""")


def _child(crash: str):
    return lambda shapes, workers: [sys.executable, "-c", FAKE_CHILD, ";".join(shapes), str(workers), crash]


def test_a_crashing_shape_is_reported_and_the_others_compile():
    shapes = ["backbone[T=16]", "backbone[T=64]", "logits[R=8]", "head[R=8,greedy]", "backbone[T=256]"]
    seen = []
    results = compile_isolated(shapes, _child("backbone[T=64];backbone[T=256]"), 2, seen.append)
    by_name = {r["name"]: r for r in results}
    assert [r["name"] for r in results] == shapes
    for name in ("backbone[T=64]", "backbone[T=256]"):
        r = by_name[name]
        assert not r["compiled"] and "SIGSEGV" in r["error"] and "Check failed: offset < limit" in r["error"]
        assert r["size"] == int(name.split("=")[1][:-1])
    assert all(by_name[n]["compiled"] for n in ("backbone[T=16]", "logits[R=8]", "head[R=8,greedy]"))
    assert sorted(r["name"] for r in seen) == sorted(shapes)  # each reported once, as it ended


def test_a_child_that_dies_before_any_shape_is_an_error():
    with pytest.raises(RuntimeError, match="before compiling any shape"):
        compile_isolated(["logits[R=8]"], lambda s, w: [sys.executable, "-c", "import sys; sys.exit(3)"], 1)
