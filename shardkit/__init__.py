"""shardkit: write the model once with logical axis names, pick a recipe, train on any mesh.

The library API (shardkit/api.py), importable from here:

    load(source, *overrides, model=None) -> Recipe     a built-in name, TOML path, dict of tables or Recipe
    Trainer.build(recipe, loss_fn, optimizer)          layout, sharded init, jitted train/eval steps, checkpoints
    build_layout(recipe, devices) -> Layout            the resolved layout (mesh, shardings, attention, precision, ...)
    build_step(layout) -> StepBuilder                  the sharded state and jitted train/eval steps of a layout
    ShardkitError                                      every bad input, naming the field and what is valid

Names are imported on first use, so `import shardkit` (and the CLI's `--help`) does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "load": "shardkit.api",
    "Trainer": "shardkit.api",
    "build_layout": "shardkit.layout",
    "Layout": "shardkit.layout",
    "build_step": "shardkit.step",
    "StepBuilder": "shardkit.step",
    "Recipe": "shardkit.recipe",
    "ModelProtocol": "shardkit.registry",
    "ShardkitError": "shardkit.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
