"""What `plan` and `train` say about a user's own model: where each of its logical names lands, and the layouts that
would not do what the recipe says because of how the model is written (its attention weights left whole on the
`tensor` axis, a sequence split that nothing in the model reads)."""

from __future__ import annotations

import math
import re
from typing import Any

import jax

from shardkit.layout import Layout, model_names, path_str
from shardkit.naming import NO_SOURCE
from shardkit.recipe import MESH_AXES
from shardkit.registry import is_builtin
from shardkit.rules import DEFAULT_PARAM_RULES

# Path components that mark a parameter as an attention weight (q/k/v/o projections as models name them).
ATTENTION_MARKS = ("attn", "attention", "query", "key", "value", "qkv")
# The dimensions the analytic model reads by their logical names from the model's Config.
ANALYTIC_DIMS = ("layers", "embed", "mlp")


def name_rows(layout: Layout) -> list[dict[str, Any]]:
    """Each logical name the model's parameters carry: the mesh axes its parameter rule maps it to, those of them
    that split it on this mesh, and where the rule comes from (the defaults, the recipe, or the name being a mesh
    axis's own)."""
    sizes, recipe_rules = dict(layout.mesh.shape), dict(layout.recipe.rules.params)
    rows = []
    for name in sorted(model_names(layout.logical)):
        axes = list(layout.rules.params.get(name, ()))
        source = ("recipe" if name in recipe_rules or name not in DEFAULT_PARAM_RULES and name not in MESH_AXES
                  else "mesh axis" if name not in DEFAULT_PARAM_RULES else "default")
        if name in DEFAULT_PARAM_RULES and tuple(axes) != DEFAULT_PARAM_RULES[name]:
            source = "recipe"
        rows.append({"name": name, "axes": axes, "split_over": [a for a in axes if sizes[a] > 1], "source": source})
    return rows


def format_names(rows: list[dict[str, Any]]) -> str:
    """`model names: embed -> fsdp (default), kv -> whole (recipe), ...`."""
    parts = [f"{row['name']} -> {'+'.join(row['split_over']) or 'whole'} ({row['source']})" for row in rows]
    return "model names: " + ", ".join(parts)


def layout_warnings(layout: Layout) -> list[str]:
    """One line for each thing the recipe asks that the model, as written, will not do."""
    if is_builtin(layout.model_class):
        return []
    fsdp = _idle_axis_warning(layout, "fsdp")
    tensor = _idle_axis_warning(layout, "tensor", offer_mesh_names=fsdp is None)  # one rule offered per name
    lines = (fsdp, tensor or _tensor_warning(layout), _unnamed_warning(layout), _sequence_warning(layout))
    return [line for line in lines if line]


# More than this share of the parameters' bytes left unnamed (replicated) is worth a warning.
UNNAMED_SHARE_WARNED = 0.01


def _unnamed_warning(layout: Layout) -> str | None:
    """The parameters no name reaches hold a real share of the model: name the largest and the rule that splits it."""
    unnamed = [(path, shape) for path, shape in _shapes(layout) if layout.name_sources.get(path) == NO_SOURCE]
    total = sum(math.prod(shape) for _, shape in _shapes(layout))
    size = sum(math.prod(shape) for _, shape in unnamed)
    if not unnamed or size <= UNNAMED_SHARE_WARNED * total:
        return None
    path, shape = max(unnamed, key=lambda item: math.prod(item[1]))
    return (f"warning: {len(unnamed)} parameters have no logical names and are replicated on every device "
            f"({size / total:.1%} of the parameters), the largest {path} {shape}; name it by path, e.g. "
            f"[rules.paths] {example_rule(layout, path, shape, 'fsdp')}")


def _idle_axis_warning(layout: Layout, axis: str, offer_mesh_names: bool = True) -> str | None:
    """A mesh axis of more than one device that the recipe's parameter rules use, but that splits no parameter: the
    model carries none of the names mapped to it. Names the model's own mesh-axis names of size 1 here (its authors'
    `data`), with the rule that would map them (`offer_mesh_names`), else a path rule for its largest parameter."""
    size = layout.mesh.shape[axis]
    meant = sorted(name for name, axes in layout.rules.params.items() if axis in axes and name not in MESH_AXES)
    if size == 1 or not meant or layout.splits(axis):
        return None
    line = (f"warning: mesh.{axis}={size} splits no parameter: the model's parameters carry none of the names the "
            f"rules map to `{axis}` ({', '.join(meant)})")
    idle_names = sorted(name for name in model_names(layout.logical)
                        if name in MESH_AXES and name != axis and layout.mesh.shape[name] == 1
                        and tuple(layout.rules.params.get(name, ())) == (name,))
    if idle_names and offer_mesh_names:
        return line + (f"; the model names mesh axis `{idle_names[0]}`, of size 1 in this recipe: map it with "
                       f"--set rules.params.{idle_names[0]}={axis}")
    path, shape = max(_shapes(layout), key=lambda item: math.prod(item[1]))
    return line + f"; name its dimensions by path, e.g. [rules.paths] {example_rule(layout, path, shape, axis)}"


def example_rule(layout: Layout, path: str, shape: tuple[int, ...], axis: str) -> str:
    """A `[rules.paths]` line for the parameter at `path` (its layer numbers generalised) whose names put it on
    `axis`: `embed` on the dimension of the config's embed width (else the largest), and for `tensor`, `mlp` on
    the largest other dimension."""
    names = [""] * len(shape)
    embed = getattr(layout.config, "embed", None)
    dims = sorted(range(len(shape)), key=lambda dim: -shape[dim])
    embed_dim = next((dim for dim in dims if shape[dim] == embed), dims[0] if dims else None)
    if embed_dim is not None:
        names[embed_dim] = "embed"
    other = next((dim for dim in dims if dim != embed_dim), None)
    if axis == "tensor" and other is not None:
        names[other] = "mlp"
    pattern = re.sub(r"\d+", r"\\d+", re.escape(path))
    return f"'{pattern}' = [" + ", ".join(f'"{name}"' for name in names) + "]"


def _shapes(layout: Layout) -> list[tuple[str, tuple[int, ...]]]:
    return [(path_str(path), tuple(leaf.shape))
            for path, leaf in jax.tree_util.tree_flatten_with_path(layout.abstract_params)[0]]


def _tensor_warning(layout: Layout) -> str | None:
    """The `tensor` axis splits none of the attention weights (the model never names their heads)."""
    if layout.mesh.shape["tensor"] == 1:
        return None
    specs = layout.specs(layout.rules.params)
    is_spec = lambda leaf: isinstance(leaf, jax.sharding.PartitionSpec)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    attention = [(path_str(path), spec) for path, spec in flat
                 if any(mark in part.lower() for part in path_str(path).split("/") for mark in ATTENTION_MARKS)]
    if not attention or any("tensor" in str(spec) for _, spec in attention):
        return None
    names = sorted({name for path, _ in attention for name in _names_at(layout, path) if name is not None}, key=str)
    return (f"warning: mesh.tensor={layout.mesh.shape['tensor']} splits none of the model's attention weights (such as "
            f"{attention[0][0]}), whose names {names} no rule maps to `tensor`; map the heads' name, e.g. --set "
            f"rules.params.NAME=tensor")


def _names_at(layout: Layout, path: str) -> tuple:
    node = layout.logical
    for key in path.split("/"):
        node = node[key] if key in node else node[int(key)]
    return node


def _sequence_warning(layout: Layout) -> str | None:
    """The recipe splits the sequence (context or sequence parallelism), and the model pins no activation along it:
    it computes its own attention and never reaches shardkit's, so the devices along that axis repeat the same work."""
    split = {name: [axis for axis in layout.rules.activations.get(name, ()) if layout.mesh.shape[axis] > 1]
             for name in ("sequence", "residual_sequence")}
    axes = {axis for mapped in split.values() for axis in mapped}
    if not axes or _pins_sequence(layout, axes):
        return None
    name = "sequence" if split["sequence"] else "residual_sequence"
    return (f"warning: the recipe splits the sequence over {sorted(axes)}, but {layout.model_class.__name__} computes "
            f"its own attention and pins no activation along `{name}`: the split does nothing (those devices repeat "
            "the same work) and plan's analytic figures assume a split; pin the activations with "
            f"flax.linen.with_logical_constraint(x, (\"batch\", \"{name}\", \"embed\")) or use shardkit.nn.attention")


def _pins_sequence(layout: Layout, axes: set[str]) -> bool:
    """Whether the model's forward pass constrains some activation along one of the mesh `axes` (a sharding
    constraint from shardkit.nn or Flax's logical constraints, or shardkit's attention regions)."""
    train = layout.recipe.train
    tokens = jax.ShapeDtypeStruct((train.global_batch // train.grad_accum, train.seq_len), "int32")

    def forward(params, tokens_BS):
        with layout.context(training=False):
            return layout.apply(params, tokens_BS)

    text = str(jax.make_jaxpr(forward)(layout.abstract_params, tokens))
    return any(f"'{axis}'" in line for line in text.splitlines() if "sharding" in line or "shard_map" in line
               for axis in axes)


def analytic_note(layout: Layout) -> str:
    """Why `plan` shows no analytic or compiled figures for a model whose Config lacks `ANALYTIC_DIMS`."""
    missing = ", ".join(f"`{name}`" for name in analytic_dims_missing(layout))
    return (f"note: {type(layout.config).__name__} has no {missing} field, dimensions the analytic model reads by "
            "logical name: no memory or communication figures (compile with `shardkit hlo` for XLA's)")


def analytic_dims_missing(layout: Layout) -> list[str]:
    return config_dims_missing(layout.config)


def config_dims_missing(config: Any) -> list[str]:
    """The `ANALYTIC_DIMS` a model config lacks (a model of its own dimension names)."""
    return [name for name in ANALYTIC_DIMS if not isinstance(getattr(config, name, None), int)]
