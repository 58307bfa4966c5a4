"""Pipeline benchmark: step time and compiled memory per device against micro-batch count and schedule.

    python bench/pipeline.py --devices 8 [--steps 5] [--microbatches 4,8,16] [--out bench_pipeline.json]

Runs recipes/pp.toml (4 stages x 2 data replicas, 8 layers) with global_batch 32 under gpipe, circular (v=2) and 1f1b.
Beside each row: the idle fraction of the schedule the executor runs (idle stage-ticks over all stage-ticks of the
compiled tick program, forward and backward) and the theory (p-1)/(v*m+p-1). On fake CPU devices an idle tick still
computes (its result is masked away) and all devices share the host's cores, so step time grows with the tick count
(m*v + p - 1) rather than showing idle gaps; `ms/tick` is the step time over the forward ticks (m*v + p - 1 for
every schedule, so the column compares like with like). 1f1b's idle column is its own grid's (shardkit/pipeline.py).
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
    """Compile the step once, run it `steps` times; return timings, memory and the schedule's idle fractions."""
    import jax

    from shardkit.data import TokenSource
    from shardkit.partition import build_layout
    from shardkit.pipeline import bubble_fraction, idle_fraction, pipeline_config, schedule_grid
    from shardkit.recipe import load_recipe
    from shardkit.train import build_step

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
        "stages": config.stages, "step_ms": 1e3 * step_s, "ms_per_tick": 1e3 * step_s / config.forward_ticks,
        "compile_s": compile_s,
        "temp_bytes": memory.temp_size_in_bytes, "argument_bytes": memory.argument_size_in_bytes,
        "idle_measured": idle_fraction(schedule_grid(config)), "idle_theory": bubble_fraction(config),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--out", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    from shardkit.devices import use_fake_cpu_devices

    use_fake_cpu_devices(args.devices)
    rows = []
    print(f"{'schedule':<9} {'v':>2} {'m':>3} {'step ms':>8} {'ms/tick':>8} {'temp MiB':>9} {'args MiB':>9} "
          f"{'idle':>6} {'theory':>7}")
    for schedule, repeats in (("gpipe", 1), ("circular", 2), ("1f1b", 1)):
        for m in (int(x) for x in args.microbatches.split(",")):
            overrides = ["model.layers=8", "train.global_batch=32", f"pipeline.microbatches={m}",
                         f"pipeline.schedule={schedule}", f"pipeline.repeats={repeats}"]
            row = measure(overrides, args.steps)
            rows.append(row)
            print(f"{schedule:<9} {repeats:>2} {m:>3} {row['step_ms']:>8.1f} {row['ms_per_tick']:>8.2f} "
                  f"{row['temp_bytes'] / 2**20:>9.2f} {row['argument_bytes'] / 2**20:>9.2f} "
                  f"{row['idle_measured']:>6.1%} {row['idle_theory']:>7.1%}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
