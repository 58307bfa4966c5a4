"""The analytic step time `shardkit suggest` ranks layouts by: compute (`shardkit.analysis.predicted.kernels`), the
pipeline bubble and the exposed part of each collective as NCCL runs it (`shardkit.analysis.predicted.nccl`), under an
`Exposure` of what hides behind compute. `step_time`'s docstring states what it assumes. A compiled layout is priced by
the replay of its schedule instead (`shardkit.analysis.predicted.overlap`), with the same kernel and collective prices.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping, Sequence

from shardkit.analysis.predicted.comm_terms import CommItem, pipeline_bubble_fraction
from shardkit.analysis.predicted.estimate import communication_estimate
from shardkit.analysis.predicted.flops import flops_per_step
from shardkit.analysis.predicted.frameworks import SHARDKIT, STAGE_SENDS, Framework, async_send_exposure, framework_comm
from shardkit.analysis.predicted.kernels import compute_time, gemm_attention_seconds, output_head_seconds
from shardkit.analysis.predicted.nccl import axes_group, stream_seconds
from shardkit.analysis.predicted.rates import RATES
from shardkit.analysis.predicted.steptime import INTER, INTRA, CommTime, StepTime
from shardkit.analysis.predicted.targets import Target
from shardkit.analysis.predicted.tick_bytes import tick_stage_items

# Collectives that XLA's async collectives can run behind the layers' compute (named as `estimate` names them).
OVERLAPPABLE = ("gradients", "parameters, forward", "parameters, backward")


# Exposure(layout, priced collectives, compute seconds) -> exposed seconds, one per collective.
Exposure = Callable[[Any, Sequence[CommTime], float], list[float]]


def collective_seconds(item: CommItem, sizes: Mapping[str, int], target: Target,
                       messages: int = 1) -> tuple[str, float]:
    """(link, seconds) of one stream on the target, as NCCL runs it (`shardkit.analysis.predicted.nccl.stream_seconds`,
    which the schedule replay uses too): `messages` collectives of equal size over the stream's group, which spans
    `Target.host_split`'s hosts of its axes with the rest of the group on each host."""
    per_host, across = target.host_split(sizes)
    group = axes_group(item.axes, per_host, across)
    seconds = stream_seconds(item.kind, item.bytes, item.group_size, group, target.fabric, messages)
    return (INTER if group.nodes > 1 else INTRA), seconds


def stream_messages(item: CommItem, layout) -> int:
    """How many collectives a stream is made of, for the latency term: one per layer and micro-batch for per-layer
    streams (FSDP gathers, gradient reductions, context parallelism), four per layer and micro-batch for tensor
    parallelism, one per micro-batch and stage boundary for pipeline sends; one for anything else."""
    layers = max(getattr(layout.config, "layers", 1) // layout.mesh.shape["pipeline"], 1)
    accum = layout.recipe.train.grad_accum
    if "tensor" in item.axes and "layer activations" in item.what:
        return 4 * layers * accum // (2 if "SP" in item.what else 1)
    if "context parallel" in item.what:
        return layers * accum
    if item.kind == "collective-permute":
        return 2 * max(layout.pipeline.microbatches, 1) * accum
    if item.what in OVERLAPPABLE:
        return layers * (accum if item.what != "gradients" else 1)
    if item.what == "gradients":
        return layers
    return 1


def hidden_by_layers(item: CommItem) -> bool:
    """Whether `assumed_exposure` lets a stream run behind the layers' compute: FSDP's gathers and the gradients'
    reduce-scatters, not the gradients' all-reduces."""
    return item.what in OVERLAPPABLE and not (item.what == "gradients" and item.kind == "all-reduce")


def assumed_exposure(layout, comm: Sequence[CommTime], compute: float) -> list[float]:
    """What is assumed to overlap (the default `Exposure`).

    - FSDP parameter all-gathers and gradient reductions (reduce-scatter or all-reduce over data/fsdp/sequence) run
      behind the layers' compute: the forward gathers behind the forward (a third of the compute), the backward
      gathers and gradient reductions behind the backward (two thirds). Exposed: one layer's share of each (the
      first layer's gather has nothing before it to hide behind, the last layer's reduction nothing after it), plus
      whatever exceeds the compute of its pass.
    - Gradient all-reduces (over `data`) are exposed: XLA:GPU combines a layer's into one, issued at the end of the
      backward loop's iteration and waited for before the next (compiled for h100:2x4, data=2 x fsdp=4: 97% of
      their time exposed; zero1 on h100x8: 88%), and under accumulation they run once after the last micro-batch.
    - Everything else is exposed: tensor-parallel all-reduces (or SP gathers/scatters) sit between matmuls that need
      their result; pipeline sends and the pipeline's output all-reduce are on the critical path; ZeRO's and per-step
      FSDP's parameter all-gathers sit at the step's edge; context parallelism's K/V gathers precede attention.
    """
    layers = max(getattr(layout.config, "layers", 1) // layout.mesh.shape["pipeline"], 1)
    exposed = [c.seconds for c in comm]
    passes = {"forward": compute / 3, "backward": 2 * compute / 3}
    for pass_name, budget in passes.items():
        members = [i for i, c in enumerate(comm) if hidden_by_layers(c.item)
                   and (c.item.what == "parameters, forward") == (pass_name == "forward")]
        edge = sum(comm[i].seconds for i in members) / layers
        hidden_need = sum(comm[i].seconds for i in members) - edge
        overflow = max(0.0, hidden_need - budget)
        for i in members:
            share = comm[i].seconds / max(sum(comm[j].seconds for j in members), 1e-30)
            exposed[i] = comm[i].seconds / layers + overflow * share
    return exposed


def analytic_comm(layout, framework: Framework = SHARDKIT) -> list[CommItem]:
    """`estimate.communication_estimate` (context parallelism's traffic included), with tensor-parallel traffic
    repeated by full remat's recomputed forward (two of its four collectives per layer run again); under the 1F1B
    family as `framework` runs it with shardkit's tick executor (`Framework.tick_stages`), the busiest stage's
    collectives instead (`tick_bytes.tick_stage_items`, which counts the ticks' recompute and remat's own)."""
    if framework.tick_stages and layout.pipeline.one_f_one_b:
        return max(tick_stage_items(layout), key=lambda stage: sum(item.bytes for item in stage))
    items = []
    for item in communication_estimate(layout):
        if "tensor" in item.axes and layout.recipe.train.remat == "full":
            item = dataclasses.replace(item, bytes=item.bytes * 1.5)
        items.append(item)
    return items


def step_time(layout, target: Target, comm_items: Sequence[CommItem] | None = None,
              exposure: Exposure = assumed_exposure, framework: Framework = SHARDKIT) -> StepTime:
    """The analytic step time of a layout on a target: what ranks the layouts before any compile.

    - Compute: one device's kernels (`shardkit.analysis.predicted.kernels.compute_time`): GEMMs by shape at the target's
      measured GEMM rate, attention at its fused (or XLA) kernel's rate, memory-bound kernels at HBM bandwidth,
      remat's recompute and, with a pipeline, the head every stage runs.
    - Pipeline bubble: compute x b / (1 - b), b = `comm_terms.pipeline_bubble_fraction` ((p-1)/(v*m+p-1)).
    - Collectives: `collective_seconds` (NCCL's ring or tree, its latency per collective and step, the nodes' NICs
      shared by their GPUs); which seconds are exposed is `exposure`'s (default `assumed_exposure`).
    - The layout as `framework` runs it (default `SHARDKIT`, as shardkit compiles it): which pipeline collectives it
      has (`framework_comm`), whether its stage sends hide behind compute (`async_send_exposure`), whether the stage
      that sets the pace runs the output head, and its attention kernel (`stage_compute_seconds`).

    Args:
        layout: a layout (on a planned or a real mesh).
        target: the cluster.
        comm_items: the collectives to price (default: `analytic_comm`); the compiled re-rank passes its own.
        exposure: which seconds of each collective are not hidden behind compute.
        framework: the framework that runs the layout (`Framework`): shardkit, or a published run's.
    """
    spec = target.spec
    compute = stage_compute_seconds(layout, target, framework)
    bubble_fraction = pipeline_bubble_fraction(layout) or 0.0
    bubble = compute * bubble_fraction / (1 - bubble_fraction)
    sizes = dict(layout.mesh.shape)
    items = framework_comm(analytic_comm(layout, framework) if comm_items is None else comm_items, layout,
                           framework)
    priced = [CommTime(item, *collective_seconds(item, sizes, target, stream_messages(item, layout)))
              for item in items]
    exposed = exposure(layout, priced, compute)
    if framework.async_sends and layout.pipeline.enabled:
        exposed = [async_send_exposure(layout, c, compute) if c.item.what == STAGE_SENDS else e
                   for c, e in zip(priced, exposed)]
    comm = tuple(CommTime(c.item, c.link, c.seconds, e) for c, e in zip(priced, exposed))
    return StepTime(compute, bubble, comm, flops_per_step(layout), layout.mesh.size, spec.peak_bf16_flops)


def stage_compute_seconds(layout, target: Target, framework: Framework = SHARDKIT) -> float:
    """One device's kernel seconds per step (`kernels.compute_time`), on the stage that sets the pipeline's pace:
    attention as `framework` runs it, and without the output head where `framework` gives the head a layer's slot on
    the last stage (the priced layout then counts that slot among its layers)."""
    rates = RATES[target.gpu]
    kernels = compute_time(layout, rates)
    compute = kernels.total
    if framework.attention_as_gemms:
        compute += gemm_attention_seconds(layout, rates) - kernels.attention
    if framework.head_in_a_layer_slot and layout.pipeline.enabled:
        compute -= output_head_seconds(layout, rates).total
    return compute


def bytes_per_axis(items: Iterable[CommItem]) -> dict[str, float]:
    """Full-buffer bytes per step by mesh axes ('data+fsdp' for a collective over both)."""
    out: dict[str, float] = {}
    for item in items:
        key = "+".join(item.axes) or "unmapped"
        out[key] = out.get(key, 0.0) + item.bytes
    return out
