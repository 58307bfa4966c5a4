"""`train.fsdp_sync = "per_step"` under GPipe and circular: the stage weights gathered over FSDP once per step.

Without a pipeline, per-step FSDP sync gathers the parameters once before the accumulation loop and reduces the
accumulated gradients once after it (`shardkit.microbatch`). Under a pipeline the region gathers a stage's FSDP
shards itself, once per pass (`pipeline.fsdp_gather = "per_step"`), and each pass reduces its stage gradients over
the data replicas at the region's edge. Here, instead, the step gathers every stage weight once, before the
accumulation loop, into one copy per data replica (`hold`: a leading replica axis laid over the region's data axes,
so each device keeps its own replica's whole stage). Each pass's region takes that copy as it is (no gather inside,
`held_leaves`); its gradient comes out per replica, unreduced (a value that is varying over the data axes needs no
sum at the region's edge), is summed through the passes in fp32, and is reduced over the replicas once, after the
loop (`release`; XLA's reduce-scatter onto the FSDP shards, an all-reduce over `data`). The price is what it is
without a pipeline: the stage's gathered weights (in the compute dtype) and an unreduced fp32 gradient of them held
for the step. A pass's stage gradient is summed through its ticks as the region sums it (the compute dtype, or fp32
under `precision.grad_reduce = "float32"`, rounded to the compute dtype once per pass), the passes' in fp32.

The copy reaches the layer loop through a context (`holding`), which the loss the step differentiates enters with
the copy as one of its arguments (`HeldStage`), so autodiff gives its gradient beside the parameters'.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardkit import microbatch
from shardkit.axes import PIPELINE
from shardkit.errors import ShardkitError
from shardkit.nn import dropout_stream
from shardkit.pipeline.config import PipelineRegion, pipeline_region
from shardkit.precision import Fp8Trained


class HeldStage(NamedTuple):
    """What one pass is differentiated in: the trained parameters (or `Fp8Trained`) and the held copy of the stage
    weights, {path in the layer stack: (replicas, v, p, layers per chunk, ...)}."""

    trained: Any
    stage: dict


class _Held(NamedTuple):
    copy: dict
    used: list  # set by the layer loop that took the copy


_HELD: contextvars.ContextVar[_Held | None] = contextvars.ContextVar("shardkit_held_stage", default=None)


def holds_stage(layout) -> bool:
    """Whether the layout's step holds the stage weights for the step: per-step FSDP sync with accumulation under a
    pipeline whose region gathers over `fsdp` itself (`shardkit.pipeline.config.validate_pipeline` refuses the
    other pipelines)."""
    recipe = layout.recipe
    return (layout.pipeline.enabled and recipe.train.grad_accum > 1 and recipe.train.fsdp_sync == "per_step"
            and pipeline_region(layout).gathers_per_step)


def check_model(layout) -> None:
    """The held copy replaces the weights of the layer stack that `shardkit.nn.scan_stack` hands the pipeline: a model
    naming it in `LAYER_STACK`. A model that scans its own layers (shardkit/pipeline/scan_layers.py) is refused."""
    if holds_stage(layout) and not hasattr(layout.model_class, "LAYER_STACK"):
        raise ShardkitError("train.fsdp_sync", f"'per_step' with accumulation under a pipeline needs a model whose "
                            f"layer stack is named in LAYER_STACK; {layout.model_class.__name__} scans its own layers; "
                            "use train.fsdp_sync = 'per_microbatch'")


@contextlib.contextmanager
def holding(stage: dict):
    """A context in which the layer loop takes `stage` (see `HeldStage`) for the layer stack's weights."""
    held = _Held(stage, [])
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)
    if not held.used:
        raise RuntimeError("the held stage weights were not taken by a pipeline layer loop")


def _path_keys(path) -> tuple[str, ...]:
    return tuple(str(entry.key) for entry in path if isinstance(entry, jax.tree_util.DictKey))


def held_leaves(stacked_state) -> list | None:
    """Inside `holding`: per leaf of the layer loop's stacked state (`jax.tree.leaves` order), the held copy of that
    weight, or None for leaves that are not weights (the FP8 scaling state, the dropout layer index). None outside."""
    held = _HELD.get()
    if held is None:
        return None
    held.used.append(True)
    found = []
    for path, node in jax.tree_util.tree_flatten_with_path(stacked_state,
                                                           is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        copy = held.copy.get(_path_keys(path)) if isinstance(node, nnx.Variable) else None
        found.extend([copy] * len(jax.tree.leaves(node)))
    if sum(copy is not None for copy in found) != len(held.copy):
        raise RuntimeError("the held stage weights do not match the layer stack's")
    return found


def held_spec(region: PipelineRegion) -> PartitionSpec:
    """A held weight (replicas, v, p, ...) enters the region split over its data axes and stages."""
    return PartitionSpec(region.data_axes, None, PIPELINE)


def _replicas(region: PipelineRegion) -> int:
    return math.prod(region.mesh.shape[axis] for axis in region.data_axes)


def _held_shardings(layout, region: PipelineRegion, stack: dict) -> dict:
    """Each held weight's layout: the replica axis over the data axes, the stages over `pipeline`, and the rest as the
    region's automatic axes split it (e.g. `tensor`)."""
    specs = layout.specs(region.rules.params)[layout.model_class.LAYER_STACK]
    flat = {_path_keys(path): spec for path, spec in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec))[0]}
    return {key: NamedSharding(region.mesh, PartitionSpec(region.data_axes, None, PIPELINE, *flat[key]))
            for key in stack}


def hold(layout, region: PipelineRegion, stack) -> dict:
    """The step's one gather of the stage weights: {path: (replicas, v, p, layers per chunk, ...)}, every replica's
    copy whole over the data axes."""
    flat = {_path_keys(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(stack)[0]}
    shardings = _held_shardings(layout, region, flat)
    p, v, replicas = region.config.stages, region.config.repeats, _replicas(region)

    def copy(key, w_L):
        chunks = w_L.reshape(v, p, w_L.shape[0] // (p * v), *w_L.shape[1:])
        return jax.lax.with_sharding_constraint(jnp.broadcast_to(chunks, (replicas, *chunks.shape)), shardings[key])

    return {key: copy(key, leaf) for key, leaf in flat.items()}


def _params(trained):
    return trained.params if isinstance(trained, Fp8Trained) else trained


def _with_params(trained, params):
    return trained._replace(params=params) if isinstance(trained, Fp8Trained) else params


def accumulate(value_and_grad, layout):
    """`shardkit.microbatch.accumulate` for a step that holds the stage weights (`holds_stage`): `value_and_grad`
    takes `HeldStage(params, held copy)` and gives gradients of that shape."""
    region = pipeline_region(layout)
    count, stack_name = layout.recipe.train.grad_accum, layout.model_class.LAYER_STACK

    def run(trained, tokens_BS1):
        # Gathered in the compute dtype, as the region's own per-pass gather is (the stages use it in no other).
        stage = hold(layout, region, layout.policy.cast_to_compute(_params(trained)[stack_name]))
        shardings = _held_shardings(layout, region, stage)
        fp32_zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)  # noqa: E731
        zero = HeldStage(fp32_zeros(trained), jax.lax.with_sharding_constraint(fp32_zeros(stage), shardings))

        def body(sums: microbatch.Sums, micro):
            tokens_bS1, index = micro
            with dropout_stream(index):
                (loss, aux), grads = value_and_grad(HeldStage(trained, stage), tokens_bS1)
            stage_sum = jax.tree.map(jnp.add, sums.grads.stage, grads.stage)
            total = HeldStage(microbatch.add_gradients(sums.grads.trained, grads.trained),
                              jax.lax.with_sharding_constraint(stage_sum, shardings))
            return microbatch.Sums(sums.loss + loss, total), aux

        micro = (microbatch.split(tokens_BS1, count), jnp.arange(count, dtype=jnp.uint32))
        sums, aux_A = jax.lax.scan(body, microbatch.Sums(jnp.float32(0), zero), micro)
        grads = release(sums.grads, stack_name)
        mean = jax.tree.map(lambda g: g / count, _params(grads))
        return (sums.loss / count, jax.tree.map(lambda a: a.sum(axis=0), aux_A)), _with_params(grads, mean)

    return run


def release(grads: HeldStage, stack_name: str):
    """The trained parameters' gradients with the layer stack's taken from the held copy's: summed over the replicas
    (the step's one reduction of them) and laid back into (layers, ...)."""
    params = _params(grads.trained)

    def stack_grad(path, unused):
        g = grads.stage[_path_keys(path)].sum(axis=0)
        return g.reshape(unused.shape)

    stack = jax.tree_util.tree_map_with_path(stack_grad, params[stack_name])
    return _with_params(grads.trained, {**params, stack_name: stack})
