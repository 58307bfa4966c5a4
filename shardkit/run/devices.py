"""Fake CPU devices, set before JAX initialises its backend."""

from __future__ import annotations

import math
import os

from shardkit.errors import ShardkitError

# Fake devices are for developing layouts on a laptop. Starting a thousand of them takes seconds and over a gigabyte of
# host memory, and a compile grows with the device count from there, so larger counts are refused at
# once: bigger clusters are what `--target` compiles for without building a fake device per GPU.
MAX_FAKE_DEVICES = 1024


def use_fake_cpu_devices(count: int) -> None:
    """Run on `count` fake CPU devices. Call before anything touches a JAX backend.

    If the backend is already up (a test process, a notebook), this only checks that it has `count` devices.
    """
    check_fake_device_count(count)
    import jax

    if backend_initialized():
        have = jax.device_count()
        if have != count:
            raise ShardkitError("--devices", f"JAX is already running with {have} devices; cannot switch to {count}")
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def use_cpu_host() -> None:
    """Keep the host side of a `--target` compile on the CPU: never initialise a GPU backend that is not there.

    Only the platform is set; a CPU device count chosen earlier (a test process's fake devices) is kept. Nothing is
    done once the backend is up.
    """
    import jax

    if backend_initialized():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")


def check_fake_device_count(count: int, mesh=None) -> None:
    """Refuse a fake device count before anything is built: out of range, or one the recipe's mesh cannot cover.

    Args:
        count: the `--devices` value.
        mesh: the recipe's `MeshSection`, whose fixed axes (all but a -1 one) must multiply to `count`, or divide it
            when one axis is -1.
    """
    if not 1 <= count <= MAX_FAKE_DEVICES:
        raise ShardkitError(
            "--devices",
            f"must be in 1..{MAX_FAKE_DEVICES} fake CPU devices, got {count} (for a GPU cluster use --target)",
        )
    if mesh is None:
        return
    sizes = mesh.sizes()
    fixed = math.prod(size for size in sizes.values() if size != -1)
    wildcard = -1 in sizes.values()
    if (count % fixed if wildcard else count != fixed):
        shown = ", ".join(f"{axis}={size}" for axis, size in sizes.items() if size != 1) or "all 1"
        need = f"a multiple of {fixed}" if wildcard else str(fixed)
        raise ShardkitError("--devices", f"the recipe's mesh ({shown}) needs {need} devices, got {count}")


def backend_initialized() -> bool:
    """Whether JAX has started its backends (after which device counts and platforms are fixed).

    JAX has no public query, but it refuses to change `jax_num_cpu_devices` once started: changing it and changing it
    back is a harmless probe before that, and a RuntimeError after.
    """
    import jax

    current = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", current + 1 if current > 0 else 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False
