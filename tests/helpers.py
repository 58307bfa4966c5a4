"""Shared helpers for the test suite."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from shardkit.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"


def recipe(name: str, *overrides: str):
    """A recipe from recipes/ with `section.key=value` overrides."""
    return load_recipe(RECIPES / f"{name}.toml", list(overrides))


def free_port() -> int:
    """A TCP port on the loopback that is free now (for a multi-process run's coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fresh_process_env() -> dict[str, str]:
    """This process's environment for a command a test starts as a user would: without JAX_PLATFORMS and XLA_FLAGS,
    whose settings (a platform, a device count) must not override the command's own `--devices`, except for the
    compile-time flags tests/conftest.py sets for the whole suite. Kept, the command compiles as cheaply as the test
    process and shares the session's compilation cache; `SHARDKIT_TEST_XLA_DEFAULTS=1` leaves them unset, so the
    command compiles as users compile."""
    from tests.conftest import SUITE_XLA_FLAGS  # set before JAX's import there, so not imported at the top here

    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag in SUITE_XLA_FLAGS]
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return env | ({"XLA_FLAGS": " ".join(kept)} if kept else {})
