"""Logical axis names -> mesh axes, resolved strictly into PartitionSpecs.

Two tables decide a layout (Levanter's parameter vs compute mapping): one for parameters and one for activations.
FSDP is the difference between them: parameters sharded along `embed` over `fsdp`, compute not. ZeRO-1/2 add two
derived tables, for the optimizer state and for the gradients, which also shard over the `data` axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec

from shardkit.axes import MESH_AXES
from shardkit.errors import ShardkitError
from shardkit.recipe import RulesSection

Table = Mapping[str, tuple[str, ...]]

# Every mesh axis is in the mesh (size 1 when unused), so these defaults are the whole map and the mesh sizes decide
# what is really sharded: `[mesh] fsdp = -1` alone is FSDP, `[mesh] tensor = 4` alone is Megatron TP.
DEFAULT_PARAM_RULES: dict[str, tuple[str, ...]] = {
    "batch": (),
    "sequence": (),
    "residual_sequence": (),
    # Every rank that would hold a replica is an FSDP rank (MaxText; torchtitan's dp_shard_cp): the context and expert
    # ranks shard the parameters along `embed` too, gathered per layer with the fsdp shards.
    "embed": ("fsdp", "sequence", "expert"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": ("pipeline",),
    "experts": ("expert",),
}
# Mesh axes a parameter dimension's rule may list after another axis as extra FSDP ranks. Such a secondary placement
# yields to a dimension of the same tensor whose rule leads with the axis: the experts' weights keep `expert` on
# their `experts` dimension, their `embed` is sharded over the other axes of its rule.
SHARED_FSDP_AXES = ("sequence", "expert")
DEFAULT_ACTIVATION_RULES: dict[str, tuple[str, ...]] = {
    # Expert parallelism shares the batch too: each `expert` rank routes its own rows (shardkit/moe.py).
    "batch": ("data", "fsdp", "expert"),
    "sequence": ("sequence",),
    # The residual stream's sequence (norms, dropout, block outputs). Context parallelism cuts it like `sequence`;
    # Megatron-SP also cuts it over `tensor`: `[rules] tensor = [..., "residual_sequence"]` (recipes/tp_sp.toml).
    "residual_sequence": ("sequence",),
    "embed": (),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": (),
    "experts": ("expert",),
}
# Which table(s) an intent-level shorthand `[rules] <axis> = [...]` rewrites.
SHORTHAND_TABLES = {
    "data": ("activations",),
    "fsdp": ("params",),
    "tensor": ("params", "activations"),
    "sequence": ("activations",),
    "pipeline": ("params",),
    # Parameters only: on activations the shorthand would also take `expert` off the batch, which it must split.
    "expert": ("params",),
}


@dataclasses.dataclass(frozen=True)
class RuleSet:
    """The resolved rule tables of a recipe."""

    params: Table
    activations: Table
    optimizer: Table
    gradients: Table

    def without_axes(self, axes: Sequence[str]) -> "RuleSet":
        """The same rules with the mesh `axes` removed everywhere: the rules of code that is manual over them (a
        pipeline region, a per-replica vmap), or of one replica's share of the parameters."""
        strip = lambda table: table_without_axes(table, axes)
        return RuleSet(strip(self.params), strip(self.activations), strip(self.optimizer), strip(self.gradients))


def table_without_axes(table: Table, axes: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """One rule table with the mesh `axes` removed everywhere (`RuleSet.without_axes` of one table)."""
    return dict(_without_axes(tuple(table.items()), frozenset(axes)))


@functools.lru_cache(maxsize=4096)
def _without_axes(table: tuple[tuple[str, tuple[str, ...]], ...], axes: frozenset[str]):
    """`RuleSet.without_axes` of one table given as its items, as items: a pure function of its arguments, memoised
    because the analytic model strips the same few tables thousands of times in one `suggest` search (each caller
    still gets a dict of its own)."""
    return tuple((name, tuple(a for a in mapped if a not in axes)) for name, mapped in table)


def without_shared_fsdp_ranks(rules: RuleSet) -> RuleSet:
    """The rules with the SHARED_FSDP_AXES dropped where a parameter table lists them after another axis: the rules
    under a pipeline, whose stage regions take the parameters split over `fsdp` and `tensor` only and run their
    context- and expert-parallel regions nested inside; there the context and expert ranks hold replicas."""
    strip = table_without_shared_fsdp_ranks
    return RuleSet(strip(rules.params), rules.activations, strip(rules.optimizer), strip(rules.gradients))


def table_without_shared_fsdp_ranks(table: Table) -> dict[str, tuple[str, ...]]:
    """One parameter table with the SHARED_FSDP_AXES dropped where a rule lists them after another axis
    (`without_shared_fsdp_ranks` of one table)."""
    return dict(_without_shared_fsdp_ranks(tuple(table.items())))


@functools.lru_cache(maxsize=4096)
def _without_shared_fsdp_ranks(table: tuple[tuple[str, tuple[str, ...]], ...]):
    """`without_shared_fsdp_ranks` of one table given as its items, as items (memoised as `_without_axes` is)."""
    return tuple((name, mapped[:1] + tuple(a for a in mapped[1:] if a not in SHARED_FSDP_AXES))
                 for name, mapped in table)


def build_rules(section: RulesSection) -> RuleSet:
    """Expand a recipe's `[rules]` into the four tables: defaults, then shorthands, then the raw tables."""
    tables = {"params": dict(DEFAULT_PARAM_RULES), "activations": dict(DEFAULT_ACTIVATION_RULES)}
    for axis in MESH_AXES:
        names = getattr(section, axis)
        if names is None:
            continue
        for table_name in SHORTHAND_TABLES[axis]:
            _assign_axis(tables[table_name], axis, names, SHARED_FSDP_AXES if axis == "fsdp" else ())
    for table_name in ("params", "activations"):
        tables[table_name].update(dict(getattr(section, table_name)))
    params = tables["params"]
    zero_names = section.fsdp if section.fsdp is not None else ("embed",)
    optimizer = _with_zero(params, zero_names) if section.zero >= 1 else params
    gradients = _with_zero(params, zero_names) if section.zero >= 2 else params
    return RuleSet(params=params, activations=tables["activations"], optimizer=optimizer, gradients=gradients)


def check_rule_names(section: RulesSection, known: set[str]) -> None:
    """Every logical name a recipe's rules mention must be one the defaults or the model know: a typo such as
    `fsdp = "embd"` would otherwise leave every parameter silently replicated."""
    mentioned = [(f"rules.{axis}", name) for axis in MESH_AXES for name in (getattr(section, axis) or ())]
    mentioned += [(f"rules.{table}.{name}", name) for table in ("params", "activations")
                  for name, _ in getattr(section, table)]
    for field, name in mentioned:
        if name not in known:
            raise ShardkitError(field, f"unknown logical name {name!r}; known names are {sorted(known)}")


def _assign_axis(table: dict[str, tuple[str, ...]], axis: str, names: Sequence[str],
                 companions: Sequence[str] = ()) -> None:
    """Make `names` exactly the logical names mapped to `axis` in `table`; `companions` (the extra FSDP ranks of the
    `fsdp` shorthand) follow `axis` wherever a rule lists them after another axis."""
    follows = lambda a, position: a == axis or (a in companions and position > 0)
    for name, axes in table.items():
        table[name] = tuple(a for position, a in enumerate(axes) if not follows(a, position))
    for name in names:
        kept = table.get(name, ())
        table[name] = kept + (axis,) + tuple(a for a in companions if a not in kept)


def _with_zero(params: Table, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """ZeRO: shard along `names` over `data` too, in front of whatever parameters already use."""
    return {name: (("data",) + axes if name in names else axes) for name, axes in params.items()}


def axes_degree(axes, mesh_sizes: Mapping[str, int]) -> int:
    """How many devices mesh `axes` (a name, a sequence of names, or None) split a dimension over."""
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh_sizes[axis] for axis in axes)


def logical_degree(table: Table, name: str, mesh_sizes: Mapping[str, int]) -> int:
    """How many devices a logical name is split over under a rule table (1 for a name the table leaves whole)."""
    return axes_degree(table.get(name, ()), mesh_sizes)


def resolve_spec(
    path: str,
    shape: Sequence[int],
    logical: Sequence[str | None],
    table: Table,
    mesh_sizes: Mapping[str, int],
    table_name: str = "params",
) -> PartitionSpec:
    """The PartitionSpec of one tensor, or a ShardkitError naming the tensor, its shape and the rule at fault.

    Fewer names than dimensions name the leading ones, the rest unsharded, as JAX reads a PartitionSpec. Mesh axes of
    size 1 are checked like the others (a misconfigured rule is wrong whatever the device count) and then dropped, so
    a spec shows only what is really sharded.
    """
    if len(logical) > len(shape):
        raise ShardkitError(path, f"has shape {tuple(shape)} but {len(logical)} logical axes {tuple(logical)}; give "
                            "at most one per dimension")
    logical = tuple(logical) + (None,) * (len(shape) - len(logical))  # as JAX reads a spec: the leading dimensions
    used: dict[str, str] = {}
    entries = []
    mapped = [() if name is None else _mapped_axes(path, name, shape, logical, table, table_name) for name in logical]
    if table_name != "activations":
        mapped = _yield_shared_axes(mapped)
    for dim, name, axes in zip(shape, logical, mapped):
        if name is None:
            entries.append(None)
            continue
        for axis in axes:
            if axis not in mesh_sizes:
                raise ShardkitError(f"rules.{table_name}.{name}", f"unknown mesh axis {axis!r}; valid axes are "
                                                                  f"{list(MESH_AXES)}")
            if axis in used:
                raise ShardkitError(
                    path,
                    f"mesh axis {axis!r} is used twice in one spec (by {used[axis]!r} and {name!r}; shape "
                    f"{tuple(shape)}, "
                    f"axes {tuple(logical)}); change rules.{table_name}.{name} or rules.{table_name}.{used[axis]}",
                )
            used[axis] = name
        degree = axes_degree(axes, mesh_sizes)
        if dim % degree and name in ("heads", "kv_heads"):
            raise ShardkitError(path, _heads_message(name, dim, degree, axes, tuple(shape), table_name))
        if dim % degree:
            raise ShardkitError(
                path,
                f"dimension {name!r} of size {dim} (shape {tuple(shape)}) is not divisible by {degree}, the size of "
                f"mesh axes {list(axes)} from rule rules.{table_name}.{name}; pick a mesh whose {list(axes)} divide "
                f"{dim} "
                f"or map {name!r} elsewhere",
            )
        real = tuple(axis for axis in axes if mesh_sizes[axis] > 1)
        entries.append(None if not real else real[0] if len(real) == 1 else real)
    return PartitionSpec(*entries)


def _yield_shared_axes(mapped: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Each dimension's axes without the SHARED_FSDP_AXES that it lists after another axis and that another dimension's
    rule leads with (see SHARED_FSDP_AXES)."""
    leading = {axes[0] for axes in mapped if axes}
    return [axes[:1] + tuple(a for a in axes[1:] if not (a in SHARED_FSDP_AXES and a in leading)) for axes in mapped]


def _mapped_axes(path: str, name, shape, logical, table: Table, table_name: str) -> tuple[str, ...]:
    """The mesh axes of one dimension's entry: a logical name, or a tuple of them (JAX's several axes on one
    dimension), their rules' axes in order.

    Raises:
        ShardkitError: naming a name no rule maps and the `--set` that would map it.
    """
    axes: tuple[str, ...] = ()
    for member in name if isinstance(name, tuple) else (name,):
        if member not in table:
            raise ShardkitError(
                path,
                f"logical axis {member!r} (shape {tuple(shape)}, axes {tuple(logical)}) has no rule in "
                f"rules.{table_name}; map it to mesh axes with --set rules.{table_name}.{member}=tensor (or a list, "
                f"or [] to leave it whole); known names are {sorted(table)}",
            )
        axes += table[member]
    return axes


def with_mesh_axis_names(rules: RuleSet, names) -> RuleSet:
    """The rules with each of `names` that is a mesh axis (`P('fsdp', 'tensor')`, as Flax's guides annotate) and that
    no rule maps sharding along that axis, in every table."""
    added = {name: (name,) for name in names if name in MESH_AXES}
    return RuleSet(*({**added, **getattr(rules, field.name)} for field in dataclasses.fields(rules)))


def _heads_message(name: str, count: int, degree: int, axes, shape, table_name: str) -> str:
    """Heads that the tensor degree does not divide: say what would be valid, and how GQA replicates KV heads."""
    message = (
        f"{count} {name} (shape {shape}) cannot be split over {degree} devices of mesh axes {list(axes)} "
        f"(rule rules.{table_name}.{name}); use a tensor degree that divides {count}"
    )
    if name == "kv_heads":
        message += (
            "; or replicate the KV heads on every tensor rank, as Megatron does when the tensor degree exceeds the KV "
            "heads, with rules.params.kv_heads = [] and rules.activations.kv_heads = []"
        )
    return message


def spec_to_json(spec: PartitionSpec, ndim: int) -> list:
    """One entry per dimension: None, an axis name, or a list of axis names."""
    entries = list(spec) + [None] * (ndim - len(spec))
    return [list(entry) if isinstance(entry, tuple) else entry for entry in entries]
