"""`shardkit` command line: parses arguments and calls the library. Bad input exits with code 2 and one line.

Each command imports the library inside its handler: `--devices N` must take effect before JAX initialises (which
importing most of shardkit does), and `shardkit --help` or a bad argument should answer without importing JAX.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import textwrap
import unicodedata
import warnings
from pathlib import Path
from typing import MutableMapping, Sequence

from shardkit.analysis.compiled.fit import DEFAULT_MEM_FRACTION, MEM_FRACTION_ENV, is_out_of_memory, out_of_memory_error
from shardkit.errors import ShardkitError
from shardkit.platforms import mesh_platform
from shardkit.run.distributed import DEFAULT_PEER_TIMEOUT_S, find_peers, process_index
from shardkit.run.supervise import can_supervise, supervise

EXIT_BAD_INPUT = 2

DESCRIPTION = """Write the model once with logical axis names, pick a recipe, train on any mesh.

A RECIPE is a built-in name (`shardkit recipes` lists them, e.g. fsdp, fsdp_tp, tp_sp, pp) or a TOML file.
Try: shardkit train fsdp --devices 8 --steps 20 --out runs/fsdp    (8 fake CPU devices, no accelerator needed)
     shardkit plan fsdp_tp --devices 8                              (where every parameter lives, before a step)
Your own Flax NNX model: --set model.name=my_module:MyModel; from Python: import shardkit
(see docs/guide/library.md)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse exits with 2 already; this keeps its message to one line in our format."""

    def error(self, message: str):
        raise ShardkitError("arguments", f"{message} (see {self.prog} --help)")  # prog: `shardkit data prepare`


def _recipe_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", help="a built-in recipe name (see `shardkit recipes`) or a TOML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe value (repeatable), e.g. --set train.steps=10")
    parser.add_argument("--devices", type=int, help="run on N fake CPU devices (set before JAX starts)")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="shardkit", description=DESCRIPTION,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardkit {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    recipes = commands.add_parser("recipes", help="list the built-in recipes, usable by name")
    recipes.set_defaults(run=_recipes)
    train = commands.add_parser("train", help="train a recipe")
    _recipe_args(train)
    train.add_argument("--steps", type=int, help="number of steps (same as --set train.steps=N)")
    train.add_argument("--out", default="runs/latest", help="run directory: metrics.jsonl and checkpoints/")
    train.add_argument("--profile", metavar="START:STOP", help="write a profiler trace of these steps to OUT/profile")
    train.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address, for a multi-process run (SLURM, Open MPI and JAX_COORDINATOR_ADDRESS "
                            "with JAX_NUM_PROCESSES and JAX_PROCESS_ID need no flags)")
    train.add_argument("--num-processes", type=int, help="number of processes of a multi-process run")
    train.add_argument("--process-id", type=int, help="this process's index in a multi-process run")
    train.add_argument("--peer-timeout", type=float, default=DEFAULT_PEER_TIMEOUT_S, metavar="SECONDS",
                       help="a multi-process run ends (exit 75, to be retried) when one of its processes is silent "
                            f"this long (default {DEFAULT_PEER_TIMEOUT_S:.0f})")
    train.set_defaults(run=_train)
    plan = commands.add_parser("plan", help="show where every parameter lives, without running a step")
    _recipe_args(plan)
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.add_argument("--target", help="compile for a GPU cluster without a GPU, e.g. h100x8 or h100:2x8")
    plan.add_argument("--no-compile", action="store_true", help="skip the compiled figures (analytic model only)")
    plan.add_argument("--gantt", metavar="FILE.svg", help="write the pipeline schedule as an SVG Gantt chart")
    plan.add_argument("--html", metavar="FILE.html", help="write the plan as one self-contained page (inline SVG)")
    plan.set_defaults(run=_plan)
    _add_suggest(commands)
    show = commands.add_parser("show", help="print the resolved recipe: overrides and every default, as TOML")
    show.add_argument("recipe", help="recipe file, e.g. recipes/fsdp.toml")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override a recipe value (repeatable), e.g. --set train.steps=10")
    show.set_defaults(run=_show)
    hlo = commands.add_parser("hlo", help="write the StableHLO, the optimized HLO and summary.json of the step")
    _recipe_args(hlo)
    hlo.add_argument("--out", required=True, metavar="DIR", help="directory for the artifacts")
    hlo.add_argument("--target", help="compile for a GPU cluster without a GPU, e.g. h100x8 or h100:2x8")
    hlo.add_argument("--step", choices=("train", "eval"), default="train",
                     help="which step to compile: the training step (default) or the evaluation step")
    hlo.set_defaults(run=_hlo)
    bench = commands.add_parser("bench", help="benchmarks: `bench collectives`")
    bench.add_argument("what", choices=["collectives"], help="what to benchmark")
    bench.add_argument("--devices", type=int, help="run on N fake CPU devices (set before JAX starts)")
    bench.add_argument("--sizes", help="comma-separated buffer sizes, e.g. 1K,1M,256M (default 1K..256M)")
    bench.add_argument("--ops", help="comma-separated subset of "
                                     "all-reduce,reduce-scatter,all-gather,ppermute,all-to-all")
    bench.add_argument("--repeats", type=int, default=10, help="timed repeats per size (median reported)")
    bench.set_defaults(run=_bench)
    export = commands.add_parser("export", help="write a run's parameters unsharded as .npy files + index.json")
    export.add_argument("run_dir", metavar="RUN_DIR", help="a `shardkit train --out` directory")
    export.add_argument("--to", required=True, metavar="DIR", help="new directory for index.json and params/")
    export.add_argument("--step", type=int, help="checkpoint step to export (default: the latest)")
    export.add_argument("--format", choices=["numpy", "hf"], default="numpy",
                        help="numpy: .npy files + index.json (default); hf: a Hugging Face Llama directory")
    export.add_argument("--shard-size", default="5GB", help="hf: split the safetensors above this size (default 5GB)")
    export.set_defaults(run=_export)
    _add_import_hf(commands)
    _add_data(commands)
    _add_generate(commands)
    return parser


def _version() -> str:
    from shardkit import __version__

    return __version__


def _recipes(args) -> int:
    from shardkit.recipe import builtin_recipes, recipe_summary

    recipes = builtin_recipes()
    width = max(map(len, recipes))
    columns = max(shutil.get_terminal_size((100, 24)).columns, 60)
    for name, path in recipes.items():  # each description whole, wrapped under its own column
        print(textwrap.fill(recipe_summary(path), columns, initial_indent=f"{name:<{width}}  ",
                            subsequent_indent=" " * (width + 2), break_on_hyphens=False))
    return 0


def _add_data(commands) -> None:
    data = commands.add_parser("data", help="datasets: `data prepare` tokenizes text into .bin files")
    actions = data.add_subparsers(dest="action", required=True, parser_class=ArgumentParser)
    prepare = actions.add_parser("prepare", help="tokenize text, JSONL or parquet into train.bin, val.bin and "
                                                 "meta.json")
    prepare.add_argument("inputs", nargs="+", metavar="INPUT",
                         help=".txt (one document each), .jsonl or .parquet files; .txt and .jsonl may be .gz or .zst")
    prepare.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizers JSON file (tokenizer.json)")
    prepare.add_argument("--out", required=True, metavar="DIR", help="new directory for the token files")
    prepare.add_argument("--val-fraction", type=float, default=0.01, help="held-out share of the tokens (0.01)")
    prepare.add_argument("--eos", help="end-of-document token (default: </s>, <|end_of_text|>, ... if present)")
    prepare.add_argument("--text-key", default="text", help="the JSONL field or parquet column holding the text "
                                                            "(default: text)")
    prepare.set_defaults(run=_data_prepare)


def _data_prepare(args) -> int:
    from shardkit.data.prepare import prepare

    meta = prepare(args.inputs, args.tokenizer, args.out, args.val_fraction, args.eos, args.text_key)
    splits = ", ".join(f"{name} {split['tokens']:,} tokens" for name, split in meta["splits"].items())
    print(f"wrote {args.out}: {splits} ({meta['dtype']}, vocab {meta['vocab_size']}); train with\n"
          f"  --set data.source=bin --set data.path={args.out}/train.bin --set data.dtype={meta['dtype']}")
    return 0


def _add_generate(commands) -> None:
    parser = commands.add_parser("generate", help="continue prompts with a run's latest checkpoint")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a `shardkit train --out` directory")
    parser.add_argument("--prompt", action="append", default=[],
                        help="text to continue; repeat it for several prompts, generated as one batch")
    parser.add_argument("--prompts-file", metavar="FILE",
                        help="a UTF-8 file of prompts, one a line (blank lines skipped)")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens at most (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampling")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tokenizer", help="tokenizer.json (default: the one beside the run's prepared data)")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    parser.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                        help="rerun the whole sequence for every token instead of decoding against a KV cache")
    parser.set_defaults(run=_generate)


def _generate(args) -> int:
    from shardkit.run.generate import Sampling, generate

    prompts = list(args.prompt) + (_prompts_file(args.prompts_file) if args.prompts_file else [])
    sampling = Sampling(args.max_tokens, args.temperature, args.seed, args.kv_cache)
    for prompt, completion in zip(prompts, generate(args.run_dir, prompts, sampling, args.tokenizer, args.step)):
        print(prompt + completion)
    return 0


def _prompts_file(path: str) -> list[str]:
    """The non-blank lines of `path`, one prompt each."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ShardkitError("--prompts-file", f"cannot read {path!r}: {err}") from None
    return [line for line in text.splitlines() if line.strip()]


def _add_import_hf(commands) -> None:
    parser = commands.add_parser("import-hf", help="a Hugging Face Llama checkpoint as step 0 of a new run")
    parser.add_argument("hf_dir", metavar="HF_DIR", help="directory with config.json and *.safetensors")
    parser.add_argument("--out", required=True, metavar="RUN_DIR", help="new run directory (train --out it later)")
    parser.add_argument("--recipe", help="layout to write it under (default: FSDP over all devices)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a value of --recipe (repeatable); the model table comes from config.json")
    parser.add_argument("--devices", type=int, help="run on N fake CPU devices (set before JAX starts)")
    parser.set_defaults(run=_import_hf)


def _import_hf(args) -> int:
    from shardkit.hf.convert import import_hf
    from shardkit.recipe import RUN_RECIPE, load_recipe

    if args.overrides and not args.recipe:
        raise ShardkitError("--set", "needs --recipe (the recipe whose values it overrides)")
    recipe = load_recipe(args.recipe, args.overrides) if args.recipe else None
    imported = import_hf(args.hf_dir, args.out, recipe)
    print(f"imported {args.hf_dir} as step 0 of {args.out}; continue with\n"
          f"  shardkit train {args.out}/{RUN_RECIPE} --out {args.out}\n"
          f"or under any recipe with\n  shardkit train RECIPE --out {args.out} {imported.model_flags()}")
    return 0


def _load(args):
    from shardkit.recipe import load_recipe

    overrides = list(args.overrides)
    if getattr(args, "steps", None) is not None:
        overrides.append(f"train.steps={args.steps}")
    return load_recipe(args.recipe, overrides)


def _show(args) -> int:
    from shardkit.optimizer import with_optimizer_settings
    from shardkit.recipe import resolved_toml
    from shardkit.registry import load_model_class, model_config, model_dims

    command = " ".join(["shardkit show", args.recipe, *(f"--set {override}" for override in args.overrides)])
    recipe = _load(args)
    model_class = load_model_class(recipe.model.name)
    config = model_config(model_class, recipe.model)
    recipe = with_optimizer_settings(recipe, model_class, config)
    print(resolved_toml(recipe, model_dims(config), [f"{command}: the resolved recipe, defaults included"]), end="")
    print(_expanded_rules(recipe), end="")
    return 0


def _expanded_rules(recipe) -> str:
    """The rule tables `[rules]` expands to, as commented TOML (shown, not read back: the file above is the recipe)."""
    from shardkit.rules import build_rules

    rules = build_rules(recipe.rules)
    tables = {"params": rules.params, "activations": rules.activations}
    sharded_apart = [name for name in ("optimizer", "gradients") if getattr(rules, name) != rules.params]
    tables |= {name: getattr(rules, name) for name in sharded_apart}
    lines = ["", "# What [rules] expands to: logical name = the mesh axes it is split over ([] = not split), for the",
             "# parameters and the activations (and the optimizer state and gradients where ZeRO shards them apart)."]
    for name, table in tables.items():
        lines += [f"# [rules.{name}]"] + [f"# {key} = {json.dumps(list(axes))}" for key, axes in table.items()]
    return "\n".join(lines) + "\n"


def _train(args) -> int:
    from shardkit.run.distributed import check_peer_timeout, initialize
    from shardkit.run.loop import train
    from shardkit.run.profiler import parse_window
    from shardkit.run.watchdog import watching_peers

    window, recipe = parse_window(args.profile), _load(args)  # bad input refused before any peer is waited for
    initialize(args.coordinator, args.num_processes, args.process_id, check_peer_timeout(args.peer_timeout))
    with watching_peers(args.out, args.peer_timeout):
        result = train(recipe, args.out, profile=window)
    return 128 + result.stopped_by if result.stopped_by is not None and result.stopped_by != 15 else 0


def _plan(args) -> int:
    from shardkit.analysis.planning.model_names import (
        analytic_dims_missing,
        analytic_note,
        format_names,
        layout_warnings,
        name_rows,
    )
    from shardkit.analysis.planning.plan import analytic_vs_compiled, build_plan, format_comparison, format_plan
    from shardkit.analysis.planning.plan_page import write_page
    from shardkit.analysis.predicted.estimate import estimate

    layout = _layout_for(args)
    if args.gantt and not layout.pipeline.enabled:  # said before the compile, not after it
        raise ShardkitError("--gantt", "the recipe has no pipeline (mesh.pipeline is 1), so there is no schedule to "
                                       "draw")
    plan = build_plan(layout)
    plan["names"], plan["warnings"] = name_rows(layout), layout_warnings(layout)
    if analytic_dims_missing(layout):  # a model of its own dimension names: parameters, warnings, the schedule only
        _own_dims_plan(args, layout, plan, [format_plan(plan), "", format_names(plan["names"]), *plan["warnings"],
                                            analytic_note(layout)])
        return 0
    plan["estimate"] = estimate(layout)
    exposure = None
    if not args.no_compile:
        from shardkit.analysis.planning.plan import compile_layout

        compiled = compile_layout(layout)
        plan["compiled"] = analytic_vs_compiled(layout, compiled)
        exposure = _exposure(compiled, layout, args.target)
    text = "\n".join([format_plan(plan), "", format_names(plan["names"]), *plan["warnings"]])
    text += "" if args.no_compile else "\n\n" + format_comparison(plan["compiled"])
    if exposure is not None:
        from shardkit.analysis.predicted.overlap import format_exposure

        plan["exposure"] = exposure.to_json()
        text += "\n\n" + format_exposure(exposure, args.target) + "\n" + _predicted(exposure, layout, args.target, plan)
    if args.target:  # will the step fit on one device of the target, with JAX's memory fraction
        from shardkit.analysis.planning.plan import format_fit, target_fit
        from shardkit.analysis.predicted.targets import parse_target

        plan["fit"] = target_fit(plan, parse_target(args.target))
        text += "\n\n" + format_fit(plan["fit"])
    if plan["pipeline"] is not None:  # the bubble and the schedule's text Gantt chart
        from shardkit.pipeline import format_pipeline_summary

        text += "\n\n" + format_pipeline_summary(plan["pipeline"])
    if args.gantt:
        from shardkit.pipeline import write_svg_gantt

        with _writing(args.gantt):
            write_svg_gantt(layout, args.gantt)
    if args.html:
        with _writing(args.html):
            write_page(args.html, plan, layout)
    print(json.dumps(plan, indent=1) if args.json else text)
    return 0


def _own_dims_plan(args, layout, plan: dict, lines: list[str]) -> None:
    """`plan` for a model whose config lacks the analytic model's dimensions: no figures, so a page of them (--html)
    or a fit on a target (--target) is refused in one line; the pipeline's schedule is shown and drawn (--gantt)."""
    from shardkit.pipeline import format_pipeline_summary, write_svg_gantt

    for flag, value in (("--html", args.html), ("--target", args.target)):
        if value:
            raise ShardkitError(flag, f"{lines[-1].removeprefix('note: ')}, so plan has none to draw or to fit")
    if plan["pipeline"] is not None:
        lines += ["", format_pipeline_summary(plan["pipeline"])]
    if args.gantt:
        with _writing(args.gantt):
            write_svg_gantt(layout, args.gantt)
    print(json.dumps(plan, indent=1) if args.json else "\n".join(lines))


def _add_suggest(commands) -> None:
    parser = commands.add_parser("suggest", help="rank layouts of a model on a GPU cluster; compile the best for it")
    parser.add_argument("recipe", metavar="RECIPE_OR_PRESET", help="a recipe (file or built-in name) or a model preset "
                                                                   "such as 8b")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a recipe value (repeatable), e.g. --set train.global_batch=64")
    parser.add_argument("--target", required=True, help="the cluster, e.g. h100x8 or h100:4x8")
    parser.add_argument("--top", type=int, default=3, help="compile the best K for the target and show them (3)")
    parser.add_argument("--no-compile", action="store_true", help="rank by the analytic model only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--write", metavar="FILE.toml", help="write the winner as a recipe that `train` runs")
    parser.add_argument("--html", metavar="FILE.html", help="write the ranked table and the winner's plan as a page")
    parser.set_defaults(run=_suggest)


def _check_analytic_dims(recipe) -> None:
    """`suggest` ranks layouts with the analytic model, which reads the model's dimensions by logical name."""
    from shardkit.analysis.planning.model_names import config_dims_missing
    from shardkit.registry import load_model_class, model_config

    config = model_config(load_model_class(recipe.model.name), recipe.model)
    missing = config_dims_missing(config)
    if missing:
        raise ShardkitError("model", f"suggest ranks layouts with the analytic model, which reads the dimensions "
                            f"{missing} from the model's Config; {type(config).__name__} has no such fields: compare "
                            "recipes with `shardkit plan` or `shardkit hlo` instead")


def _suggest(args) -> int:
    from shardkit.analysis.planning.plan_page import write_page
    from shardkit.analysis.predicted.targets import parse_target, target_devices
    from shardkit.analysis.search.suggest import format_suggestion, load_base, suggest, winner_plan, write_recipe
    from shardkit.run.devices import use_cpu_host

    target = parse_target(args.target)
    if args.top < 0:
        raise ShardkitError("--top", f"must be >= 0, got {args.top}")
    recipe = load_base(args.recipe, args.overrides)
    _check_analytic_dims(recipe)
    use_cpu_host()
    compiling = not args.no_compile and args.top > 0
    devices = target_devices(target) if compiling else None  # a missing plugin fails here, before the search
    log = lambda line: print(line, file=sys.stderr, flush=True)
    result = suggest(recipe, target, args.top, devices, log=log)
    if args.write:
        with _writing(args.write):
            write_recipe(result, args.write)
    if args.html:
        with _writing(args.html):
            write_page(args.html, winner_plan(result), result.winner.layout, result.to_json(args.top))
    print(json.dumps(result.to_json(args.top), indent=1) if args.json else format_suggestion(result, args.top))
    if args.write and not args.json:
        print(f"wrote {args.write}; check it with: shardkit plan {args.write} --target {target}")
    return 0


def _layout_for(args):
    """The recipe's layout on the fake/real devices, or on the compile-only devices of `--target`."""
    from shardkit.layout import build_layout

    recipe = _load(args)
    if not getattr(args, "target", None):
        return build_layout(recipe)
    from shardkit.analysis.predicted.targets import parse_target, target_devices
    from shardkit.run.devices import use_cpu_host

    target = parse_target(args.target)
    if args.devices is None:
        use_cpu_host()
    devices = target_devices(target)
    return build_layout(recipe, devices)


def _hlo(args) -> int:
    from shardkit.analysis.compiled.hlo import format_summary, write_artifacts
    from shardkit.step import build_step

    layout = _layout_for(args)
    from shardkit.xla_flags import compile_lowered

    builder = build_step(layout)
    lowered = builder.lower() if args.step == "train" else builder.lower_eval()
    compiled = compile_lowered(lowered, layout.recipe, layout.mesh)
    extra = {"recipe": layout.recipe.name, "target": args.target, "platform": mesh_platform(layout.mesh),
             "step": args.step, "attention": {"kernel": layout.attention.choice.kernel,
                                              "reason": layout.attention.choice.reason}}
    exposure = _exposure(compiled, layout, args.target)
    predicted = None
    if exposure is not None:  # the scheduled GPU program: how much of its communication compute hides
        extra["exposure"] = exposure.to_json()
        predicted = _predicted(exposure, layout, args.target, extra) if args.step == "train" else None
    with _writing(args.out):
        summary = write_artifacts(lowered, compiled, args.out, layout.mesh, extra)
    print(format_summary(summary))
    if args.step == "train" and layout.pipeline.one_f_one_b and summary.collectives.conditional_ops:
        print(_tick_switch_lines(compiled, summary, layout))
    print(f"attention (shardkit.nn.attention): {layout.attention.choice.kernel} ({layout.attention.choice.reason})")
    if exposure is not None:
        from shardkit.analysis.predicted.overlap import format_exposure

        print(format_exposure(exposure, args.target))
    if predicted is not None:
        print(predicted)
    print(f"wrote {args.out}/stablehlo.mlir, optimized_hlo.txt, summary.json")
    return 0


def _tick_switch_lines(compiled, summary, layout) -> str:
    """The 1F1B family's exact collective bytes per stage, each tick's switch attributed; or why not."""
    from shardkit.analysis.compiled.hlo_parse import parse_hlo
    from shardkit.analysis.compiled.tick_branches import exact_lines
    from shardkit.pipeline.program import tick_program

    lines = exact_lines(parse_hlo(compiled.as_text()), summary.collectives, tick_program(layout.pipeline))
    return "\n".join(lines) if lines else "tick switches not attributed: the upper bound above stands"


def _predicted(exposure, layout, target_text, out: dict) -> str:
    """The step time the replay predicts (the line `suggest` prints for the same compiled layout); kept in `out`."""
    from shardkit.analysis.predicted.steptime import format_predicted, replayed_step_time
    from shardkit.analysis.predicted.targets import parse_target

    step = replayed_step_time(exposure, layout, parse_target(target_text))
    out["predicted_step"] = step.to_json()
    return format_predicted(step, parse_target(target_text))


def _exposure(compiled, layout, target_text):
    """The exposed-communication report of a `--target` compile (shardkit.analysis.predicted.overlap), None without a
    target."""
    if not target_text:
        return None
    from shardkit.analysis.predicted.overlap import exposure_report
    from shardkit.analysis.predicted.targets import parse_target

    return exposure_report(compiled, layout.mesh, parse_target(target_text))


def _bench(args) -> int:
    from shardkit.analysis.compiled.collectives import (
        DEFAULT_SIZES,
        HEADER,
        check_repeats,
        parse_ops,
        parse_sizes,
        run_bench,
    )

    sizes = parse_sizes(args.sizes) if args.sizes else DEFAULT_SIZES
    ops = parse_ops(args.ops)
    check_repeats(args.repeats)  # all input checked before the header, so bad input prints nothing to stdout
    print(HEADER)
    run_bench(ops, sizes, args.repeats, log=lambda line: print(line, flush=True))
    return 0


def _export(args) -> int:
    import jax

    from shardkit.hf.export import export_run

    jax.config.update("jax_platforms", "cpu")  # export reads files into host memory: no accelerator is needed
    if args.format == "hf":
        from shardkit.hf.convert import export_hf
        from shardkit.units import parse_size

        written = export_hf(args.run_dir, args.to, args.step, parse_size(args.shard_size, "--shard-size"))
        print(f"exported step {written['step']} to {args.to} as a Hugging Face Llama ({', '.join(written['files'])})")
        return 0
    index = export_run(args.run_dir, args.to, args.step)
    print(f"exported {len(index['params'])} parameters of step {index['step']} to {args.to}")
    return 0


def _use_devices(args) -> None:
    """Fake devices, after checking the count against the recipe's mesh: before JAX starts, so a typo costs nothing."""
    from shardkit.run.devices import check_fake_device_count, use_fake_cpu_devices

    check_fake_device_count(args.devices, _load(args).mesh if getattr(args, "recipe", None) else None)
    use_fake_cpu_devices(args.devices)


# Every flag naming something a command writes, by argparse dest: checked in `main` before any work.
OUTPUT_DIRS = {"out": "--out", "to": "--to"}
OUTPUT_FILES = {"html": "--html", "gantt": "--gantt", "write": "--write"}


@contextlib.contextmanager
def _writing(path: str):
    """Writes to `path` whose failure names it: a full disk or an I/O error raised by write or close carries no file
    name (an open's errors do), and `main` reports only OSErrors that name a file, as one line."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            err.filename = str(path)
        raise


def _check_outputs(args) -> None:
    """Each output a command was given can be written (shardkit.run.outputs): one line, exit 2, before any work."""
    from shardkit.run.outputs import check_output_dir, check_output_file

    for dest, flag in OUTPUT_DIRS.items():
        if getattr(args, dest, None) is not None:
            check_output_dir(flag, getattr(args, dest))
    for dest, flag in OUTPUT_FILES.items():
        if getattr(args, dest, None) is not None:
            check_output_file(flag, getattr(args, dest))


def _printable(text: str) -> str:
    """The message on one line whatever the input held: control and format characters (a newline or carriage return
    in a key, a bidi override) are shown escaped, as Python writes them."""
    return "".join(
        char.encode("unicode_escape").decode("ascii") if unicodedata.category(char)[0] == "C" else char
        for char in text
    )


def set_memory_fraction(environ: MutableMapping[str, str] | None = None) -> str:
    """Set JAX's GPU memory fraction before JAX starts, unless the user did; returns the fraction in effect.

    Only the GPU client reads it, so it is harmless on CPU runs.
    """
    environ = os.environ if environ is None else environ
    return environ.setdefault(MEM_FRACTION_ENV, DEFAULT_MEM_FRACTION)


NVIDIA_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


def _cpu_without_nvidia_driver(environ: MutableMapping[str, str] | None = None) -> None:
    """On a machine without NVIDIA's driver, JAX on the CPU, unless the user chose its platforms.

    Why: with the jax[cuda12] plugin installed (the test extra brings it, to compile for GPU targets), JAX tries to
    start CUDA first and logs a `cuInit(0) failed` traceback before falling back to the CPU. A `--target` compile
    needs no driver either: it builds its compile-only devices from the plugin itself.
    """
    environ = os.environ if environ is None else environ
    if "JAX_PLATFORMS" not in environ and not any(os.path.exists(path) for path in NVIDIA_DRIVER_FILES):
        environ["JAX_PLATFORMS"] = "cpu"


def _quiet_process_reports() -> None:
    """What the command line sets for the whole process and a library never does: orbax's reports of failures that
    shardkit reports itself go, and shardkit's warnings print as one `shardkit: warning:` line."""
    from shardkit.run.checkpoint import quiet_orbax_reports

    quiet_orbax_reports()
    warnings.showwarning = _one_line_warning


_PYTHON_SHOWWARNING = warnings.showwarning
_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """shardkit's own warnings as one `shardkit: warning:` line; anyone else's as Python prints them."""
    if not str(Path(filename).resolve()).startswith(_PACKAGE_DIR):
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)
        return
    print(f"shardkit: warning: {_printable(str(message))}", file=sys.stderr if file is None else file)


def _supervised_peers(args):
    """The peers of a multi-process `train`, which runs under a supervisor (`shardkit.run.supervise`); None for any
    other command, a single process, or the supervised child itself."""
    if args.command != "train" or not can_supervise():
        return None
    return find_peers(args.coordinator, args.num_processes, args.process_id)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardkit` command; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        _check_outputs(args)
        peers = _supervised_peers(args)
        if peers is not None:  # before anything starts JAX or sets its variables: the child does
            return supervise(sys.argv[1:] if argv is None else list(argv), args.out, process_index(peers))
        set_memory_fraction()  # before JAX starts: its GPU client reads it once (CPU runs ignore it)
        if getattr(args, "devices", None) is not None:
            _use_devices(args)
        else:
            _cpu_without_nvidia_driver()  # before anything imports JAX, which reads JAX_PLATFORMS then
        _quiet_process_reports()
        return args.run(args)
    except ShardkitError as err:
        print(f"shardkit: error: {_printable(str(err))}", file=sys.stderr)
        return getattr(err, "exit_code", EXIT_BAD_INPUT)  # e.g. 3 for a non-finite loss (shardkit.run.loop)
    except RuntimeError as err:  # XLA's allocation failures outside the training loop (plan, hlo, bench)
        if not is_out_of_memory(err):
            raise
        print(f"shardkit: error: {out_of_memory_error(err)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as err:  # writing an output failed after the pre-checks (disk full, I/O error, removed directory)
        if err.filename is None:  # not a file's failure: a bug, with its traceback
            raise
        reason = err.strerror or type(err).__name__
        print(f"shardkit: error: {_printable(str(err.filename))}: {reason}", file=sys.stderr)
        return EXIT_BAD_INPUT


def run() -> None:
    """The console script: `main` with its exit code; a closed pipe (`shardkit plan ... | head`) ends quietly."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes at exit
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    run()
