"""What XLA made of a program: its collectives (count, bytes, mesh axes) per execution, fusions, memory and FLOPs.

The one call for users' tests:

    summary = shardkit.analysis.compiled.hlo.summarize(jitted_step, state, batch)      # or collective_summary(compiled)
    assert summary.collectives.count("all-reduce", axes=("data",)) == 1
    assert summary.collectives.bytes("all-gather", axes=("fsdp",)) == param_bytes

Counting rules (all from the optimized HLO text, a public artifact of `jax.stages.Compiled.as_text()`):
- A collective inside a `while` body counts `known_trip_count` times (from the loop's backend_config); nested loops
  multiply. A loop without a known trip count counts once and is listed in `unknown_trip_counts`.
- Asynchronous pairs count once: `all-gather-start`/`-done` is one all-gather; an `async-start` wrapping a
  reduce-scatter is one reduce-scatter (the `-done` and `async-done` halves are not counted).
- `bytes` is the full buffer the op reduces or gathers: the operand of an all-reduce, reduce-scatter or all-to-all,
  the (gathered) result of an all-gather (collective-permutes: below). `wire_bytes` is what one device sends under ring
  algorithms: 2(n-1)/n x bytes for all-reduce, (n-1)/n x bytes for all-gather, reduce-scatter and all-to-all, and
  `bytes` for a collective-permute (so there, the group's pairs summed, not one device's send).
- A collective-permute's `bytes` is its operand times its source-target pairs, divided by the number of groups the
  spanned mesh axes cut the devices into: per pipeline group, summed over that group's pairs (`pairs` on the op).
- Collectives inside the branches of a `conditional` (lax.cond, lax.switch) are not in the per-step totals: which
  branch runs is data-dependent (a 1F1B tick's switch branches on the stage), so they are listed apart
  (`conditional_ops`) and bounded from above by each conditional's costliest branch (`conditional_bytes`).
- Mesh axes come from the replica groups (explicit `{{0,1},..}`, iota `[2,4]<=[4,2]T(1,0)` and mesh-axes
  `mesh['a'=2,'b'=4] {'b'}` forms): an axis is spanned when devices in one group differ in their coordinate on it.
  Device ids are positions in the executable's device assignment, which for a `NamedSharding` is the mesh's
  devices in row-major order.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from shardkit.analysis.compiled.collective_kinds import COLLECTIVE_KINDS, RING_FACTORS
from shardkit.analysis.compiled.hlo_parse import (
    FUSION_OPCODES,
    Branch,
    HloModule,
    Instruction,
    count_executions,
    fused_computations,
    parse_hlo,
    replica_groups,
    shape_bytes,
    spanned_axes,
)

# Elementwise opcodes that should live inside a fusion; found outside one, each is a kernel of its own.
ELEMENTWISE = {
    "add", "subtract", "multiply", "divide", "maximum", "minimum", "negate", "abs", "exp", "exponential",
    "exponential-minus-one", "log", "log-plus-one", "logistic", "tanh", "erf", "rsqrt", "sqrt", "cbrt", "power",
    "select", "compare", "convert", "clamp", "and", "or", "xor", "not", "sign", "floor", "ceil", "round-nearest-even",
    "remainder", "atan2", "sine", "cosine", "is-finite",
}


ELEMENTWISE_KIND = {  # which part of a model an unfused op most likely came from
    "rsqrt": "norm", "sqrt": "norm", "logistic": "activation", "tanh": "activation", "erf": "activation",
    "exp": "softmax", "exponential": "softmax", "rng-bit-generator": "dropout", "rng": "dropout",
}


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction and how often it runs per execution of the program.

    For a collective-permute, `bytes` is the operand times the op's source-target pairs of one group (the pairs over
    the number of groups the mesh axes it spans cut the devices into, e.g. one pipeline of a pipeline x data mesh):
    every pair sends the operand once, so it is what the group's links carry, comparable with the analytic
    `shardkit.pipeline.collective_permute_bytes`. `pairs` is the op's total source-target pair count (1 otherwise).
    An op inside a conditional branch has `branch` set and `count` as if that branch ran every time.
    """

    kind: str
    name: str
    computation: str
    count: int
    bytes: float  # the full buffer reduced or gathered (permutes: summed over one group's pairs), per execution
    group_size: int
    axes: tuple[str, ...] | None  # None when no mesh was known
    op_name: str
    pairs: int = 1
    branch: Branch | None = None
    dtypes: tuple[tuple[str, float], ...] = ()  # (element type, share of `bytes`) of its operands

    def bytes_by_dtype(self) -> dict[str, float]:
        """Bytes per execution by element type (`bf16`, `f32`): what precision the collective moves."""
        return {dtype: share * self.bytes for dtype, share in self.dtypes}

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution under a ring algorithm (permutes: the group's pairs summed)."""
        return self.bytes * RING_FACTORS[self.kind](self.group_size) if self.group_size > 1 else 0.0


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """All collectives of a program, with per-kind totals per execution (one training step for a train step).

    `ops` run unconditionally and make the totals. `conditional_ops` sit in the branches of `conditional`s (lax.cond,
    lax.switch: 1F1B ticks, ring attention's causal halves); they are kept out of the totals and bounded from above
    by `conditional_bytes`: per execution of a conditional, the costliest of its branches.
    """

    ops: tuple[CollectiveOp, ...]
    unknown_trip_counts: tuple[str, ...] = ()
    conditional_ops: tuple[CollectiveOp, ...] = ()

    def select(self, kind: str | None = None, axes: Iterable[str] | None = None,
               ops: Sequence[CollectiveOp] | None = None) -> list[CollectiveOp]:
        """Ops of `kind` (any kind when None) whose spanned axes are exactly `axes` (any when None), from `ops`
        (the unconditional ones when None)."""
        wanted = None if axes is None else tuple(sorted(axes))
        return [
            op for op in (self.ops if ops is None else ops)
            if (kind is None or op.kind == kind) and (wanted is None or tuple(sorted(op.axes or ())) == wanted)
        ]

    def count(self, kind: str | None = None, axes: Iterable[str] | None = None) -> int:
        """Executions per step of collectives of `kind` over exactly `axes`."""
        return sum(op.count for op in self.select(kind, axes))

    def bytes(self, kind: str | None = None, axes: Iterable[str] | None = None) -> float:
        """Full-buffer bytes per step of collectives of `kind` over exactly `axes`."""
        return sum(op.count * op.bytes for op in self.select(kind, axes))

    def wire_bytes(self, kind: str | None = None, axes: Iterable[str] | None = None) -> float:
        """Bytes one device sends per step under ring algorithms."""
        return sum(op.count * op.wire_bytes for op in self.select(kind, axes))

    def conditional_bytes(self, kind: str | None = None, axes: Iterable[str] | None = None,
                          measure: str = "bytes") -> float:
        """Upper bound on the per-step full-buffer bytes (or `count`, `wire_bytes`) of the selected collectives in
        conditional branches: for each conditional, its costliest branch as if taken on every execution."""
        per_branch: dict[Branch, float] = collections.defaultdict(float)
        for op in self.select(kind, axes, self.conditional_ops):
            per_branch[op.branch] += op.count * (1 if measure == "count" else getattr(op, measure))
        worst: dict[str, float] = {}
        for branch, value in per_branch.items():
            worst[branch.conditional] = max(worst.get(branch.conditional, 0.0), value)
        return sum(worst.values())

    def by_kind(self) -> dict[str, dict[str, Any]]:
        """kind -> {count, bytes, wire_bytes, axes: {"fsdp": {count, bytes}, ...}}, kinds in a fixed order."""
        out: dict[str, dict[str, Any]] = {}
        for kind in COLLECTIVE_KINDS:
            ops = self.select(kind)
            if not ops:
                continue
            out[kind] = {
                "count": self.count(kind), "bytes": self.bytes(kind), "wire_bytes": self.wire_bytes(kind),
                "axes": _per_axes(ops),
            }
        return out

    def conditional_by_kind(self) -> dict[str, dict[str, Any]]:
        """kind -> upper bounds {count, bytes, wire_bytes} and `conditionals` (how many hold it), branches only."""
        out: dict[str, dict[str, Any]] = {}
        for kind in COLLECTIVE_KINDS:
            ops = self.select(kind, ops=self.conditional_ops)
            if not ops:
                continue
            out[kind] = {
                "count": self.conditional_bytes(kind, measure="count"), "bytes": self.conditional_bytes(kind),
                "wire_bytes": self.conditional_bytes(kind, measure="wire_bytes"),
                "conditionals": len({op.branch.conditional for op in ops}), "axes": _per_axes(ops),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        """`by_kind`, with each definition that differs from "the full buffer" stated beside its figures."""
        data = self.by_kind()
        if "collective-permute" in data:
            data["collective-permute"]["note"] = PERMUTE_NOTE
        if self.conditional_ops:
            data["conditional"] = {
                "note": CONDITIONAL_NOTE, **self.conditional_by_kind(),
            }
        if self.unknown_trip_counts:
            data["unknown_trip_counts"] = list(self.unknown_trip_counts)
        return data


CONDITIONAL_NOTE = (
    "collectives inside lax.cond/lax.switch branches, not in the per-step figures above: which branch runs is "
    "data-dependent, so count/bytes/wire_bytes are upper bounds (each conditional's costliest branch, every time it "
    "runs); axes sums every branch"
)


PERMUTE_NOTE = ("collective-permute bytes: the operand x the source-target pairs of one group (e.g. one pipeline), "
                "what that group's links carry")


def _per_axes(ops: Sequence[CollectiveOp]) -> dict[str, dict[str, float]]:
    """'fsdp+tensor' -> {count, bytes} over the ops ("none": spans no axis, "unknown": no mesh known)."""
    per_axes: dict[str, dict[str, float]] = {}
    for op in ops:
        key = "+".join(op.axes) if op.axes else ("none" if op.axes is not None else "unknown")
        entry = per_axes.setdefault(key, {"count": 0, "bytes": 0})
        entry["count"] += op.count
        entry["bytes"] += op.count * op.bytes
    return per_axes


def collectives_from_module(module: HloModule, mesh_shape: Mapping[str, int] | None = None) -> CollectiveSummary:
    """Every collective of a parsed module with its per-execution count, bytes, group size and mesh axes."""
    counts = count_executions(module)
    device_count = math.prod(mesh_shape.values()) if mesh_shape else module.num_partitions
    always = [op for name, times in counts.always.items()
              for op in _collectives_in(module, name, times, None, mesh_shape, device_count)]
    branched = [op for (name, branch), times in counts.branches.items()
                for op in _collectives_in(module, name, times, branch, mesh_shape, device_count)]
    return CollectiveSummary(tuple(always), counts.unknown_trip_counts, tuple(branched))


def _collectives_in(module: HloModule, name: str, times: int, branch: Branch | None,
                    mesh_shape: Mapping[str, int] | None, device_count: int) -> list[CollectiveOp]:
    """The collectives of one computation, each run `times` times per execution of the program."""
    computation = module.computations[name]
    shapes = computation.shapes()
    ops = []
    for instruction in computation.instructions:
        kind = _collective_kind(instruction.opcode)
        if kind is None:
            continue
        groups = replica_groups(instruction.attributes, device_count)
        axes = spanned_axes(groups, mesh_shape) if mesh_shape else None
        largest = max((len(group) for group in groups), default=1)
        size = _full_buffer_bytes(kind, instruction, shapes, largest)
        pairs = 1
        if kind == "collective-permute":
            pairs = len(groups)
            size *= pairs / _permute_groups(groups, axes, mesh_shape)
        group_size = 2 if kind == "collective-permute" else largest
        ops.append(CollectiveOp(kind, instruction.name, name, times, size, group_size, axes, instruction.op_name,
                                pairs, branch, _dtype_shares(instruction, shapes)))
    return ops


_ELEMENT = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def _dtype_shares(instruction: Instruction, shapes: Mapping[str, str]) -> tuple[tuple[str, float], ...]:
    """Each element type's share of an instruction's operand bytes (its result's when operands are unknown)."""
    texts = [shapes[name] for name in instruction.operands if name in shapes] or [instruction.shape]
    by_dtype: dict[str, float] = {}
    for text in texts:
        for match in _ELEMENT.finditer(text):
            by_dtype[match.group(1)] = by_dtype.get(match.group(1), 0.0) + shape_bytes(match.group(0))
    total = sum(by_dtype.values())
    return tuple((dtype, value / total) for dtype, value in sorted(by_dtype.items())) if total else ()


def reduction_bytes_by_dtype(ops: Iterable[CollectiveOp]) -> dict[str, float]:
    """Bytes per step that all-reduces and reduce-scatters move, by element type: the precision gradients are
    reduced in, as compiled."""
    out: dict[str, float] = {}
    for op in ops:
        if op.kind in ("all-reduce", "reduce-scatter") and op.group_size > 1:
            for dtype, value in op.bytes_by_dtype().items():
                out[dtype] = out.get(dtype, 0.0) + op.count * value
    return out


def _permute_groups(pairs: Sequence[Sequence[int]], axes: tuple[str, ...] | None,
                    mesh_shape: Mapping[str, int] | None) -> int:
    """How many independent groups a collective-permute's pairs serve: with a mesh, the devices over the sizes of
    the axes the pairs span (a pipeline x data mesh has `data` pipelines); without one, the connected components.
    Pairs that span no axis (each device to itself: the part of a reorder that stays, split off by XLA into its own
    permute) are each a group of their own, as they would be counted inside the reorder's permute."""
    if axes == ():
        return max(len(pairs), 1)
    if mesh_shape is not None and axes is not None:
        return max(math.prod(mesh_shape.values()) // math.prod(mesh_shape[axis] for axis in axes), 1)
    parent: dict[int, int] = {}

    def root(device: int) -> int:
        while parent.setdefault(device, device) != device:
            device = parent[device]
        return device

    for source, target in pairs:
        parent[root(source)] = root(target)
    return max(len({root(device) for device in parent}), 1)


def _collective_kind(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in COLLECTIVE_KINDS else None


def _full_buffer_bytes(kind: str, instruction: Instruction, shapes: Mapping[str, str], group_size: int) -> float:
    operands = [shapes[name] for name in instruction.operands if name in shapes]
    if kind == "collective-permute":
        operands = operands[:1]  # the in-place form also passes the output buffer and offsets
    operand_bytes = sum(shape_bytes(shape) for shape in operands)
    if len(operands) != len(instruction.operands) or not operands:
        operand_bytes = None  # an operand we could not resolve: fall back on the result shape
    if kind == "all-gather":
        if operand_bytes is not None:
            return operand_bytes * group_size
        return shape_bytes(instruction.shape)
    if operand_bytes is not None:
        return operand_bytes
    result = shape_bytes(instruction.shape)
    return result * group_size if kind == "reduce-scatter" else result


def fusion_summary(module: HloModule) -> dict[str, Any]:
    """Kernels launched per execution: fusions and ops left outside any fusion, with unfused elementwise ops listed.

    `fusions` counts unconditional code; `fusions_in_branches` is the upper bound for code inside conditional
    branches (every branch as if it ran every time); unfused ops inside a branch carry its name in `branch`.
    """
    counts = count_executions(module)
    fused = fused_computations(module)
    places = [(name, None, times) for name, times in counts.always.items()]
    places += [(name, branch, times) for (name, branch), times in counts.branches.items()]
    fusions = in_branches = 0
    static: set[str] = set()  # a computation reached from several places is still one set of instructions
    unfused: list[dict[str, Any]] = []
    for name, branch, times in places:
        if name in fused:
            continue
        for instruction in module.computations[name].instructions:
            if instruction.opcode in FUSION_OPCODES:
                fusions += times if branch is None else 0
                in_branches += times if branch is not None else 0
                static.add(instruction.name)
            elif instruction.opcode in ELEMENTWISE or instruction.opcode in ("rng", "rng-bit-generator"):
                unfused.append({
                    "name": instruction.name, "opcode": instruction.opcode, "count": times,
                    "kind": ELEMENTWISE_KIND.get(instruction.opcode, "elementwise"), "op_name": instruction.op_name,
                    "shape": instruction.shape, "branch": str(branch) if branch else None,
                })
    return {"fusions": fusions, "fusions_in_branches": in_branches, "fusion_instructions": len(static),
            "unfused_elementwise": unfused}


@dataclasses.dataclass(frozen=True)
class HloSummary:
    """Everything `shardkit hlo` reports about one compiled program."""

    collectives: CollectiveSummary
    fusion: Mapping[str, Any]
    memory: Mapping[str, int] | None
    flops: Mapping[str, float] | None
    mesh: Mapping[str, int] | None

    def to_json(self) -> dict[str, Any]:
        return {
            "mesh": dict(self.mesh) if self.mesh else None,
            "collectives": self.collectives.to_json(),
            "memory": dict(self.memory) if self.memory is not None else None,
            "flops": dict(self.flops) if self.flops is not None else None,
            "fusion": dict(self.fusion),
        }


def optimized_hlo_text(compiled_or_lowered: Any) -> str:
    """The optimized HLO text of a `Compiled`, a `Lowered` (compiled here) or HLO text itself."""
    if isinstance(compiled_or_lowered, str):
        return compiled_or_lowered
    compiled = _as_compiled(compiled_or_lowered)
    return compiled.as_text()


def _as_compiled(obj: Any):
    if hasattr(obj, "compile") and not hasattr(obj, "memory_analysis"):
        return obj.compile()
    return obj


def mesh_of(compiled: Any):
    """The mesh of the first `NamedSharding` among a compiled program's inputs or outputs, or None."""
    import jax

    for attribute in ("input_shardings", "output_shardings"):
        try:
            shardings = getattr(compiled, attribute)
        except Exception:  # noqa: BLE001 - not every stage object carries shardings
            continue
        for sharding in jax.tree.leaves(shardings):
            if isinstance(sharding, jax.sharding.NamedSharding):
                return sharding.mesh
    return None


def collective_summary(compiled_or_lowered: Any, mesh=None) -> CollectiveSummary:
    """Collectives per execution of a compiled (or lowered) program, or of optimized HLO text.

    Args:
        compiled_or_lowered: a `jax.stages.Compiled`, a `jax.stages.Lowered` (compiled here) or HLO text.
        mesh: the mesh whose axes name the replica groups; taken from the program's shardings when None.
    """
    compiled = _as_compiled(compiled_or_lowered)
    mesh = mesh if mesh is not None or isinstance(compiled, str) else mesh_of(compiled)
    module = parse_hlo(optimized_hlo_text(compiled))
    return collectives_from_module(module, dict(mesh.shape) if mesh is not None else None)


def hlo_summary(compiled_or_lowered: Any, mesh=None) -> HloSummary:
    """Collectives, fusion summary, XLA's memory analysis and cost analysis of one compiled program."""
    compiled = _as_compiled(compiled_or_lowered)
    mesh = mesh if mesh is not None else mesh_of(compiled)
    module = parse_hlo(compiled.as_text())
    mesh_shape = dict(mesh.shape) if mesh is not None else None
    return HloSummary(
        collectives=collectives_from_module(module, mesh_shape),
        fusion=fusion_summary(module),
        memory=memory_stats(compiled),
        flops=cost_stats(compiled),
        mesh=mesh_shape,
    )


def summarize(fn: Any, *args: Any, mesh=None, **kwargs: Any) -> HloSummary:
    """Lower and compile `fn(*args, **kwargs)` (jitting it if needed) and summarize the result.

    Arguments may be arrays or `jax.ShapeDtypeStruct`s with shardings, so nothing needs to be allocated.
    """
    import jax

    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    return hlo_summary(jitted.lower(*args, **kwargs).compile(), mesh)


MEMORY_FIELDS = (
    "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
    "generated_code_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
    "host_temp_size_in_bytes",
)


def memory_stats(compiled: Any) -> dict[str, int] | None:
    """XLA's per-device memory analysis, plus `peak_bytes` = arguments + outputs - aliased + temporaries."""
    try:
        stats = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - backends without the analysis raise various errors
        return None
    if stats is None:
        return None
    out = {field: int(getattr(stats, field)) for field in MEMORY_FIELDS if hasattr(stats, field)}
    out["peak_bytes"] = (
        out.get("argument_size_in_bytes", 0) + out.get("output_size_in_bytes", 0)
        - out.get("alias_size_in_bytes", 0) + out.get("temp_size_in_bytes", 0)
    )
    return out


def cost_stats(compiled: Any) -> dict[str, float] | None:
    """XLA's cost analysis (FLOPs, transcendentals, bytes accessed) per device, or None where unavailable."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - e.g. compile-only GPU targets have no cost analysis
        return None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    if not cost:
        return None
    keys = ("flops", "transcendentals", "bytes accessed", "optimal_seconds")
    return {key: float(cost[key]) for key in keys if key in cost}


def write_artifacts(lowered: Any, compiled: Any, out_dir: str | Path, mesh=None,
                    extra: Mapping | None = None) -> HloSummary:
    """Write `stablehlo.mlir`, `optimized_hlo.txt` and `summary.json` under `out_dir`; return the summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "stablehlo.mlir").write_text(lowered.as_text())
    (out_dir / "optimized_hlo.txt").write_text(compiled.as_text())
    summary = hlo_summary(compiled, mesh)
    data = {**summary.to_json(), **(extra or {})}
    (out_dir / "summary.json").write_text(json.dumps(data, indent=1) + "\n")
    return summary


def format_summary(summary: HloSummary) -> str:
    """The short table printed by `shardkit hlo`."""
    collectives = summary.collectives
    lines = ["collective          count      bytes/step   wire bytes/dev  axes"]
    lines += _collective_rows(collectives.by_kind()) or ["(none)"]
    if collectives.conditional_ops:
        lines.append("in conditional branches (not in the figures above; upper bound, costliest branch every time):")
        lines += _collective_rows(collectives.conditional_by_kind(), prefix="  ")
    if collectives.select("collective-permute", ops=collectives.ops + collectives.conditional_ops):
        lines.append(f"note: {PERMUTE_NOTE}")
    if summary.collectives.unknown_trip_counts:
        lines.append(f"loops without a known trip count (counted once): "
                     f"{list(summary.collectives.unknown_trip_counts)}")
    fusion = summary.fusion
    lines.append(f"fused kernels per step: {fusion['fusions']} ({fusion['fusion_instructions']} in the program)"
                 + (f", up to {fusion['fusions_in_branches']} more in conditional branches"
                    if fusion.get("fusions_in_branches") else ""))
    unfused = fusion["unfused_elementwise"]
    if unfused:
        kinds = collections.Counter(item["kind"] for item in unfused)
        lines.append("unfused elementwise ops: " + ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items())))
    else:
        lines.append("unfused elementwise ops: none")
    if summary.memory:
        memory = summary.memory
        lines.append(
            f"memory per device: peak {human_bytes(memory['peak_bytes'])} (arguments "
            f"{human_bytes(memory.get('argument_size_in_bytes', 0))}, temporaries "
            f"{human_bytes(memory.get('temp_size_in_bytes', 0))})"
        )
    if summary.flops and "flops" in summary.flops:
        lines.append(f"flops per device per step: {summary.flops['flops']:.4g}")
    else:
        lines.append("flops: no cost analysis on this backend")
    return "\n".join(lines)


def _collective_rows(by_kind: Mapping[str, Mapping[str, Any]], prefix: str = "") -> list[str]:
    """One table row per collective kind: count, bytes, wire bytes, and the count per spanned axes."""
    rows = []
    for kind, entry in by_kind.items():
        axes = ", ".join(f"{key} x{int(value['count'])}" for key, value in entry["axes"].items())
        rows.append(
            f"{prefix}{kind:<{18 - len(prefix)}} {int(entry['count']):>6}  {human_bytes(entry['bytes']):>14}  "
            f"{human_bytes(entry['wire_bytes']):>14}  {axes}"
        )
    return rows


def human_bytes(count: float) -> str:
    """A byte count in binary units: `512 B`, `1.50 KiB`, `3.00 MiB`."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return str(count)
