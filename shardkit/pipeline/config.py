"""A layout's pipeline, resolved and checked once: its shape, its validation, and what its shard_map region is.

`Layout.pipeline` (the `PipelineConfig` with the mesh's stage count) and `pipeline_region(layout)` (the axes the
region is manual over, the rules and model context inside it, the dropout stream of a micro-batch) are derived here
and nowhere else; GPipe/circular (shardkit/pipeline/gpipe.py) and 1F1B (shardkit/pipeline/one_f_one_b.py) build on
them.

Data parallelism. When the mesh has `data` > 1 (leading the batch's activation rule), the region is manual over `data`
too (`manual_data_axes`): each data replica runs its own pipeline on its rows and accumulates its own weight
gradients, which are summed over `data` once, at the region's edge, after the tick loop: one gradient reduction per
step, as plain data parallelism has. With `data` left automatic, every tick's weight gradient was all-reduced inside
the loop. Dropout inside the stages draws its masks per (data replica, micro-batch, stage, layer), under every
schedule (`PipelineRegion.stream_index`); they are not the masks one device would draw over the whole batch.

FSDP (`pipeline.fsdp_gather`). Under `per_step` (the default) the region is manual over `fsdp` as well, as one more
data axis: a stage's weights enter as their FSDP shards, are all-gathered once before the tick loop (`gather_stage`),
and their gradient, accumulated per replica through the ticks, is reduce-scattered once after it (the transpose of
that gather under autodiff, `reduce_scatter_stage` in 1F1B's own backward): MaxText's `pipeline_fsdp_ag_once`. The
price is the stage's gathered weights (compute dtype) held for the step. Under `per_use`, `fsdp` stays automatic and
XLA gathers a stage's weights for every micro-batch, forward and backward, and reduce-scatters their gradient after
every use: 2 x micro-batches x repeats gathers of the stage per step, one layer's weights gathered at a time.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from shardkit.axes import EXPERT, PIPELINE, SEQUENCE
from shardkit.errors import ShardkitError
from shardkit.nn import LOGICAL_AXES, model_context
from shardkit.pipeline.schedule import CHUNKED_SCHEDULES, TICK_SCHEDULES, PipelineConfig, bubble_fraction
from shardkit.rules import RuleSet


class PipelineBubbleWarning(UserWarning):
    """Fewer micro-batches than stages: most of every stage's time is bubble."""


def pipeline_config(recipe, stages: int | None = None) -> PipelineConfig:
    """The recipe's pipeline: `stages` stages (a layout's resolved mesh size; the recipe's `mesh.pipeline` when None,
    which may still be -1), micro-batches, repeats and schedule from `[pipeline]`. A layout's own is `Layout.pipeline`.
    """
    section = recipe.pipeline
    stages = recipe.mesh.pipeline if stages is None else stages
    return PipelineConfig(stages, section.microbatches, section.repeats, section.schedule, section.fsdp_gather)


def validate_pipeline(recipe, layers: int | None, mesh_sizes) -> None:
    """Check a pipelined recipe against its model and mesh; raises ShardkitError, warns on a large bubble.

    Args:
        recipe: the validated recipe.
        layers: the model's number of stacked layers (its config's `layers`), None if it has no such field.
        mesh_sizes: the resolved mesh, axis -> size.
    """
    stages = mesh_sizes[PIPELINE]
    if stages == 1:
        return
    if layers is None:
        raise ShardkitError("mesh.pipeline", "the model's config has no `layers` field, so it has no layer stack to "
                            "pipeline; use mesh.pipeline=1")
    section, train = recipe.pipeline, recipe.train
    m, v = section.microbatches, section.repeats
    if v > 1 and section.schedule not in CHUNKED_SCHEDULES:
        raise ShardkitError("pipeline.repeats", f"only {list(CHUNKED_SCHEDULES)} use repeats; got repeats={v} with "
                            f"schedule={section.schedule!r} (set pipeline.schedule=\"circular\" or repeats=1)")
    if layers % (stages * v):
        raise ShardkitError("model.layers", f"{layers} layers cannot be split into {stages} stages x {v} repeats; "
                            f"use a multiple of {stages * v} layers or change mesh.pipeline / pipeline.repeats")
    if train.grad_accum > 1 and train.fsdp_sync == "per_step" and mesh_sizes["fsdp"] > 1:
        _check_held_stage(section)
    batch = train.global_batch // train.grad_accum
    if batch % m:
        raise ShardkitError("pipeline.microbatches", f"the batch of {batch} sequences (train.global_batch / "
                            f"train.grad_accum) is not divisible by {m} micro-batches; use a divisor of {batch}")
    replicas = mesh_sizes["data"] * mesh_sizes["fsdp"]
    if (batch // m) % replicas:
        raise ShardkitError("pipeline.microbatches", f"each micro-batch of {batch // m} sequences must split over the "
                            f"{replicas} data x fsdp replicas; use fewer micro-batches or a larger train.global_batch")
    if v > 1 and m < stages:
        raise ShardkitError("pipeline.microbatches", f"the {section.schedule} schedule needs at least as many "
                            f"micro-batches as stages ({stages}), got {m}")
    if section.schedule == "interleaved_1f1b" and m % stages:
        # Megatron's order walks the chunks in groups of p micro-batches.
        raise ShardkitError("pipeline.microbatches", f"interleaved_1f1b runs micro-batches in groups of the {stages} "
                            f"stages; use a multiple of {stages}, got {m}")
    if m < stages:
        bubble = bubble_fraction(pipeline_config(recipe, stages))
        warnings.warn(f"pipeline.microbatches={m} is fewer than the {stages} stages: the bubble is {bubble:.0%} of "
                      f"the step ((p-1)/(m+p-1)); use at least {stages}, ideally {4 * stages}",
                      PipelineBubbleWarning, stacklevel=2)


def _check_held_stage(section) -> None:
    """`train.fsdp_sync = "per_step"` with accumulation holds the stage weights, gathered once per step, through the
    accumulation loop (shardkit/pipeline/held.py): GPipe's and circular's region takes them per data replica, which
    needs the region manual over `fsdp`. The 1F1B family's own backward gathers a stage's shards in every pass."""
    if section.schedule in TICK_SCHEDULES:
        raise ShardkitError("train.fsdp_sync", f"'per_step' with accumulation under a pipeline runs under 'gpipe' and "
                            f"'circular', not {section.schedule!r} (its stage-by-stage backward gathers a stage's "
                            "FSDP shards itself, once per pass); use pipeline.schedule = 'gpipe' or 'circular', or "
                            "train.fsdp_sync = 'per_microbatch'")
    if section.fsdp_gather != "per_step":
        raise ShardkitError("train.fsdp_sync", "'per_step' with accumulation under a pipeline needs "
                            f"pipeline.fsdp_gather = 'per_step', got {section.fsdp_gather!r} (the stages take the "
                            "weights gathered once per step per FSDP replica only in a region manual over fsdp); use "
                            "pipeline.fsdp_gather = 'per_step' or train.fsdp_sync = 'per_microbatch'")


def microbatch_activation_bytes(layout) -> int:
    """One micro-batch's layer-boundary activation (b x S x D in the compute dtype) as one device holds it: its rows
    split over the batch rule's axes (`data`, `fsdp` and the expert ranks), its tokens over the sequence rule's (the
    context ranks)."""
    recipe = layout.recipe
    shape = layout.mesh.shape
    rows = recipe.train.global_batch // recipe.train.grad_accum // recipe.pipeline.microbatches
    for axis in layout.rules.activations.get("batch", ()):
        rows //= shape.get(axis, 1)
    tokens = recipe.train.seq_len
    for axis in layout.rules.activations.get("sequence", ()):
        tokens //= shape.get(axis, 1)
    return rows * tokens * layout.config.embed * layout.policy.compute_size


def manual_data_axes(layout) -> tuple[str, ...]:
    """The data-parallel axes a pipeline region is manual over besides `pipeline`: ("data",), ("data", "fsdp"),
    ("fsdp",) or ().

    The leading axes of the batch's activation rule among the mesh's axes > 1, as long as each is `data`, or `fsdp`
    under `pipeline.fsdp_gather = "per_step"` (so a replica's rows are one contiguous block and the manual split
    moves nothing); the region then reduces the stage gradients over them once per step. Other axes stay automatic.
    """
    wanted = {"data", "fsdp"} if layout.pipeline.fsdp_gather == "per_step" else {"data"}
    axes = []
    for axis in layout.rules.activations["batch"]:
        if layout.mesh.shape.get(axis, 1) == 1:
            continue
        if axis not in wanted:
            break
        axes.append(axis)
    return tuple(axes)


def fsdp_dim(logical, rules: RuleSet) -> int:
    """The dimension of a parameter (by its logical axis names) that the parameter rules shard over `fsdp`; -1 for
    none (a pytree-friendly "None")."""
    for dim, name in enumerate(logical or ()):
        if name is not None and "fsdp" in rules.params.get(name, ()):
            return dim
    return -1


def stack_fsdp_dims(stacked_state, rules: RuleSet) -> list[int]:
    """`fsdp_dim` of every array leaf of a layer stack's state (in `jax.tree.leaves` order), read from the logical
    names its Flax variables carry; -1 for leaves without them (e.g. the layer index the dropout keys ride on)."""
    leaves = jax.tree.leaves(stacked_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [fsdp_dim(_logical_names(leaf), rules) if isinstance(leaf, nnx.Variable) else -1 for leaf in leaves]


def stack_automatic_specs(stacked_state, region: PipelineRegion, leading: int) -> list[PartitionSpec]:
    """`PipelineRegion.automatic_spec` of every array leaf of a layer stack's state (in `jax.tree.leaves` order), with
    `leading` whole dimensions in front; PartitionSpec() for leaves without logical names."""
    leaves = jax.tree.leaves(stacked_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return [region.automatic_spec(_logical_names(leaf), leading) if isinstance(leaf, nnx.Variable) else PartitionSpec()
            for leaf in leaves]


def _logical_names(variable: nnx.Variable):
    metadata = variable.get_metadata()
    return next((metadata[key] for key in (LOGICAL_AXES, "sharding_names", "sharding") if metadata.get(key)), None)


# ---- the region ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PipelineRegion:
    """What a layout's pipeline region is, derived once (`pipeline_region`): the schedule's shape, the mesh, the data
    axes the region is manual over besides `pipeline`, and the rules inside it (without the manual axes, which cannot
    be named there)."""

    config: PipelineConfig
    mesh: Mesh
    data_axes: tuple[str, ...]
    rules: RuleSet

    @property
    def manual_axes(self) -> set[str]:
        return {PIPELINE, *self.data_axes}

    @property
    def gathers_per_step(self) -> bool:
        """Whether the region gathers the stages' FSDP shards once per step itself (`fsdp` is one of its axes)."""
        return "fsdp" in self.data_axes

    def automatic_spec(self, logical, leading: int = 0) -> PartitionSpec:
        """A parameter's split over the axes the region leaves automatic (e.g. `tensor`), by its logical names (None:
        no split), with `leading` whole dimensions in front (a stage's chunk axis): what a collective written inside the
        region must keep it split over (`shardkit.pipeline.sends.gather_stage`)."""
        sizes = self.mesh.shape
        entries = []
        for name in logical or ():
            axes = tuple(axis for axis in self.rules.params.get(name, ()) if sizes[axis] > 1) if name else ()
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*[None] * leading, *entries)

    @property
    def unrolled(self) -> bool:
        """Whether the loops the backward differentiates inside the region (ticks, a stage's layers) run as Python
        loops (`unrolled_layers` says why): under context and expert parallelism, whose attention and experts are
        regions nested in this one (`shardkit.nested`)."""
        return self.mesh.shape.get(SEQUENCE, 1) > 1 or self.mesh.shape.get(EXPERT, 1) > 1

    def context(self):
        """The model context inside the region: constraints name the region's abstract mesh (where `pipeline` and the
        data axes are Manual) under the inner rules, and a layer stack is a plain scan, or under context parallelism
        a Python loop over the stage's layers (`unrolled_layers` says why)."""
        loop = unrolled_layers if self.unrolled else None
        return model_context(mesh=jax.sharding.get_abstract_mesh(), activation_rules=self.rules.activations,
                             layer_loop=loop)

    def replica_index(self) -> jax.Array | int:
        """This device's data replica inside the region (0 when the region is not manual over `data`)."""
        return jax.lax.axis_index(self.data_axes) if self.data_axes else 0

    def stream_index(self, replica, micro, stage) -> jax.Array:
        """The dropout stream of one (data replica, micro-batch, stage), for `shardkit.nn.dropout_stream`: distinct for
        each, so no two micro-batches (or replicas, which each see only their own rows) draw the same masks, and the
        same in a backward's recompute as in the forward."""
        config = self.config
        return jnp.asarray((replica * config.microbatches + micro) * config.stages + stage).astype(jnp.uint32)


def unrolled_layers(layer_fn, carry, stacked_state):
    """A stage's layers one after another in Python (`shardkit.nn.scan_stack`'s `layer_loop` contract). Why: a
    context-parallel attention region nested in the pipeline's region cannot sit under a differentiated
    `jax.lax.scan`: the scan's partial evaluation cuts the nested region's loop-invariant values out as residuals
    laid out over the enclosing region's manual axes too, which Shardy refuses ("all manual axes must come before free
    axes"; jax 0.10.2). The price is compile time that grows with the layers per stage."""
    layers = jax.tree.leaves(stacked_state)[0].shape[0]
    for index in range(layers):
        carry = layer_fn(carry, jax.tree.map(lambda w: w[index], stacked_state))
    return carry


def pipeline_region(layout) -> PipelineRegion:
    """The layout's pipeline region (a layout whose `pipeline.enabled`)."""
    data_axes = manual_data_axes(layout)
    return PipelineRegion(layout.pipeline, layout.mesh, data_axes, layout.rules.without_axes((PIPELINE, *data_axes)))
