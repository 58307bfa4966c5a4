"""Pipeline benchmark: step time, compiled memory per device and the measured idle fraction, against micro-batch
count and schedule.

    python bench/pipeline.py --devices 8 [--steps 5] [--microbatches 4,8,16] [--rows 4] [--out bench_pipeline.json]

Runs recipes/pp.toml (4 stages x 2 data replicas, 8 layers) under gpipe, circular (v=2), 1f1b, interleaved_1f1b (v=2)
and zero_bubble, with a fixed
micro-batch of `--rows` sequences (global batch = m x rows), so that one tick (one stage's chunk of layers, forward and
backward, on one micro-batch) costs the same for every m.

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


def measure(name_overrides: list[str], steps: int) -> dict:
    """Compile the step once, run it `steps` times; return the median step time, memory and the theory's bubble."""
    import jax

    from shardkit.data.source import TokenSource
    from shardkit.layout import build_layout
    from shardkit.pipeline import bubble_fraction, idle_fraction, pipeline_config, schedule_grid
    from shardkit.recipe import load_recipe
    from shardkit.step import build_step

    recipe = load_recipe(ROOT / "recipes" / "pp.toml", name_overrides)
    layout = build_layout(recipe)
    builder = build_step(layout)
    began = time.perf_counter()
    compiled = builder.compile()
    compile_s = time.perf_counter() - began
    memory = compiled.memory_analysis()
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
    config = pipeline_config(recipe)
    step_s = statistics.median(times)
    return {
        "schedule": config.schedule, "repeats": config.repeats, "microbatches": config.microbatches,
        "stages": config.stages, "global_batch": recipe.train.global_batch, "ticks": step_ticks(config),
        "bubble_ticks": bubble_ticks(config), "idle_grid": idle_fraction(schedule_grid(config)),
        "step_ms": 1e3 * step_s, "compile_s": compile_s,
        "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
        "idle_theory": bubble_fraction(config),
    }


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", default="4,8,16", help="at least two counts (the fit needs them)")
    parser.add_argument("--rows", type=int, default=4, help="sequences per micro-batch (global batch = m x rows)")
    parser.add_argument("--out", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    from shardkit.run.devices import use_fake_cpu_devices

    use_fake_cpu_devices(args.devices)
    counts = [int(x) for x in args.microbatches.split(",")]
    if len(set(counts)) < 2:
        parser.error("--microbatches needs at least two different counts to fit the tick time")
    rows = []
    print(f"{'schedule':<16} {'v':>2} {'m':>3} {'batch':>5} {'step ms':>8} {'tick ms':>8} {'overhead':>8} "
          f"{'fit err':>7} {'temp MiB':>9} {'args MiB':>9} {'idle (measured)':>15} {'theory':>7}")
    for schedule, repeats in (("gpipe", 1), ("circular", 2), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1)):
        schedule_rows = []
        for m in counts:
            overrides = ["model.layers=8", f"train.global_batch={m * args.rows}", f"pipeline.microbatches={m}",
                         f"pipeline.schedule={schedule}", f"pipeline.repeats={repeats}"]
            schedule_rows.append(measure(overrides, args.steps))
        fit_ticks(schedule_rows)
        for row in schedule_rows:
            print(f"{schedule:<16} {repeats:>2} {row['microbatches']:>3} {row['global_batch']:>5} "
                  f"{row['step_ms']:>8.1f} "
                  f"{row['tick_ms']:>8.2f} {row['overhead_ms']:>8.1f} {row['fit_error']:>7.1%} "
                  f"{row['temp_bytes'] / 2**20:>9.2f} {row['argument_bytes'] / 2**20:>9.2f} "
                  f"{_percent(row['idle_measured']):>15} {row['idle_theory']:>7.1%}", flush=True)
        rows.extend(schedule_rows)
    if any(row["idle_measured"] is None for row in rows):
        print(f"n/a: the fit step = ticks x tick + overhead has a negative overhead or a residual above "
              f"{MAX_FIT_ERROR:.0%}, so the bubble's share of the step cannot be read from it (see the docstring)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
