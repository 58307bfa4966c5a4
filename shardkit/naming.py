"""Where each parameter's logical names come from: the recipe's path rules, the model's own Flax metadata, or none.

A recipe's `[rules.paths]` maps a regular expression, matched in full against a parameter's path as `plan` prints it
(`lm/blocks_0/CausalAttn_0/query/kernel`), to logical names, one per dimension ("" for a dimension left unnamed), as
t5x's `override_params_axes_names` and EasyLM's partition rules do. The first matching rule in file order wins over
the model's names. A parameter that neither names is replicated, as Flax's `nn.get_sharding` does
(`rules.unnamed = "refuse"` refuses it instead).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from shardkit.errors import ShardkitError
from shardkit.recipe import RulesSection

MODEL_SOURCE = "model"
NO_SOURCE = "none"
ANNOTATE_HINT = ("annotate it the Flax way, e.g. kernel_init=nnx.with_partitioning(init, (\"embed\", \"mlp\")) or "
                 "nnx.Param(value, sharding_names=(...)), or name it by path in the recipe's [rules.paths]")


class ParamNames(NamedTuple):
    """One parameter's path, shape and the names its model metadata gives (None: no metadata)."""

    path: str
    shape: tuple[int, ...]
    model: tuple | None


def path_rule_source(pattern: str) -> str:
    return f"path rule {pattern!r}"


def resolve_names(params: Sequence[ParamNames], rules: RulesSection) -> tuple[list[tuple], list[str]]:
    """Each parameter's logical names (one per dimension, None for a dimension left whole) and their source, in the
    order of `params`.

    Raises:
        ShardkitError: a path rule matching no parameter or giving more names than the parameter has dimensions; a
            model's names that do not fit the stored parameter; an unnamed parameter under `rules.unnamed = "refuse"`.
    """
    compiled = [(pattern, re.compile(pattern), names) for pattern, names in rules.paths]
    matched: set[str] = set()
    logical, sources = [], []
    for param in params:
        rule = next(((pattern, names) for pattern, regex, names in compiled if regex.fullmatch(param.path)), None)
        if rule is not None:
            matched.add(rule[0])
            names, source = _rule_names(param, *rule), path_rule_source(rule[0])
        elif param.model is not None:
            names, source = _model_names(param), MODEL_SOURCE
        elif rules.unnamed == "refuse":
            raise ShardkitError("model", f"parameter {param.path} {param.shape} has no logical axis names; "
                                + ANNOTATE_HINT + " (rules.unnamed = \"refuse\"; \"replicate\" replicates it)")
        else:
            names, source = (), NO_SOURCE
        logical.append(names + (None,) * (len(param.shape) - len(names)))
        sources.append(source)
    for pattern, _, _ in compiled:
        if pattern not in matched:
            example = params[0].path if params else "(none)"
            raise ShardkitError(f"rules.paths.{pattern!r}", f"matches no parameter (matched in full against paths "
                                f"such as {example}; `shardkit plan` lists them)")
    return logical, sources


def _rule_names(param: ParamNames, pattern: str, names: tuple[str, ...]) -> tuple:
    if len(names) > len(param.shape):
        raise ShardkitError(f"rules.paths.{pattern!r}", f"gives {len(names)} names {list(names)} to {param.path}, "
                            f"which has shape {param.shape}; give at most one per dimension (\"\" leaves one whole)")
    return tuple(name or None for name in names)


def _model_names(param: ParamNames) -> tuple:
    """The model's names, as JAX reads a PartitionSpec: fewer than the dimensions name the leading ones."""
    if len(param.model) > len(param.shape):
        override = [""] * len(param.shape)
        raise ShardkitError("model", f"parameter {param.path} has shape {param.shape} but {len(param.model)} "
                            f"logical names {param.model}, which cannot fit it; name it in the recipe instead: "
                            f"[rules.paths] {_toml_key(param.path)} = {_toml_list(override)} (one name per "
                            "dimension, \"\" for none)")
    return param.model


def _toml_key(path: str) -> str:
    """The parameter's path as a `[rules.paths]` key matching exactly it: a TOML literal string of the escaped path."""
    return f"'{re.escape(path)}'"


def _toml_list(names: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{name}"' for name in names) + "]"
