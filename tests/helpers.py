"""Shared helpers for the test suite."""

from __future__ import annotations

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
