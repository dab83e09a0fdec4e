"""`jaxserve compile` that survives a compiler crash: the shapes compile in a child process.

A compiler that dies (libtpu's SparseCore code generator took the whole process down with a
SIGSEGV on one Llama-3.1-8B step program for v6e) must cost one shape, not the plan. The
parent runs the plan's shapes in a child `jaxserve compile` that reports each shape as it
starts and ends, one line each on its stdout (`START <name>`, `RESULT <json>`). When a child
dies, the shapes it had started and not finished are the suspects: one alone is the shape
that crashed; several (compiled in parallel threads) are each retried alone, so the crash is
pinned on its own shape. The crashed shapes are reported with the compiler's last words (the
tail of the child's stderr) and the others go on in a new child. The HBM plan is computed in
the parent once the children are done (it compiles nothing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence

START, RESULT = "JAXSERVE-COMPILE-START ", "JAXSERVE-COMPILE-RESULT "

_STDOUT_LOCK = threading.Lock()


def report_line(line: str) -> None:
    """One protocol line from the child, whole: the compile threads report concurrently, and a
    print writes the text and its newline apart."""
    with _STDOUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


# (shapes, workers) -> the child's command line (it prints START / RESULT lines on stdout)
ChildCommand = Callable[[Sequence[str], int], list[str]]


@dataclasses.dataclass
class ChildRun:
    """What one child reported before it exited."""

    started: list[str]
    results: list[dict]
    returncode: int
    stderr: str


def run_child(command: list[str], on_result: Callable[[dict], None] | None = None) -> ChildRun:
    started, results = [], []
    # The child imports what this process can (a compile-only plugin put on sys.path included).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    # stderr goes to a file: a pipe nobody reads while stdout is read would fill and stall the
    # child (XLA logs a lot).
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        try:
            for line in proc.stdout:
                if line.startswith(START):
                    started.append(line[len(START):].strip())
                elif line.startswith(RESULT):
                    results.append(json.loads(line[len(RESULT):]))
                    if on_result is not None:
                        on_result(results[-1])
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    return ChildRun(started, results, proc.returncode, stderr)


def compile_isolated(shapes: Sequence[str], child: ChildCommand, workers: int,
                     on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Every shape's result (ShapeResult fields as a dict), crashed ones included (compiled
    False, `error` naming the crash and the compiler's message), in `shapes`' order."""
    done: dict[str, dict] = {}

    def record(r: dict) -> None:
        done[r["name"]] = r
        if on_result is not None:
            on_result(r)

    remaining = list(shapes)
    while remaining:
        run = run_child(child(remaining, workers), record)
        if run.returncode == 0 and all(s in done for s in remaining):
            break
        suspects = [s for s in run.started if s not in done]
        if not run.started:  # it died before compiling anything: not a shape's fault
            raise RuntimeError(f"the compile child exited with status {run.returncode} before compiling any "
                               f"shape:\n{_tail(run.stderr, 20)}")
        if not suspects and not run.results:  # it ended without finishing its shapes, none in flight
            raise RuntimeError(f"the compile child exited with status {run.returncode} leaving "
                               f"{len(remaining)} shapes:\n{_tail(run.stderr, 20)}")
        if len(suspects) == 1:
            record(crashed(suspects[0], run))
        for name in suspects if len(suspects) > 1 else ():
            alone = run_child(child([name], 1), record)
            if name not in done:
                record(crashed(name, alone))
        remaining = [s for s in remaining if s not in done]
    return [done[s] for s in shapes]


def crashed(name: str, run: ChildRun) -> dict:
    code = run.returncode
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    size = re.search(r"=(\d+)", name)
    return {"name": name, "kind": name.split("[")[0], "size": int(size.group(1)) if size else 0,
            "compiled": False, "seconds": 0.0,
            "attention": None, "hbm_bytes": None, "temp_bytes": None,
            "error": f"the compiler crashed ({how}) compiling {name}: {_tail(run.stderr, 6)}"}


def _tail(text: str, lines: int) -> str:
    kept = [ln for ln in text.strip().splitlines() if ln.strip() and "Warning" not in ln]
    return " | ".join(kept[-lines:])[-1500:] or "(nothing on stderr)"
