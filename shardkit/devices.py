"""Fake CPU devices, set before JAX initialises its backend."""

from __future__ import annotations

import os

from shardkit.errors import ShardkitError


def use_fake_cpu_devices(count: int) -> None:
    """Run on `count` fake CPU devices. Call before anything touches a JAX backend.

    If the backend is already up (a test process, a notebook), this only checks that it has `count` devices.
    """
    if count < 1:
        raise ShardkitError("--devices", f"must be >= 1, got {count}")
    import jax

    if _backend_initialized():
        have = jax.device_count()
        if have != count:
            raise ShardkitError("--devices", f"JAX is already running with {have} devices; cannot switch to {count}")
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def _backend_initialized() -> bool:
    from jax._src import xla_bridge  # no public query exists; reading it never initialises anything

    return bool(getattr(xla_bridge, "_backends", {}))
