"""Compiled memory per device against sequence length under context parallelism, and the longest sequence that fits.

    python bench/context_memory.py --devices 8                      # the sweep in the README (compile only)
    python bench/context_memory.py --devices 8 --cp 2 --lengths 4096 --budget-gib 24
    JAX_PLATFORMS=cpu python bench/context_memory.py --compare-context --target h100x8 --lengths 32768

`--compare-context` compiles recipes/cp.toml (sequence 4 x fsdp 2, bf16, remat full) for a GPU target (needs the
jax[cuda12] plugin, no GPU) once per train.context (ring, allgather) and block kernel (xla, cudnn), and prints the
bytes one device sends in collectives over `sequence` per step (ring algorithms) and XLA's compiled peak memory per
device: the figures that chose train.context's default (README). Compile-only: no timing.

For each ring size cp (train.context = ring, mesh.sequence = cp, mesh.fsdp = --fsdp for every cp, every other axis 1,
one sequence per step) and each length, the training step of recipes/cp.toml with the `small` Llama is lowered and
compiled, never run, and
XLA's memory analysis gives the bytes per device: arguments + outputs - aliased (donated state) + temporaries. The
columns split that total into the part fixed by the model and layout and the part that grows with the sequence:
    state        arguments + outputs - aliased: parameters and optimizer state (same for every cp: fsdp is fixed)
    grads        fp32 gradients, the part of the temporaries fixed by the parameters (analytic,
                 shardkit.analysis.predicted.estimate)
    act          temporaries - grads: activations, logits and the transients of the step;
    O(s / cp) per device
    act/1k tok   act per 1024 tokens per device: flat across cp at one s / cp when memory is O(s / cp)
"The longest sequence that trains" is the longest length (a multiple of 2 x cp x 1024, so zigzag chunks split into
whole key chunks) whose compiled footprint stays within the budget: a fit through the sweep's longest lengths (quadratic
for cp = 1, linear for ring attention) predicts it, and compiles at and around the prediction confirm it.

cp = 1 has no ring: attention is plain attention, whose (s x s) scores make its memory quadratic in s; ring attention
(cp > 1) scores at most 512 keys at a time, so its memory grows linearly in s / cp.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 1024**3
STEP_MULTIPLE = 1024  # lengths are multiples of 2 x cp x this, so zigzag chunks split into whole key chunks


def compiled_bytes(cp: int, seq_len: int, model: str, remat: str, fsdp: int = 1) -> dict:
    """Compile one step and return XLA's per-device figures (bytes), split into fixed and activation parts."""
    import jax

    from shardkit.analysis.predicted.memory_terms import sharded_bytes
    from shardkit.layout import build_layout
    from shardkit.recipe import load_recipe
    from shardkit.step import build_step

    overrides = [f"model.preset={model}", f"mesh.fsdp={fsdp}", f"mesh.sequence={cp}", "train.global_batch=1",
                 f"train.seq_len={seq_len}", f"train.remat={remat}", "train.context=ring"]
    recipe = load_recipe(ROOT / "recipes" / "cp.toml", overrides)
    began = time.perf_counter()
    layout = build_layout(recipe, jax.devices()[: cp * fsdp])
    memory = build_step(layout).compile().memory_analysis()
    state = memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
    grads = sharded_bytes(layout, "gradients", 4)
    return {"cp": cp, "fsdp": fsdp, "seq_len": seq_len, "state": state, "grads": grads,
            "act": memory.temp_size_in_bytes - grads, "temp": memory.temp_size_in_bytes,
            "arguments": memory.argument_size_in_bytes, "total": state + memory.temp_size_in_bytes,
            "compile_s": round(time.perf_counter() - began, 1)}


def predict_longest(points: list[dict], budget: float, degree: int) -> float:
    """The length where a polynomial fit of total bytes through the longest points reaches the budget.

    `degree` 2 for plain attention (cp = 1, s x s scores), 1 for ring attention, whose memory is linear in s; the fit
    uses the longest `degree + 1` lengths, past short sequences where the key chunks are still shorter than 512.
    """
    import numpy as np

    longest = sorted(points, key=lambda p: p["seq_len"])[-(degree + 1):]
    lengths = np.array([p["seq_len"] for p in longest], float)
    totals = np.array([p["total"] for p in longest], float)
    coeffs = np.polyfit(lengths, totals, min(degree, len(longest) - 1))
    roots = np.roots(np.concatenate([coeffs[:-1], [coeffs[-1] - budget]]))
    real = [r.real for r in roots if abs(r.imag) < 1e-6 and r.real > 0]
    return max(real) if real else float(lengths.max())


def longest_that_fits(cp: int, points: list[dict], budget: float, args) -> tuple[int, list[dict]]:
    """Confirm the predicted longest length by compiling at it, stepping down until it fits and up while it fits."""
    unit = 2 * cp * STEP_MULTIPLE
    guess = max(unit, int(predict_longest(points, budget, degree=2 if cp == 1 else 1)) // unit * unit)
    checked = []
    fit = compiled_bytes(cp, guess, args.model, args.remat, args.fsdp)
    checked.append(fit)
    while fit["total"] > budget and guess > unit:
        guess -= unit
        fit = compiled_bytes(cp, guess, args.model, args.remat, args.fsdp)
        checked.append(fit)
    if fit["total"] > budget:
        return 0, checked  # not even the shortest length fits
    while True:  # the fit may be pessimistic: step up while the next length still fits
        above = compiled_bytes(cp, guess + unit, args.model, args.remat, args.fsdp)
        checked.append(above)
        if above["total"] > budget:
            return guess, checked
        guess = above["seq_len"]


def context_figures(target: str, model: str, seq_len: int, context: str, kernel: str) -> dict:
    """One compile of the cp recipe for `target`: collective bytes over `sequence` by kind, and peak bytes per
    device."""
    from shardkit.analysis.compiled.hlo import hlo_summary
    from shardkit.analysis.predicted.targets import parse_target, target_devices
    from shardkit.attention import context as sequence
    from shardkit.layout import build_layout
    from shardkit.recipe import load_recipe
    from shardkit.step import build_step

    sequence.block_kernel = lambda _context: kernel  # until train.attention reaches the model context (see sequence)
    overrides = [f"model.preset={model}", "precision.policy=bf16", "train.global_batch=2", f"train.seq_len={seq_len}",
                 "train.remat=full", f"train.context={context}"]
    layout = build_layout(load_recipe(ROOT / "recipes" / "cp.toml", overrides), target_devices(parse_target(target)))
    summary = hlo_summary(build_step(layout).compile(), layout.mesh)
    kinds = ("collective-permute", "all-gather", "reduce-scatter", "all-reduce")
    sent = {kind: summary.collectives.wire_bytes(kind, ("sequence",)) for kind in kinds}
    # shardkit.analysis.compiled.hlo sums a collective-permute over its n source-target pairs; one device sends 1 / n
    # of that.
    sent["collective-permute"] /= layout.mesh.shape["sequence"]
    counts = {kind: summary.collectives.count(kind, ("sequence",)) for kind in kinds}
    return {"context": context, "kernel": kernel, "seq_len": seq_len, "bytes": sent, "counts": counts,
            "peak": summary.memory["peak_bytes"]}


def compare_context(args) -> int:
    rows = []
    print(f"{'context':>9} {'kernel':>6} {'seq_len':>8} {'peak GiB':>8}  collectives over sequence per step "
          "(count x, MiB one device sends)")
    for seq_len in args.lengths:
        for kernel in args.kernels:
            for context in ("ring", "allgather"):
                row = context_figures(args.target, args.model, seq_len, context, kernel)
                rows.append(row)
                moved = ", ".join(f"{kind} {row['counts'][kind]}x {row['bytes'][kind] / 2**20:.0f}"
                                  for kind in row["bytes"] if row["counts"][kind])
                print(f"{context:>9} {kernel:>6} {seq_len:>8} {row['peak'] / GIB:>8.2f}  {moved}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (at least the largest cp)")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--model", default="small")
    parser.add_argument("--remat", default="full", help="train.remat for every run (full: long-sequence training)")
    parser.add_argument("--fsdp", type=int, default=1, help="mesh.fsdp for every cp, so the state per device is the "
                        "same across the sweep (needs cp x fsdp devices)")
    parser.add_argument("--budget-gib", type=float, default=24.0, help="memory per device that must hold the step")
    parser.add_argument("--no-longest", action="store_true", help="only the sweep")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compare-context", action="store_true", help="ring against allgather on --target instead")
    parser.add_argument("--target", default="h100x8", help="GPU target of --compare-context")
    parser.add_argument("--kernels", nargs="+", default=["xla", "cudnn"], help="block kernels of --compare-context")
    args = parser.parse_args(argv)
    if args.compare_context:
        return compare_context(args)

    from shardkit.run.devices import use_fake_cpu_devices

    use_fake_cpu_devices(args.devices)
    budget = args.budget_gib * GIB
    results = {"model": args.model, "remat": args.remat, "fsdp": args.fsdp, "budget_gib": args.budget_gib,
               "sweep": [], "longest": {}}
    print(f"{'cp':>3} {'seq_len':>8} {'state GiB':>9} {'grads GiB':>9} {'act GiB':>8} {'act/1k tok MiB':>14} "
          f"{'total GiB':>9} {'compile s':>9}")
    for cp in args.cp:
        points = []
        for seq_len in args.lengths:
            point = compiled_bytes(cp, seq_len, args.model, args.remat, args.fsdp)
            points.append(point)
            per_1k_tokens = point["act"] / (seq_len / cp / 1024) / 2**20
            print(f"{cp:>3} {seq_len:>8} {point['state'] / GIB:>9.2f} {point['grads'] / GIB:>9.2f} "
                  f"{point['act'] / GIB:>8.2f} {per_1k_tokens:>14.1f} {point['total'] / GIB:>9.2f} "
                  f"{point['compile_s']:>9}", flush=True)
        results["sweep"] += points
        if not args.no_longest:
            longest, checked = longest_that_fits(cp, points, budget, args)
            results["longest"][cp] = {"seq_len": longest, "checked": checked}
            print(f"{cp:>3} longest within {args.budget_gib:g} GiB per device: {longest} tokens "
                  f"(checked {[c['seq_len'] for c in checked]})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
