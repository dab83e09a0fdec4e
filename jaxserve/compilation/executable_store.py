"""Executables kept beside the persistent compilation cache, so that a restart traces nothing.

JAX's persistent cache is keyed by the lowered program: a warm start still traces and lowers
every planned shape to find its key (~160 ms a shape on a CPU host) before it loads anything.
So after warmup the engine also serializes its step executables into
`<cache dir>/executables/<digest of the identity>/`, with the manifest `jaxserve compile
--out` writes. A later start whose identity is equal (software versions, device kind and
count, model config, engine settings, the kernels chosen, XLA's flags, the source code that
builds the programs) deserializes them
instead: nothing is traced, lowered or compiled. A start that finds no entry for its identity
compiles as before and logs what differs from the entry saved last, so an operator can see
why a restart was slow. At most `MAX_ENTRIES` identities are kept (the oldest go).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from jaxserve.compilation.aot import (
    MANIFEST,
    CompiledMismatchError,
    _serialize,
    load_compiled,
    manifest_differences,
    read_manifest,
)
from jaxserve.compilation.targets import software_versions
from jaxserve.compilation.warmup import ShapeRecord, WarmupReport
from jaxserve.worker.compile_plan import ShapeKey

logger = logging.getLogger(__name__)

STORE_DIR = "executables"
MAX_ENTRIES = 4
# Part of every identity: entries written by an earlier format are not loaded. 2: entries
# never hold executables that were loaded from the persistent cache (`not_saveable`). 3: the
# logits program takes the count of live rows.
STORE_FORMAT = 3
# Environment that changes what XLA emits for the same program.
_COMPILER_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a set of executables was built for; equal identities load each other's."""

    platform: str
    num_devices: int
    device_kind: str
    program: dict[str, Any]  # `aot.program_fingerprint` + kernels + compiler environment
    versions: dict[str, str]

    @classmethod
    def of(cls, platform: str, num_devices: int, device_kind: str, fingerprint: dict[str, Any],
           kernels: dict[str, Any]) -> Identity:
        env = {k: os.environ.get(k, "") for k in _COMPILER_ENV}
        # As a manifest reads it back (tuples become lists), so equal settings compare equal.
        program = json.loads(json.dumps({**fingerprint, "kernels": kernels, "compiler_env": env,
                                         "store_format": STORE_FORMAT, "source": source_digest()},
                                        default=str))
        return cls(platform, num_devices, device_kind, program, software_versions(platform))

    def digest(self) -> str:
        text = json.dumps(dataclasses.asdict(self), sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def differences(self, manifest: dict[str, Any]) -> list[str]:
        return manifest_differences(manifest, platform=self.platform, num_devices=self.num_devices,
                                    device_kind=self.device_kind, fingerprint=self.program)


@functools.cache
def source_digest(roots: tuple[str, ...] = ("jaxserve", "pallas_kernels")) -> str:
    """A digest of the Python and C++ sources of the packages that build the step programs.
    Code that changes a program without changing its settings (a model or kernel change, an
    upgrade) must not load executables saved by other code: they would run the old program,
    or fail on a changed signature. Read once per process (~1 MB of sources)."""
    h = hashlib.sha256()
    base = Path(__file__).resolve().parents[2]
    for root in roots:
        for f in sorted((base / root).rglob("*")):
            if f.suffix in (".py", ".cc") and f.is_file():
                h.update(str(f.relative_to(base)).encode() + b"\0")
                h.update(f.read_bytes())
    return h.hexdigest()[:20]


def not_saveable(platform: str, records: tuple[ShapeRecord, ...]) -> list[str]:
    """The shapes whose executables cannot be written out whole. XLA:CPU (jaxlib 0.10) keeps
    an executable's object code only when it compiled it itself: one that it loaded from JAX's
    persistent cache serializes without it, and a process that loads those bytes fails at the
    first step of that shape ("Function <fusion> not found"). So on CPU, a shape any of whose
    programs came from the persistent cache (or from this process's memory, where an earlier
    engine may have loaded it so) is not saveable; on other platforms every shape is."""
    if platform != "cpu":
        return []
    return [r.name for r in records if r.cache_hits or r.cache in ("hit", "memory")]


class ExecutableStore:
    """One server identity's entry under `<cache_dir>/executables/`."""

    def __init__(self, cache_dir: str, identity: Identity):
        self.root = os.path.join(cache_dir, STORE_DIR)
        self.identity = identity
        self.path = os.path.join(self.root, identity.digest())

    def load(self, runner: Any, keys: list[ShapeKey]) -> WarmupReport | None:
        """Installs the saved executable of every key in `runner`; None (logged, nothing
        raised) when there is no usable entry and the caller must compile."""
        if not os.path.isfile(os.path.join(self.path, MANIFEST)):
            logger.info("no saved executables for this server: compiling (%s)", self._why_none())
            return None
        try:
            manifest = read_manifest(self.path)
            problems = self.identity.differences(manifest)
            if problems:  # a digest collision or a hand-edited entry
                raise CompiledMismatchError("; ".join(problems))
            return load_compiled(self.path, manifest, runner, keys)
        except (CompiledMismatchError, OSError, ValueError) as e:
            logger.warning("the saved executables in %s are not usable (%s): compiling; the entry is removed",
                           self.path, e)
            shutil.rmtree(self.path, ignore_errors=True)  # it could only fail the same way again
            return None

    def save(self, runner: Any, keys: list[ShapeKey]) -> bool:
        """Serializes the runner's executable of every key into this identity's entry
        (written aside, then renamed into place: a reader never sees half an entry). A
        failure (a full disk, a read-only cache) is logged; serving goes on."""
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(os.path.join(tmp, "executables"))
            shapes = [{"name": k.name, "file": _serialize(tmp, k, runner.executables[k])} for k in keys]
            manifest = {**dataclasses.asdict(self.identity), "target": f"{self.identity.platform} (serving)",
                        "shapes": shapes}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f, indent=1)
            shutil.rmtree(self.path, ignore_errors=True)
            os.replace(tmp, self.path)
        except Exception as e:  # noqa: BLE001 - saving is an optimisation; serving does not depend on it
            shutil.rmtree(tmp, ignore_errors=True)
            logger.warning("could not save the executables to %s (%s: %s); the next start compiles again",
                           self.path, type(e).__name__, e)
            return False
        self._prune()
        return True

    def _entries(self) -> list[str]:
        """Complete entries (those with a manifest), newest first."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        found = []
        for name in names:
            if ".tmp-" in name:
                continue
            path = os.path.join(self.root, name)
            try:
                found.append((os.path.getmtime(os.path.join(path, MANIFEST)), path))
            except OSError:  # no manifest, or removed meanwhile by another server
                continue
        return [p for _, p in sorted(found, reverse=True)]

    def _why_none(self) -> str:
        """What differs from the entry saved last (or that none was saved yet)."""
        entries = [p for p in self._entries() if p != self.path]
        if not entries:
            return f"none saved yet under {self.root}"
        try:
            problems = self.identity.differences(read_manifest(entries[0]))
        except (OSError, ValueError) as e:
            return f"the last saved entry {entries[0]} is unreadable: {e}"
        return "the last saved entry differs: " + ("; ".join(problems) or "in settings not named in its manifest")

    def _prune(self) -> None:
        for old in self._entries()[MAX_ENTRIES:]:
            shutil.rmtree(old, ignore_errors=True)
