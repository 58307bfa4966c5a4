"""Exposed communication: how much of a step's collective time XLA:GPU's schedule leaves uncovered by compute.

A `--target` compile yields XLA:GPU's optimized, *scheduled* HLO (`is_scheduled=true` in the module header): each
computation's instructions are printed in the order they run, and collectives are asynchronous pairs
(`all-gather-start` ... `all-gather-done`, or `async-start`/`async-done` around a collective) wherever XLA let them
be. Between a start and its done, the compute stream keeps running the kernels scheduled there; the done waits for
the collective. This module replays that schedule on a two-stream model of one device and reports, per collective,
the compute scheduled between its start and done (`overlapped`) and the time the compute stream waits at its done
(`exposed`), per step, per mesh axis and per kind.

The model (all per device; stated again in docs/guide/step-time.md). It prices every kernel and collective with the
functions the analytic step time uses (`Pricing`), so that the two differ only in what the schedule decides: which
kernels
run, and what overlaps what.
- Compute stream: kernels run one after another in schedule order. cuDNN fused attention runs at its measured rate
  (FLOPs: forward 4·B·H·Sq·Sk·D, backward 2.5x that, halved for a causal mask); any other kernel takes the slower
  of its GEMMs (dots in gemm fusions, cuBLAS calls or bare, by M x N x K:
  `shardkit.analysis.predicted.rates.gemm_seconds`) and its bytes at streaming HBM bandwidth (operands and results; a
  dynamic-slice reads only its slice and a dynamic-update-slice writes only its update, in place). An asynchronous
  fusion (`fusion-start` ... `fusion-done`) is that one fused kernel, charged at its start. Every kernel time is
  multiplied by `shardkit.analysis.predicted.kernels.OVERHEAD`, as in the analytic model.
- Communication: one link per device, collectives run one at a time in the order they were started (NCCL on one
  stream), each priced by `shardkit.analysis.predicted.nccl`: NCCL's latency per collective and ring step, the ring's
  bytes over NVLink inside a host and, for a group spanning hosts, what each host receives over the NICs of its GPUs in
  the group; all-reduce over more than two hosts may take NCCL's tree.
- A collective's exposed time is the wait at its done: max(0, its finish - the compute stream's time at the done).
  With one collective in flight that is max(0, communication - compute scheduled between start and done); with
  several in flight they queue on the link. A synchronous collective is fully exposed (its wait for the link too).
- Loops run their known trip count (the body replayed once, its figures multiplied); a conditional runs its costliest
  branch. A collective started outside a loop and finished after it overlaps the loop's whole time, less the link
  time the loop's own collectives take.

Replica groups are mapped to mesh axes by `shardkit.analysis.compiled.hlo` (the same collectives, bytes and axes as
`shardkit hlo`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

from shardkit.analysis.compiled.hlo import CollectiveOp, collectives_from_module, optimized_hlo_text
from shardkit.analysis.compiled.hlo_parse import (
    DTYPE_BYTES,
    FUSION_OPCODES,
    HloModule,
    Instruction,
    parse_hlo,
    shape_bytes,
)
from shardkit.analysis.predicted.kernels import OVERHEAD
from shardkit.analysis.predicted.nccl import Fabric, Group, axes_group, stream_seconds
from shardkit.analysis.predicted.rates import RATES, KernelRates, attention_seconds, gemm_seconds, streaming_seconds

# Instructions that launch no kernel: bookkeeping, aliasing and control.
FREE_OPCODES = {
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id", "replica-id",
    "add-dependency", "opt-barrier", "iota", "domain", "copy-start", "copy-done", "send", "recv", "send-done",
    "recv-done", "all-gather-done", "all-reduce-done", "reduce-scatter-done", "all-to-all-done",
    "collective-permute-done", "collective-broadcast-done", "ragged-all-to-all-done", "async-done", "async-update",
    "fusion-done",
}
# A fusion run asynchronously (`fusion-start` ... `fusion-done`, how XLA:GPU of jax 0.11.2 emits the dynamic-slice and
# dynamic-update-slice fusions of a scanned layer stack): its start launches the fused kernel, priced as that fusion
# is; its done only waits for it (free, in FREE_OPCODES). Both carry the whole stacked buffer in their shapes, so
# pricing them by operand and result bytes charged the whole stack twice per layer. The kernel stays on the compute
# stream: these starts name operation queue 0, the compute stream itself. (FUSION_OPCODES: hlo.py's.)
_DIMS = re.compile(r"\b[a-z][a-z0-9]*\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_JSON_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


# ---- what kernels and collectives cost ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Pricing:
    """What the replay charges, with the analytic step time's own functions: kernels by
    `shardkit.analysis.predicted.rates` (GEMMs by shape, fused attention at its measured rate, the rest at streaming HBM
    bandwidth) times `shardkit.analysis.predicted.kernels.OVERHEAD`, collectives by `shardkit.analysis.predicted.nccl`
    (latency per collective and ring step, NVLink inside a host, the hosts' NICs shared by the group's GPUs on each)."""

    rates: KernelRates
    fabric: Fabric
    per_host: Mapping[str, int]  # each mesh axis's size within a host
    across: Mapping[str, int]  # and across hosts
    overhead: float = OVERHEAD

    @classmethod
    def for_target(cls, target, mesh_shape: Mapping[str, int]) -> "Pricing":
        """The target's rates and fabric, its hosts laid over `mesh_shape` as `shardkit.mesh` lays them."""
        per_host, across = target.host_split(dict(mesh_shape))
        return cls(RATES[target.gpu], target.fabric, per_host, across)

    def group(self, op: CollectiveOp) -> Group:
        """The op's group in nodes x ranks per node; one host when its mesh axes are unknown."""
        if op.axes is None:
            return Group(1, op.group_size)
        return axes_group(op.axes, self.per_host, self.across)

    def collective(self, op: CollectiveOp) -> tuple[float, bool]:
        """(seconds, crosses hosts) of one execution of `op`."""
        group = self.group(op)
        return stream_seconds(op.kind, op.bytes, op.group_size, group, self.fabric), group.nodes > 1


# ---- the report -----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CollectiveExposure:
    """One collective instruction of the schedule and its times, per execution; `count` executions per step."""

    op: CollectiveOp
    asynchronous: bool
    inter_host: bool
    count: int
    comm_seconds: float  # on the link
    overlapped_seconds: float  # compute stream time between start and done
    exposed_seconds: float  # the compute stream's wait at the done (or for the whole op, when synchronous)

    @property
    def kind(self) -> str:
        return self.op.kind

    @property
    def axes_key(self) -> str:
        """`fsdp`, `fsdp+tensor`; `none` for a group of one device, `unknown` without a mesh."""
        if self.op.axes is None:
            return "unknown"
        return "+".join(self.op.axes) or "none"


@dataclasses.dataclass(frozen=True)
class ExposureReport:
    """Exposed communication of one compiled step (figures per step, per device)."""

    collectives: tuple[CollectiveExposure, ...]
    compute_seconds: float  # the compute stream's kernels, waits excluded
    step_seconds: float  # compute + exposed communication, as replayed
    scheduled: bool  # the module said is_scheduled=true (otherwise the order is XLA's, not a schedule)
    unknown_trip_counts: tuple[str, ...] = ()

    @property
    def exposed_seconds(self) -> float:
        return sum(c.count * c.exposed_seconds for c in self.collectives)

    @property
    def comm_seconds(self) -> float:
        return sum(c.count * c.comm_seconds for c in self.collectives)

    def breakdown(self, by: str = "axes") -> dict[str, dict[str, float]]:
        """`by` = "axes" (`fsdp`, `fsdp+tensor`, ...) or "kind" -> {count, bytes, comm_s, exposed_s, async (how many
        of the executions were async pairs), network (some went between hosts)}."""
        out: dict[str, dict[str, float]] = {}
        for item in sorted(self.collectives, key=lambda c: (c.axes_key, c.kind)):
            key = item.axes_key if by == "axes" else item.kind
            entry = out.setdefault(key, {"count": 0, "bytes": 0.0, "comm_s": 0.0, "exposed_s": 0.0, "async": 0,
                                         "network": False})
            entry["network"] = entry["network"] or item.inter_host
            entry["count"] += item.count
            entry["bytes"] += item.count * item.op.bytes
            entry["comm_s"] += item.count * item.comm_seconds
            entry["exposed_s"] += item.count * item.exposed_seconds
            entry["async"] += item.count if item.asynchronous else 0
        return out

    def by_axes_and_kind(self) -> dict[str, dict[str, dict[str, float]]]:
        """axes -> kind -> {count, bytes, comm_s, exposed_s, async}."""
        grouped: dict[str, list[CollectiveExposure]] = collections.defaultdict(list)
        for item in self.collectives:
            grouped[item.axes_key].append(item)
        return {axes: ExposureReport(tuple(items), 0.0, 0.0, self.scheduled).breakdown("kind")
                for axes, items in sorted(grouped.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "model": MODEL_NOTE,
            "scheduled": self.scheduled,
            "compute_s": self.compute_seconds,
            "comm_s": self.comm_seconds,
            "exposed_s": self.exposed_seconds,
            "step_s": self.step_seconds,
            "by_axes": self.breakdown("axes"),
            "by_kind": self.breakdown("kind"),
            "by_axes_and_kind": self.by_axes_and_kind(),
            **({"unknown_trip_counts": list(self.unknown_trip_counts)} if self.unknown_trip_counts else {}),
        }


MODEL_NOTE = ("replay of XLA's schedule on one device, priced as the analytic step time prices it: kernels in order "
              "(cuDNN attention at its measured rate, GEMMs by shape, the rest at streaming HBM bandwidth, x the "
              "calibrated overhead); collectives one at a time as NCCL runs them (latency per collective and ring "
              "step, NVLink inside a host, the hosts' NICs across); exposed = the compute stream's wait at each done "
              "(synchronous collectives: all of it); loops x trip count, conditionals their costliest branch")


def exposed_seconds(report: ExposureReport) -> float:
    """Seconds per step the compute stream waits for communication: what `suggest` adds to compute and bubble."""
    return report.exposed_seconds


def exposed_by_axis(report: ExposureReport) -> dict[str, float]:
    """Exposed seconds per step by the mesh axes the collectives span (`fsdp`, `fsdp+tensor`, ...)."""
    return {axes: entry["exposed_s"] for axes, entry in report.breakdown("axes").items()}


# ---- replaying the schedule -----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Replay:
    """One computation's replay: its duration on the compute stream, its kernels' time, its link time and what each
    collective did (per execution of the computation)."""

    duration: float = 0.0
    compute: float = 0.0
    link: float = 0.0
    exposures: list[CollectiveExposure] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _InFlight:
    op: CollectiveOp
    started: float
    finish: float
    comm: float
    inter_host: bool


class _Replayer:
    """Replays computations of one module; results per computation are cached (a body is the same every trip)."""

    def __init__(self, module: HloModule, ops: Mapping[tuple[str, str], CollectiveOp], pricing: Pricing):
        self.module, self.ops, self.pricing = module, ops, pricing
        self.cache: dict[str, _Replay] = {}

    def replay(self, name: str) -> _Replay:
        if name not in self.cache:
            self.cache[name] = self._replay(name)
        return self.cache[name]

    def _replay(self, name: str) -> _Replay:
        computation = self.module.computations[name]
        shapes = computation.shapes()
        result = _Replay()
        clock = link_free = 0.0
        in_flight: dict[str, _InFlight] = {}
        for instruction in computation.instructions:
            collective = self._collective(name, instruction)
            if collective is not None and _is_start(instruction):
                comm, inter = self.pricing.collective(collective)
                begin = max(clock, link_free)
                link_free = begin + comm
                in_flight[instruction.name] = _InFlight(collective, clock, link_free, comm, inter)
                result.link += comm
            elif _is_done(instruction) and instruction.operands and instruction.operands[0] in in_flight:
                flight = in_flight.pop(instruction.operands[0])
                wait = max(0.0, flight.finish - clock)
                result.exposures.append(CollectiveExposure(flight.op, True, flight.inter_host, 1, flight.comm,
                                                           clock - flight.started, wait))
                clock += wait
            elif collective is not None:  # synchronous: the compute stream waits for the link, then for the op
                comm, inter = self.pricing.collective(collective)
                finish = max(clock, link_free) + comm
                result.exposures.append(CollectiveExposure(collective, False, inter, 1, comm, 0.0, finish - clock))
                result.link += comm
                clock = link_free = finish
            elif instruction.opcode == "async-update" and instruction.operands[:1] and \
                    instruction.operands[0] in in_flight:  # start -> update -> done: the done names the update
                in_flight[instruction.name] = in_flight.pop(instruction.operands[0])
            else:
                inner = self._nested(instruction)
                if inner is not None:
                    times, replay = inner
                    # Collectives still on the link share it with the nested code's own: they finish later.
                    delay = times * replay.link
                    for flight in in_flight.values():
                        flight.finish += delay if flight.finish > clock else 0.0
                    link_free += delay if link_free > clock else 0.0
                    clock += times * replay.duration
                    result.compute += times * replay.compute
                    result.link += delay
                    result.exposures += [dataclasses.replace(e, count=e.count * times) for e in replay.exposures]
                else:
                    seconds = self.kernel_seconds(instruction, shapes)
                    clock += seconds
                    result.compute += seconds
        for flight in in_flight.values():  # a start without its done here: waited for at the end
            wait = max(0.0, flight.finish - clock)
            result.exposures.append(CollectiveExposure(flight.op, True, flight.inter_host, 1, flight.comm,
                                                       clock - flight.started, wait))
            clock += wait
        result.duration = clock
        return result

    def _collective(self, computation: str, instruction: Instruction) -> CollectiveOp | None:
        """The collective an instruction starts or runs (looking inside an `async-start` wrapper), if any."""
        if instruction.opcode == "async-start":
            for _, callee in instruction.callees():
                wrapped = self.module.computations.get(callee)
                for inner in wrapped.instructions if wrapped is not None else ():
                    if (callee, inner.name) in self.ops:
                        return self.ops[(callee, inner.name)]
            return None
        return self.ops.get((computation, instruction.name))

    def _nested(self, instruction: Instruction) -> tuple[int, _Replay] | None:
        """(times, replay) for a while loop's body, a conditional's costliest branch or a called computation."""
        callees = [callee for attribute, callee in instruction.callees() if callee in self.module.computations]
        if instruction.opcode == "while":
            body = [callee for attribute, callee in instruction.callees() if attribute == "body"]
            return _trip_count(instruction), self.replay(body[0])
        if instruction.opcode == "conditional":
            branches = [self.replay(callee) for attribute, callee in instruction.callees()
                        if attribute in ("branch_computations", "true_computation", "false_computation")]
            return (1, max(branches, key=lambda r: r.duration)) if branches else None
        if instruction.opcode in ("call", "async-start") and callees:
            return 1, self.replay(callees[0])
        return None

    def kernel_seconds(self, instruction: Instruction, shapes: Mapping[str, str]) -> float:
        """One kernel at the shared rates (`Pricing`): cuDNN attention at its measured rate; otherwise the slower of
        its GEMMs by shape (a fusion's dots, a cuBLAS call) and its bytes at streaming bandwidth; times the
        overhead."""
        if instruction.opcode in FREE_OPCODES:
            return 0.0
        rates = self.pricing.rates
        attention = self._attention_flops(instruction, shapes)
        if attention:
            return self.pricing.overhead * attention_seconds(rates, attention, fused=True)
        gemms = sum(gemm_seconds(rates, *shape) for shape in self._gemm_shapes(instruction, shapes))
        traffic = streaming_seconds(rates, self.kernel_bytes(instruction, shapes))
        return self.pricing.overhead * max(gemms, traffic)

    def _fused(self, instruction: Instruction) -> list[Instruction]:
        return [inner for _, callee in instruction.callees() if callee in self.module.computations
                for inner in self.module.computations[callee].instructions]

    def _inner_shapes(self, instruction: Instruction) -> dict[str, str]:
        return {name: shape for _, callee in instruction.callees() if callee in self.module.computations
                for name, shape in self.module.computations[callee].shapes().items()}

    def _gemm_shapes(self, instruction: Instruction, shapes: Mapping[str, str]) -> list[tuple[int, int, int, int]]:
        if instruction.opcode in FUSION_OPCODES:
            inner_shapes = self._inner_shapes(instruction)
            return [shape for inner in self._fused(instruction) for shape in self._gemm_shapes(inner, inner_shapes)]
        shape = gemm_shape(instruction, shapes)
        return [shape] if shape else []

    def _attention_flops(self, instruction: Instruction, shapes: Mapping[str, str]) -> float:
        if instruction.opcode in FUSION_OPCODES:
            inner_shapes = self._inner_shapes(instruction)
            return sum(self._attention_flops(inner, inner_shapes) for inner in self._fused(instruction))
        if instruction.opcode == "custom-call" and "fmha" in _custom_call_target(instruction):
            return instruction_flops(instruction, shapes)
        return 0.0

    def kernel_bytes(self, instruction: Instruction, shapes: Mapping[str, str]) -> float:
        if instruction.opcode in FUSION_OPCODES:
            fused = [self.module.computations[c] for _, c in instruction.callees() if c in self.module.computations]
            if fused:
                return fusion_bytes(fused[0].instructions)
        if instruction.opcode == "dynamic-update-slice":
            return 2 * shape_bytes(shapes.get(instruction.operands[1], ""))
        if instruction.opcode in ("dynamic-slice", "slice"):
            return 2 * shape_bytes(instruction.shape)
        operands = sum(shape_bytes(shapes.get(name, "")) for name in instruction.operands)
        if instruction.opcode == "custom-call":  # the output, not the scratch workspace XLA adds to the tuple
            first = _DIMS.search(instruction.shape)
            return operands + (shape_bytes(first.group(0)) if first else 0.0)
        return operands + shape_bytes(instruction.shape)


def _is_start(instruction: Instruction) -> bool:
    return instruction.opcode.endswith("-start")


def _is_done(instruction: Instruction) -> bool:
    return instruction.opcode.endswith("-done")


def _trip_count(instruction: Instruction) -> int:
    match = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', instruction.attributes)
    return int(match.group(1)) if match else 1


# ---- FLOPs and bytes of one kernel ----------------------------------------------------------------------------------
def dims(shape: str) -> list[int]:
    """The dimensions of the first array in a shape text: `bf16[4,128]{1,0}` -> [4, 128]."""
    match = _DIMS.search(shape)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _custom_call_target(instruction: Instruction) -> str:
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    return target.group(1) if target else ""


def gemm_shape(instruction: Instruction, shapes: Mapping[str, str]) -> tuple[int, int, int, int] | None:
    """(M, N, K, operand itemsize) of a dot or a cuBLAS call, None for anything else: N is the result's minor
    dimension, M the rest of it (batch dimensions folded in), K the contracted size."""
    if instruction.opcode == "dot":
        pattern = _CONTRACTING
    elif instruction.opcode == "custom-call" and re.search(r"gemm|matmul", _custom_call_target(instruction)):
        pattern = _JSON_CONTRACTING
    else:
        return None
    result = dims(instruction.shape)
    if not result or not instruction.operands:
        return None
    operand_dims = [dims(shapes.get(name, "")) for name in instruction.operands]
    dtype = re.match(r"\W*([a-z][a-z0-9]*)\[", shapes.get(instruction.operands[0], ""))
    itemsize = DTYPE_BYTES.get(dtype.group(1), 2) if dtype else 2
    n = result[-1]
    return math.prod(result) // max(n, 1), n, _contracted(pattern, instruction, operand_dims), itemsize


def instruction_flops(instruction: Instruction, shapes: Mapping[str, str]) -> float:
    """FLOPs of a dot, a convolution, a cuBLAS call or a cuDNN fused-attention call; 0 for anything else.

    A dot is 2 x its result's elements x the contracted size; a convolution 2 x its result's elements x the kernel's
    elements per output feature.
    """
    operand_dims = [dims(shapes.get(name, "")) for name in instruction.operands]
    if instruction.opcode == "dot":
        return 2 * math.prod(dims(instruction.shape)) * _contracted(_CONTRACTING, instruction, operand_dims)
    if instruction.opcode == "convolution" and len(operand_dims) == 2:
        return _convolution_flops(instruction, operand_dims[1])
    if instruction.opcode != "custom-call":
        return 0.0
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    target = target.group(1) if target else ""
    if "fmha" in target:
        return attention_flops(instruction, operand_dims, backward="Backward" in target)
    if "gemm" in target or "matmul" in target:
        return 2 * math.prod(dims(instruction.shape)) * _contracted(_JSON_CONTRACTING, instruction, operand_dims)
    return 0.0


def _contracted(pattern: re.Pattern, instruction: Instruction, operand_dims: Sequence[list[int]]) -> int:
    match = pattern.search(instruction.attributes)
    if not match or not operand_dims or not operand_dims[0]:
        return 1
    indices = [int(i.strip().strip('"')) for i in match.group(1).split(",") if i.strip()]
    return math.prod(operand_dims[0][i] for i in indices if i < len(operand_dims[0]))


def _convolution_flops(instruction: Instruction, kernel_dims: list[int]) -> float:
    labels = re.search(r"dim_labels=[^_]*_([^-]*)->", instruction.attributes)
    output_features = kernel_dims[labels.group(1).index("o")] if labels and "o" in labels.group(1) else 1
    return 2 * math.prod(dims(instruction.shape)) * math.prod(kernel_dims) / max(output_features, 1)


def attention_flops(instruction: Instruction, operand_dims: Sequence[list[int]], backward: bool) -> float:
    """cuDNN flash attention: forward two matmuls of B·H·Sq·Sk·D (4·B·H·Sq·Sk·D FLOPs); backward five (2.5x);
    half of it under a causal mask. B, H, Sq, Sk from `intermediate_tensor_shape`, D from the query's contracted
    dimension."""
    scores = re.search(r'"intermediate_tensor_shape"\s*:\s*\{[^}]*?"dimensions"\s*:\s*\[([^\]]*)\]',
                       instruction.attributes)
    if not scores or not operand_dims:
        return 0.0
    batch_heads_sq_sk = math.prod(int(d.strip().strip('"')) for d in scores.group(1).split(",") if d.strip())
    contracting = re.search(r'"lhs_contracting_dimensions"\s*:\s*\["?(\d+)', instruction.attributes)
    query = operand_dims[0]
    head_dim = query[int(contracting.group(1))] if contracting and int(contracting.group(1)) < len(query) else 0
    flops = 4 * batch_heads_sq_sk * head_dim * (2.5 if backward else 1.0)
    return flops / 2 if '"mask_type": "CAUSAL"' in instruction.attributes or '"mask_type":"CAUSAL"' in \
        instruction.attributes else flops


def fusion_bytes(instructions: Sequence[Instruction]) -> float:
    """Bytes a fused kernel reads and writes. A parameter read only through dynamic-slices or slices costs those
    slices; the buffer a root dynamic-update-slice updates in place costs nothing to read, and the write is the
    update. The root is the computation's last instruction (XLA prints it last)."""
    by_name = {instruction.name: instruction for instruction in instructions}
    users: dict[str, list[Instruction]] = collections.defaultdict(list)
    for instruction in instructions:
        for operand in instruction.operands:
            users[operand].append(instruction)
    roots = _root_values(instructions[-1], by_name) if instructions else []
    in_place = {_through_bitcasts(root.operands[0], by_name) for root in roots
                if root.opcode == "dynamic-update-slice" and root.operands}
    read = 0.0
    for instruction in instructions:
        if instruction.opcode != "parameter" or instruction.name in in_place:
            continue
        readers = users.get(instruction.name, [])
        if readers and all(user.opcode in ("dynamic-slice", "slice") and user.operands[0] == instruction.name
                           for user in readers):
            read += sum(shape_bytes(user.shape) for user in readers)
        else:
            read += shape_bytes(instruction.shape)
    written = 0.0
    for root in roots:
        if root.opcode == "dynamic-update-slice" and len(root.operands) > 1:
            written += shape_bytes(by_name[root.operands[1]].shape) if root.operands[1] in by_name else 0.0
        else:
            written += shape_bytes(root.shape)
    return read + written


def _root_values(root: Instruction, by_name: Mapping[str, Instruction]) -> list[Instruction]:
    """The instructions a fusion's root returns: the tuple's elements (bitcasts looked through), or the root."""
    if root.opcode == "tuple":
        return [by_name[_through_bitcasts(name, by_name)] for name in root.operands if name in by_name]
    return [by_name[_through_bitcasts(root.name, by_name)]]


def _through_bitcasts(name: str, by_name: Mapping[str, Instruction]) -> str:
    while name in by_name and by_name[name].opcode == "bitcast" and by_name[name].operands:
        name = by_name[name].operands[0]
    return name


# ---- the public entry points --------------------------------------------------------------------------------------
def exposure_from_text(hlo_text: str, pricing: Pricing,
                       mesh_shape: Mapping[str, int] | None = None) -> ExposureReport:
    """Replay a scheduled module's HLO text (see the module docstring for the model).

    Args:
        hlo_text: optimized HLO of a GPU compile (`Compiled.as_text()`).
        pricing: what kernels and collectives cost (`Pricing.for_target(target, mesh_shape)`).
        mesh_shape: axis -> size, naming the replica groups' axes (as in `shardkit.analysis.compiled.hlo`).
    """
    module = parse_hlo(hlo_text)
    summary = collectives_from_module(module, mesh_shape)
    ops = {(op.computation, op.name): op for op in summary.ops + summary.conditional_ops}
    replay = _Replayer(module, ops, pricing).replay(module.entry)
    scheduled = bool(re.search(r"^HloModule\s+\S+.*\bis_scheduled=true", hlo_text, re.M))
    collectives = tuple(e for e in replay.exposures if e.op.group_size > 1)
    return ExposureReport(_merge(collectives), replay.compute, replay.duration, scheduled,
                          summary.unknown_trip_counts)


def _merge(items: Sequence[CollectiveExposure]) -> tuple[CollectiveExposure, ...]:
    """One entry per collective instruction (a body reached twice adds its counts)."""
    merged: dict[tuple[str, str], CollectiveExposure] = {}
    for item in items:
        key = (item.op.computation, item.op.name)
        merged[key] = dataclasses.replace(item, count=merged[key].count + item.count) if key in merged else item
    return tuple(merged.values())


def exposure_report(compiled, mesh, target) -> ExposureReport:
    """Exposed communication of a compiled `--target` step on `mesh` (compile-only devices of `target`)."""
    shape = dict(mesh.shape)
    return exposure_from_text(optimized_hlo_text(compiled), Pricing.for_target(target, shape), shape)


def format_exposure(report: ExposureReport, title: str = "") -> str:
    """The table `shardkit hlo --target` and `plan --target` print: per mesh axes and kind, communication time,
    exposed time and how many executions were asynchronous."""
    lines = [f"exposed communication{' on ' + title if title else ''} (per step, per device; model in "
             f"docs/guide/step-time.md)"]
    if not report.scheduled:
        lines.append("  note: the module is not scheduled (not a GPU compile); instruction order is not run order")
    rows = report.by_axes_and_kind()
    wide = max([16, *(len(axes) for axes in rows)])  # the axes column as wide as its longest entry
    lines.append(f"  {'axes':<{wide}} {'collective':<18} {'link':<8} {'count':>6} {'async':>6} {'comm ms':>10} "
                 f"{'exposed ms':>11} {'exposed':>8}")
    for axes, kinds in rows.items():
        for kind, entry in kinds.items():
            share = entry["exposed_s"] / entry["comm_s"] if entry["comm_s"] else 0.0
            link = "network" if entry["network"] else "nvlink"
            lines.append(f"  {axes:<{wide}} {kind:<18} {link:<8} {int(entry['count']):>6} {int(entry['async']):>6} "
                         f"{entry['comm_s'] * 1e3:>10.3f} {entry['exposed_s'] * 1e3:>11.3f} {share:>8.1%}")
    lines.append(f"  compute {report.compute_seconds * 1e3:.3f} ms + exposed {report.exposed_seconds * 1e3:.3f} ms "
                 f"of {report.comm_seconds * 1e3:.3f} ms communication = step {report.step_seconds * 1e3:.3f} ms")
    if report.unknown_trip_counts:
        lines.append(f"  loops without a known trip count (counted once): {list(report.unknown_trip_counts)}")
    return "\n".join(lines)
