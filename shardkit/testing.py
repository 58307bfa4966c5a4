"""Helpers for users' own tests: fake devices, golden sharding files, and a "big parameters are sharded" check.

    # tests/conftest.py
    from shardkit.testing import use_test_devices
    use_test_devices(8)

Golden files are `{parameter path: spec}` JSON, one per (model, recipe). Regenerate them after an intended change with
`SHARDKIT_UPDATE_GOLDEN=1 pytest tests/test_golden.py` (`make golden`), and review the diff like code.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Mapping

from shardkit.run.devices import use_fake_cpu_devices

UPDATE_GOLDEN_ENV = "SHARDKIT_UPDATE_GOLDEN"


def use_test_devices(count: int = 8) -> None:
    """`count` fake CPU devices and strict rank promotion. Call at the top of conftest.py, before JAX starts."""
    use_fake_cpu_devices(count)
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")


def requires_devices(count: int):
    """A pytest mark that skips a test when fewer than `count` devices are present."""
    import jax
    import pytest

    return pytest.mark.skipif(jax.device_count() < count, reason=f"needs {count} devices, {jax.device_count()} present")


def sharding_specs(layout) -> dict[str, list]:
    """`{parameter path: spec}` of a layout's parameters, each spec one entry per dimension."""
    from shardkit.analysis.planning.plan import parameter_rows

    return {row["path"]: row["spec"] for row in parameter_rows(layout)}


def check_golden(path: str | Path, specs: Mapping[str, list]) -> None:
    """Compare `specs` with the golden file at `path`; with SHARDKIT_UPDATE_GOLDEN=1, rewrite it instead."""
    path = Path(path)
    lines = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in sorted(specs.items())]
    text = "{\n" + ",\n".join(lines) + "\n}\n"  # one parameter per line, so diffs read like a review
    if os.environ.get(UPDATE_GOLDEN_ENV) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        raise AssertionError(f"golden file {path} is missing; create it with {UPDATE_GOLDEN_ENV}=1")
    expected = path.read_text()
    if expected != text:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "now"))
        raise AssertionError(
            f"shardings differ from {path}. If the rules or the model changed on purpose, regenerate with "
            f"`make golden` and review the diff; otherwise a layout changed by accident:\n{diff}"
        )


def assert_params_sufficiently_sharded(layout, min_bytes: int = 4096, allow: tuple[str, ...] = ()) -> None:
    """Every parameter of `min_bytes` or more is sharded over every device (apart from paths in `allow`).

    "Sharded over every device" means its per-device bytes times the device count equals its total bytes, the test
    MaxText applies to FSDP layouts.
    """
    from shardkit.analysis.planning.plan import parameter_rows

    devices = layout.mesh.size
    offenders = [
        f"{row['path']} {row['shape']} spec {row['spec']}: {row['device_bytes']} bytes per device"
        for row in parameter_rows(layout)
        if row["bytes"] >= min_bytes and row["device_bytes"] * devices != row["bytes"] and row["path"] not in allow
    ]
    if offenders:
        raise AssertionError(f"parameters not sharded over all {devices} devices:\n" + "\n".join(offenders))
