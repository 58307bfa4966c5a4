"""Layouts without devices: `planned_mesh` stands in for the mesh of a target cluster, with its shape and a device
of the target's kind, which is all the analytic model reads; `candidate_layout` resolves a searched layout on it and
`peak_bytes` is its analytic peak per device.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np

from shardkit.analysis.predicted.estimate import memory_estimate
from shardkit.analysis.predicted.targets import Target
from shardkit.axes import MESH_AXES
from shardkit.layout import Layout, abstract_model, check_layout, check_rule_names, known_logical_names
from shardkit.mesh import resolve_sizes, split_across_hosts
from shardkit.pipeline import validate_pipeline
from shardkit.recipe import Recipe
from shardkit.registry import load_model_class, model_config
from shardkit.rules import build_rules
from shardkit.step import check_step_layout


@dataclasses.dataclass(frozen=True)
class PlannedDevice:
    """What the analytic model reads of a device: its platform and kind (a compile-only device has the same)."""

    id: int
    process_index: int
    device_kind: str
    platform: str = "gpu"
    client: Any = None


@functools.lru_cache(maxsize=16)
def planned_devices(target: Target) -> tuple[PlannedDevice, ...]:
    """The target's devices in rank order, made once per target (frozen: every planned mesh may share them)."""
    return tuple(PlannedDevice(i, i // target.per_host, target.spec.name) for i in range(target.devices))


def planned_mesh(sizes: Mapping[str, int], target: Target):
    """A stand-in for `jax.sharding.Mesh` over the target's devices: shape, size and devices, nothing compiled."""
    shape = OrderedDict((axis, sizes[axis]) for axis in MESH_AXES)
    devices = np.array(planned_devices(target), dtype=object).reshape(tuple(shape.values()))
    return types.SimpleNamespace(shape=shape, size=target.devices, devices=devices, axis_names=MESH_AXES)


@dataclasses.dataclass(frozen=True)
class PlannedLayout(Layout):
    """A Layout whose PartitionSpecs and shard sizes are memoised per (rule table, mesh shape), and its parameters'
    leaves once: the search asks for the same ones thousands of times. The cache is shared by every layout
    `dataclasses.replace` derives from one base, i.e. one model."""

    spec_cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def specs(self, table, table_name: str = "params"):
        return self._memoised("specs", super().specs, table, table_name)

    def shard_elements(self, table, table_name: str = "params"):
        return self._memoised("elements", super().shard_elements, table, table_name)

    def parameter_leaves(self) -> tuple:
        return self._model_memoised("parameter_leaves", super().parameter_leaves)

    def logical_leaves(self) -> tuple:
        return self._model_memoised("logical_leaves", super().logical_leaves)

    def _model_memoised(self, what: str, compute):
        """What depends on the model alone (the same for every layout sharing the cache); immutable tuples only."""
        if what not in self.spec_cache:
            self.spec_cache[what] = compute()
        return self.spec_cache[what]

    def _memoised(self, what: str, compute, table, table_name: str):
        key = (what, table_name, tuple(sorted(table.items())), tuple(self.mesh.shape.items()))
        if key not in self.spec_cache:
            self.spec_cache[key] = compute(table, table_name)
        return self.spec_cache[key]


def base_layout(recipe: Recipe):
    """The model's abstract parameters and logical names, once: every candidate's layout shares them."""
    cls = load_model_class(recipe.model.name)
    config = model_config(cls, recipe.model)
    graphdef, abstract_params, logical = abstract_model(cls, config, recipe.rules)
    check_rule_names(recipe.rules, known_logical_names(cls, logical))
    return PlannedLayout(recipe, cls, config, None, build_rules(recipe.rules), graphdef, abstract_params,
                                   logical)


def candidate_layout(base, recipe: Recipe, target: Target):
    """The candidate recipe's layout on a planned mesh, with every check `build_layout` and `build_step` make.

    Raises:
        ShardkitError: the layout cannot run (indivisible shapes, a batch that does not split, ...).
    """

    sizes = resolve_sizes(recipe.mesh, target.devices)
    split_across_hosts(sizes, target.hosts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bubble warning: the time model prices the bubble
        validate_pipeline(recipe, getattr(base.config, "layers", None), sizes)
    layout = dataclasses.replace(base, recipe=recipe, mesh=planned_mesh(sizes, target), rules=build_rules(recipe.rules))
    check_layout(layout)
    check_step_layout(layout)
    return layout


def peak_bytes(layout) -> float:
    """The analytic peak per device (`estimate.memory_estimate`), which prices each pipeline schedule's activations
    by what its compiled program holds: the loop's buffers under gpipe and circular
    (`pipeline_memory.loop_schedule_memory_terms`), the tick executor's buffers under 1f1b, interleaved_1f1b and
    zero_bubble (`pipeline_memory.tick_schedule_memory_terms`).
    """
    return memory_estimate(layout).total
