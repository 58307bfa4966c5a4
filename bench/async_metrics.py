"""Training throughput with the metrics fetched on a worker thread (`logging.async_metrics = true`, the default) and
with the loop waiting for each step's metrics itself (`false`).

    python bench/async_metrics.py --devices 8 [--recipe recipes/fsdp.toml] [--steps 60] [--rounds 2] [--set K=V ...]

Throughput is wall-clock: tokens of the steps after the first 10 over the time between the progress lines of step 10
and of the last step, as a user watching the run sees it (the per-step `step_time_s` of the two modes measure
different intervals). The modes alternate for `--rounds` rounds so that load from other processes hits both.
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WARMUP = 10


class _Stamped(io.StringIO):
    """A log stream that notes when each progress line `step N/...` arrived."""

    def __init__(self):
        super().__init__()
        self.when: dict[int, float] = {}

    def write(self, text: str) -> int:
        if text.startswith("step "):
            self.when[int(text.split()[1].split("/")[0])] = time.perf_counter()
        return super().write(text)


def measure(recipe_path: str, overrides: list[str], steps: int, asynchronous: bool) -> float:
    """Tokens per second of steps WARMUP+1..steps, wall clock."""
    from shardkit.recipe import load_recipe
    from shardkit.run.loop import train

    overrides = [*overrides, f"train.steps={steps}", f"logging.async_metrics={str(asynchronous).lower()}"]
    recipe = load_recipe(recipe_path, overrides)
    log = _Stamped()
    with tempfile.TemporaryDirectory() as out:
        train(recipe, out, log=log)
    tokens = (steps - WARMUP) * recipe.train.global_batch * recipe.train.seq_len
    return tokens / (log.when[steps] - log.when[WARMUP])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--recipe", default="recipes/fsdp.toml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    from shardkit.run.devices import use_fake_cpu_devices

    use_fake_cpu_devices(args.devices)
    results: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for asynchronous in (True, False):
            results[asynchronous].append(measure(args.recipe, args.overrides, args.steps, asynchronous))
    for asynchronous, figures in results.items():
        shown = ", ".join(f"{figure:,.0f}" for figure in figures)
        print(f"async_metrics={str(asynchronous).lower():5}  median {statistics.median(figures):,.0f} tokens/s  "
              f"({shown})")
    ratio = statistics.median(results[True]) / statistics.median(results[False])
    print(f"async / sync: {ratio:.2f}x")


if __name__ == "__main__":
    main()
