"""Compiling for a GPU cluster from a CPU machine: GPU target descriptions and compile-only devices.

With the `jax[cuda12]` plugin installed, XLA's GPU compiler runs without a GPU: a topology built from a target
description (`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`) gives compile-only devices; a
mesh over them lowers and compiles the sharded step into the real GPU program (async collectives, reduce-scatter)
with `memory_analysis()` per device. Cost analysis is not available on that path.

Targets are written `<device>x<devices per host>` for one host (`h100x8`) or `<device>:<hosts>x<devices per host>`
(`h100:2x8`). The descriptions below are ours, from the devices' published specifications (NVIDIA H100/H200/A100
datasheets and the CUDA programming guide's per-compute-capability limits).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

from shardkit.analysis.predicted.nccl import Fabric
from shardkit.errors import ShardkitError
from shardkit.mesh import split_across_hosts

INSTALL_HINT = 'install the CUDA plugin: pip install "jax[cuda12]==0.10.2" (or shardkit[cuda12])'


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """What XLA's GPU compiler needs to know about a device (a `GpuTargetConfigProto`), from its datasheet."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_cores_per_sm: int
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    l2_cache_bytes: int
    boost_clock_ghz: float
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    peak_bf16_flops: float  # dense, without sparsity
    intra_host_bandwidth: float  # bytes/s one GPU sends over NVLink, one direction
    inter_host_bandwidth: float  # bytes/s one GPU sends over the network between hosts, one direction
    link_efficiency: float  # NCCL bus bandwidth achieved / link bandwidth for large ring collectives

    def target_config(self) -> str:
        """The text-format `GpuTargetConfigProto` that `get_topology_desc(target_config=...)` reads.

        `runtime_version` is the CUDA runtime of the jax[cuda12] wheels (12.8 or later); left out, XLA takes it as
        0.0 and, judging cuBLASLt too old for FP8, upcasts FP8 matmuls to bf16 (the fp8 precision policy)."""
        major, minor = self.compute_capability
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fp32_cores_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)}
  l2_cache_size: {self.l2_cache_bytes}
  clock_rate_ghz: {self.boost_clock_ghz}
  device_memory_size: {self.memory_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 patch: 0 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{self.name}"
"""


# Hopper: 228 KiB shared memory per SM, 227 KiB per block opt-in; Ampere (8.0): 164 KiB and 163 KiB.
# Peaks: NVIDIA's datasheets (H100 SXM / H200 SXM 989 TFLOP/s dense bf16, A100 SXM 312). Links: NVLink 4 gives a
# Hopper GPU 900 GB/s in both directions together (450 GB/s each way), NVLink 3 an A100 600 GB/s (300 each way);
# between hosts, DGX H100/H200 nodes have one 400 Gb/s ConnectX-7 port per GPU (50 GB/s), DGX A100 one 200 Gb/s
# HDR port per GPU (25 GB/s). Achieved GEMM rates are `shardkit.analysis.predicted.rates.GEMM_TABLE`'s. Link efficiency:
# NCCL all-reduce bus bandwidth near 80% of the link on 8-GPU NVLink nodes (nccl-tests results NVIDIA publishes); the
# same fraction is assumed for the H200 and A100, which this project has not measured.
# Dense bf16 peaks (without sparsity, datasheets) by device family: the one table of them. The targets below take
# theirs from it; a real device's (MFU in metrics.jsonl) is looked up by its device kind (`peak_flops`).
PEAK_BF16_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2250e12, "l40s": 362e12}
# Grand Teton's 500 W H100 (torchtitan's runs): its bf16 peak is not published; torchtitan's paper (arXiv
# 2410.06511) puts it between the H100 SXM's (989 TFLOP/s at 700 W) and the H100 NVL's (835 dense at 400 W, NVIDIA's
# datasheet). Taken linear in the power limit between those two points.
GRAND_TETON_PEAK = 835e12 + (989e12 - 835e12) * (500 - 400) / (700 - 400)


def peak_flops(device_kind: str) -> float | None:
    """A device's dense bf16 peak by its device kind (e.g. "NVIDIA H100 80GB HBM3"), or None when it is not in
    `PEAK_BF16_FLOPS` (CPU devices are not)."""
    kind = device_kind.lower()
    return next((flops for family, flops in PEAK_BF16_FLOPS.items() if family in kind), None)


GPUS = {
    "h100": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 80 * 2**30, 3.35e12, 50 * 2**20, 1.98,
                    228 * 1024, 227 * 1024, PEAK_BF16_FLOPS["h100"], 450e9, 50e9, 0.8),
    "h200": GpuSpec("NVIDIA H200", (9, 0), 132, 128, 141 * 10**9, 4.8e12, 50 * 2**20, 1.98, 228 * 1024, 227 * 1024,
                    PEAK_BF16_FLOPS["h200"], 450e9, 50e9, 0.8),
    # Clusters that differ from DGX H100 in their network or their H100s, each described as its own kind:
    # - h100-a3: Google Cloud's A3 High VMs (a3-highgpu-8g, MaxText's published Llama2 runs): the same H100 SXM
    #   80GB, but 4 x 200 Gb/s GPU NICs per 8 GPUs (GPUDirect-TCPX), i.e. 100 Gb/s = 12.5 GB/s per GPU between
    #   hosts (Google Cloud's A3 machine-type documentation), link efficiency as for DGX.
    # - h100-gt: Meta's Grand Teton H100s (torchtitan's published runs, pytorch/torchtitan docs/performance.md):
    #   96 GB HBM2e at 2.4 TB/s, 400 Gb/s RDMA per GPU, run at a 500 W power limit; its peak, 886 TFLOP/s, is
    #   `GRAND_TETON_PEAK` (between the H100 SXM's and the H100 NVL's, linear in the power limit).
    "h100-a3": GpuSpec("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 80 * 2**30, 3.35e12, 50 * 2**20, 1.98,
                       228 * 1024, 227 * 1024, PEAK_BF16_FLOPS["h100"], 450e9, 12.5e9, 0.8),
    "h100-gt": GpuSpec("NVIDIA H100", (9, 0), 132, 128, 96 * 10**9, 2.4e12, 50 * 2**20, 1.98,
                       228 * 1024, 227 * 1024, GRAND_TETON_PEAK, 450e9, 50e9, 0.8),
    "a100": GpuSpec("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 80 * 2**30, 2.039e12, 40 * 2**20, 1.41,
                    164 * 1024, 163 * 1024, PEAK_BF16_FLOPS["a100"], 300e9, 25e9, 0.8),
}


# Device memory as the driver reports it (cuMemGetInfo's total), of which JAX's pool takes its memory fraction
# (`bytes_limit` = fraction x this; XLA's gpu_helpers.cc). H100: the 59.4 GiB bytes_limit measured at JAX's default
# 0.75 on one H100, i.e. 79.2 GiB; H200: its 112,583,507,968-byte bytes_limit measured at 0.75 on jax 0.11.2
# (bench/results/gpu_step_h200_4096.json's run), i.e. 139.8 GiB, below nvidia-smi's 143,771 MiB; A100: nvidia-smi's
# 81920 MiB, not measured by this project; the Grand Teton H100's: its 96 GB as published, not measured.
DRIVER_MEMORY_BYTES = {"h100": int(59.4 * 2**30 / 0.75), "h200": int(112_583_507_968 / 0.75), "a100": 81920 * 2**20,
                       "h100-a3": int(59.4 * 2**30 / 0.75), "h100-gt": 96 * 10**9}


def usable_bytes(gpu: str, fraction: float) -> int:
    """What JAX lets one device of kind `gpu` allocate at memory fraction `fraction` (its `bytes_limit`)."""
    return int(DRIVER_MEMORY_BYTES[gpu] * fraction)


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU cluster to compile for: device kind, hosts and devices per host."""

    gpu: str
    hosts: int
    per_host: int

    @property
    def devices(self) -> int:
        return self.hosts * self.per_host

    @property
    def topology(self) -> str:
        """XLA's topology string: `<partitions>x<hosts per partition>x<devices per host>`."""
        return f"1x{self.hosts}x{self.per_host}"

    @property
    def spec(self) -> GpuSpec:
        """The datasheet description of this target's device kind."""
        return GPUS[self.gpu]

    @property
    def fabric(self) -> Fabric:
        """One GPU's NVLink and NIC bandwidth, one way, at the link efficiency (what NCCL's rings reach)."""
        spec = self.spec
        efficiency = spec.link_efficiency
        return Fabric(spec.intra_host_bandwidth * efficiency, spec.inter_host_bandwidth * efficiency)

    def host_split(self, sizes) -> tuple[dict[str, int], dict[str, int]]:
        """Each mesh axis's size within a host and across hosts, in `shardkit.mesh.build_mesh`'s device order:
        `tensor` innermost, the host factor on `pipeline`, then `data`, `fsdp`, `sequence`
        (`shardkit.mesh.CROSS_HOST_ORDER`)."""
        if self.hosts == 1:
            return dict(sizes), {axis: 1 for axis in sizes}
        return split_across_hosts(sizes, self.hosts)

    def __str__(self) -> str:
        return f"{self.gpu}:{self.hosts}x{self.per_host}" if self.hosts > 1 else f"{self.gpu}x{self.per_host}"


def parse_target(text: str) -> Target:
    """`h100x8` (one host of 8) or `h100:2x8` (2 hosts of 8); a ShardkitError naming `--target` otherwise."""
    match = re.fullmatch(r"([a-z0-9-]+?)(?::(\d+))?x(\d+)", text.strip().lower())
    if not match or match.group(1) not in GPUS:
        raise ShardkitError(
            "--target", f"cannot read {text!r}; use <gpu>x<devices> or <gpu>:<hosts>x<devices per host> with gpu one "
            f"of {sorted(GPUS)}, e.g. h100x8 or h100:2x8",
        )
    hosts, per_host = int(match.group(2) or 1), int(match.group(3))
    if hosts < 1 or per_host < 1:
        raise ShardkitError("--target", f"hosts and devices per host must be >= 1, got {text!r}")
    return Target(match.group(1), hosts, per_host)


def cuda_plugin_available() -> bool:
    """Whether the jax[cuda12] plugin is installed (it registers itself as `jax_plugins.xla_cuda12`)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:
        return False


def target_devices(target: Target) -> list:
    """Compile-only devices of the target, from its topology description.

    Raises:
        ShardkitError: the CUDA plugin is missing or XLA cannot build the topology.
    """
    if not cuda_plugin_available():
        raise ShardkitError("--target", f"compiling for {target} needs the jax[cuda12] plugin, which is not installed; "
                            f"{INSTALL_HINT}")
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=target.topology, target_config=GPUS[target.gpu].target_config()
        )
    except Exception as err:  # noqa: BLE001 - XLA raises several runtime error types here
        raise ShardkitError("--target", f"XLA could not build the {target} topology: "
                                        f"{str(err).splitlines()[0]}") from None
    return list(topology.devices)
