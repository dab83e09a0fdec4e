"""Building the native CPU kernels (XLA FFI custom calls compiled from C++ on first use).

Each kernel's source is compiled for the host CPU (`-march=native`) into a cache keyed by
everything that changes the binary (source, flags, compiler, jaxlib, CPU features), so a home
directory shared between machines never runs code built for another CPU. The target name
carries the key: a compiled program (and the persistent compile cache) always names the
binary it was built against.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-w")

# The instruction sets the kernels are built for, best first, with the cpuid flags each needs
# and its -march. "native" is the host's own (what `cpu_features` lists: AVX-512 with bf16 dot
# products on Zen 4 / Sapphire Rapids and later); the others cap it for tests.
ISA_MARCH = {"native": "native", "avx512": "x86-64-v4", "avx2": "x86-64-v3", "portable": "x86-64"}
ISA_NEEDS = {"native": (), "avx512": ("avx512f", "avx512bw", "avx512vl"), "avx2": ("avx2", "fma"), "portable": ()}
# Tests only: cap the kernels' instruction set ("avx2" runs the AVX2 path on any x86 machine;
# "portable", x86-64's SSE2 baseline, runs the loops a CPU without AVX2 (or an ARM host) gets).
# The engine itself never reads the environment; its configuration is `EngineConfig`.
TEST_ISA_ENV = "JAXSERVE_TEST_CPU_ISA"
# Headers every kernel may include (vector math shared between them); part of the build key.
INCLUDE_DIR = Path(__file__).with_name("_native")


def cpu_features() -> str:
    """The host's CPU feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def target_isa() -> str:
    """The instruction set the native kernels are built for: the host's ("native"), unless
    the test-only `JAXSERVE_TEST_CPU_ISA` caps it ("avx512", "avx2"); a cap the host lacks is
    an error naming the missing flags."""
    isa = os.environ.get(TEST_ISA_ENV, "native") or "native"
    if isa not in ISA_MARCH:
        raise ValueError(f"{TEST_ISA_ENV} must be one of {sorted(ISA_MARCH)}, got {isa!r}")
    flags = set(cpu_features().split())
    missing = [f for f in ISA_NEEDS[isa] if f not in flags]
    if missing and platform.machine() in ("x86_64", "AMD64"):
        raise ValueError(f"{TEST_ISA_ENV}={isa}: this CPU lacks {', '.join(missing)}")
    return isa


def compile_flags() -> tuple[str, ...]:
    """The compiler flags of every native CPU kernel, -march included (`target_isa`)."""
    return (*FLAGS, f"-march={ISA_MARCH[target_isa()]}")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxserve" / "cpu_kernels"


def build(source: Path, prefix: str, what: str) -> tuple[Path | None, str, str]:
    """(shared library or None, why, target name `<prefix>_<key>`) for `source`; `what`
    names the kernel in the messages. Compiles once per distinct binary."""
    if platform.machine() not in ("x86_64", "AMD64", "aarch64", "arm64"):
        return None, f"no native {what} for {platform.machine()}", ""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        return None, f"no C++ compiler (c++, g++ or clang++) on PATH to build the {what}", ""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cxx} --version failed: {e}", ""
    try:
        flags = compile_flags()
    except ValueError as e:
        return None, str(e), ""
    headers = [h.read_bytes() for h in sorted(INCLUDE_DIR.glob("*.h"))]
    parts = [source.read_bytes(), *headers, " ".join(flags).encode(), version.encode(), jax.__version__.encode(),
             cpu_features().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    name = f"{prefix}_{key}"
    out = cache_dir() / f"{name}.so"
    if out.exists():
        return out, f"native CPU kernel {out.name}", name
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = out.parent
    except OSError:
        tmp_dir = Path(tempfile.gettempdir())
        out = tmp_dir / out.name
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=tmp_dir)
    os.close(fd)
    cmd = [cxx, *flags, f"-I{INCLUDE_DIR}", f"-I{jax.ffi.include_dir()}", str(source), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        return None, f"building the {what} failed: {e}", ""
    if done.returncode != 0:
        os.unlink(tmp)
        return None, f"building the {what} failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}", ""
    os.replace(tmp, out)  # atomic: concurrent builders leave one complete file
    return out, f"native CPU kernel {out.name}", name


def instruction_set(path: Path | None, symbol: str) -> str:
    """What the built kernel at `path` says its inner loops were compiled for (its
    `<symbol>() -> const char*`), or why it cannot say."""
    if path is None:
        return "not built"
    try:
        fn = getattr(ctypes.cdll.LoadLibrary(str(path)), symbol)
    except (OSError, AttributeError) as e:
        return f"unknown ({e})"
    fn.restype = ctypes.c_char_p
    return fn().decode()
