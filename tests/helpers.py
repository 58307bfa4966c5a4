"""Shared helpers for the test suite."""

from __future__ import annotations

from pathlib import Path

from shardkit.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"


def recipe(name: str, *overrides: str):
    """A recipe from recipes/ with `section.key=value` overrides."""
    return load_recipe(RECIPES / f"{name}.toml", list(overrides))
