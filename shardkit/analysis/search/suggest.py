"""`shardkit suggest`: rank the parallel layouts of a model on a GPU cluster before renting it.

1. Enumerate layouts (`shardkit.analysis.search.candidates`): mesh sizes over the search axes, and for each mesh the
remat
   preset, the gradient accumulation, Megatron sequence parallelism and, with a pipeline, the schedule and
   micro-batch count.
2. Prune with the analytic memory model (`shardkit.analysis.predicted.estimate.memory_estimate`, on layouts without
devices:
   `shardkit.analysis.search.planned`) against what one device of the target may allocate
   (`shardkit.analysis.predicted.targets.usable_bytes`), and rank what fits by the analytic step time
   (`shardkit.analysis.predicted.step_model.step_time`).
3. Compile the best K for the target (the `--target` path of `plan` and `hlo`) and re-rank with the compiled peak
   memory and the replay of the compiled schedule.

Only the compile step needs the `jax[cuda12]` plugin.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from shardkit.analysis.compiled.collective_kinds import collective_family
from shardkit.analysis.compiled.fit import memory_fraction
from shardkit.analysis.compiled.hlo import hlo_summary, human_bytes
from shardkit.analysis.planning.plan import (
    analytic_vs_compiled,
    build_plan,
    compile_layout,
    model_label,
    parameter_rows,
    precision_summary,
    target_fit,
)
from shardkit.analysis.predicted.comm_terms import CommItem
from shardkit.analysis.predicted.estimate import estimate
from shardkit.analysis.predicted.overlap import exposure_report
from shardkit.analysis.predicted.step_model import analytic_comm, bytes_per_axis, step_time
from shardkit.analysis.predicted.steptime import StepTime, format_predicted, replayed_step_time
from shardkit.analysis.predicted.targets import Target, usable_bytes
from shardkit.analysis.search.candidates import (
    MICROBATCHES_PER_STAGE,
    REMAT_ORDER,
    Candidate,
    batch_splits,
    candidate_groups,
    divisors,
    mesh_shapes,
)
from shardkit.analysis.search.planned import base_layout, candidate_layout, peak_bytes
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.pipeline import validate_pipeline
from shardkit.recipe import Recipe, apply_override, builtin_recipes, load_recipe, recipe_from_tables, to_toml
from shardkit.step import check_step_layout
from shardkit.units import GIB

DEFAULT_TOP = 3


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
