"""NVIDIA GPUs `jaxserve compile` can target without one attached.

XLA:GPU compiles for a device it is told about: a `stream_executor.GpuTargetConfigProto`
(text form) carrying the public facts of the part (compute capability, SM count, memory size
and bandwidth, shared-memory limits, toolkit versions). The CUDA plugin then hands out
compile-only devices of that kind, and XLA and Triton emit real sm_90a code for them. Without
a device there is no autotuning: XLA's own GEMMs get its default tiles.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    device_kind: str  # the name CUDA reports (jax's `device.device_kind`)
    compute_capability: tuple[int, int]
    core_count: int  # SMs
    memory_bytes: int  # device memory as the driver reports it
    memory_bandwidth: int  # bytes / s
    l2_cache_bytes: int
    clock_ghz: float
    shared_memory_per_core: int
    shared_memory_per_block_optin: int


# Hopper SXM parts (the facts NVIDIA publishes; memory sizes as the driver reports them).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 84_942_979_072, 3_352_320_000_000, 52_428_800, 1.98,
                    233_472, 232_448),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 151_397_597_184, 4_800_000_000_000, 52_428_800, 1.98,
                    233_472, 232_448),
}

# Toolkit and cuDNN versions the description claims: CUDA 12.9 (the ptxas `make install-test`
# installs) and cuDNN 9.10 (within the plugin's requirement, >= 9.8 and < 10).
_RUNTIME = (12, 9, 0)
_DNN = (9, 10, 0)


def target_config(spec: GpuSpec) -> str:
    """The GpuTargetConfigProto text XLA:GPU compiles against for `spec`."""
    major, minor = spec.compute_capability
    runtime = ".".join(map(str, _RUNTIME))
    # sm_90a (Hopper's accelerated features: wgmma, TMA) is what Triton and XLA target there.
    extension = "\n    feature_extension: ACCELERATED_FEATURES" if major == 9 else ""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {spec.core_count}
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {spec.memory_bandwidth}
  l2_cache_size: {spec.l2_cache_bytes}
  clock_rate_ghz: {spec.clock_ghz}
  device_memory_size: {spec.memory_bytes}
  shared_memory_per_block_optin: {spec.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}
    minor: {minor}{extension}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  device_vendor: "NVIDIA Corporation"
  name: "{spec.device_kind}"
  runtime_version: "{runtime}"
  compile_time_toolkit_version: "{runtime}"
}}
platform_name: "CUDA"
dnn_version_info {{
  major: {_DNN[0]}
  minor: {_DNN[1]}
  patch: {_DNN[2]}
}}
device_description_str: "{spec.device_kind}"
"""
