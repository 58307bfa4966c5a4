"""What `shardkit plan` shows of a pipeline: its summary (bubble, bytes sent, live micro-batches) and Gantt charts of
the schedule's grid, as text and as SVG (`plan --gantt FILE.svg`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from shardkit.pipeline.config import microbatch_activation_bytes
from shardkit.pipeline.schedule import (
    PipelineConfig,
    Work,
    bubble_fraction,
    collective_permute_bytes,
    idle_fraction,
    peak_live_activations,
    schedule_grid,
)


def text_gantt(grid: Sequence[Sequence[Work | None]], config: PipelineConfig) -> str:
    """Stages down, ticks across: `F3` is micro-batch 3's forward, `b3` its backward, `..` a bubble.

    With repeats, a forward cell shows the micro-batch and the repeat as `F3'` (repeat 1), `F3"` (repeat 2), ...
    """
    width = max(len(_cell_label(cell)) for row in grid for cell in row) + 1
    lines = [f"schedule {config.schedule}: p={config.stages} stages, m={config.microbatches} micro-batches, "
             f"v={config.repeats}; bubble {bubble_fraction(config):.1%} (theory), {idle_fraction(grid):.1%} (this "
             f"grid)"]
    for stage, row in enumerate(grid):
        lines.append(f"stage {stage} |" + "".join(_cell_label(cell).ljust(width) for cell in row).rstrip())
    return "\n".join(lines)


def _cell_label(cell: Work | None) -> str:
    if cell is None:
        return ".."
    mark = ("'" * cell.repeat) if cell.repeat < 3 else f"^{cell.repeat}"
    return (f"F{cell.micro}" if cell.kind == "F" else f"b{cell.micro}") + mark


def svg_gantt(grid: Sequence[Sequence[Work | None]], config: PipelineConfig) -> str:
    """The same chart as an SVG document: blue forwards, orange backwards, grey bubbles, a title with the bubble."""
    cell_w, cell_h, left, top = 28, 26, 70, 34
    ticks = max(len(row) for row in grid)
    title = (f"{config.schedule}: p={config.stages}, m={config.microbatches}, v={config.repeats}; "
             f"bubble {bubble_fraction(config):.1%}")
    # A short schedule's grid is narrower than its title: the chart is as wide as the wider of the two (a monospace
    # 13 px character is under 0.62 x 13 px wide).
    width = max(left + ticks * cell_w, 4 + math.ceil(len(title) * 13 * 0.62)) + 10
    height = top + len(grid) * cell_h + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
             f'font-size="11">', f'<text x="4" y="18" font-size="13">{title}</text>']
    for stage, row in enumerate(grid):
        y = top + stage * cell_h
        parts.append(f'<text x="4" y="{y + 17}">stage {stage}</text>')
        for tick, cell in enumerate(row):
            x = left + tick * cell_w
            fill = "#e6e6e6" if cell is None else _FORWARD_COLOURS[cell.repeat % 3] if cell.kind == "F" else "#f4a259"
            parts.append(f'<rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" fill="{fill}"/>')
            if cell is not None:
                parts.append(f'<text x="{x + 3}" y="{y + 16}">{_cell_label(cell)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


_FORWARD_COLOURS = ("#7fb3e0", "#4f8fc7", "#2d6aa3")


def pipeline_summary(layout) -> dict | None:
    """The `plan` entry for a pipelined layout (None without one): bubble, sends, activation memory, text Gantt."""
    config = layout.pipeline
    if not config.enabled:
        return None
    grid = schedule_grid(config)
    # The activation's width is the config's `embed`; a model of one's own may call it otherwise (None: unknown).
    activation = microbatch_activation_bytes(layout) if isinstance(getattr(layout.config, "embed", None), int) else None
    sent = None if activation is None else collective_permute_bytes(config, activation) * layout.recipe.train.grad_accum
    return {
        "stages": config.stages, "microbatches": config.microbatches, "repeats": config.repeats,
        "schedule": config.schedule, "layers_per_stage": layout.layers // config.stages,
        "bubble_fraction": bubble_fraction(config), "grid_idle_fraction": idle_fraction(grid),
        "microbatch_activation_bytes": activation,
        "collective_permute_bytes": sent,
        "peak_live_microbatches": peak_live_activations(grid),
        "gantt": text_gantt(grid, config),
    }


def format_pipeline_summary(summary: dict) -> str:
    """The pipeline section of `shardkit plan`'s text output."""
    return "\n".join([
        f"pipeline: {summary['stages']} stages x {summary['layers_per_stage']} layers, {summary['microbatches']} "
        f"micro-batches, schedule {summary['schedule']}, repeats {summary['repeats']}",
        f"  bubble (p-1)/(v*m+p-1) = {summary['bubble_fraction']:.1%}; activations sent per step (forward and "
        f"backward, per pipeline group): {_sent(summary['collective_permute_bytes'])}",
        f"  micro-batches alive per stage at peak: {summary['peak_live_microbatches']}",
        "", summary["gantt"],
    ])


def _sent(count: int | None) -> str:
    return "unknown (the model's config has no `embed` width)" if count is None else f"{count:,} bytes"


def write_svg_gantt(layout, path) -> None:
    """Write the layout's schedule as an SVG Gantt chart (`shardkit plan --gantt FILE.svg`)."""
    Path(path).write_text(svg_gantt(schedule_grid(layout.pipeline), layout.pipeline))
