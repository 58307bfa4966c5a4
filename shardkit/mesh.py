"""The recipe's mesh sizes -> a `jax.sharding.Mesh` with Auto axis types over the devices present."""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from shardkit.axes import MESH_AXES
from shardkit.errors import ShardkitError
from shardkit.recipe import MeshSection

# Across hosts the slow links carry the axes that communicate least per byte of compute: pipeline first, then data.
CROSS_HOST_ORDER = ("pipeline", "data", "fsdp", "expert", "sequence", "tensor")


def resolve_sizes(section: MeshSection, device_count: int) -> dict[str, int]:
    """Fill in the -1 axis and check that the sizes multiply to the device count."""
    sizes = section.sizes()
    fixed = math.prod(size for size in sizes.values() if size != -1)
    wildcard = [axis for axis, size in sizes.items() if size == -1]
    if wildcard:
        if device_count % fixed:
            raise ShardkitError(
                f"mesh.{wildcard[0]}",
                f"-1 cannot fill the mesh: the other axes multiply to {fixed}, which does not divide {device_count} "
                f"devices",
            )
        sizes[wildcard[0]] = device_count // fixed
    total = math.prod(sizes.values())
    if total != device_count:
        shown = ", ".join(f"{axis}={size}" for axis, size in sizes.items() if size > 1) or "all 1"
        raise ShardkitError(
            "mesh",
            f"axes ({shown}) cover {total} devices but {device_count} are present; make the sizes multiply to "
            f"{device_count} or set one axis to -1",
        )
    return sizes


def build_mesh(section: MeshSection, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all devices (or `devices`) with axes in `MESH_AXES` order and Auto axis types.

    Device order comes from JAX's mesh utilities, which know the interconnect: within a host `tensor` is innermost;
    with several processes the host dimension goes to pipeline, then data (see `CROSS_HOST_ORDER`).
    """
    devices = list(devices if devices is not None else jax.devices())
    sizes = resolve_sizes(section, len(devices))
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    hosts = len({device.process_index for device in devices})
    if hosts > 1:
        per_host, across = split_across_hosts(sizes, hosts)
        grid = mesh_utils.create_hybrid_device_mesh(
            tuple(per_host[a] for a in MESH_AXES), tuple(across[a] for a in MESH_AXES), devices,
            process_is_granule=True,  # GPU hosts are the granule; slices are a TPU notion
        )
    else:
        grid = _single_host_grid(shape, devices)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def _single_host_grid(shape: tuple[int, ...], devices: list[jax.Device]) -> np.ndarray:
    try:
        return mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        # Platforms without a topology model (CPU): plain row-major order is all there is to know.
        return np.asarray(devices).reshape(shape)


def split_across_hosts(sizes: Mapping[str, int], hosts: int) -> tuple[dict[str, int], dict[str, int]]:
    """Split each axis into (within a host, across hosts), putting the host factor on `CROSS_HOST_ORDER` axes first."""
    across = {axis: 1 for axis in MESH_AXES}
    remaining = hosts
    for axis in CROSS_HOST_ORDER:
        factor = math.gcd(sizes[axis], remaining)
        across[axis] = factor
        remaining //= factor
    if remaining != 1:
        raise ShardkitError("mesh", f"cannot spread the mesh {dict(sizes)} evenly over {hosts} hosts")
    per_host = {axis: sizes[axis] // across[axis] for axis in MESH_AXES}
    return per_host, across


def device_table(mesh: Mesh) -> list[dict]:
    """One row per device: global rank, process and local rank, and its coordinate on each mesh axis.

    Megatron's nomenclature: `data` rank is the rank among data-parallel replicas (data x fsdp), `tensor` and
    `pipeline` ranks are the coordinates on those axes.
    """
    rows = []
    local_rank: dict[int, int] = {}
    for coord in np.ndindex(mesh.devices.shape):
        device = mesh.devices[coord]
        position = dict(zip(mesh.axis_names, coord))
        process = device.process_index
        rows.append(
            {
                "device": device.id,
                "global_rank": len(rows),
                "process": process,
                "local_rank": local_rank.setdefault(process, 0),
                "data_rank": position["data"] * mesh.shape["fsdp"] + position["fsdp"],
                **position,
            }
        )
        local_rank[process] += 1
    return rows
