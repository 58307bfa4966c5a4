"""Model lookup: a registered name (`llama`, `mlp`, `moe`) or a user's `module:Class`, plus its configuration.

A model class must have a frozen dataclass `Config` whose fields are its dimensions by logical name, a `PRESETS` dict
of named configs, an `__init__(config, *, rngs)`, and `__call__(tokens_BS) -> logits_BSV`.

The reference models are installed with the package, in `shardkit.models`.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

from shardkit.errors import ShardkitError
from shardkit.recipe import ModelSection

BUILTIN_MODELS = {"llama": ("llama", "Llama"), "mlp": ("mlp", "DeepMLP"), "moe": ("moe", "MoeLlama")}


def load_model_class(name: str) -> type:
    """The model class for a registered name or a `module:Class` import path."""
    if name in BUILTIN_MODELS:
        module_name, class_name = BUILTIN_MODELS[name]
        module = importlib.import_module(f"shardkit.models.{module_name}")
    elif ":" in name:
        module_name, class_name = name.split(":", 1)
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())  # as `python -m` would: the console script does not put the cwd there
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ShardkitError("model.name", f"cannot import {module_name!r}: {err}") from None
    else:
        raise ShardkitError("model.name", f"unknown model {name!r}; use one of {sorted(BUILTIN_MODELS)} or module:Class")
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ShardkitError("model.name", f"{module_name!r} has no attribute {class_name!r}")
    for attribute in ("Config", "PRESETS"):
        if not hasattr(cls, attribute):
            raise ShardkitError("model.name", f"{name} has no {attribute}; a model class needs Config and PRESETS")
    return cls


# A model dimension past 2**31 - 1 cannot be allocated anywhere, and past 2**63 it no longer fits XLA's int64 shapes
# (JAX fails inside tracing): refused with the field's name instead.
MAX_MODEL_DIM = 2**31 - 1


def model_config(cls: type, section: ModelSection) -> Any:
    """The preset named in the recipe with its per-dimension overrides applied, validated."""
    if section.preset not in cls.PRESETS:
        raise ShardkitError("model.preset", f"unknown preset {section.preset!r}; valid presets are {sorted(cls.PRESETS)}")
    base = cls.PRESETS[section.preset]
    fields = {field.name: field for field in dataclasses.fields(base)}
    changes = {}
    for key, value in section.dims:
        if key not in fields:
            raise ShardkitError(f"model.{key}", f"unknown model field; valid fields are {sorted(fields)}")
        expected = type(getattr(base, key))
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise ShardkitError(f"model.{key}", f"must be {expected.__name__}, got {type(value).__name__} {value!r}")
        if expected is int and not 1 <= value <= MAX_MODEL_DIM:
            raise ShardkitError(f"model.{key}", f"must be in 1..{MAX_MODEL_DIM}, got {value}")
        changes[key] = value
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as err:
        raise ShardkitError("model", str(err)) from None
