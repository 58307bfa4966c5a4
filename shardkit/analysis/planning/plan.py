"""What a recipe puts where, without running a step: the mesh, every parameter's spec and shard, per-device totals."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from shardkit.analysis.compiled.collective_kinds import collective_family
from shardkit.analysis.compiled.fit import fit_summary, memory_fraction
from shardkit.analysis.compiled.hlo import PERMUTE_NOTE, hlo_summary, human_bytes, reduction_bytes_by_dtype
from shardkit.analysis.predicted.estimate import communication_estimate, memory_estimate
from shardkit.analysis.predicted.targets import DRIVER_MEMORY_BYTES, usable_bytes
from shardkit.layout import Layout, device_shape, path_str
from shardkit.mesh import device_table
from shardkit.moe import expert_placement, format_placement
from shardkit.naming import MODEL_SOURCE, NO_SOURCE, path_rule_source
from shardkit.pipeline import pipeline_summary
from shardkit.platforms import mesh_platform
from shardkit.registry import config_json
from shardkit.rules import spec_to_json
from shardkit.step import build_step
from shardkit.units import GIB
from shardkit.xla_flags import compile_lowered


def parameter_rows(layout: Layout) -> list[dict[str, Any]]:
    """One row per parameter: path, shape, logical axes, spec, per-device shape and bytes (in the fp32 master dtype)."""
    specs = layout.specs(layout.rules.params)
    flat_specs = dict(_flatten(specs))
    flat_logical = dict(_flatten(layout.logical, is_leaf=lambda x: isinstance(x, tuple)))
    sizes = dict(layout.mesh.shape)
    rows = []
    for path, leaf in _flatten(layout.abstract_params):
        spec = flat_specs[path]
        shard = device_shape(leaf.shape, spec, sizes)
        rows.append(
            {
                "path": path,
                "shape": list(leaf.shape),
                "dtype": str(leaf.dtype),
                "logical": list(flat_logical[path]),
                "names_from": layout.name_sources.get(path, MODEL_SOURCE),
                "spec": spec_to_json(spec, len(leaf.shape)),
                "device_shape": list(shard),
                "device_bytes": math.prod(shard) * np.dtype(leaf.dtype).itemsize,
                "bytes": math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize,
            }
        )
    return rows


def _flatten(tree, is_leaf=None):
    return [(path_str(path), leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]


def build_plan(layout: Layout) -> dict[str, Any]:
    """The `plan --json` object: mesh, params, totals and the device -> mesh-coordinate table."""
    rows = parameter_rows(layout)
    return {
        "recipe": layout.recipe.name,
        "model": {"name": layout.recipe.model.name, "preset": layout.recipe.model.preset,
                  **config_json(layout.config)},
        "model_label": model_label(layout.recipe.model),
        "precision": precision_summary(layout),
        "mesh": dict(layout.mesh.shape),
        "params": rows,
        "path_rules": [pattern for pattern, _ in layout.recipe.rules.paths],
        "totals": {
            "parameters": sum(math.prod(row["shape"]) for row in rows),
            "param_bytes": sum(row["bytes"] for row in rows),
            "param_bytes_per_device": sum(row["device_bytes"] for row in rows),
        },
        "unnamed": unnamed_summary(rows),
        "devices": device_table(layout.mesh),
        "pipeline": pipeline_summary(layout),  # None without a pipeline axis
        "experts": expert_placement(layout),  # None for a dense model
        "attention": {"kernel": layout.attention.choice.kernel, "reason": layout.attention.choice.reason},
    }


def unnamed_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The parameters named by neither the model nor a path rule (replicated): count, bytes and their share of the
    parameters' bytes, the largest first."""
    unnamed = sorted((row for row in rows if row["names_from"] == NO_SOURCE), key=lambda row: -row["bytes"])
    total = sum(row["bytes"] for row in rows) or 1
    size = sum(row["bytes"] for row in unnamed)
    return {"count": len(unnamed), "bytes": size, "share": size / total, "paths": [row["path"] for row in unnamed]}


def names_line(plan: dict[str, Any], path_rules: list[str]) -> str:
    """`names from: the model 20, path rule 1 '...' 4, none 7 (unnamed: replicated, 1.75 KiB)`."""
    counts: dict[str, int] = {}
    for row in plan["params"]:
        counts[row["names_from"]] = counts.get(row["names_from"], 0) + 1
    parts = [f"the model {counts.pop(MODEL_SOURCE)}"] if MODEL_SOURCE in counts else []
    parts += [f"path rule {index} '{pattern}' {counts.pop(path_rule_source(pattern), 0)}"
              for index, pattern in enumerate(path_rules, 1)]
    unnamed = plan["unnamed"]
    if unnamed["count"]:
        parts.append(f"none {unnamed['count']} (unnamed: replicated, {human_bytes(unnamed['bytes'])})")
    return "names from: " + ", ".join(parts)


def _names_from(source: str, path_rules: list[str]) -> str:
    """The table's short form of a name source: `model`, `rule N`, `none`."""
    rules = {path_rule_source(pattern): f"rule {index}" for index, pattern in enumerate(path_rules, 1)}
    return rules.get(source, source)


def model_label(model) -> str:
    """`llama/8b` for a preset as it is; a model given by dimensions shows them: `llama (8b with layers=32, ...)`."""
    if not model.dims:
        return f"{model.name}/{model.preset}"
    return f"{model.name} ({model.preset} with " + ", ".join(f"{k}={v}" for k, v in model.dims) + ")"


def precision_summary(layout: Layout) -> dict[str, Any]:
    """The policy, the recipe's `precision.grad_reduce` setting, the dtype the layers' gradients cross devices in
    (`Policy.grad_reduce_dtype`), and whether a mixture of experts' own matmuls are left in the compute dtype."""
    precision = layout.recipe.precision
    return {"policy": precision.policy, "grad_reduce_setting": precision.grad_reduce,
            "grad_reduce": str(layout.policy.grad_reduce_dtype),
            # shardkit.moe runs the experts with ragged_dot / einsum, not shardkit.nn.dot
            "experts_in_compute_dtype": (layout.policy.weight_grad_dtype is not None
                                         and hasattr(layout.config, "experts"))}


def grad_reduce_line(precision: dict[str, Any]) -> str:
    """`plan`'s precision line: where the layers' gradient-reduction dtype comes from and what it covers."""
    head = (f"precision {precision['policy']}: the layers' gradients reduced across devices in "
            f"{precision['grad_reduce']} (precision.grad_reduce={precision['grad_reduce_setting']}")
    if precision["grad_reduce_setting"] != "float32":
        return head + ", the compute dtype; fp32-computed gradients such as the norms' in fp32)"
    experts = "; not applied to the experts' matmuls (shardkit.moe)" if precision["experts_in_compute_dtype"] else ""
    return (head + ": the weight-gradient matmuls of shardkit.nn.dot produce fp32, rounded to the compute dtype "
            f"after the reduction; not applied to matmuls a model runs itself, such as nnx.Linear{experts}: those "
            "reduce in the compute dtype)")


def format_plan(plan: dict[str, Any]) -> str:
    """The human-readable table printed by `shardkit plan`."""
    mesh = " x ".join(f"{axis}={size}" for axis, size in plan["mesh"].items())
    precision = plan["precision"]
    lines = [f"recipe {plan['recipe']}: model {plan['model_label']}, mesh {mesh}",
             grad_reduce_line(precision),
             f"attention (shardkit.nn.attention): {plan['attention']['kernel']} ({plan['attention']['reason']})", ""]
    header = ("path", "shape", "logical", "from", "spec", "per device", "bytes/dev")
    path_rules = plan.get("path_rules", [])
    table = [header] + [
        (
            row["path"], _dims(row["shape"]), ",".join(str(n) for n in row["logical"]),
            _names_from(row["names_from"], path_rules), _spec(row["spec"]), _dims(row["device_shape"]),
            human_bytes(row["device_bytes"]),
        )
        for row in plan["params"]
    ]
    widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
    lines += ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip() for line in table]
    totals = plan["totals"]
    lines += [
        "",
        f"parameters {totals['parameters']:,} ({human_bytes(totals['param_bytes'])}), "
        f"per device {human_bytes(totals['param_bytes_per_device'])}",
        names_line(plan, path_rules),
        "",
        "device  rank  process  local  data_rank  " + "  ".join(plan["mesh"]),
    ]
    for row in plan["devices"]:
        coords = "  ".join(str(row[axis]).rjust(len(axis)) for axis in plan["mesh"])
        lines.append(
            f"{row['device']:>6}  {row['global_rank']:>4}  {row['process']:>7}  {row['local_rank']:>5}  "
            f"{row['data_rank']:>9}  {coords}"
        )
    if plan.get("experts"):
        lines += ["", format_placement(plan["experts"])]
    return "\n".join(lines)


def _dims(shape) -> str:
    return "(" + ",".join(str(d) for d in shape) + ")"


def _spec(spec) -> str:
    return "(" + ",".join("None" if e is None else "+".join(e) if isinstance(e, list) else e for e in spec) + ")"


# ---- the analytic model beside XLA's compiled figures ------------------------------------------------------------
BACKEND_NOTES = {
    "cpu": "XLA:CPU reduces with all-reduce followed by a dynamic-slice where XLA:GPU emits reduce-scatter; both are "
           "compared as one 'reduction' family over the full buffer. Use --target (e.g. h100x8) for the GPU program.",
}


def compile_layout(layout: Layout):
    """Lower and compile the layout's training step once (on its mesh's devices, real or compile-only), with the
    recipe's XLA flags as `train` compiles it."""
    return compile_lowered(build_step(layout).lower(), layout.recipe, layout.mesh)


def analytic_vs_compiled(layout: Layout, compiled=None) -> dict[str, Any]:
    """The analytic model (`shardkit.analysis.predicted.estimate`) beside XLA's compiled figures, with compiled/analytic
    ratios.

    Memory: state (parameters, master copy, optimizer) against XLA's argument bytes less the batch; the step's
    transient memory (gradients, gathered parameters, activations, logits) against XLA's temporaries; and the peak.
    Communication: full-buffer bytes per step by collective family and mesh axes.
    """
    memory = memory_estimate(layout)
    compiled = compiled if compiled is not None else compile_layout(layout)
    summary = hlo_summary(compiled, layout.mesh)
    platform = mesh_platform(layout.mesh)
    out: dict[str, Any] = {"platform": platform, "memory": [], "communication": [], "notes": []}
    if summary.memory is not None:
        stats = summary.memory
        state = stats["argument_size_in_bytes"] - _batch_bytes_per_device(layout)
        out["memory"] = [
            _row("state (params, master, optimizer)", memory.state, state),
            _row("step temporaries (grads, gathered params, activations, logits)", memory.transient,
                 stats["temp_size_in_bytes"]),
            _row("peak", memory.total, stats["peak_bytes"]),
        ]
    analytic: dict[tuple[str, tuple[str, ...]], float] = {}
    for item in communication_estimate(layout):
        key = (collective_family(item.kind), tuple(sorted(item.axes)))
        analytic[key] = analytic.get(key, 0.0) + item.bytes
    compiled_bytes: dict[tuple[str, tuple[str, ...]], float] = {}
    for op in summary.collectives.ops:
        if op.group_size <= 1:
            continue
        key = (collective_family(op.kind), tuple(sorted(op.axes or ())))
        compiled_bytes[key] = compiled_bytes.get(key, 0.0) + op.count * op.bytes
    for key in sorted(set(analytic) | set(compiled_bytes)):
        family, axes = key
        out["communication"].append(
            _row(f"{family} over {'+'.join(axes) or '-'}", analytic.get(key, 0.0), compiled_bytes.get(key, 0.0))
        )
    out["grad_reduce"] = compiled_reduction_precision(layout, summary.collectives.ops)
    out["notes"].append(out["grad_reduce"]["note"])
    if platform in BACKEND_NOTES:
        out["notes"].append(BACKEND_NOTES[platform])
    if any(family == "all-to-all" for family, _ in compiled_bytes) and not any(f == "all-to-all" for f, _ in analytic):
        out["notes"].append("all-to-all: the embedding lookup on a sharded table exchanges rows (and scatters their "
                            "gradients back) instead of gathering the table; the model has no all-to-all of its own.")
    if summary.collectives.unknown_trip_counts:
        out["notes"].append(f"loops without a known trip count were counted once: "
                            f"{summary.collectives.unknown_trip_counts}")
    if any(family == "collective-permute" for family, _ in compiled_bytes | analytic):
        out["notes"].append(PERMUTE_NOTE)
    _mark_rows_in_branches(out["communication"], summary.collectives.conditional_ops)
    exact = _exact_tick_stages(layout, compiled, summary) if summary.collectives.conditional_ops else None
    if exact is not None:  # the 1F1B family's tick switches: the branch each tick takes is in the tick program
        out["notes"].append(exact[0])
        out["stages"] = exact[1]
    elif summary.collectives.conditional_ops:  # which branch runs is data-dependent
        out["notes"].append(f"collectives in conditional branches are not in the compiled figures: up to "
                            f"{human_bytes(summary.collectives.conditional_bytes())} more per step (each conditional's "
                            f"costliest branch, every time it runs)")
    return out


def _mark_rows_in_branches(rows: list[dict[str, Any]], conditional_ops) -> None:
    """Flag each communication row (`in_branches`: True) whose collectives also run inside conditional branches
    (a pipeline's tick switches): its compiled figure, the unconditional ops alone, leaves those out."""
    keys = {f"{collective_family(op.kind)} over {'+'.join(sorted(op.axes or ())) or '-'}"
            for op in conditional_ops if op.group_size > 1}
    for row in rows:
        row["in_branches"] = row["what"] in keys


def _exact_tick_stages(layout: Layout, compiled, summary) -> tuple[str, list[list[dict[str, Any]]]] | None:
    """The 1F1B family's exact bytes per stage (`shardkit.analysis.compiled.tick_branches`) beside the per-stage model
    (`shardkit.analysis.predicted.tick_bytes`): the note, and per stage one row per collective family; None where the
    tick switches are not attributed."""
    if not layout.pipeline.one_f_one_b:
        return None
    from shardkit.analysis.compiled.hlo_parse import parse_hlo
    from shardkit.analysis.compiled.tick_branches import by_kind, exact_tick_bytes, format_against_analytic
    from shardkit.analysis.predicted.tick_bytes import tick_stage_communication
    from shardkit.pipeline.program import tick_program

    stages = exact_tick_bytes(parse_hlo(compiled.as_text()), summary.collectives, tick_program(layout.pipeline))
    if stages is None:
        return None
    analytic = tick_stage_communication(layout)
    rows = []
    for figures, wanted in zip(stages, analytic, strict=True):
        got = by_kind(figures, collective_family)
        rows.append([_row(family, wanted.get(family, 0.0), got.get(family, 0.0))
                     for family in sorted(set(wanted) | set(got))])
    return format_against_analytic(stages, analytic, collective_family), rows


def compiled_reduction_precision(layout: Layout, ops) -> dict[str, Any]:
    """What the compiled all-reduces and reduce-scatters move by element type, beside the policy's gradient-reduction
    dtype (`Policy.grad_reduce_dtype`: the compute dtype, or fp32 under `precision.grad_reduce = "float32"`) that
    the layers' weight gradients cross devices in; gradients computed in fp32 (the norms' scales, the output head's
    from the fp32 logits) cross in fp32 either way."""
    expected = str(layout.policy.grad_reduce_dtype)
    by_dtype = reduction_bytes_by_dtype(ops)
    total = sum(by_dtype.values())
    shares = ", ".join(f"{dtype} {human_bytes(value)} ({value / total:.0%})" for dtype, value in
                       sorted(by_dtype.items(), key=lambda item: -item[1])) if total else "none"
    return {"policy": expected, "compiled": by_dtype,
            "note": f"gradient reductions: policy dtype {expected}; compiled reductions by element type: {shares}"}


def _row(what: str, analytic: float, compiled: float) -> dict[str, Any]:
    return {"what": what, "analytic": analytic, "compiled": compiled,
            "ratio": compiled / analytic if analytic else None}


def _batch_bytes_per_device(layout: Layout) -> float:
    train = layout.recipe.train
    degree = layout.degree("batch")
    return train.global_batch * (train.seq_len + 1) * 4 / degree


def format_comparison(comparison: dict[str, Any]) -> str:
    """Compiled beside analytic, one line per figure, for `shardkit plan`. The compiled figure leads: it is what XLA
    will run, exact for this XLA; the analytic one is the model's first-order count."""
    lines = [f"XLA:{comparison['platform'].upper()} compiled beside the analytic model (per device, per step)"]
    for section in ("memory", "communication"):
        lines.append(f"  {section:<64} {'compiled':>12} {'analytic':>12}  compiled/analytic")
        for row in comparison[section]:
            ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
            analytic, compiled = human_bytes(row["analytic"]), human_bytes(row["compiled"])
            lines.append(f"    {row['what']:<62} {compiled:>12} {analytic:>12}  {ratio}")
    lines += [f"  note: {note}" for note in comparison["notes"]]
    return "\n".join(lines)


# ---- will it fit on a target GPU ----------------------------------------------------------------------------------
def target_fit(plan: dict[str, Any], target) -> dict[str, Any]:
    """The step's peak per device (compiled when the plan has it, else analytic) against the target GPU's usable
    memory: JAX's pool, the driver's total times XLA_PYTHON_CLIENT_MEM_FRACTION (shardkit's default when unset)."""
    peak = [row["compiled"] for row in (plan.get("compiled") or {}).get("memory", []) if row["what"] == "peak"]
    needed, source = (peak[0], "compiled") if peak else (plan["estimate"]["memory"]["total"], "analytic")
    fraction = memory_fraction()
    return {"target": str(target), "needed": needed, "available": usable_bytes(target.gpu, fraction),
            "source": source, "fraction": fraction, "driver_bytes": DRIVER_MEMORY_BYTES[target.gpu]}


def format_fit(fit: dict[str, Any]) -> str:
    """`fits on h100x1: 28.98 GiB needed of 71.28 GiB per device (...)` for `shardkit plan --target`."""
    verdict, _, sizes = fit_summary(fit["needed"], fit["available"]).partition(": ")
    usable = f"XLA_PYTHON_CLIENT_MEM_FRACTION {fit['fraction']:g} x {fit['driver_bytes'] / GIB:.1f} GiB"
    return f"{verdict} on {fit['target']}: {sizes} ({fit['source']} peak; usable = {usable})"
