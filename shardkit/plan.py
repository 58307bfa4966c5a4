"""What a recipe puts where, without running a step: the mesh, every parameter's spec and shard, per-device totals."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from shardkit.mesh import device_table
from shardkit.partition import Layout, device_shape
from shardkit.rules import spec_to_json


def parameter_rows(layout: Layout) -> list[dict[str, Any]]:
    """One row per parameter: path, shape, logical axes, spec, per-device shape and bytes (in the fp32 master dtype)."""
    specs = layout.specs(layout.rules.params)
    flat_specs = dict(_flatten(specs))
    flat_logical = dict(_flatten(layout.logical, is_leaf=lambda x: isinstance(x, tuple)))
    sizes = dict(layout.mesh.shape)
    rows = []
    for path, leaf in _flatten(layout.abstract_params):
        spec = flat_specs[path]
        shard = device_shape(leaf.shape, spec, sizes)
        rows.append(
            {
                "path": path,
                "shape": list(leaf.shape),
                "dtype": str(leaf.dtype),
                "logical": list(flat_logical[path]),
                "spec": spec_to_json(spec, len(leaf.shape)),
                "device_shape": list(shard),
                "device_bytes": math.prod(shard) * np.dtype(leaf.dtype).itemsize,
                "bytes": math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize,
            }
        )
    return rows


def _flatten(tree, is_leaf=None):
    from shardkit.partition import path_str

    return [(path_str(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def build_plan(layout: Layout) -> dict[str, Any]:
    """The `plan --json` object: mesh, params, totals and the device -> mesh-coordinate table."""
    rows = parameter_rows(layout)
    return {
        "recipe": layout.recipe.name,
        "model": {"name": layout.recipe.model.name, "preset": layout.recipe.model.preset, **vars(layout.config)},
        "mesh": dict(layout.mesh.shape),
        "params": rows,
        "totals": {
            "parameters": sum(math.prod(row["shape"]) for row in rows),
            "param_bytes": sum(row["bytes"] for row in rows),
            "param_bytes_per_device": sum(row["device_bytes"] for row in rows),
        },
        "devices": device_table(layout.mesh),
    }


def format_plan(plan: dict[str, Any]) -> str:
    """The human-readable table printed by `shardkit plan`."""
    mesh = " x ".join(f"{axis}={size}" for axis, size in plan["mesh"].items())
    lines = [f"recipe {plan['recipe']}: model {plan['model']['name']}/{plan['model']['preset']}, mesh {mesh}", ""]
    header = ("path", "shape", "logical", "spec", "per device", "bytes/dev")
    table = [header] + [
        (
            row["path"], _dims(row["shape"]), ",".join(str(n) for n in row["logical"]), _spec(row["spec"]),
            _dims(row["device_shape"]), _bytes(row["device_bytes"]),
        )
        for row in plan["params"]
    ]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    lines += ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    totals = plan["totals"]
    lines += [
        "",
        f"parameters {totals['parameters']:,} ({_bytes(totals['param_bytes'])}), "
        f"per device {_bytes(totals['param_bytes_per_device'])}",
        "",
        "device  rank  process  local  data_rank  " + "  ".join(plan["mesh"]),
    ]
    for row in plan["devices"]:
        coords = "  ".join(str(row[axis]).rjust(len(axis)) for axis in plan["mesh"])
        lines.append(
            f"{row['device']:>6}  {row['global_rank']:>4}  {row['process']:>7}  {row['local_rank']:>5}  "
            f"{row['data_rank']:>9}  {coords}"
        )
    return "\n".join(lines)


def _dims(shape) -> str:
    return "(" + ",".join(str(d) for d in shape) + ")"


def _spec(spec) -> str:
    return "(" + ",".join("None" if e is None else "+".join(e) if isinstance(e, list) else e for e in spec) + ")"


def _bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return str(count)
