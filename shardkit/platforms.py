"""Which platform a mesh's devices are on: the one test of "is this XLA:GPU" that every module asks.

A `--target` compile's devices are compile-only GPU devices on a CPU process; they answer as GPUs do. This module
imports nothing from shardkit, so anything may import it.
"""

GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # what XLA:GPU's devices (real or a --target's) call their platform


def mesh_platform(mesh) -> str:
    """The platform of a mesh's devices (one platform a mesh): "cpu", "cuda", "gpu", "rocm", "tpu", ..."""
    return mesh.devices.flat[0].platform


def on_gpu(mesh) -> bool:
    """Whether a mesh's devices are XLA:GPU's, real or a `--target`'s."""
    return mesh_platform(mesh) in GPU_PLATFORMS
