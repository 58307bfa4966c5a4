"""Exact collective bytes of the 1F1B family's tick switches: which branch of which HLO conditional runs at each tick.

`shardkit.analysis.compiled.hlo` can only bound a conditional's collectives from above (its costliest branch every
time), since which branch runs is data-dependent. For the tick executor (shardkit/pipeline/one_f_one_b.py) it is not:
the tick program says which action every stage takes at every tick, and `tick_switch` which branch runs it. What is
left is to find each tick's switch in the compiled program:

- Every tick's switch consumes the sums the previous tick's switch returned: the conditionals form a chain of data
  dependencies in tick order. HLO text defines every value before its use, so walking the entry's instructions in
  text order, and expanding each while loop by its known trip count (a tick block's scan, kept as a loop or unrolled
  by XLA), lists the conditional that runs at every tick.
- A tick where every stage idles has a switch of one branch, which `jax.lax.switch` compiles as a plain call: no
  conditional, and its code is counted with the unconditional collectives. The other ticks each have one.
- The attribution is checked, not assumed: the list must be exactly as long as the program has ticks with a
  conditional, in tick order, and hold every conditional as often as it runs per step (`hlo_parse.count_executions`),
  every conditional must have as many branches as its tick's switch, and its branches' op_name metadata
  (`.../cond/branch_<i>_fun/...`) must name their own index and no other (at least one of them naming it), so branch
  i is `tick_switch(actions)[0][i]`.

Where any check fails (another program, another XLA), `attribute_ticks` returns None and callers keep the upper
bound.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Mapping

import numpy as np

from shardkit.analysis.compiled.collective_kinds import COLLECTIVE_KINDS
from shardkit.analysis.compiled.hlo import CollectiveOp, CollectiveSummary, human_bytes
from shardkit.analysis.compiled.hlo_parse import (
    BRANCH_ATTRIBUTES,
    Branch,
    HloModule,
    count_executions,
    known_trip_count,
)

_BRANCH_FUN = re.compile(r"/cond/branch_(\d+)_fun(?:/|$)")
# (collective kind, spanned mesh axes sorted) -> full-buffer bytes per step
KindAxesBytes = Mapping[tuple[str, tuple[str, ...]], float]


@dataclasses.dataclass(frozen=True)
class TickConditional:
    """The HLO conditional that runs at one tick, and the names of its branches (the tick switch's, in order)."""

    tick: int
    conditional: str
    executions: int  # how often this conditional runs per step (its enclosing loops' trip counts)
    branch_names: tuple[str, ...]
    branch_of_action: tuple[int, ...]  # per `Action`, the branch index that runs it


def conditionals_in_order(module: HloModule) -> list[tuple[str, int]]:
    """(conditional, runs per step) in execution order, one entry per run: while loops are expanded by their known
    trip count (their bodies' conditionals repeated), branches are not entered. None of a loop without a known trip
    count is expanded (the list is then too short and the attribution fails)."""
    counts = count_executions(module)
    memo: dict[str, list[str]] = {}

    def sequence(name: str) -> list[str]:
        if name not in memo:  # a loop body or called computation shared by several callers is walked once
            out: list[str] = []
            for instruction in module.computations[name].instructions:
                if instruction.opcode == "conditional":
                    out.append(instruction.name)
                elif instruction.opcode == "while":
                    trip, body = known_trip_count(instruction), dict(instruction.callees()).get("body")
                    if trip is not None and body in module.computations:
                        out += sequence(body) * trip
                elif instruction.opcode == "call":
                    out += [c for _, callee in instruction.callees() if callee in module.computations
                            for c in sequence(callee)]
            memo[name] = out
        return memo[name]

    runs = {}
    for name, times in counts.always.items():
        for instruction in module.computations[name].instructions:
            if instruction.opcode == "conditional":
                runs[instruction.name] = runs.get(instruction.name, 0) + times
    return [(name, runs.get(name, 0)) for name in sequence(module.entry)]


def attribute_ticks(module: HloModule, program) -> list[TickConditional] | None:
    """Each tick's conditional and branch names, or None where the compiled program does not check out (see the
    module docstring). `program`: the `TickProgram` the step was built from."""
    from shardkit.pipeline.one_f_one_b import tick_switch
    from shardkit.pipeline.program import block_actions, tick_blocks

    switches = [(tick, *tick_switch(block_actions(program, first + (tick - first) % period, period, count)))
                for first, period, count in tick_blocks(program) for tick in range(first, first + period * count)]
    switches = [(tick, names, index) for tick, names, index in switches if len(names) > 1]
    order = conditionals_in_order(module)
    walked = collections.Counter(name for name, _ in order)
    if len(order) != len(switches) or any(walked[name] != runs for name, runs in order):
        return None
    conditionals = {instruction.name: instruction for computation in module.computations.values()
                    for instruction in computation.instructions if instruction.opcode == "conditional"}
    out = []
    for (tick, names, index), (name, executions) in zip(switches, order):
        branches = [callee for attribute, callee in conditionals[name].callees() if attribute in BRANCH_ATTRIBUTES]
        named = [_named_branches(module, branch) for branch in branches]
        if len(branches) != len(names) or not any(named) or any(seen - {i} for i, seen in enumerate(named)):
            return None
        out.append(TickConditional(tick, name, executions, tuple(names), tuple(int(i) for i in index)))
    return out


def _named_branches(module: HloModule, computation: str) -> set[int]:
    """The switch branch indices the op_names of a branch computation's instructions name (the first, outermost
    `cond/branch_<i>_fun` of each; a switch inside a layer would come later in the name)."""
    return {int(match.group(1)) for instruction in module.computations[computation].instructions
            for match in [_BRANCH_FUN.search(instruction.op_name)] if match}


def branch_bytes(collectives: CollectiveSummary, ticks: list[TickConditional],
                 measure: str = "bytes") -> dict[Branch, dict[tuple[str, tuple[str, ...]], float]]:
    """Per branch of the tick conditionals, the (kind, axes) -> bytes (or `count`, `wire_bytes`) of ONE run of it."""
    executions = {tick.conditional: tick.executions for tick in ticks}
    out: dict[Branch, dict] = collections.defaultdict(lambda: collections.defaultdict(float))
    for op in collectives.conditional_ops:
        if op.branch.conditional in executions and op.group_size > 1:
            value = 1.0 if measure == "count" else getattr(op, measure)
            out[op.branch][_key(op)] += op.count * value / executions[op.branch.conditional]
    return out


def _key(op: CollectiveOp) -> tuple[str, tuple[str, ...]]:
    return op.kind, tuple(sorted(op.axes or ()))


def stage_bytes(collectives: CollectiveSummary, ticks: list[TickConditional], action: np.ndarray,
                measure: str = "bytes") -> list[dict[tuple[str, tuple[str, ...]], float]]:
    """Per stage, the exact per-step (kind, axes) -> bytes: the unconditional collectives plus, at every tick, the
    branch that stage's action takes. `action`: the program's [stage, tick] action table."""
    per_branch = branch_bytes(collectives, ticks, measure)
    unconditional: dict = collections.defaultdict(float)
    for op in collectives.ops:
        if op.group_size > 1:
            unconditional[_key(op)] += op.count * (1.0 if measure == "count" else getattr(op, measure))
    stages = []
    for stage in range(action.shape[0]):
        total = collections.defaultdict(float, unconditional)
        for tick in ticks:
            branch = Branch(tick.conditional, tick.branch_of_action[int(action[stage, tick.tick])])
            for key, value in per_branch.get(branch, {}).items():
                total[key] += value
        stages.append(dict(total))
    return stages


def exact_tick_bytes(module: HloModule, collectives: CollectiveSummary, program,
                     measure: str = "bytes") -> list[dict[tuple[str, tuple[str, ...]], float]] | None:
    """Per stage, the exact per-step collective bytes of a 1F1B-family step, or None where the tick switches cannot
    be attributed (see `attribute_ticks`)."""
    ticks = attribute_ticks(module, program)
    return None if ticks is None else stage_bytes(collectives, ticks, program.action, measure)


def branch_name_bytes(collectives: CollectiveSummary, ticks: list[TickConditional]) -> dict[str, float] | None:
    """Bytes of one run of each named branch (`forward`, `backward_last`, ...), or None where two conditionals'
    branches of one name differ (then the names would not tell the cost apart and the figures need a closer look)."""
    per_branch = branch_bytes(collectives, ticks)
    out: dict[str, float] = {}
    for tick in ticks:
        for index, name in enumerate(tick.branch_names):
            value = sum(per_branch.get(Branch(tick.conditional, index), {}).values())
            if out.setdefault(name, value) != value:
                return None
    return out


def by_kind(per_key: KindAxesBytes, family=lambda kind: kind) -> dict[str, float]:
    """(kind, axes) -> bytes summed per kind (or per `family(kind)`)."""
    out: dict[str, float] = collections.defaultdict(float)
    for (kind, _), value in per_key.items():
        out[family(kind)] += value
    return dict(out)


def format_exact(stages: list[KindAxesBytes], per_name: Mapping[str, float] | None = None) -> list[str]:
    """Lines for `shardkit hlo`: the exact per-step bytes of each kind, per stage, and what one run of each branch
    moves."""
    kinds = [kind for kind in COLLECTIVE_KINDS if any(kind in by_kind(stage) for stage in stages)]
    header = "".join(f"{'stage ' + str(d):>12}" for d in range(len(stages)))
    lines = ["tick switches attributed (shardkit.analysis.compiled.tick_branches): exact bytes/step per device, with "
             "the branch each tick takes", f"  {'collective':<18} {header}"]
    for kind in kinds:
        figures = "".join(f"{human_bytes(by_kind(stage).get(kind, 0.0)):>12}" for stage in stages)
        lines.append(f"  {kind:<18} {figures}")
    if per_name:
        lines.append("  one run of each branch: " + ", ".join(f"{name} {human_bytes(value)}"
                                                            for name, value in per_name.items()))
    return lines


def exact_lines(module: HloModule, collectives: CollectiveSummary, program) -> list[str] | None:
    """`format_exact` of a compiled 1F1B-family step, or None where its tick switches cannot be attributed."""
    ticks = attribute_ticks(module, program)
    if ticks is None:
        return None
    return format_exact(stage_bytes(collectives, ticks, program.action), branch_name_bytes(collectives, ticks))


def format_against_analytic(stages: list[KindAxesBytes], analytic: list[Mapping[str, float]], family) -> str:
    """One note for `shardkit plan`: per stage, the exact compiled bytes/step of each collective family beside
    analytic / compiled. `analytic`: per stage, family -> bytes (`shardkit.analysis.predicted.tick_bytes`); `family`:
    how a compiled kind maps to one."""
    parts = []
    for stage, (figures, wanted) in enumerate(zip(stages, analytic, strict=True)):
        compiled = by_kind(figures, family)
        rows = ", ".join(f"{name} {human_bytes(compiled.get(name, 0.0))} "
                         f"({_ratio(wanted.get(name, 0.0), compiled.get(name, 0.0))})"
                         for name in sorted(set(wanted) | set(compiled)))
        parts.append(f"stage {stage}: {rows}")
    return ("tick switches attributed per tick (shardkit.analysis.compiled.tick_branches): exact bytes/step per "
            "device with the branch each tick takes (analytic per stage, shardkit.analysis.predicted.tick_bytes / "
            "compiled): "
            + "; ".join(parts))


def _ratio(analytic: float, compiled: float) -> str:
    return f"{analytic / compiled:.2f}" if compiled else "-"
