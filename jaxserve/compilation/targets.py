"""Compile targets: the devices `jaxserve compile` plans for, attached or not.

`tpu:v5e-4` is four v5e chips as libtpu describes them, `gpu:h200x8` eight H200s as the CUDA
plugin describes them from `gpu_specs` (compile-only devices: XLA:TPU with Mosaic, XLA:GPU
with Triton run here, nothing executes); `cpu` / `cpu-N` is this host's CPU devices, whose
executables can be served (`jaxserve serve --compiled`). A target knows its devices and the
HBM a program may use on each.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import jax
import jax.numpy as jnp

# TPU generations libtpu describes with one device per chip, and their topology axes.
_TPU_CHIPS = {"v5e": 2, "v6e": 2, "v5p": 3}
_GIB = 2**30
# JAX preallocates this share of a GPU's memory for its allocator (XLA_PYTHON_CLIENT_MEM_FRACTION
# on the serving host changes it); programs and the KV cache must fit in it.
GPU_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class Target:
    platform: str  # "tpu" | "gpu" | "cpu"
    chip: str  # "v5e", "v6e", "v5p"; "h100", "h200"; "host" for the CPU
    num_devices: int

    @property
    def name(self) -> str:
        if self.platform == "cpu":
            return "cpu" if self.num_devices == 1 else f"cpu-{self.num_devices}"
        if self.platform == "gpu":
            return f"gpu:{self.chip}" if self.num_devices == 1 else f"gpu:{self.chip}x{self.num_devices}"
        return f"{self.platform}:{self.chip}-{self.num_devices}"

    @property
    def attached(self) -> bool:
        """True when the target's devices are this process's own (executables can run)."""
        return self.platform == "cpu"

    @classmethod
    def parse(cls, text: str) -> Target:
        """`tpu:<chip>-<chips>` (chips a power of two), `gpu:<part>[x<gpus>]` (one host of 1-8
        GPUs), `cpu` or `cpu-<devices>`."""
        m = re.fullmatch(r"cpu(?:-(\d+))?", text)
        if m:
            return cls("cpu", "host", int(m.group(1) or 1))
        m = re.fullmatch(r"gpu:([a-z]+\d+)(?:x(\d+))?", text)
        if m:
            from jaxserve.compilation.gpu_specs import GPUS

            part, n = m.group(1), int(m.group(2) or 1)
            if part not in GPUS:
                raise ValueError(f"unknown GPU {part!r} in {text!r}: one of {', '.join(GPUS)}")
            if not 1 <= n <= 8:
                raise ValueError(f"target {text!r}: one host of 1 to 8 GPUs, got {n}")
            return cls("gpu", part, n)
        m = re.fullmatch(r"tpu:(v\d+[a-z]?)-(\d+)", text)
        if not m:
            raise ValueError(f"unknown target {text!r}: expected tpu:<chip>-<chips> (e.g. tpu:v5e-4, tpu:v6e-8), "
                             "gpu:<part>[x<gpus>] (e.g. gpu:h200, gpu:h100x8) or cpu[-<devices>]")
        chip, n = m.group(1), int(m.group(2))
        if chip not in _TPU_CHIPS:
            raise ValueError(f"unknown TPU chip {chip!r} in {text!r}: one of {', '.join(_TPU_CHIPS)}")
        if n < 1 or n & (n - 1):
            raise ValueError(f"target {text!r}: the number of chips must be a power of two, got {n}")
        return cls("tpu", chip, n)

    def devices(self) -> list[Any]:
        if self.platform == "cpu":
            devices = jax.devices("cpu")
            if len(devices) < self.num_devices:
                raise ValueError(f"target {self.name} needs {self.num_devices} CPU devices; this process has "
                                 f"{len(devices)}")
            return devices[: self.num_devices]
        if self.platform == "gpu":
            return list(_gpu_devices(self.chip, self.num_devices))
        return list(_tpu_devices(self.chip, self.num_devices))

    def hbm_bytes(self) -> int | None:
        """Memory a program may use on each device (None: host memory, unbounded here): on TPU
        the limit XLA enforces, on GPU the share JAX's allocator preallocates."""
        if self.platform == "gpu":
            return int(self.nominal_hbm_bytes() * GPU_MEMORY_FRACTION)
        if self.platform != "tpu":
            return None
        return _usable_hbm(self.chip)

    def capacity_note(self) -> str:
        """Where `hbm_bytes` comes from, for reports."""
        if self.platform == "gpu":
            return (f"{GPU_MEMORY_FRACTION:.0%} of {self.nominal_hbm_bytes() / _GIB:.1f} GiB, JAX's default "
                    "GPU preallocation (XLA_PYTHON_CLIENT_MEM_FRACTION)")
        if self.platform == "tpu":
            return "the HBM XLA:TPU allows a program"
        return "host memory"

    def nominal_hbm_bytes(self) -> int | None:
        if self.platform == "gpu":
            from jaxserve.compilation.gpu_specs import GPUS

            return GPUS[self.chip].memory_bytes
        if self.platform != "tpu":
            return None
        return _nominal_hbm(self.chip)

    def versions(self) -> dict[str, str]:
        return software_versions(self.platform)


def software_versions(platform: str) -> dict[str, str]:
    """What must match for a serialized executable to load: jax, jaxlib and the plugin."""
    import importlib.metadata

    import jaxlib

    out = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    plugins = {"tpu": ("libtpu",), "gpu": ("jax-cuda12-plugin", "jax-cuda12-pjrt")}.get(platform, ())
    for name in plugins:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "unknown"
    return out


@functools.cache
def _gpu_devices(part: str, n: int) -> tuple[Any, ...]:
    """`n` compile-only GPUs of one host, described by `gpu_specs` (needs the CUDA plugin; the
    process must run with JAX_PLATFORMS=cpu, or the plugin looks for a driver and fails)."""
    from jax.experimental import topologies

    from jaxserve.compilation.gpu_specs import GPUS, target_config

    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(GPUS[part]),
                                                topology=f"1x1x{n}")
    except Exception as e:  # noqa: BLE001 - name what is missing
        raise RuntimeError(f"compile-only {part} GPUs need the CUDA plugin (pip install 'jax[cuda12]', or "
                           f"jax-cuda12-plugin + jax-cuda12-pjrt + nvidia-cuda-nvcc-cu12 at jax's version) and "
                           f"JAX_PLATFORMS=cpu: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from e
    return tuple(topology.devices)


def _topology(chip: str, n: int) -> tuple[str, tuple[int, int, int]]:
    """A libtpu topology of `n` chips and the chips-per-host bounds it needs (< 4 chips)."""
    axes = _TPU_CHIPS[chip]
    dims = [1] * axes
    i = 0
    while dims[0] * dims[1] * (dims[2] if axes == 3 else 1) < n:  # grow x, y alternately
        dims[i % 2] *= 2
        i += 1
    dims = dims[::-1] if axes == 2 else [dims[1], dims[0], dims[2]]
    bounds = (min(dims[0], 2), min(dims[1], 2), 1)
    return f"{chip}:{'x'.join(map(str, dims))}", bounds


@functools.cache
def _tpu_devices(chip: str, n: int) -> tuple[Any, ...]:
    from jax.experimental import topologies

    name, bounds = _topology(chip, n)
    devices = topologies.get_topology_desc(topology_name=name, platform="tpu",
                                           chips_per_host_bounds=bounds).devices
    if len(devices) != n:
        raise ValueError(f"libtpu's topology {name} has {len(devices)} devices, not {n}")
    return tuple(devices)


@functools.cache
def tpu_info(chip: str):
    """Pallas' description of the chip (HBM size and bandwidth, VMEM, ...)."""
    from jax.experimental.pallas import tpu as pltpu

    with jax.default_device(_tpu_devices(chip, 1)[0]):
        return pltpu.get_tpu_info()


def _nominal_hbm(chip: str) -> int:
    info = tpu_info(chip)  # per TensorCore; a device may hold two (megacore)
    return info.hbm_capacity_bytes * info.num_cores


@functools.cache
def _usable_hbm(chip: str) -> int:
    """XLA:TPU keeps part of HBM for itself; the limit it enforces is read off the error it
    gives a program that needs more than the chip has (one small compile, cached)."""
    nominal = _nominal_hbm(chip)
    device = _tpu_devices(chip, 1)[0]
    too_big = nominal // 4 + _GIB // 4  # f32 words: a little more than the whole chip
    out = jax.ShapeDtypeStruct((too_big,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(lambda: jnp.zeros(out.shape, out.dtype), out_shardings=out.sharding).lower().compile()
    except Exception as e:  # noqa: BLE001 - the message carries the figure
        m = re.search(r"available HBM \(([\d.]+)([GM])\)", str(e))
        if m:
            return int(float(m.group(1)) * (_GIB if m.group(2) == "G" else 2**20))
    return nominal


def fp8_weights_unsupported(platform: str, chip: str | None = None,
                            compute_capability: tuple[int, int] | None = None) -> str | None:
    """Why float8 weights cannot be served on this target (None: they can).

    fp8 weights need fp8 matrix units: NVIDIA compute capability >= 8.9 (Ada, Hopper: H100,
    H200). None of the TPU generations jaxserve targets (v5e, v5p, v6e) has e4m3 arithmetic.
    On CPU XLA emulates fp8: the weights are stored in fp8 and converted in each matmul
    (memory, not speed; the engine logs it).
    """
    if platform == "cpu":
        return None
    if platform == "gpu":
        if compute_capability is None and chip is not None:
            from jaxserve.compilation.gpu_specs import GPUS

            spec = GPUS.get(chip.lower())
            compute_capability = spec.compute_capability if spec is not None else None
        if compute_capability is not None and tuple(compute_capability) >= (8, 9):
            return None
        return (f"quantization='fp8' needs a GPU with fp8 matrix units (compute capability >= 8.9, e.g. "
                f"H100/H200); {chip or 'this GPU'} has {compute_capability or 'unknown'}: use 'int8'")
    return (f"quantization='fp8' is not supported on {platform} {chip or ''}".rstrip()
            + ": no fp8 matrix arithmetic on TPU v5e/v5p/v6e; use 'int8'")
