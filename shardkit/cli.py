"""`shardkit` command line: parses arguments and calls the library. Bad input exits with code 2 and one line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable, Sequence

from shardkit.errors import ShardkitError

EXIT_BAD_INPUT = 2


class ArgumentParser(argparse.ArgumentParser):
    """argparse exits with 2 already; this keeps its message to one line in our format."""

    def error(self, message: str):
        raise ShardkitError("arguments", f"{message} (see shardkit {self.prog.split()[-1]} --help)")


def _recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="recipe file, e.g. recipes/fsdp.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe value (repeatable), e.g. --set train.steps=10")
    parser.add_argument("--devices", type=int, help="run on N fake CPU devices (set before JAX starts)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="shardkit", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    train = commands.add_parser("train", help="train a recipe")
    _recipe_args(train)
    train.add_argument("--steps", type=int, help="number of steps (same as --set train.steps=N)")
    train.add_argument("--out", default="runs/latest", help="run directory: metrics.jsonl and checkpoints/")
    train.set_defaults(run=_train)
    plan = commands.add_parser("plan", help="show where every parameter lives, without running a step")
    _recipe_args(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(run=_plan)
    return parser


def _load(args):
    from shardkit.recipe import load_recipe

    overrides = list(args.overrides)
    if getattr(args, "steps", None) is not None:
        overrides.append(f"train.steps={args.steps}")
    return load_recipe(args.recipe, overrides)


def _train(args) -> int:
    from shardkit.runner import train

    result = train(_load(args), args.out)
    return 128 + result.stopped_by if result.stopped_by is not None and result.stopped_by != 15 else 0


def _plan(args) -> int:
    from shardkit.partition import build_layout
    from shardkit.plan import build_plan, format_plan

    plan = build_plan(build_layout(_load(args)))
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardkit` command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "devices", None) is not None:
            from shardkit.devices import use_fake_cpu_devices

            use_fake_cpu_devices(args.devices)
        return args.run(args)
    except ShardkitError as err:
        print(f"shardkit: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run() -> None:
    sys.exit(main())


if __name__ == "__main__":
    run()
