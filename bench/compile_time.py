"""Compile time of the training step against depth: the scan over stacked layers keeps it flat.

    python bench/compile_time.py --devices 8 --layers 2 16 [--recipe recipes/fsdp.toml] [--repeats 3]

Prints one line per depth (median seconds to lower and to compile the whole train step) and the ratio of the deepest
to the shallowest. Each measurement builds a fresh layout and step; one unmeasured warm-up compile comes first, since
a process's first trace and compile pay one-off costs that would otherwise land on the first depth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(recipe_path: str, layers: int) -> tuple[float, float]:
    """Seconds to lower and to compile the train step of `recipe_path` with `layers` layers."""
    from shardkit.layout import build_layout
    from shardkit.recipe import load_recipe
    from shardkit.step import build_step

    builder = build_step(build_layout(load_recipe(recipe_path, [f"model.layers={layers}"])))
    began = time.perf_counter()
    lowered = builder.lower()
    lowered_at = time.perf_counter()
    lowered.compile()
    return lowered_at - began, time.perf_counter() - lowered_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--recipe", default="recipes/fsdp.toml")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from shardkit.run.devices import use_fake_cpu_devices

    use_fake_cpu_devices(args.devices)
    measure(args.recipe, args.layers[0])  # warm-up: the process's first trace and compile pay one-off costs
    results = {}
    for layers in args.layers:
        runs = [measure(args.recipe, layers) for _ in range(args.repeats)]
        lower = statistics.median(run[0] for run in runs)
        compile_ = statistics.median(run[1] for run in runs)
        results[layers] = {"lower_s": lower, "compile_s": compile_}
        print(f"layers {layers:>3}: lower {lower:.2f}s  compile {compile_:.2f}s")
    first, last = results[args.layers[0]], results[args.layers[-1]]
    ratio = (last["lower_s"] + last["compile_s"]) / (first["lower_s"] + first["compile_s"])
    print(f"ratio {args.layers[-1]} / {args.layers[0]} layers (lower + compile): {ratio:.2f}")
    print(json.dumps({"recipe": args.recipe, "devices": args.devices, "results": results, "ratio": ratio}))


if __name__ == "__main__":
    main()
