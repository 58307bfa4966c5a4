"""`shardkit suggest`: rank the parallel layouts of a model on a GPU cluster before renting it.

1. Enumerate layouts: mesh sizes over the search axes (`AXIS_OPTIONS`), and for each mesh the remat preset, the
   gradient accumulation, Megatron sequence parallelism and, with a pipeline, the schedule and micro-batch count.
2. Prune with the analytic memory model (`shardkit.analysis.estimate.memory_estimate`) against what one device of the target
   may allocate (`shardkit.analysis.targets.usable_bytes`), and rank what fits by an analytic step time (`step_time`).
3. Compile the best K for the target (the `--target` path of `plan` and `hlo`) and re-rank with the compiled peak
   memory and the compiled collective bytes.

The step-time model, and what it assumes, is `step_time`'s docstring. It is one function of a layout, a target and
an `Exposure` (which seconds of each collective are not hidden behind compute), so a schedule-derived exposure can be
plugged in instead of `assumed_exposure`.

Layouts are evaluated without devices: `planned_mesh` stands in for the mesh, with the shape and a device of the
target's kind, which is all the analytic model reads. Only the compile step needs the `jax[cuda12]` plugin.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tomllib
import types
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from shardkit.units import GIB
from shardkit.errors import ShardkitError
from shardkit.analysis.estimate import (
    CommItem,
    communication_estimate,
    estimate,
    flops_per_step,
    is_transformer,
    memory_estimate,
    pipeline_bubble_fraction,
)
from shardkit.analysis.fit import memory_fraction
from shardkit.analysis.hlo import hlo_summary, human_bytes
from shardkit.analysis.kernels import compute_time, gemm_attention_seconds, output_head_seconds
from shardkit.analysis.nccl import axes_group, stream_seconds
from shardkit.analysis.rates import RATES
from shardkit.analysis.tick_bytes import tick_stage_items
from shardkit.layout import Layout, abstract_model, build_layout, check_layout, check_rule_names, known_logical_names
from shardkit.mesh import resolve_sizes, split_across_hosts
from shardkit.analysis.overlap import exposure_report
from shardkit.analysis.steptime import INTER, INTRA, CommTime, StepTime, format_predicted, replayed_step_time
from shardkit.pipeline import CHUNKED_SCHEDULES, validate_pipeline
from shardkit.analysis.collective_kinds import collective_family
from shardkit.analysis.plan import model_label, precision_summary, analytic_vs_compiled, build_plan, compile_layout, parameter_rows, target_fit
from shardkit.axes import MESH_AXES
from shardkit.recipe import (Recipe, apply_override, builtin_recipes, load_recipe, recipe_from_tables,
                             to_toml)
from shardkit.registry import load_model_class, model_config
from shardkit.rules import build_rules
from shardkit.analysis.targets import Target, usable_bytes
from shardkit.step import check_step_layout

# Remat presets in order of recompute: none and minimal_with_context recompute no matmul, selective reruns the
# attention forward under a fused kernel, full the whole layer. `offload` is left out: its host transfers need a
# real GPU's pinned memory to compile and are not in the time model.
REMAT_ORDER = ("none", "minimal_with_context", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved_1f1b", "zero_bubble")
MICROBATCHES_PER_STAGE = (1, 2, 4, 8)  # pipeline micro-batches tried: p, 2p, 4p, 8p
TP_SP_RULES = ["heads", "kv_heads", "mlp", "vocab", "residual_sequence"]  # recipes/tp_sp.toml's tensor rule
DEFAULT_TOP = 3


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipeline_sizes(config, recipe: Recipe, target: Target) -> list[int]:
    return divisors(config.layers) if hasattr(config, "layers") else [1]


def _sequence_sizes(config, recipe: Recipe, target: Target) -> list[int]:
    # Context parallelism only for attention models; zigzag needs seq_len divisible by 2 x the ring.
    if not is_transformer(config):
        return [1]
    return [d for d in divisors(recipe.train.seq_len) if recipe.train.seq_len % (2 * d) == 0 or d == 1]


def _tensor_sizes(config, recipe: Recipe, target: Target) -> list[int]:
    # Megatron's rule: tensor parallelism stays inside one NVLink domain (a host), where its exposed all-reduces run.
    return divisors(target.per_host)


def _any_size(config, recipe: Recipe, target: Target) -> list[int]:
    return divisors(target.devices)


# Which sizes each mesh axis may take, one line per axis: an axis added to the mesh (e.g. `expert`) is one more line.
AXIS_OPTIONS: dict[str, Callable[[Any, Recipe, Target], list[int]]] = {
    "pipeline": _pipeline_sizes,
    "data": _any_size,
    "fsdp": _any_size,
    "sequence": _sequence_sizes,
    "tensor": _tensor_sizes,
}


# ---- candidates -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout to try: mesh sizes and the knobs that go with them, as recipe overrides."""

    mesh: tuple[tuple[str, int], ...]
    remat: str
    grad_accum: int
    sequence_parallel: bool = False
    microbatches: int = 0  # 0: no pipeline
    schedule: str = ""
    repeats: int = 1

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    def tables(self, base: Mapping[str, Any]) -> dict[str, Any]:
        """The base recipe's TOML tables with this layout written over them."""
        tables = {key: dict(value) if isinstance(value, Mapping) else value for key, value in base.items()}
        tables["mesh"] = {axis: size for axis, size in self.mesh}
        tables.setdefault("train", {}).update(remat=self.remat, grad_accum=self.grad_accum)
        if self.microbatches:
            tables.setdefault("pipeline", {}).update(microbatches=self.microbatches, schedule=self.schedule,
                                                     repeats=self.repeats)
        if self.sequence_parallel:
            tables.setdefault("rules", {})["tensor"] = list(TP_SP_RULES)
        return tables

    def label(self) -> str:
        """`fsdp=4 tensor=2(sp) | remat=full accum=2 | 1f1b m=8`: the axes above 1 and the knobs."""
        axes = " ".join(f"{axis}={size}" + ("(sp)" if axis == "tensor" and self.sequence_parallel else "")
                        for axis, size in self.mesh if size > 1) or "single device"
        knobs = f"remat={self.remat} accum={self.grad_accum}"
        if self.microbatches:
            knobs += f" {self.schedule} m={self.microbatches}" + (f" v={self.repeats}" if self.repeats > 1 else "")
        return f"{axes} | {knobs}"


def mesh_shapes(config, recipe: Recipe, target: Target) -> list[dict[str, int]]:
    """Every assignment of sizes to the search axes that covers the target's devices exactly (axes outside
    `AXIS_OPTIONS` stay 1)."""
    options = [[size for size in AXIS_OPTIONS[axis](config, recipe, target) if target.devices % size == 0]
               for axis in AXIS_OPTIONS]
    shapes = []
    for sizes in itertools.product(*options):
        if math.prod(sizes) == target.devices:
            shape = {axis: 1 for axis in MESH_AXES}
            shape.update(zip(AXIS_OPTIONS, sizes))
            shapes.append(shape)
    return shapes


def pipeline_choices(shape: Mapping[str, int], config, recipe: Recipe) -> list[tuple[int, str, int]]:
    """(micro-batches, schedule, repeats) to try for a mesh: nothing to choose without a pipeline.

    One micro-batch count per schedule, the largest of p, 2p, 4p, 8p that the batch splits into: in the model, more
    micro-batches only shrink the bubble (activations depend on the rows per device, not on m, and 1F1B's on p / m),
    so a smaller m is never ranked higher. The chunked schedules (circular, interleaved_1f1b) run two repeats where
    the layers allow it.
    """
    p = shape["pipeline"]
    if p == 1:
        return [(0, "", 1)]
    replicas = shape["data"] * shape["fsdp"]
    batch = recipe.train.global_batch
    counts = [k * p for k in MICROBATCHES_PER_STAGE if batch % (k * p * replicas) == 0]
    m = max(counts, default=p)
    choices = []
    for schedule in SCHEDULES:
        repeats = 2 if schedule in CHUNKED_SCHEDULES else 1
        if config.layers % (p * repeats) == 0:
            choices.append((m, schedule, repeats))
    return choices


def batch_splits(candidate: "Candidate", batch: int) -> bool:
    """Whether each micro-batch (and pipeline micro-batch) splits over the data x fsdp replicas: checked before a
    recipe is built, since most (mesh, grad_accum) pairs fail here."""
    sizes = candidate.sizes
    rows = batch // candidate.grad_accum
    per_micro = rows // candidate.microbatches if candidate.microbatches else rows
    if candidate.microbatches and rows % candidate.microbatches:
        return False
    return per_micro % (sizes["data"] * sizes["fsdp"]) == 0


def candidate_groups(shape: Mapping[str, int], config, recipe: Recipe) -> Iterable[Candidate]:
    """Per mesh: one candidate (remat `none`, no accumulation) per sequence-parallelism and pipeline choice; the
    remat presets and accumulations are varied on it by `with_knobs`."""
    mesh = tuple((axis, shape[axis]) for axis in MESH_AXES)
    sp_options = (False, True) if shape["tensor"] > 1 and recipe.rules.tensor is None else (False,)
    for sp in sp_options:
        for microbatches, schedule, repeats in pipeline_choices(shape, config, recipe):
            yield Candidate(mesh, "none", 1, sp, microbatches, schedule, repeats)


# ---- layouts without devices ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PlannedDevice:
    """What the analytic model reads of a device: its platform and kind (a compile-only device has the same)."""

    id: int
    process_index: int
    device_kind: str
    platform: str = "gpu"
    client: Any = None


def planned_mesh(sizes: Mapping[str, int], target: Target):
    """A stand-in for `jax.sharding.Mesh` over the target's devices: shape, size and devices, nothing compiled."""
    shape = OrderedDict((axis, sizes[axis]) for axis in MESH_AXES)
    devices = np.array([PlannedDevice(i, i // target.per_host, target.spec.name) for i in range(target.devices)],
                       dtype=object).reshape(tuple(shape.values()))
    return types.SimpleNamespace(shape=shape, size=target.devices, devices=devices, axis_names=MESH_AXES)


@dataclasses.dataclass(frozen=True)
class PlannedLayout(Layout):
    """A Layout whose PartitionSpecs are memoised per (rule table, mesh shape): the search asks for the same ones
    thousands of times. The cache is shared by every layout `dataclasses.replace` derives from one base, i.e. one
    model."""

    spec_cache: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def specs(self, table, table_name: str = "params"):
        key = (table_name, tuple(sorted(table.items())), tuple(self.mesh.shape.items()))
        if key not in self.spec_cache:
            self.spec_cache[key] = super().specs(table, table_name)
        return self.spec_cache[key]


def base_layout(recipe: Recipe):
    """The model's abstract parameters and logical names, once: every candidate's layout shares them."""
    cls = load_model_class(recipe.model.name)
    config = model_config(cls, recipe.model)
    graphdef, abstract_params, logical = abstract_model(cls, config)
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


# ---- memory ---------------------------------------------------------------------------------------------------------
def peak_bytes(layout) -> float:
    """The analytic peak per device (`estimate.memory_estimate`), which prices each pipeline schedule's activations
    by what its compiled program holds: the loop's buffers under gpipe and circular
    (`estimate.loop_schedule_memory_terms`), the tick executor's buffers under 1f1b, interleaved_1f1b and zero_bubble
    (`estimate.tick_schedule_memory_terms`).
    """
    return memory_estimate(layout).total


# ---- step time --------------------------------------------------------------------------------------------------------
# Collectives that XLA's async collectives can run behind the layers' compute (named as `estimate` names them).
OVERLAPPABLE = ("gradients", "parameters, forward", "parameters, backward")


# Exposure(layout, priced collectives, compute seconds) -> exposed seconds, one per collective.
Exposure = Callable[[Any, Sequence[CommTime], float], list[float]]


def collective_seconds(item: CommItem, sizes: Mapping[str, int], target: Target,
                       messages: int = 1) -> tuple[str, float]:
    """(link, seconds) of one stream on the target, as NCCL runs it (`shardkit.analysis.nccl.stream_seconds`, which
    the schedule replay uses too): `messages` collectives of equal size over the stream's group, which spans
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


@dataclasses.dataclass(frozen=True)
class Framework:
    """How the framework running a layout executes it, where frameworks differ in what the step time sees.

    `step_time` prices a layout as shardkit compiles it (`SHARDKIT`, the default); a published run made with another
    framework is priced as that framework runs the same layout (`MEGATRON_SC21`, `LLAMA3`), each field set from the
    framework's code or paper (the sources are beside each instance).

    Attributes:
        name: the framework, as the README names it.
        async_sends: pipeline stage sends run on their own stream beside the next chunk's compute, so only the
            pipeline's fill and drain wait for them (`async_send_exposure`); otherwise every send is waited for.
        split_sends: each tensor-parallel rank sends 1/t of the boundary activation across hosts (Megatron's
            scatter/gather, or a sequence-parallel residual stream); otherwise each sends all of it.
        head_in_a_layer_slot: the output head and loss take one layer's place on the last stage (the embedding one
            on the first), so the stages that set the pace run layers only; otherwise a stage runs its layers and the
            head (shardkit's SPMD region runs it on every stage; Megatron's last stage runs it on top of its layers).
        region_collectives: shardkit's own pipeline-edge collectives exist: the embedded batch's gradient summed
            over `pipeline` and the chunked schedules' re-layout of the layer stack (`estimate._pipeline_items`).
        attention_as_gemms: attention runs as batched GEMMs around a fused softmax and dropout
            (`kernels.gemm_attention_seconds`) instead of the layout's own kernel choice.
        tick_stages: the 1F1B family runs as shardkit's tick executor (shardkit/pipeline/one_f_one_b.py): a backward
            tick re-runs its chunk's forward, the loss runs on the last stage, so each stage moves its own actions'
            bytes (`shardkit.analysis.tick_bytes`) and the busiest stage's are the step's; otherwise every stage
            moves the per-device figure of `estimate.communication_estimate`.
    """

    name: str
    async_sends: bool = False
    split_sends: bool = False
    head_in_a_layer_slot: bool = False
    region_collectives: bool = True
    attention_as_gemms: bool = False
    tick_stages: bool = False


SHARDKIT = Framework("shardkit", tick_stages=True)
# Megatron-LM as run for Narayanan et al. 2021 (SC21, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM"): the interleaved schedule with the scatter/gather optimization (their section 4.1: each tensor
# rank sends 1/t of the activation, then an NVLink all-gather). Its sends block: megatron/p2p_communication.py's
# `_communicate` waits on every `batch_isend_irecv` request, then `torch.cuda.synchronize()` "to protect against race
# condition when using batch_isend_irecv()". Each virtual stage is built in place (`get_model`, one model chunk per
# virtual rank): no re-layout; the head runs on the last stage after its layers, with no layer taken off. Attention
# (megatron/model/transformer.py, ParallelAttention): `torch.baddbmm` for the scores, `scale_mask_softmax` (fused),
# `attention_dropout`, `torch.bmm` with V; no flash kernel then.
MEGATRON_SC21 = Framework("Megatron-LM (SC21)", split_sends=True, region_collectives=False, attention_as_gemms=True)
# Meta's Llama 3 405B training (The Llama 3 Herd of Models, arXiv 2407.21783v3, section 3.3.2): "we adopt
# asynchronous point-to-point communication in PP"; tensor parallelism with sequence parallelism (Korthikanti et
# al. cited), so a boundary activation is cut over the tensor ranks; "we reduce one Transformer layer each from the
# first and the last stages ... the first model chunk on the first stage has only the embedding, and the last model
# chunk on the last stage has only output projection and loss calculation".
LLAMA3 = Framework("Meta Llama 3", async_sends=True, split_sends=True, head_in_a_layer_slot=True,
                   region_collectives=False)
STAGE_SENDS = "stage boundaries (forward + backward)"  # `estimate._pipeline_items`' name for the sends
# shardkit's region-edge collectives, as `estimate._pipeline_items` names them: the tick executor's sum of the
# embedded batch's gradient, GPipe/circular's hand-out of the outputs, and the chunked schedules' re-layout.
REGION_COLLECTIVES = ("embedded batch's gradient", "outputs to every stage, input gradient back",
                      "layers into chunk order, gradients back")


def framework_comm(items: Sequence[CommItem], layout, framework: Framework) -> list[CommItem]:
    """The collectives of `items` that `framework` runs: shardkit's region-edge ones dropped where the framework has
    none, stage sends cut over the tensor ranks where it splits them."""
    if not layout.pipeline.enabled:
        return list(items)
    out = []
    for item in items:
        if item.what in REGION_COLLECTIVES and not framework.region_collectives:
            continue
        if item.what == STAGE_SENDS and framework.split_sends:
            item = dataclasses.replace(item, bytes=item.bytes / layout.mesh.shape["tensor"])
        out.append(item)
    return out


def sends_per_device(layout) -> float:
    """Stage sends one device makes per step: each micro-batch crosses v*p - 1 boundaries forward and as many
    backward (`shardkit.pipeline.collective_permute_bytes`), shared by the p devices of the pipeline."""
    config = layout.pipeline
    transfers = 2 * config.microbatches * (config.repeats * config.stages - 1)
    return transfers * layout.recipe.train.grad_accum / config.stages


def async_send_exposure(layout, sends: CommTime, compute: float) -> float:
    """What asynchronous stage sends leave exposed: in the steady state a send runs beside the next chunk's compute,
    so only the fill and the drain wait for theirs (a micro-batch's activation crosses p - 1 hosts on its way to the
    last stage before it has work, and its gradient p - 1 on the way back: 2(p - 1) sends on the critical path);
    plus whatever the sends need beyond the step's compute (one link per device, on its own stream)."""
    one_send = sends.seconds / sends_per_device(layout)
    critical = 2 * (layout.pipeline.stages - 1) * one_send
    return min(sends.seconds, critical + max(0.0, sends.seconds - compute))


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

    - Compute: one device's kernels (`shardkit.analysis.kernels.compute_time`): GEMMs by shape at the target's
      measured GEMM rate, attention at its fused (or XLA) kernel's rate, memory-bound kernels at HBM bandwidth,
      remat's recompute and, with a pipeline, the head every stage runs.
    - Pipeline bubble: compute x b / (1 - b), b = `estimate.pipeline_bubble_fraction` ((p-1)/(v*m+p-1)).
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
    comm = tuple(dataclasses.replace(c, exposed=e) for c, e in zip(priced, exposed))
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


# ---- ranking --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Ranked:
    """One evaluated layout: analytic figures, then compiled ones once it has been compiled."""

    candidate: Candidate
    recipe: Recipe
    layout: Any
    memory: float
    time: StepTime
    compiled_memory: float | None = None
    compiled_time: StepTime | None = None
    compiled_bytes: dict[str, float] | None = None
    compile_error: str | None = None
    comparison: dict | None = None

    @property
    def best_time(self) -> StepTime:
        return self.compiled_time or self.time

    def fits(self, usable: float) -> bool:
        return (self.compiled_memory if self.compiled_memory is not None else self.memory) <= usable

    def to_json(self, usable: float) -> dict[str, Any]:
        return {
            "layout": self.candidate.label(), "mesh": self.candidate.sizes, "remat": self.candidate.remat,
            "grad_accum": self.candidate.grad_accum, "sequence_parallel": self.candidate.sequence_parallel,
            "pipeline": ({"microbatches": self.candidate.microbatches, "schedule": self.candidate.schedule,
                          "repeats": self.candidate.repeats} if self.candidate.microbatches else None),
            "memory_analytic": self.memory, "memory_compiled": self.compiled_memory,
            "bytes_per_axis_analytic": bytes_per_axis(c.item for c in self.time.comm),
            "bytes_per_axis_compiled": self.compiled_bytes,
            "predicted": self.time.to_json(), "predicted_compiled": self.compiled_time.to_json()
            if self.compiled_time else None,
            "fits": self.fits(usable), "compile_error": self.compile_error,
        }


@dataclasses.dataclass
class Search:
    """What the enumeration saw: layouts tried, rejected by a check, too big; the smallest memory found."""

    meshes: int = 0
    evaluated: int = 0
    invalid: int = 0
    too_big: int = 0
    smallest: tuple[float, str] | None = None
    fewest_replicas: int | None = None  # smallest data x fsdp among the meshes the batch did not split over

    def saw_memory(self, memory: float, candidate: Candidate) -> None:
        if self.smallest is None or memory < self.smallest[0]:
            self.smallest = (memory, candidate.label())


def rank_layouts(recipe: Recipe, target: Target, usable: float) -> tuple[list[Ranked], Search]:
    """Every mesh's fastest fitting variant, fastest first (ties: less memory first).

    Per (mesh, sequence parallelism, pipeline choice) the layout is checked once (shapes, rules, sequence, pipeline);
    then for each remat preset only the smallest `grad_accum` that fits is kept: more accumulation never removes
    compute and repeats FSDP's gathers and the pipeline's fill per micro-batch.
    """
    base = base_layout(recipe)
    search = Search()
    best: dict[tuple, Ranked] = {}
    for shape in mesh_shapes(base.config, recipe, target):
        search.meshes += 1
        for candidate in candidate_groups(shape, base.config, recipe):
            layout = _checked_layout(base, recipe, candidate, target, search)
            if layout is None:
                continue
            for remat in REMAT_ORDER:
                ranked = _smallest_accumulation_that_fits(layout, candidate, remat, target, usable, search)
                if ranked is not None and (candidate.mesh not in best or _order(ranked) < _order(best[candidate.mesh])):
                    best[candidate.mesh] = ranked
    return sorted(best.values(), key=_order), search


def _order(ranked: Ranked) -> tuple[float, float]:
    return (ranked.best_time.total, ranked.compiled_memory or ranked.memory)


def _checked_layout(base, recipe: Recipe, candidate: Candidate, target: Target, search: Search):
    """The candidate's layout with every structural check passed, or None (counted) when one fails."""
    if not batch_splits(candidate, recipe.train.global_batch):  # without accumulation: the largest micro-batch
        replicas = candidate.sizes["data"] * candidate.sizes["fsdp"]
        search.fewest_replicas = min(search.fewest_replicas or replicas, replicas)
        search.invalid += 1
        return None
    try:
        candidate_recipe = recipe_from_tables(candidate.tables(recipe.raw), name=recipe.name)
        return candidate_layout(base, candidate_recipe, target)
    except ShardkitError:
        search.invalid += 1
        return None


def _smallest_accumulation_that_fits(layout, candidate: Candidate, remat: str, target: Target, usable: float,
                                     search: Search) -> Ranked | None:
    """The first `grad_accum` (ascending) whose layout passes the step's checks and fits, under one remat preset."""

    batch = layout.recipe.train.global_batch
    for accum in divisors(batch):
        variant = dataclasses.replace(candidate, remat=remat, grad_accum=accum)
        if not batch_splits(variant, batch):
            break  # smaller micro-batches only split worse
        train = dataclasses.replace(layout.recipe.train, remat=remat, grad_accum=accum)
        recipe = dataclasses.replace(layout.recipe, train=train)
        variant_layout = dataclasses.replace(layout, recipe=recipe)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                validate_pipeline(recipe, getattr(layout.config, "layers", None), dict(layout.mesh.shape))
            check_step_layout(variant_layout)
        except ShardkitError:
            search.invalid += 1
            continue
        search.evaluated += 1
        memory = peak_bytes(variant_layout)
        search.saw_memory(memory, variant)
        if memory <= usable:
            return Ranked(variant, recipe, variant_layout, memory, step_time(variant_layout, target))
        search.too_big += 1
    return None


# ---- compiling the best K ---------------------------------------------------------------------------------------------
def compile_ranked(ranked: Ranked, target: Target, devices: Sequence) -> None:
    """Compile a layout for the target and fill in its compiled peak, collective bytes and re-priced step time."""
    try:
        layout = build_layout(ranked.recipe, devices)
        compiled = compile_layout(layout)
    except ShardkitError as err:
        ranked.compile_error = str(err)
        return
    except Exception as err:  # noqa: BLE001 - XLA's compile errors come in several runtime types
        ranked.compile_error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        return
    ranked.comparison = analytic_vs_compiled(layout, compiled)
    peak = [row["compiled"] for row in ranked.comparison["memory"] if row["what"] == "peak"]
    ranked.compiled_memory = peak[0] if peak else None
    items = compiled_comm(analytic_comm(layout), hlo_summary(compiled, layout.mesh).collectives.ops)
    ranked.compiled_bytes = bytes_per_axis(items)
    ranked.compiled_time = replayed_step_time(exposure_report(compiled, layout.mesh, target), layout, target)
    ranked.layout = layout


def compiled_comm(analytic: Sequence[CommItem], ops) -> list[CommItem]:
    """The analytic collectives rescaled to the compiled program's bytes, per (family, mesh axes) as `plan` compares
    them; compiled collectives with no analytic counterpart (e.g. the embedding's all-to-all) added as they are."""
    def key(kind, axes):
        return collective_family(kind), tuple(sorted(axes or ()))

    compiled: dict[tuple, float] = {}
    kinds: dict[tuple, tuple[str, tuple[str, ...], int]] = {}
    for op in ops:
        if op.group_size > 1 and op.branch is None:
            k = key(op.kind, op.axes)
            compiled[k] = compiled.get(k, 0.0) + op.count * op.bytes
            kinds.setdefault(k, (op.kind, tuple(op.axes or ()), op.group_size))
    expected: dict[tuple, float] = {}
    for item in analytic:
        k = key(item.kind, item.axes)
        expected[k] = expected.get(k, 0.0) + item.bytes
    items = [dataclasses.replace(item, bytes=item.bytes * compiled.get(key(item.kind, item.axes), 0.0)
                                 / expected[key(item.kind, item.axes)])
             for item in analytic if expected[key(item.kind, item.axes)] > 0]
    for k, total in compiled.items():
        if k not in expected:
            kind, axes, group = kinds[k]
            items.append(CommItem(_compiled_role(k[0], axes), kind, axes, total, group))
    return items


def _compiled_role(family: str, axes: tuple[str, ...]) -> str:
    """What a compiled collective with no analytic counterpart most likely is, in `OVERLAPPABLE`'s names: XLA may
    split a gradient reduction over data x fsdp into one per axis, or gather parameters over a different axis set;
    those overlap like their analytic counterparts. Anything else is counted as exposed."""
    replica_axes = {"data", "fsdp", "sequence"}
    if axes and set(axes) <= replica_axes and family == "reduction":
        return "gradients"
    if axes and set(axes) <= replica_axes and family == "all-gather":
        return "parameters, backward"
    return f"compiled only: {family} over {'+'.join(axes) or 'unmapped devices'}"


# ---- the whole command ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Suggestion:
    """The result of `suggest`: the target, usable memory, ranked layouts (best first) and the search's counts."""

    recipe: Recipe
    target: Target
    usable: float
    ranked: list[Ranked]
    search: Search
    compiled: int = 0

    @property
    def winner(self) -> Ranked:
        fitting = [r for r in self.ranked if r.fits(self.usable) and r.compile_error is None]
        return fitting[0] if fitting else self.ranked[0]

    def to_json(self, top: int) -> dict[str, Any]:
        return {
            "target": str(self.target), "devices": self.target.devices, "usable_bytes": self.usable,
            "model": {"name": self.recipe.model.name, "preset": self.recipe.model.preset},
            "global_batch": self.recipe.train.global_batch, "seq_len": self.recipe.train.seq_len,
            "precision": self.recipe.precision.policy,
            "searched": dataclasses.asdict(self.search), "compiled": self.compiled,
            "ranked": [r.to_json(self.usable) for r in self.ranked[:max(top, self.compiled)]],
            "winner": self.winner.candidate.label(), "assumptions": ASSUMPTIONS,
        }


ASSUMPTIONS = (
    "compute: one device's kernels (GEMMs at achieved rates by shape (rates.GEMM_TABLE), cuDNN attention at 347, "
    "memory-bound kernels at 0.8 x HBM bandwidth) x one overhead calibrated on MaxText's Llama2-7B (kernels.OVERHEAD)",
    "analytic ranking: FSDP gathers and gradient reduce-scatters overlap compute except one layer's share and what "
    "exceeds the pass's compute; gradient all-reduces (over data), tensor-parallel, pipeline, context-parallel and "
    "ZeRO/per-step gathers are exposed",
    "compiled layouts: the replay of XLA's schedule decides (same kernel and collective prices, overlap as scheduled)",
    "collectives as NCCL runs them: latency per collective and ring step, NVLink inside a node, a node's NICs shared "
    "by its GPUs across nodes, tree all-reduce over more than two nodes; gradients reduced in the dtype the first "
    "line states (precision.grad_reduce); "
    "device order: tensor innermost, hosts on pipeline, then data, fsdp, sequence",
)


def load_base(recipe_or_preset: str, overrides: Sequence[str]) -> Recipe:
    """A recipe file or built-in recipe name (`fsdp_tp`), or a model preset name (the default recipe with that
    `model.preset`), with `--set` overrides."""
    is_recipe = Path(recipe_or_preset).is_file() or recipe_or_preset.endswith(".toml")
    if is_recipe or recipe_or_preset in builtin_recipes():
        return load_recipe(recipe_or_preset, list(overrides))
    tables: dict[str, Any] = {"model": {"preset": recipe_or_preset}}
    for override in overrides:
        apply_override(tables, override)
    return recipe_from_tables(tables, name=recipe_or_preset)


def suggest(recipe: Recipe, target: Target, top: int = DEFAULT_TOP, compile_devices: Sequence | None = None,
            fraction: float | None = None, log: Callable[[str], None] = lambda line: None) -> Suggestion:
    """Rank the layouts of `recipe`'s model, batch and sequence on `target`, compiling the best `top` when
    `compile_devices` (the target's compile-only devices) are given.

    Raises:
        ShardkitError: no layout can split the batch, or no layout fits (naming the smallest memory found).
    """
    usable = float(usable_bytes(target.gpu, memory_fraction() if fraction is None else fraction))
    ranked, search = rank_layouts(recipe, target, usable)
    if not ranked:  # said in one line, without the progress lines
        raise _nothing_fits(recipe, target, usable, search)
    log(f"searched {search.meshes} meshes, {search.evaluated} layouts ({search.invalid} rejected by a check, "
        f"{search.too_big} too big for {usable / GIB:.2f} GiB); {len(ranked)} meshes fit")
    suggestion = Suggestion(recipe, target, usable, ranked, search)
    if compile_devices is not None and top > 0:
        for position, item in enumerate(ranked[:top]):
            log(f"compiling {position + 1}/{min(top, len(ranked))} for {target}: {item.candidate.label()}")
            compile_ranked(item, target, compile_devices)
        suggestion.compiled = min(top, len(ranked))
        head = sorted(ranked[:top], key=lambda r: (not r.fits(usable) or r.compile_error is not None, _order(r)))
        suggestion.ranked = head + ranked[top:]
    return suggestion


def smallest_batch_multiple(recipe: Recipe, target: Target) -> int | None:
    """The smallest batch multiple some layout can split: data x fsdp (x p micro-batches with a pipeline) over the
    layouts that pass every check when the batch is large, None when none does (the model cannot be laid out)."""
    tables = {key: dict(value) if isinstance(value, Mapping) else value for key, value in recipe.raw.items()}
    tables.setdefault("train", {})["global_batch"] = target.devices * max(MICROBATCHES_PER_STAGE) * 2
    probe = recipe_from_tables(tables, name=recipe.name)
    base = base_layout(probe)
    needs = []
    for shape in mesh_shapes(base.config, probe, target):
        for candidate in candidate_groups(shape, base.config, probe):
            if _checked_layout(base, probe, candidate, target, Search()) is not None:
                needs.append(shape["data"] * shape["fsdp"] * shape["pipeline"])  # at least p micro-batches
    return min(needs, default=None)


def _nothing_fits(recipe: Recipe, target: Target, usable: float, search: Search) -> ShardkitError:
    train = recipe.train
    if search.evaluated == 0:
        multiple = smallest_batch_multiple(recipe, target)
        hint = f"; use a global_batch that is a multiple of {multiple}" if multiple else ""
        return ShardkitError("train.global_batch", f"no layout of {target.devices} devices can split a batch of "
                             f"{train.global_batch} sequences of {train.seq_len}: data x fsdp must divide the batch "
                             f"and tensor (<= {target.per_host}, within a host), pipeline (dividing the layers) and "
                             f"sequence (dividing seq_len / 2) cover the rest{hint}")
    smallest, label = search.smallest
    devices_needed = math.ceil(target.devices * smallest / usable)
    return ShardkitError("memory", f"no layout of model {recipe.model.preset} fits on {target}: the smallest analytic "
                         f"peak found is {smallest / GIB:.2f} GiB per device ({label}) against {usable / GIB:.2f} GiB "
                         f"usable, {(smallest - usable) / GIB:.2f} GiB more than there is; it would need about "
                         f"{devices_needed} devices, a GPU with more memory, or a smaller train.global_batch / "
                         f"train.seq_len (now {train.global_batch} x {train.seq_len})")


# ---- output ----------------------------------------------------------------------------------------------------------
def format_suggestion(suggestion: Suggestion, top: int) -> str:
    """The ranked table: layout, memory analytic/compiled, bytes per axis, predicted time and MFU, fits."""
    usable = suggestion.usable
    r = suggestion.recipe
    lines = [f"suggest for {model_label(r.model)} on {suggestion.target} ({suggestion.target.devices} x "
             f"{suggestion.target.spec.name}, {usable / GIB:.2f} GiB usable each): global_batch {r.train.global_batch} "
             f"x seq {r.train.seq_len}, precision {r.precision.policy} (gradients reduced in "
             f"{r.precision.parsed.grad_reduce_dtype}, precision.grad_reduce={r.precision.grad_reduce})",
             f"searched {suggestion.search.meshes} meshes, {suggestion.search.evaluated} layouts; "
             f"{len(suggestion.ranked)} meshes fit; compiled the first {suggestion.compiled}", ""]
    header = ("#", "layout", "mem analytic", "mem compiled", "bytes/step per axis", "step s", "MFU", "fits")
    rows = [header]
    shown = suggestion.ranked[:max(top, suggestion.compiled)]
    for index, item in enumerate(shown, 1):
        per_axis = item.compiled_bytes if item.compiled_bytes is not None else bytes_per_axis(
            c.item for c in item.time.comm)
        axes = ", ".join(f"{axis} {human_bytes(value)}" for axis, value in sorted(per_axis.items()) if value) or "-"
        compiled = human_bytes(item.compiled_memory) if item.compiled_memory is not None else (
            "error" if item.compile_error else "-")
        time = item.best_time
        rows.append((str(index), item.candidate.label(), human_bytes(item.memory), compiled, axes,
                     f"{time.total:.3f}", f"{time.mfu:.1%}", "yes" if item.fits(usable) and not item.compile_error
                     else "no"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    lines += [""] + [f"assumed: {text}" for text in ASSUMPTIONS]
    errors = [(i, item.compile_error) for i, item in enumerate(shown, 1) if item.compile_error]
    lines += [f"#{i} did not compile: {error}" for i, error in errors]
    winner = suggestion.winner
    lines += [f"#{i} {format_predicted(item.compiled_time, suggestion.target)}"
              for i, item in enumerate(shown, 1) if item.compiled_time is not None]
    lines.append(f"winner: {winner.candidate.label()}: predicted {winner.best_time.total:.3f} s/step "
                 f"(compute {winner.best_time.compute:.3f}, bubble {winner.best_time.bubble:.3f}, exposed "
                 f"communication {winner.best_time.exposed:.3f}), MFU {winner.best_time.mfu:.1%}")
    return "\n".join(lines)


def recipe_toml(suggestion: Suggestion, path: str | Path) -> str:
    """The winner as a recipe file: the base recipe's tables with the layout written over them."""
    winner = suggestion.winner
    tables = winner.candidate.tables(suggestion.recipe.raw)
    tables.setdefault("model", {}).update(name=suggestion.recipe.model.name, preset=suggestion.recipe.model.preset)
    tables.setdefault("train", {}).update(global_batch=suggestion.recipe.train.global_batch,
                                         seq_len=suggestion.recipe.train.seq_len)
    tables.setdefault("precision", {})["policy"] = suggestion.recipe.precision.policy
    header = [f"shardkit train {path}",
              f"Written by `shardkit suggest --target {suggestion.target}`: {winner.candidate.label()}; predicted "
              f"{winner.best_time.total:.3f} s/step, MFU {winner.best_time.mfu:.1%}, "
              f"{(winner.compiled_memory or winner.memory) / GIB:.2f} GiB per device "
              f"({'compiled' if winner.compiled_memory is not None else 'analytic'})."]
    return to_toml(tables, header, field="--write")


def winner_plan(suggestion: Suggestion) -> dict[str, Any]:
    """The `plan --json` object of the winner, with the analytic estimate, its compiled figures when it was compiled,
    and the fit on the target; a winner that was not compiled has a planned mesh, whose device table is its shape's."""

    winner = suggestion.winner
    layout = winner.layout
    if isinstance(layout.mesh, types.SimpleNamespace):
        rows = parameter_rows(layout)
        devices = [{"device": layout.mesh.devices[coord].id, "global_rank": rank,
                    "process": layout.mesh.devices[coord].process_index, **dict(zip(layout.mesh.shape, coord))}
                   for rank, coord in enumerate(np.ndindex(layout.mesh.devices.shape))]
        plan = {"recipe": layout.recipe.name, "model": {"name": layout.recipe.model.name,
                                                        "preset": layout.recipe.model.preset, **vars(layout.config)},
                "model_label": model_label(layout.recipe.model),
                "precision": precision_summary(layout),
                "mesh": dict(layout.mesh.shape), "params": rows, "devices": devices, "pipeline": None,
                "totals": {"parameters": sum(math.prod(r["shape"]) for r in rows),
                           "param_bytes": sum(r["bytes"] for r in rows),
                           "param_bytes_per_device": sum(r["device_bytes"] for r in rows)}}
    else:
        plan = build_plan(layout)
    plan["estimate"] = estimate(layout)
    if winner.comparison is not None:
        plan["compiled"] = winner.comparison
    plan["fit"] = target_fit(plan, suggestion.target)
    return plan


def write_recipe(suggestion: Suggestion, path: str | Path) -> None:
    """Write the winner's recipe, after checking that it loads back as the same layout."""
    text = recipe_toml(suggestion, path)
    recipe_from_tables(tomllib.loads(text), name=Path(path).stem)  # what `train` will read
    Path(path).write_text(text)
