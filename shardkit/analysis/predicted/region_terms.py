"""Context- and expert-parallel traffic inside a pipeline's stages (shardkit/nested.py: the context-parallel attention
and the experts' all-to-all run as regions nested in the stage region).

What a pipeline changes about them, from what the schedules run and hold:

- Passes. A loop schedule (gpipe, circular) is one SPMD program: every tick runs its chunk on every stage, the
  bubble's ticks included, so a device runs its chunk's layers `forward_ticks` times (T = m*v + p - 1) where the
  micro-batches need m*v; and every tick is rematerialised (its checkpoint keeps only the tick's input), so each
  layer's forward runs again in the backward whatever `train.remat` says. The 1F1B family's executor switches
  between branches, so an idle tick runs nothing, and its backward recomputes the stage from the stored input too.
- Replicas. Under a pipeline the context and expert ranks hold replicas of the stage's weights
  (`shardkit.rules.without_shared_fsdp_ranks`), and the stage region is manual over `pipeline` (and `data`) only: the
  stage's weight gradients made by one tick's backward are summed over those replica ranks inside that tick, before
  the tick loop adds them to its carry. A loop schedule runs T backward ticks, so T such all-reduces of the stage's
  weights (whole over `fsdp`: the stage works on its gathered copy; the expert weights, split over `expert`, are not
  replicas there) replace the one reduction per step a layout without a pipeline makes over those ranks.
"""

from __future__ import annotations

import dataclasses

from shardkit.analysis.predicted.comm_terms import CommItem
from shardkit.analysis.predicted.memory_terms import expert_elements_per_device, replica_elements_by_role

# Items whose bytes are one pass of each layer per micro-batch (forward and backward), priced per step.
CONTEXT_LAYER_ITEMS = ("K/V (context parallel)", "dK/dV (context parallel)")
ZIGZAG_ITEM = "queries and output to zigzag order and back (causal context parallel)"
EXPERT_ALL_TO_ALL = "tokens to experts and back (dispatch, combine; forward, backward)"


def layer_pass_ratio(layout) -> float:
    """Layer passes a device runs per pass the micro-batches need: T / (m*v) under the loop schedules, 1 under the
    1F1B family (idle ticks run nothing) and without a pipeline."""
    config = layout.pipeline
    if not config.enabled or config.one_f_one_b:
        return 1.0
    return config.forward_ticks / config.items


def recomputes_forward(layout) -> bool:
    """Whether each layer's forward runs again in the backward: under every pipeline schedule (the ticks are
    rematerialised), else where `train.remat` recomputes."""
    return layout.pipeline.enabled or layout.recipe.train.remat != "none"


def pipelined_region_items(layout, items: list[CommItem]) -> list[CommItem]:
    """`items` (the step's collectives as a layout without a pipeline makes them, per stage) with the context- and
    expert-parallel traffic as the pipeline's stages make it (module docstring): the per-layer collectives scaled by
    `layer_pass_ratio`, the forward's ones again for the recompute, and the replica ranks' gradient sums per tick."""
    if not layout.pipeline.enabled:
        return items
    shape = layout.mesh.shape
    ratio = layer_pass_ratio(layout)
    plain_remat = layout.recipe.train.remat != "none"
    out = []
    for item in items:
        if item.what in CONTEXT_LAYER_ITEMS:
            # The K/V gather of the recompute serves the backward: two gathers a layer pass either way.
            item = dataclasses.replace(item, bytes=item.bytes * ratio)
        elif item.what == ZIGZAG_ITEM:
            # Forward, backward, and the recompute's reorders (counted already where `train.remat` recomputes).
            phases = 1.0 if plain_remat else 3 / 2
            item = dataclasses.replace(item, bytes=item.bytes * ratio * phases)
        elif item.what == EXPERT_ALL_TO_ALL:
            # Dispatch and combine, forward and backward: 4 buffers, 6 with the recompute's.
            phases = 1.0 if plain_remat else 6 / 4
            item = dataclasses.replace(item, bytes=item.bytes * ratio * phases)
        elif _stage_replica_reduction(item, shape):
            continue  # replaced by the per-tick sums below
        out.append(item)
    out.extend(tick_replica_gradient_items(layout))
    return out


def _stage_replica_reduction(item: CommItem, shape) -> bool:
    """The once-per-step reduction of the layers' fsdp shard over the context or expert ranks alone."""
    return (item.kind == "all-reduce" and item.axes in (("sequence",), ("expert",))
            and item.what in ("gradients", "gradients (outside the experts, fsdp shard)"))


def tick_replica_gradient_items(layout) -> list[CommItem]:
    """Per backward tick, the stage's layer gradients summed over the context ranks (all of the stage's weights) and
    over the expert ranks (all but the expert weights), in the gradient-reduction dtype (`Policy.grad_reduce_size`):
    T reductions under the loop schedules, one per micro-batch and chunk under the 1F1B family."""
    config, shape = layout.pipeline, layout.mesh.shape
    ticks = config.items if config.one_f_one_b else config.forward_ticks
    size = layout.policy.grad_reduce_size
    stage = replica_elements_by_role(layout)["layers"] / config.chunks
    out = []
    if shape["sequence"] > 1:
        out.append(CommItem("stage gradients over the context ranks, per tick", "all-reduce", ("sequence",),
                            ticks * stage * size, shape["sequence"]))
    if shape.get("expert", 1) > 1 and hasattr(layout.config, "experts"):
        experts = expert_elements_per_device(layout) / config.chunks
        out.append(CommItem("stage gradients outside the experts over the expert ranks, per tick", "all-reduce",
                            ("expert",), ticks * (stage - experts) * size, shape["expert"]))
    return out
