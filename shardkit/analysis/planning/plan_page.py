"""`plan --html` and `suggest --html`: one self-contained page a person can look at (inline SVG and CSS, no script,
nothing fetched from the network).

The page, from the `plan --json` object (`shardkit.analysis.planning.plan.build_plan` with `estimate`, and `compiled` /
`fit` when present): the mesh as a grid of devices labelled with their coordinates, per-device memory bars (analytic
items beside the compiled figures), bytes per step per mesh axis and collective, the pipeline Gantt chart
(`shardkit.pipeline.svg_gantt`) and, for `suggest`, the ranked table.
"""

from __future__ import annotations

import html
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from shardkit.analysis.compiled.hlo import human_bytes
from shardkit.naming import path_rule_source
from shardkit.pipeline import schedule_grid, svg_gantt

MAX_DRAWN_DEVICES = 512  # beyond this the grid would be unreadable; the page says how many were left out
ITEM_COLOURS = {
    "params": "#4f8fc7", "master": "#2d6aa3", "optimizer": "#7fb3e0", "gradients": "#f4a259",
    "gathered_params": "#bc4b51", "activations": "#5b8e7d", "logits": "#8cb369", "recompute": "#b8b8d1",
    "state": "#4f8fc7", "transient": "#f4a259", "pipeline": "#9a7fc4", "other": "#cccccc",
}
# The pipeline loop's memory terms (`estimate.pipeline_memory_terms`), each its own shade of the pipeline's colour.
PIPELINE_COLOURS = ("#9a7fc4", "#7d5fb0", "#b9a3dc", "#6a4c93", "#c9b8e6", "#8e6bbf", "#a58bd0", "#5b3f80")
# The term of `pipeline_memory_terms` that is the bar's `activations` item itself, not part of `pipeline`.
PIPELINE_ACTIVATIONS_TERM = "microbatch_activations"
ANALYTIC_ITEMS = ("params", "master", "optimizer", "gradients", "gathered_params", "activations")
# Labels are monospace, so their width is known before a browser draws them: a glyph advances 0.60 em in DejaVu Sans
# Mono (what `monospace` is on Debian's Chromium) and about as much in other monospace faces; 0.62 leaves some room.
MONO_ADVANCE_EM = 0.62
STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 3px 8px; }
th { background: #f4f4f4; text-align: left; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.winner td { background: #eef6ee; } .note { color: #555; font-size: 13px; }
svg text { font-family: ui-monospace, monospace; }
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def text_width(text: str, font_size: float) -> float:
    """The drawn width of a monospace label, in pixels (see MONO_ADVANCE_EM)."""
    return len(text) * font_size * MONO_ADVANCE_EM


def _svg(width: float, height: float, body: Sequence[str], label: str) -> str:
    # Inline SVG in HTML needs no namespace declaration, so the page holds no URL at all.
    return (f'<svg width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img" '
            f'aria-label="{esc(label)}">' + "".join(body) + "</svg>")


# ---- mesh -----------------------------------------------------------------------------------------------------------
def mesh_svg(mesh: Mapping[str, int], devices: Sequence[Mapping[str, Any]]) -> str:
    """Devices as a grid: the innermost axes (sequence, tensor) across, the outer ones (pipeline, data, fsdp) down;
    each cell shows the device id and its coordinate on every axis of size > 1; colour by process (host)."""
    axes = [axis for axis, size in mesh.items() if size > 1]
    inner = [axis for axis in ("sequence", "tensor") if mesh.get(axis, 1) > 1]
    columns = math.prod(mesh[axis] for axis in inner) if inner else 1
    drawn = devices[:MAX_DRAWN_DEVICES]
    cell_w, cell_h = max(64, 12 + 9 * sum(len(_abbrev(a)) + 3 for a in axes)), 34
    rows = math.ceil(len(drawn) / columns)
    body = []
    for index, row in enumerate(drawn):
        x, y = 4 + (index % columns) * (cell_w + 4), 4 + (index // columns) * (cell_h + 4)
        hue = (row.get("process", 0) * 67) % 360
        coords = " ".join(f"{_abbrev(axis)}{row[axis]}" for axis in axes) or "-"
        tooltip = f"device {row['device']}, rank {row['global_rank']}, process {row.get('process', 0)}: {coords}"
        body.append(f'<g><title>{esc(tooltip)}</title><rect x="{x}" y="{y}" width="{cell_w}" height="{cell_h}" rx="4" '
                    f'fill="hsl({hue},45%,88%)" stroke="#888"/>'
                    f'<text x="{x + 5}" y="{y + 14}" font-size="11">dev {esc(row["device"])}</text>'
                    f'<text x="{x + 5}" y="{y + 28}" font-size="11">{esc(coords)}</text></g>')
    return _svg(8 + columns * (cell_w + 4), 8 + rows * (cell_h + 4), body, "mesh of devices")


def _abbrev(axis: str) -> str:
    return {"pipeline": "pp", "data": "dp", "fsdp": "fs", "sequence": "cp", "tensor": "tp"}.get(axis, axis[:2])


# ---- memory ----------------------------------------------------------------------------------------------------------
def analytic_memory_items(memory: Mapping[str, float],
                          pipeline_terms: Mapping[str, float] | None = None) -> list[tuple[str, float]]:
    """The analytic items that make `memory["total"]`, in drawing order: the state and transient items, the larger
    of the loss and recompute phases, the pipeline loop's terms (each `pipeline: TERM` where they add up to the
    `pipeline` figure, else `pipeline` as one), and `other` for whatever the model counts beyond these."""
    items = [(item, memory[item]) for item in ANALYTIC_ITEMS if memory.get(item)]
    phase = max(("logits", "recompute"), key=lambda k: memory.get(k, 0.0))
    if memory.get(phase):
        items.append((phase, memory[phase]))
    terms = {name: value for name, value in (pipeline_terms or {}).items()
             if name != PIPELINE_ACTIVATIONS_TERM and value}
    if terms and math.isclose(sum(terms.values()), memory.get("pipeline", 0.0), rel_tol=1e-9, abs_tol=0.5):
        items += [(f"pipeline: {name}", value) for name, value in terms.items()]
    elif memory.get("pipeline"):
        items.append(("pipeline", memory["pipeline"]))
    rest = memory.get("total", 0.0) - sum(value for _, value in items)
    if rest > 0.5:
        items.append(("other", rest))
    return items


def memory_svg(estimate_memory: Mapping[str, float], compiled_memory: Sequence[Mapping[str, Any]],
               available: float | None, pipeline_terms: Mapping[str, float] | None = None) -> str:
    """Two stacked bars per device: the analytic items (`analytic_memory_items`, adding up to the table's total),
    and XLA's compiled state + temporaries (and `other`, XLA's peak beyond them, so the bar adds up to the table's
    compiled peak); a line at the usable memory when a target is known."""
    analytic = analytic_memory_items(estimate_memory, pipeline_terms)
    compiled = [(row["what"].split(" (")[0], row["compiled"]) for row in compiled_memory if row["what"] != "peak"]
    peak = next((row["compiled"] for row in compiled_memory if row["what"] == "peak"), None)
    if compiled and peak is not None and peak - sum(value for _, value in compiled) > 0.5:
        compiled.append(("other", peak - sum(value for _, value in compiled)))
    bars = [("analytic", analytic)] + ([("compiled", compiled)] if compiled else [])
    scale_max = max([sum(v for _, v in items) for _, items in bars] + [available or 0.0, 1.0])
    totals = [human_bytes(sum(v for _, v in items)) for _, items in bars]
    width, left, bar_h = 760, 80, 30
    span = width - left - 12 - max(text_width(total, 11) for total in totals)  # each total fits after its bar
    body, y = [], 10
    for (name, items), total in zip(bars, totals):
        x = left
        body.append(f'<text x="4" y="{y + 19}" font-size="12">{name}</text>')
        for index, (item, value) in enumerate(items):
            w = span * value / scale_max
            body.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{bar_h}" '
                        f'fill="{_item_colour(item, index)}">'
                        f'<title>{esc(item)}: {esc(human_bytes(value))}</title></rect>')
            if w > text_width(_short(item), 10) + 6:  # named inside its segment only where the name fits
                body.append(f'<text x="{x + 3:.1f}" y="{y + 19}" font-size="10">{esc(_short(item))}</text>')
            x += w
        body.append(f'<text x="{x + 4:.1f}" y="{y + 19}" font-size="11">{esc(total)}</text>')
        y += bar_h + 12
    if available:
        x = left + span * available / scale_max
        body.append(f'<line x1="{x:.1f}" y1="4" x2="{x:.1f}" y2="{y}" stroke="#c00" stroke-dasharray="4 3"/>'
                    f'<text x="{x - 4:.1f}" y="{y + 12}" font-size="11" text-anchor="end" fill="#c00">usable '
                    f'{esc(human_bytes(available))}</text>')
        y += 16
    return _svg(width, y + 6, body, "memory per device")


def _item_colour(item: str, index: int) -> str:
    if item.startswith("pipeline: "):
        return PIPELINE_COLOURS[index % len(PIPELINE_COLOURS)]
    return ITEM_COLOURS.get(item.replace("step temporaries", "transient"), "#aaa")


def _short(item: str) -> str:
    short = {"gathered_params": "gathered", "step temporaries": "temporaries", "optimizer": "adam"}
    return short.get(item, item.removeprefix("pipeline: "))


# ---- communication --------------------------------------------------------------------------------------------------
def communication_rows(plan: Mapping[str, Any]) -> list[tuple[str, float, float | None]]:
    """(collective over axes, analytic bytes, compiled bytes or None) per step; a row whose compiled figure leaves
    out the collectives inside a pipeline's tick branches is named with a `*` (see `stage_rows`)."""
    if plan.get("compiled") and plan["compiled"].get("communication"):
        return [(row["what"] + (" *" if row.get("in_branches") else ""), row["analytic"], row["compiled"])
                for row in plan["compiled"]["communication"]]
    rows: dict[str, float] = {}
    for item in plan["estimate"]["communication"]:
        key = f"{item['kind']} over {'+'.join(item['axes']) or '-'}"
        rows[key] = rows.get(key, 0.0) + item["bytes"]
    return [(key, value, None) for key, value in rows.items()]


def stage_rows(plan: Mapping[str, Any]) -> list[tuple[str, float, float | None]]:
    """Per pipeline stage and collective family, (name, analytic, compiled) bytes per step per device with the
    branch each tick takes attributed (`compiled.stages`, the 1F1B family): where the step's rows marked `*` leave
    the branches out, these are the figures to compare."""
    stages = (plan.get("compiled") or {}).get("stages") or []
    return [(f"stage {stage}: {row['what']}", row["analytic"], row["compiled"])
            for stage, rows in enumerate(stages) for row in rows]


STAGE_HEADING = "per pipeline stage, tick branches attributed (what * rows leave out):"


def communication_svg(rows: Sequence[tuple[str, float, float | None]],
                      stages: Sequence[tuple[str, float, float | None]] = ()) -> str:
    """Horizontal bars per (collective, axes): analytic above compiled; then, when given, the same per pipeline
    stage under a heading (`stage_rows`)."""
    if not rows:
        return '<p class="note">No collectives: one device holds everything.</p>'
    every = [*rows, *stages]
    top = max([r[1] for r in every] + [r[2] or 0.0 for r in every] + [1.0])
    bars = [[(f"{name} {human_bytes(value)}", value, colour)
             for value, colour, name in ((analytic, "#7fb3e0", "analytic"), (compiled, "#f4a259", "compiled"))
             if value is not None] for _, analytic, compiled in every]
    left = 14 + max(text_width(what, 11) for what, _, _ in every)  # the longest name ends before the bars start
    right = 10 + max(text_width(label, 10) for row in bars for label, _, _ in row)  # a value fits after its bar
    width = max(760.0, left + 240 + right, 8 + text_width(STAGE_HEADING, 11))
    body, y = [], 6
    for index, ((what, _, _), row) in enumerate(zip(every, bars)):
        if stages and index == len(rows):
            body.append(f'<text x="4" y="{y + 11}" font-size="11" font-weight="bold">{esc(STAGE_HEADING)}</text>')
            y += 20
        body.append(f'<text x="4" y="{y + 11}" font-size="11">{esc(what)}</text>')
        for label, value, colour in row:
            w = (width - left - right) * value / top
            body.append(f'<rect x="{left:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="9" fill="{colour}">'
                        f'<title>{esc(label)}</title></rect>'
                        f'<text x="{left + w + 4:.1f}" y="{y + 9}" font-size="10">{esc(label)}</text>')
            y += 13
        y += 8
    return _svg(width, y + 4, body, "bytes per step per mesh axis and collective")


# ---- the page --------------------------------------------------------------------------------------------------------
def render_page(plan: Mapping[str, Any], gantt_svg: str | None = None,
                suggestion: Mapping[str, Any] | None = None) -> str:
    """The whole page as one HTML string.

    Args:
        plan: the `plan --json` object, with `estimate` and optionally `compiled` and `fit`.
        gantt_svg: the pipeline's chart (`shardkit.pipeline.svg_gantt`), when the layout has a pipeline.
        suggestion: the `suggest --json` object, for its ranked table.
    """
    mesh = " x ".join(f"{axis}={size}" for axis, size in plan["mesh"].items() if size > 1) or "one device"
    title = f"shardkit plan: {plan['recipe']} ({plan['model']['name']}/{plan['model']['preset']}), {mesh}"
    fit = plan.get("fit")
    parts = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
             f"<style>{STYLE}</style></head><body><h1>{esc(title)}</h1>"]
    if suggestion is not None:
        parts.append(suggestion_section(suggestion))
    totals = plan["totals"]
    parts.append(f'<p class="note">{totals["parameters"]:,} parameters ({esc(human_bytes(totals["param_bytes"]))}), '
                 f'{esc(human_bytes(totals["param_bytes_per_device"]))} per device.' +
                 (f' {esc(_fit_line(fit))}' if fit else "") + "</p>")
    shown = min(len(plan["devices"]), MAX_DRAWN_DEVICES)
    parts.append(f"<h2>Mesh: {len(plan['devices'])} devices</h2>"
                 f'<p class="note">pp pipeline, dp data, fs fsdp, cp sequence, tp tensor; colour: process (host)'
                 f'{"; first " + str(shown) + " drawn" if shown < len(plan["devices"]) else ""}.</p>')
    parts.append(mesh_svg(plan["mesh"], plan["devices"]))
    compiled = (plan.get("compiled") or {}).get("memory", [])
    parts.append("<h2>Memory per device</h2>")
    terms = plan["estimate"].get("pipeline_memory_terms")
    parts.append(memory_svg(plan["estimate"]["memory"], compiled, fit["available"] if fit else None, terms))
    parts.append(_memory_table(plan["estimate"]["memory"], compiled, terms))
    rows, stages = communication_rows(plan), stage_rows(plan)
    parts.append("<h2>Bytes per step, per mesh axis and collective</h2>")
    parts.append(communication_svg(rows, stages))
    if any(what.endswith(" *") for what, _, _ in rows):
        parts.append('<p class="note">* the compiled figure counts only the collectives outside conditional branches '
                     "(a pipeline's tick switches run the layers' collectives inside them)"
                     + ("; the per-stage rows attribute each tick's branch." if stages else ".") + "</p>")
    parts.append(_table(("collective over axes", "analytic", "compiled"),
                        [(what, human_bytes(a), "-" if c is None else human_bytes(c)) for what, a, c in
                         [*rows, *stages]]))
    notes = (plan.get("compiled") or {}).get("notes", [])
    parts += [f'<p class="note">{esc(note)}</p>' for note in notes]
    parts.append(parameters_section(plan))
    if gantt_svg:
        parts.append("<h2>Pipeline schedule</h2>")
        parts.append(strip_svg_namespace(gantt_svg))
    parts.append("</body></html>\n")
    return "".join(parts)


def parameters_section(plan: Mapping[str, Any]) -> str:
    """Each parameter's names, where they came from (the model, a `[rules.paths]` entry, none: replicated) and its
    spec, with the plan's warnings."""
    rules = {path_rule_source(pattern): f"path rule {index}: {pattern}"
             for index, pattern in enumerate(plan.get("path_rules", []), 1)}
    rows = [(row["path"], "(" + ",".join(map(str, row["shape"])) + ")", ",".join(map(str, row["logical"])),
             rules.get(row["names_from"], row["names_from"]), ",".join(map(str, row["spec"])),
             human_bytes(row["device_bytes"])) for row in plan["params"]]
    unnamed = plan.get("unnamed") or {"count": 0}
    summary = (f'<p class="note">{unnamed["count"]} parameters named by neither the model nor a path rule '
               f'(unnamed: replicated, {esc(human_bytes(unnamed["bytes"]))}).</p>' if unnamed["count"] else "")
    warnings = "".join(f'<p class="note">{esc(line)}</p>' for line in plan.get("warnings", []))
    return ("<h2>Parameters and where their names come from</h2>" + summary + warnings
            + _table(("path", "shape", "logical", "names from", "spec", "bytes/dev"), rows))


def strip_svg_namespace(svg: str) -> str:
    """An SVG document as inline HTML: without its XML namespace attribute, which HTML does not need."""
    return re.sub(r'\s+xmlns="[^"]*"', "", svg, count=1)


def _fit_line(fit: Mapping[str, Any]) -> str:
    verdict = "fits" if fit["needed"] <= fit["available"] else "does not fit"
    return (f"{verdict} on {fit['target']}: {human_bytes(fit['needed'])} needed of {human_bytes(fit['available'])} "
            f"per device ({fit['source']} peak).")


def _memory_table(memory: Mapping[str, float], compiled: Sequence[Mapping[str, Any]],
                  pipeline_terms: Mapping[str, float] | None = None) -> str:
    """The analytic items adding up to the total (what the bar draws), then the analytic-vs-compiled rows."""
    rows = [(item, human_bytes(value)) for item, value in analytic_memory_items(memory, pipeline_terms)]
    rows.append(("total", human_bytes(memory.get("total", 0.0))))
    table = _table(("analytic item", "bytes per device"), rows)
    if compiled:
        table += _table(("analytic vs compiled", "analytic", "compiled", "ratio"),
                        [(row["what"], human_bytes(row["analytic"]), human_bytes(row["compiled"]),
                          f"{row['ratio']:.2f}" if row["ratio"] else "-") for row in compiled])
    return table


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], winner: int | None = None) -> str:
    head = "".join(f"<th>{esc(cell)}</th>" for cell in header)
    body = []
    for index, row in enumerate(rows):
        cells = "".join(f'<td class="{"num" if _numeric(cell) else ""}">{esc(cell)}</td>' for cell in row)
        mark = ' class="winner"' if index == winner else ""
        body.append(f"<tr{mark}>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _numeric(cell: Any) -> bool:
    return bool(re.fullmatch(r"[-0-9.,%]+( [KMGT]?i?B)?", str(cell)))


def suggestion_section(suggestion: Mapping[str, Any]) -> str:
    """The ranked table of `suggest` (the written winner highlighted) and the model's assumptions."""
    rows = []
    for index, item in enumerate(suggestion["ranked"], 1):
        per_axis = item["bytes_per_axis_compiled"] or item["bytes_per_axis_analytic"]
        time = item["predicted_compiled"] or item["predicted"]
        rows.append((index, item["layout"], human_bytes(item["memory_analytic"]),
                     "-" if item["memory_compiled"] is None else human_bytes(item["memory_compiled"]),
                     ", ".join(f"{axis} {human_bytes(v)}" for axis, v in sorted(per_axis.items()) if v) or "-",
                     f"{time['seconds']:.3f}", f"{time['mfu']:.1%}", "yes" if item["fits"] else "no"))
    winner = next((i for i, item in enumerate(suggestion["ranked"]) if item["layout"] == suggestion["winner"]), None)
    return (f"<h2>Suggested layouts for {esc(suggestion['target'])} ({suggestion['devices']} devices, "
            f"{esc(human_bytes(suggestion['usable_bytes']))} usable each)</h2>"
            + _table(("#", "layout", "memory analytic", "memory compiled", "bytes/step per axis", "step s", "MFU",
                      "fits"), rows, winner)
            + "".join(f'<p class="note">assumed: {esc(text)}</p>' for text in suggestion["assumptions"])
            + f'<p class="note">The plan below is the winner\'s: {esc(suggestion["winner"])}.</p>')


def write_page(path: str | Path, plan: dict, layout, suggestion: dict | None = None) -> None:
    """Write `plan --html` / `suggest --html`: the plan of `layout`, its pipeline Gantt when it has a pipeline, and the
    ranked layouts when `suggestion` is given, as one self-contained page."""
    gantt = svg_gantt(schedule_grid(layout.pipeline), layout.pipeline) if layout.pipeline.enabled else None
    Path(path).write_text(render_page(plan, gantt, suggestion))
