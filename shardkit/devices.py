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

    if backend_initialized():
        have = jax.device_count()
        if have != count:
            raise ShardkitError("--devices", f"JAX is already running with {have} devices; cannot switch to {count}")
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


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
