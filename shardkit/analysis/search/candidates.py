"""The layouts `shardkit suggest` searches: mesh sizes over the search axes (`AXIS_OPTIONS`), and for each mesh
the remat preset, Megatron sequence parallelism and, with a pipeline, the schedule and micro-batch count.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Iterable, Mapping

from shardkit.analysis.predicted.flops import is_transformer
from shardkit.analysis.predicted.targets import Target
from shardkit.axes import MESH_AXES
from shardkit.pipeline import CHUNKED_SCHEDULES
from shardkit.recipe import Recipe

# Remat presets in order of recompute: none and minimal_with_context recompute no matmul, selective reruns the
# attention forward under a fused kernel, full the whole layer. `offload` is left out: its host transfers need a
# real GPU's pinned memory to compile and are not in the time model.
REMAT_ORDER = ("none", "minimal_with_context", "selective", "full")


SCHEDULES = ("gpipe", "1f1b", "circular", "interleaved_1f1b", "zero_bubble")


MICROBATCHES_PER_STAGE = (1, 2, 4, 8)  # pipeline micro-batches tried: p, 2p, 4p, 8p


TP_SP_RULES = ["heads", "kv_heads", "mlp", "vocab", "residual_sequence"]  # recipes/tp_sp.toml's tensor rule


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


def _expert_sizes(config, recipe: Recipe, target: Target) -> list[int]:
    # Expert parallelism only for mixture-of-experts models: each expert rank holds a whole number of experts.
    experts = getattr(config, "experts", 0)
    return [d for d in divisors(experts) if d <= target.devices] if experts else [1]


def _any_size(config, recipe: Recipe, target: Target) -> list[int]:
    return divisors(target.devices)


# Which sizes each mesh axis may take, one line per axis: an axis added to the mesh (e.g. `expert`) is one more line.
AXIS_OPTIONS: dict[str, Callable[[Any, Recipe, Target], list[int]]] = {
    "pipeline": _pipeline_sizes,
    "data": _any_size,
    "fsdp": _any_size,
    "sequence": _sequence_sizes,
    "tensor": _tensor_sizes,
    "expert": _expert_sizes,
}


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
    replicas = shape["data"] * shape["fsdp"] * shape.get("expert", 1)
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
    """Whether each micro-batch (and pipeline micro-batch) splits over the data x fsdp replicas and the expert ranks
    (which split the rows too): checked before a recipe is built, since most (mesh, grad_accum) pairs fail here."""
    sizes = candidate.sizes
    rows = batch // candidate.grad_accum
    per_micro = rows // candidate.microbatches if candidate.microbatches else rows
    if candidate.microbatches and rows % candidate.microbatches:
        return False
    return per_micro % (sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1)) == 0


def candidate_groups(shape: Mapping[str, int], config, recipe: Recipe) -> Iterable[Candidate]:
    """Per mesh: one candidate (remat `none`, no accumulation) per sequence-parallelism and pipeline choice; the
    remat presets and accumulations are varied on it by `with_knobs`."""
    mesh = tuple((axis, shape[axis]) for axis in MESH_AXES)
    sp_options = (False, True) if shape["tensor"] > 1 and recipe.rules.tensor is None else (False,)
    for sp in sp_options:
        for microbatches, schedule, repeats in pipeline_choices(shape, config, recipe):
            yield Candidate(mesh, "none", 1, sp, microbatches, schedule, repeats)
