"""Model lookup: a registered name (`llama`, `mlp`, `moe`) or a user's `module:Class`, plus its configuration.

A model class is any `flax.nnx.Module` that follows `ModelProtocol` (checked in one place, `check_model_class`); its
parameters carry Flax's own sharding annotations as logical names (`nnx.with_partitioning`, `sharding_names=`, Linen's
`with_logical_partitioning` through `nnx.bridge.ToNNX`). `create_model` builds one the way shardkit always does: with
Flax's eager sharding off, so no mesh is needed, the recipe deciding where each parameter lives.

The reference models are installed with the package, in `shardkit.models`.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import os
import re
import sys
from typing import Any, ClassVar, Mapping, Protocol

import jax
import numpy as np
from flax import linen, nnx
from flax.nnx import bridge
from jax.sharding import PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.recipe import ModelSection

BUILTIN_MODELS = {"llama": ("llama", "Llama"), "mlp": ("mlp", "DeepMLP"), "moe": ("moe", "MoeLlama")}


class ModelProtocol(Protocol):
    """What shardkit needs of a model class (an `nnx.Module`).

    `Config` is a dataclass of the model's settings (a recipe's `[model]` table overrides its fields by name; any
    field types: enums, dtypes, tuples, nested dataclasses, PartitionSpecs are saved with checkpoints and compared on
    resume), `PRESETS` names ready configs (every recipe uses `tiny`), and the model maps tokens (batch, seq) to logits
    (batch, seq, vocab): checked when the model is loaded (the signature) and on an abstract trace (the logits) before
    anything compiles. The vocabulary is the config's `vocab`, else the parameter dimension named `vocab`, else the
    logits' last dimension; the layer count is the config's `layers`, else the parameters' `layers` dimension.
    Optional: `inputs_shifted = True` (a class attribute or Config field) for a model that shifts its inputs right
    itself, whose `logits[t]` predict `tokens[t]`: the loss then takes the inputs as targets; `LAYER_STACK` and the
    split methods that pipelines and the lean loss use (shardkit/pipeline/one_f_one_b.py, shardkit/loss.py); and
    `OPTIMIZER_PRESETS`, a preset's published optimizer settings by preset name (shardkit/optimizer.py).
    """

    Config: ClassVar[type]
    PRESETS: ClassVar[Mapping[str, Any]]

    def __init__(self, config: Any, *, rngs: nnx.Rngs) -> None: ...

    def __call__(self, tokens_BS: jax.Array) -> jax.Array: ...


# The optional parts of the protocol, by what they enable. A pipeline's 1F1B stages need the split into embed, the
# layer stack and unembed; the lean loss (shardkit/loss.py) needs the final hidden state and the head weight instead
# of logits; an auxiliary loss (models/moe.py) comes from `layers_with_aux`.
STAGED_MEMBERS = ("LAYER_STACK", "embed", "unembed")
LEAN_LOSS_MEMBERS = ("LAYER_STACK", "embed", "final_hidden", "head_weight")
AUX_LOSS_MEMBER = "layers_with_aux"


@dataclasses.dataclass(frozen=True)
class ModelCapabilities:
    """What a model class offers beyond `ModelProtocol`, read once (`model_capabilities`) and carried by the layout.

    `staged_missing` lists what a 1F1B pipeline needs and the class lacks (empty: it can be split into stages).
    """

    staged_missing: tuple[str, ...]
    lean_loss: bool
    aux_loss: bool

    @property
    def staged(self) -> bool:
        return not self.staged_missing


def model_capabilities(cls: type) -> ModelCapabilities:
    """The one place the optional parts of the model protocol are looked up."""
    staged_missing = tuple(member for member in STAGED_MEMBERS if not hasattr(cls, member))
    if not staged_missing and not isinstance(cls.LAYER_STACK, str):
        staged_missing = ("a string LAYER_STACK",)
    return ModelCapabilities(staged_missing, all(hasattr(cls, member) for member in LEAN_LOSS_MEMBERS),
                             hasattr(cls, AUX_LOSS_MEMBER))


# Each protocol member with what to add when a class lacks it.
_PROTOCOL_HINTS = {
    "Config": "a dataclass of its dimensions, e.g. `Config = MyConfig`",
    "PRESETS": "a dict of named configs, e.g. `PRESETS = {\"tiny\": MyConfig()}`",
    "__call__": "`__call__(self, tokens_BS) -> logits_BSV`",
}


def check_model_class(cls: Any, name: str) -> None:
    """The one check that `cls` follows `ModelProtocol`.

    Raises:
        ShardkitError: on `model.name`, naming the class and what it lacks (or how to wrap a Linen module).
    """
    if isinstance(cls, type) and issubclass(cls, linen.Module):
        raise ShardkitError("model.name", f"{name} is a Linen module; wrap it in an nnx.Module whose __init__ does "
                            "`self.net = nnx.bridge.ToNNX(MyLinen(...), rngs=rngs)` and "
                            "`nnx.bridge.lazy_init(self.net, sample_tokens)`")
    if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
        raise ShardkitError("model.name", f"{name} is not a flax.nnx.Module subclass")
    missing = [member for member in _PROTOCOL_HINTS if member not in dir(cls)]
    if missing:
        raise ShardkitError("model.name", f"{name} lacks {', '.join(missing)}; add "
                            + "; ".join(_PROTOCOL_HINTS[member] for member in missing))
    if not dataclasses.is_dataclass(cls.Config) or not isinstance(cls.PRESETS, Mapping):
        raise ShardkitError("model.name", f"{name}: Config must be a dataclass and PRESETS a dict of Config values")
    _check_call_signature(cls, name)


def _check_call_signature(cls: type, name: str) -> None:
    """`__call__` takes the tokens and needs nothing else (packed rows' positions and segment ids may follow, so
    further parameters are allowed where they have defaults)."""
    try:
        parameters = list(inspect.signature(cls.__call__).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read (a builtin): left to the call
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in parameters if p.default is p.empty and p.kind in (*positional, p.KEYWORD_ONLY)]
    takes_tokens = any(p.kind in (*positional, p.VAR_POSITIONAL) for p in parameters)
    if len(required) > 1 or not takes_tokens:
        raise ShardkitError("model.name", f"{name}.__call__ takes ({', '.join(p.name for p in parameters)}), but "
                            "shardkit calls it as __call__(tokens_BS) -> logits_BSV; give the other parameters "
                            "defaults, or add a subclass whose __call__(tokens_BS) returns the logits")


def is_stacked(axes: tuple) -> bool:
    """Whether a parameter's logical names lead with `layers` (it holds one slice per layer of a stack)."""
    return bool(axes) and axes[0] == "layers"


def scans_own_layers(cls: type, logical: Mapping) -> bool:
    """A model with parameters stacked along `layers` but no `LAYER_STACK`: it runs its layers itself (`nnx.scan`),
    and a GPipe or circular pipeline finds that scan in its traced forward pass (shardkit/pipeline/scan_layers.py)."""
    names = jax.tree.leaves(logical, is_leaf=lambda leaf: isinstance(leaf, tuple))
    return not hasattr(cls, "LAYER_STACK") and any(is_stacked(axes) for axes in names)


def check_pipeline_stack(cls: type, logical: Mapping) -> None:
    """A pipeline runs the model's layer stack stage by stage: its parameters must be stacked along `layers`, run
    either through `shardkit.nn.scan_stack` (the class names the stack in `LAYER_STACK`) or by the model's own scan
    (`scans_own_layers`; 1F1B schedules, which also need the embed/unembed split, refuse that earlier by name).

    Raises:
        ShardkitError: on `mesh.pipeline`, naming the class and what to add.
    """
    names = jax.tree.leaves(logical, is_leaf=lambda leaf: isinstance(leaf, tuple))
    if any(is_stacked(axes) for axes in names) and isinstance(getattr(cls, "LAYER_STACK", ""), str):
        return
    raise ShardkitError("mesh.pipeline", f"{cls.__name__} has no layer stack a pipeline can split: stack its layers "
                        "along `layers` (shardkit.nn.stack, or nnx.vmap with transform_metadata={nnx.PARTITION_NAME: "
                        "\"layers\"}) and run them with nnx.scan or shardkit.nn.scan_stack; or use mesh.pipeline=1")


def is_builtin(cls: type) -> bool:
    """Whether `cls` is one of the reference models in `shardkit.models`."""
    return cls.__module__.startswith("shardkit.models.")


def model_import_path(cls: type) -> str:
    """The `module:Class` name under which `load_model_class` finds `cls` (a recipe's `model.name`)."""
    for name, (module_name, class_name) in BUILTIN_MODELS.items():
        if cls.__module__ == f"shardkit.models.{module_name}" and cls.__qualname__ == class_name:
            return name
    return f"{cls.__module__}:{cls.__qualname__}"


def create_model(cls: type, config: Any, rngs: nnx.Rngs) -> nnx.Module:
    """`cls(config, rngs=rngs)` as shardkit builds every model: Flax's eager sharding off for the call (a scoped
    context, nothing process-wide changes), so annotations need no mesh in scope; they are read as logical names.

    A `nnx.bridge.ToNNX` keeps the Rngs of its lazy init in its state; they are dropped after init so that the state
    is parameters only (a wrapped Linen module then runs without Linen rng streams, i.e. deterministically).
    """
    with nnx.use_eager_sharding(False):
        model = cls(config, rngs=rngs)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, bridge.ToNNX):
            node.to_nnx__rngs = None
    return model


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
        raise ShardkitError("model.name", f"unknown model {name!r}; use one of {sorted(BUILTIN_MODELS)} or "
                                          f"module:Class")
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ShardkitError("model.name", f"{module_name!r} has no attribute {class_name!r}")
    check_model_class(cls, name)
    return cls


def config_json(value: Any) -> Any:
    """A model config as JSON that compares equal exactly when the configs do, whatever fields it holds.

    Numbers, strings, booleans and None stay as they are, tuples and lists become lists and dataclasses (nested ones
    too) dicts of their fields, so a config of plain fields reads as `dataclasses.asdict` would give it. The rest is
    tagged: an enum member `{"enum": "module:Class.NAME"}`, a dtype `{"dtype": "bfloat16"}`, a PartitionSpec
    `{"PartitionSpec": [...]}`, a function or class `{"callable": "module:name"}`, anything else its repr (without
    memory addresses, which differ between runs).
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__module__}:{type(value).__qualname__}.{value.name}"}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: config_json(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, PartitionSpec):
        return {"PartitionSpec": [config_json(entry) for entry in value]}
    if isinstance(value, (list, tuple)):
        return [config_json(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): config_json(item) for key, item in value.items()}
    dtype = _as_dtype(value)
    if dtype is not None:
        return {"dtype": dtype.name}
    if callable(value) and hasattr(value, "__qualname__"):
        return {"callable": f"{getattr(value, '__module__', '')}:{value.__qualname__}"}
    return {"repr": re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))}


def _as_dtype(value: Any) -> np.dtype | None:
    """`value` as a NumPy dtype where it is one or a scalar type (np.float32, jnp.bfloat16), else None."""
    if isinstance(value, np.dtype):
        return value
    if isinstance(value, type) and issubclass(value, np.generic):
        return np.dtype(value)
    dtype = getattr(value, "dtype", None)
    return dtype if isinstance(value, type) and isinstance(dtype, np.dtype) else None


# A model dimension past 2**31 - 1 cannot be allocated anywhere, and past 2**63 it no longer fits XLA's int64 shapes
# (JAX fails inside tracing): refused with the field's name instead.
MAX_MODEL_DIM = 2**31 - 1


def model_config(cls: type, section: ModelSection) -> Any:
    """The preset named in the recipe with its per-dimension overrides applied, validated."""
    if section.preset not in cls.PRESETS:
        raise ShardkitError("model.preset", f"unknown preset {section.preset!r}; valid presets are "
                                            f"{sorted(cls.PRESETS)}")
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


def model_dims(config: Any) -> dict[str, Any]:
    """A model config (`model_config`: preset plus overrides) by field, as a resolved recipe's `[model]` shows it."""
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config) if field.init}
