"""Exposed communication per mesh axis with and without shardkit's GPU overlap flags: the README table.

    JAX_PLATFORMS=cpu python bench/overlap.py --targets h100x8 h100:2x8 --recipes fsdp zero1 fsdp_tp pp_fsdp_tp
    JAX_PLATFORMS=cpu python bench/overlap.py --targets h100x8 --recipes fsdp --ablate     # one candidate at a time

Each (target, recipe) is lowered once and compiled for the target's compile-only devices twice (or more with
`--ablate`): "off" with shardkit's GPU defaults less the overlap flags (`shardkit.xla_flags.OVERLAP_DEFAULTS`), "on"
with all of them. Each compile's scheduled HLO is replayed by `shardkit.analysis.predicted.overlap` (model in its
docstring and the README). The model is the 8b preset at seq 4096, bf16 compute, full remat, 2 sequences per device (the
global batch scales with the devices). No GPU is needed or used: every figure is a prediction from the compiled
schedule.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RECIPES = ("fsdp", "zero1", "fsdp_tp", "pp_fsdp_tp")
# Candidates tried with --ablate, each alone on top of "off" (the defaults keep those that shorten the step).
CANDIDATES = {
    "latency_hiding_scheduler": {"xla_gpu_enable_latency_hiding_scheduler": True},
    "pipelined_all_gather": {"xla_gpu_enable_pipelined_all_gather": True},
    "pipelined_reduce_scatter": {"xla_gpu_enable_pipelined_reduce_scatter": True},
    "pipelined_all_reduce": {"xla_gpu_enable_pipelined_all_reduce": True},
    "while_loop_double_buffering": {"xla_gpu_enable_while_loop_double_buffering": True},
    "reduce_scatter_combine_8MiB": {"xla_gpu_reduce_scatter_combine_threshold_bytes": 8 * 2**20},
    "all_gather_combine_512MiB": {"xla_gpu_all_gather_combine_threshold_bytes": 512 * 2**20},
    "windowed_einsum": {"xla_gpu_threshold_for_windowed_einsum_mib": 0, "xla_gpu_multi_streamed_windowed_einsum": True},
}


def overrides(recipe: str, target, preset: str, seq: int, per_device: int) -> list[str]:
    """The model and step settings of the table; a recipe whose fixed mesh covers 8 devices spreads `fsdp` over
    the rest of a bigger target."""
    out = [f"model.preset={preset}", f"train.seq_len={seq}", f"train.global_batch={per_device * target.devices}",
           "precision.policy=bf16", "train.remat=full"]
    if recipe == "pp_fsdp_tp" and target.devices != 8:
        out.append("mesh.fsdp=-1")
    return out


def variants(ablate: bool, extra: list[str] = ()) -> dict[str, dict]:
    """name -> compiler options: off, on, with --ablate each candidate alone on top of off, and each `--variant`
    (`+name+name...`: those candidates together on top of off)."""
    from shardkit.xla_flags import GPU_DEFAULTS, OVERLAP_DEFAULTS

    off = {name: value for name, value in GPU_DEFAULTS.items() if name not in OVERLAP_DEFAULTS}
    out = {"off": off, "on": dict(GPU_DEFAULTS)}
    if ablate:
        out |= {f"+{name}": off | flags for name, flags in CANDIDATES.items()}
    for combination in extra:
        flags = dict(off)
        for name in combination.strip("+").split("+"):
            flags |= CANDIDATES[name]
        out[combination] = flags
    return out


def measure(recipe: str, target_text: str, args) -> dict:
    """Compile one recipe for one target under each variant; the exposure report of each."""
    from shardkit.analysis.predicted.overlap import exposure_report
    from shardkit.analysis.predicted.targets import parse_target, target_devices
    from shardkit.layout import build_layout
    from shardkit.recipe import load_recipe
    from shardkit.step import build_step

    target = parse_target(target_text)
    loaded = load_recipe(f"recipes/{recipe}.toml", overrides(recipe, target, args.preset, args.seq, args.per_device))
    layout = build_layout(loaded, target_devices(target))
    began = time.perf_counter()
    lowered = build_step(layout).lower()
    out = {"recipe": recipe, "target": target_text, "mesh": {k: v for k, v in layout.mesh.shape.items() if v > 1},
           "lower_s": time.perf_counter() - began, "variants": {}}
    for name, options in variants(args.ablate, args.variant).items():
        began = time.perf_counter()
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as err:  # noqa: BLE001 - report which combination XLA refused, then go on
            out["variants"][name] = {"error": str(err).splitlines()[0][:300]}
            continue
        report = exposure_report(compiled, layout.mesh, target)
        out["variants"][name] = {"compile_s": time.perf_counter() - began, **report.to_json()}
        print(f"  {recipe} {target_text} {name}: compile {time.perf_counter() - began:.0f}s, compute "
              f"{report.compute_seconds * 1e3:.1f} ms, exposed {report.exposed_seconds * 1e3:.2f} ms of "
              f"{report.comm_seconds * 1e3:.1f} ms", file=sys.stderr, flush=True)
    return out


MINOR_S = 5e-5  # rows of less communication than this (scalars: the loss, the gradient norm) are left out


def markdown(results: list[dict]) -> str:
    """The README table: per target, recipe and mesh axes, communication and exposed time off -> on."""
    lines = ["| target | recipe (mesh) | axes | comm ms | exposed ms off | exposed ms on | all-gather exposed off -> "
             "on |",
             "|---|---|---|---:|---:|---:|---|"]
    for result in results:
        off, on = result["variants"].get("off", {}), result["variants"].get("on", {})
        if "error" in off or "error" in on:
            lines.append(f"| {result['target']} | {result['recipe']} | - | - | {off.get('error', '')} | "
                         f"{on.get('error', '')} | |")
            continue
        mesh = ",".join(f"{axis}={size}" for axis, size in result["mesh"].items())
        for axes in sorted(set(off["by_axes"]) | set(on["by_axes"])):
            a, b = off["by_axes"].get(axes, {}), on["by_axes"].get(axes, {})
            if max(a.get("comm_s", 0), b.get("comm_s", 0)) < MINOR_S:
                continue
            gather = [axes_kinds.get(axes, {}).get("all-gather") for axes_kinds in
                      (off["by_axes_and_kind"], on["by_axes_and_kind"])]
            major = all(gather) and min(g["comm_s"] for g in gather) >= MINOR_S
            gathered = f"{_share(gather[0])} -> {_share(gather[1])}" if major else ""
            lines.append(f"| {result['target']} | {result['recipe']} ({mesh}) | {axes} | "
                         f"{b.get('comm_s', 0) * 1e3:.1f} | {_ms(a)} | {_ms(b)} | {gathered} |")
        lines.append(f"| {result['target']} | {result['recipe']} ({mesh}) | **step** | {on['comm_s'] * 1e3:.1f} | "
                     f"{off['exposed_s'] * 1e3:.1f} (compute {off['compute_s'] * 1e3:.0f}, step "
                     f"{off['step_s'] * 1e3:.0f}) | {on['exposed_s'] * 1e3:.1f} (compute {on['compute_s'] * 1e3:.0f}, "
                     f"step {on['step_s'] * 1e3:.0f}) | |")
    return "\n".join(lines)


def ablation(results: list[dict]) -> str:
    """One line per recipe and variant: compute, exposed and step time (ms)."""
    lines = ["| target | recipe | variant | compute ms | exposed ms | step ms | bytes same as off |",
             "|---|---|---|---:|---:|---:|---|"]
    for result in results:
        off = result["variants"].get("off", {})
        for name, variant in result["variants"].items():
            if "error" in variant:
                lines.append(f"| {result['target']} | {result['recipe']} | {name} | {variant['error']} | | | |")
                continue
            same = _bytes(variant) == _bytes(off)
            lines.append(f"| {result['target']} | {result['recipe']} | {name} | {variant['compute_s'] * 1e3:.1f} | "
                         f"{variant['exposed_s'] * 1e3:.2f} | {variant['step_s'] * 1e3:.1f} | {same} |")
    return "\n".join(lines)


def _bytes(variant: dict) -> dict:
    return {kind: round(entry["bytes"]) for kind, entry in variant.get("by_kind", {}).items()}


def _ms(entry: dict) -> str:
    if not entry:
        return "-"
    share = entry["exposed_s"] / entry["comm_s"] if entry["comm_s"] else 0.0
    return f"{entry['exposed_s'] * 1e3:.2f} ({share:.0%})"


def _share(entry: dict) -> str:
    return f"{entry['exposed_s'] / entry['comm_s']:.1%}" if entry["comm_s"] else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", nargs="+", default=["h100x8", "h100:2x8"])
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--preset", default="8b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--per-device", type=int, default=2, help="sequences per device (global batch / devices)")
    parser.add_argument("--ablate", action="store_true", help="also compile each candidate flag alone")
    parser.add_argument("--variant", action="append", default=[], metavar="+A+B",
                        help="also compile these --ablate candidates together (repeatable)")
    parser.add_argument("--json", metavar="FILE", help="write every report here")
    parser.add_argument("--from-json", nargs="+", metavar="FILE", help="print the tables of earlier --json runs")
    args = parser.parse_args()
    if args.from_json:
        results = [result for path in args.from_json for result in json.loads(Path(path).read_text())]
    else:
        from shardkit.run.devices import use_fake_cpu_devices

        use_fake_cpu_devices(1)  # the host side is the CPU; the step compiles for the target's compile-only devices
        results = [measure(recipe, target, args) for target in args.targets for recipe in args.recipes]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    if args.ablate or args.variant or any(len(result["variants"]) > 2 for result in results):
        print()
        print(ablation(results))


if __name__ == "__main__":
    main()
