"""Pipeline benchmark: per schedule and micro-batch count, the bubble (the tick grid's, the compiled program's and the
measured one), collective bytes per step and the peak per device (analytic beside compiled, with their ratio) and
the step time.

    python bench/pipeline.py --devices 8 [--steps 5] [--microbatches 4,8,16] [--rows 4] [--out bench_pipeline.json]
    python bench/pipeline.py --target h100x8 [--microbatches 4,8,16] [--layers 16] [--schedules gpipe,circular]

Runs recipes/pp.toml (4 stages x 2 data replicas, `--layers` layers, 8 by default) under gpipe, circular (v=2), 1f1b,
interleaved_1f1b (v=2) and zero_bubble (or the `--schedules` named), with a fixed
micro-batch of `--rows` sequences (global batch = m x rows), so that one tick (one stage's chunk of layers, forward and
backward, on one micro-batch) costs the same for every m.

Bubble, theory and compiled. `idle grid` is the schedule grid's share of idle (stage, tick) cells
(`shardkit.pipeline.idle_fraction`), the theory. `idle program` is what the compiled program runs: under 1f1b,
interleaved_1f1b and zero_bubble the tick program's table (`shardkit.pipeline.program.tick_program`, the switch the
compiled loop executes), idle cells over all cells, the last chunk's forward counted as work (its backward runs it with
the loss); under gpipe and circular the compiled loop computes on every tick and masks the p - 1 fill and drain ticks
of each pass, so its idle share is those ticks over the loop's m*v + p - 1.

Bytes and peak. `analytic` is `shardkit.analysis.predicted.estimate` (the sum of `communication_estimate`'s full-buffer
bytes; `memory_estimate(...).total`), `compiled` the compiled step's (`shardkit.analysis.compiled.hlo.hlo_summary`:
collectives counted by loop trip counts; XLA's memory analysis: arguments + outputs - aliased + temporaries), on the
fake CPU devices the bench runs on, or with `--target h100x8` XLA:GPU's program compiled on this CPU (no step is run
then).

How the idle fraction is measured. A schedule runs m*v + p - 1 ticks (forward and backward), of which m*v per stage
are work; the other p - 1 are its bubble. For each schedule the measured step times are fitted (least squares over
the m values) to step = (m*v + p - 1) * tick + overhead; the measured idle fraction of a row is (p-1) * tick / step:
the share of that step's wall time the p - 1 bubble ticks take, beside the theory (p-1)/(v*m+p-1), which leaves out
the overhead (embedding, head, optimizer) and so is the larger. `fit err` is the largest relative residual of the
fit: when it is small, the tick model explains the measured times.

Why a fit and not per-device busy time: on fake CPU devices all 8 devices share the host's cores, so a device that
waits frees the cores for the others and no device's timeline shows its bubble; what is measurable is how the step's
wall time grows with the tick count. gpipe and circular compute on bubble ticks (masked away), so there a bubble tick
costs a work tick and the fit holds. 1f1b's idle branch does nothing, so on shared cores its bubble costs less than
its work and the fit's overhead comes out negative: such rows (and any fit off by more than MAX_FIT_ERROR) show
`n/a` rather than a number the model cannot support. On GPUs, where each stage owns its device, the same fit applies
to every schedule.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(name_overrides: list[str], target: str | None):
    """The recipe, its layout (on the target's compile-only devices with `target`) and its step builder."""
    from shardkit.analysis.predicted.targets import parse_target, target_devices
    from shardkit.layout import build_layout
    from shardkit.recipe import load_recipe
    from shardkit.step import build_step

    recipe = load_recipe(ROOT / "recipes" / "pp.toml", name_overrides)
    layout = build_layout(recipe, target_devices(parse_target(target))) if target else build_layout(recipe)
    return recipe, layout, build_step(layout)


def measure(name_overrides: list[str], steps: int, target: str | None = None) -> dict:
    """Compile the step once; read its bubble, bytes and peak beside the analytic model's; unless compiling for a
    `target`, run it `steps` times for the median step time."""
    import jax

    from shardkit.analysis.compiled.hlo import hlo_summary
    from shardkit.analysis.predicted.estimate import communication_estimate, memory_estimate
    from shardkit.data.source import TokenSource
    from shardkit.pipeline import bubble_fraction, idle_fraction, pipeline_config, schedule_grid

    recipe, layout, builder = build(name_overrides, target)
    began = time.perf_counter()
    compiled = builder.compile()
    compile_s = time.perf_counter() - began
    summary = hlo_summary(compiled, layout.mesh)
    config = pipeline_config(recipe)
    row = {
        "schedule": config.schedule, "repeats": config.repeats, "microbatches": config.microbatches,
        "stages": config.stages, "global_batch": recipe.train.global_batch, "ticks": step_ticks(config),
        "bubble_ticks": bubble_ticks(config), "idle_grid": idle_fraction(schedule_grid(config)),
        "idle_program": program_idle_fraction(config), "idle_theory": bubble_fraction(config),
        "compile_s": compile_s, "temp_bytes": summary.memory["temp_size_in_bytes"],
        "argument_bytes": summary.memory["argument_size_in_bytes"],
        "bytes_analytic": sum(item.bytes for item in communication_estimate(layout)),
        "bytes_compiled": sum(op.count * op.bytes for op in summary.collectives.ops if op.group_size > 1),
        "peak_analytic": memory_estimate(layout).total, "peak_compiled": summary.memory["peak_bytes"],
        "step_ms": None,
    }
    if target:
        return row
    state = builder.init_state(0)
    source = TokenSource(recipe.data, layout.config.vocab, recipe.train.seq_len, 0)
    batch = source.global_batch(0, recipe.train.global_batch, builder.batch_sharding())
    state, metrics = compiled(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - began)
    row["step_ms"] = 1e3 * statistics.median(times)
    return row


def program_idle_fraction(config) -> float:
    """The compiled program's idle share of (stage, tick) cells (see the module docstring)."""
    from shardkit.pipeline.program import Action, tick_program

    if not config.one_f_one_b:
        return (config.stages - 1) / (config.items + config.stages - 1)
    program = tick_program(config)
    folded = _folded_forwards(config)  # the last chunk's forwards, IDLE in the table, run by BACKWARD_LAST
    return (int((program.action == Action.IDLE).sum()) - folded) / program.action.size


def _folded_forwards(config) -> int:
    return config.microbatches  # one per micro-batch, on the last stage's last chunk


def step_ticks(config) -> float:
    """The step's length in ticks of one forward and one backward of a chunk: v*m + p - 1; zero_bubble's B and W
    are a third of such a tick each, its bubble (p-1)/3 of them (ZB-H1 with unit-time F, B and W)."""
    return config.microbatches * config.chunks + bubble_ticks(config)


def bubble_ticks(config) -> float:
    p = config.stages
    return (p - 1) / 3 if config.schedule == "zero_bubble" else p - 1


MAX_FIT_ERROR = 0.05  # beyond this the tick model does not explain the times, and no idle fraction is claimed


def fit_ticks(rows: list[dict]) -> None:
    """Fit one schedule's rows to step_ms = ticks * tick_ms + overhead_ms; add the fit and the measured idle fraction.

    Needs at least two micro-batch counts. `idle_measured` = (p-1) * tick_ms / step_ms of the row, or None when the
    fit is not physical: a negative overhead (bubble ticks cheaper than work ticks, as 1F1B's idle branch is on
    shared CPU cores) or a residual above MAX_FIT_ERROR (timing noise).
    """
    import numpy as np

    ticks = np.array([row["ticks"] for row in rows], float)
    steps = np.array([row["step_ms"] for row in rows], float)
    tick_ms, overhead_ms = np.polyfit(ticks, steps, 1)
    fit_error = float(np.max(np.abs(ticks * tick_ms + overhead_ms - steps) / steps))
    trusted = overhead_ms >= 0 and fit_error <= MAX_FIT_ERROR
    for row in rows:
        idle = row["bubble_ticks"] * tick_ms / row["step_ms"] if trusted else None
        row.update(tick_ms=float(tick_ms), overhead_ms=float(overhead_ms), fit_error=fit_error, idle_measured=idle)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


HEADER = (f"{'schedule':<16} {'v':>2} {'m':>3} {'step ms':>8} {'idle meas':>9} {'idle grid':>9} {'idle prog':>9} "
          f"{'bytes an MiB':>12} {'compiled':>9} {'ratio':>5} {'peak an MiB':>11} {'compiled':>9} {'ratio':>5}")


def format_row(row: dict) -> str:
    """One printed line: the bubble three ways, then bytes and peak analytic beside compiled (analytic / compiled)."""
    step = "-" if row["step_ms"] is None else f"{row['step_ms']:.1f}"
    return (f"{row['schedule']:<16} {row['repeats']:>2} {row['microbatches']:>3} {step:>8} "
            f"{_percent(row.get('idle_measured')):>9} {row['idle_grid']:>9.1%} {row['idle_program']:>9.1%} "
            f"{row['bytes_analytic'] / 2**20:>12.2f} {row['bytes_compiled'] / 2**20:>9.2f} "
            f"{row['bytes_analytic'] / row['bytes_compiled']:>5.2f} {row['peak_analytic'] / 2**20:>11.2f} "
            f"{row['peak_compiled'] / 2**20:>9.2f} {row['peak_analytic'] / row['peak_compiled']:>5.2f}")


SCHEDULES = {"gpipe": 1, "circular": 2, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 1}  # schedule -> repeats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--target", help="compile for this cluster (e.g. h100x8) instead of running: no step times")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", default="4,8,16", help="at least two counts (the fit needs them)")
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch (global batch = m x rows)")
    parser.add_argument("--layers", type=int, default=8, help="model layers: 16 gives the chunked schedules two a "
                                                              "chunk")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="which of them, comma-separated")
    parser.add_argument("--out", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    schedules = args.schedules.split(",")
    unknown = [schedule for schedule in schedules if schedule not in SCHEDULES]
    if unknown:
        parser.error(f"--schedules: {unknown[0]!r} is not one of {list(SCHEDULES)}")
    from shardkit.run.devices import use_fake_cpu_devices

    use_fake_cpu_devices(args.devices)
    counts = [int(x) for x in args.microbatches.split(",")]
    if len(set(counts)) < 2 and not args.target:
        parser.error("--microbatches needs at least two different counts to fit the tick time")
    rows = []
    print(HEADER)
    for schedule in schedules:
        repeats = SCHEDULES[schedule]
        schedule_rows = []
        for m in counts:
            overrides = [f"model.layers={args.layers}", f"train.global_batch={m * args.rows}",
                         f"pipeline.microbatches={m}",
                         f"pipeline.schedule={schedule}", f"pipeline.repeats={repeats}"]
            schedule_rows.append(measure(overrides, args.steps, args.target))
        if not args.target:
            fit_ticks(schedule_rows)
        for row in schedule_rows:
            print(format_row(row), flush=True)
        rows.extend(schedule_rows)
    if any(row.get("idle_measured", 0) is None for row in rows):
        print(f"n/a: the fit step = ticks x tick + overhead has a negative overhead or a residual above "
              f"{MAX_FIT_ERROR:.0%}, so the bubble's share of the step cannot be read from it (see the docstring)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
