"""The optimized HLO text as data: instructions and computations, how many times each computation runs (loops by
trip count, conditionals' branches), and which mesh axes a collective's replica groups span.

A parser of the text XLA prints (`compiled.as_text()`), written against the public text format only; nothing
here knows what a collective costs (`shardkit.analysis.compiled.hlo`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Mapping, Sequence

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1,
    "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}


# A fusion kernel, launched in place or asynchronously (`fusion-start`, whose `fusion-done` is no kernel: XLA:GPU of
# jax 0.11.2 runs a layer scan's dynamic-(update-)slice fusions so).
FUSION_OPCODES = frozenset({"fusion", "fusion-start"})


_CALLEE_ATTRS = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation|branch_computations)="
    r"(\{[^}]*\}|%?[\w.\-]+)"
)


_TRIP_COUNT = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, result shape text, opcode, operand names and the attribute text after them."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str

    def callees(self) -> list[tuple[str, str]]:
        """(attribute, computation name) for every computation this instruction refers to."""
        out = []
        for attribute, value in _CALLEE_ATTRS.findall(self.attributes):
            for name in re.findall(r"%?([\w.\-]+)", value):
                out.append((attribute, name))
        return out

    @property
    def op_name(self) -> str:
        match = _OP_NAME.search(self.attributes)
        return match.group(1) if match else ""


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    instructions: tuple[Instruction, ...]

    def shapes(self) -> dict[str, str]:
        return {instruction.name: instruction.shape for instruction in self.instructions}


@dataclasses.dataclass(frozen=True)
class HloModule:
    """A parsed optimized-HLO module: its computations by name, the entry's name and the partition count."""

    name: str
    computations: Mapping[str, Computation]
    entry: str
    num_partitions: int


def parse_hlo(text: str) -> HloModule:
    """Parse HLO text (as printed by `Compiled.as_text()`) into computations and instructions."""
    header = re.search(r"^HloModule\s+(\S+?),?(?:\s|$)(.*)$", text, re.M)
    partitions = re.search(r"num_partitions=(\d+)", header.group(2)) if header else None
    computations: dict[str, Computation] = {}
    entry = ""
    current: str | None = None
    body: list[Instruction] = []
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            match = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{$", stripped)
            if match:
                current, body = match.group(2), []
                entry = current if match.group(1) else entry
            continue
        if stripped == "}":
            computations[current] = Computation(current, tuple(body))
            current = None
            continue
        instruction = _parse_instruction(stripped)
        if instruction is not None:
            body.append(instruction)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text; pass the optimized HLO of a compiled program")
    partition_count = int(partitions.group(1)) if partitions else 1
    return HloModule(header.group(1) if header else "", computations, entry, partition_count)


def _parse_instruction(line: str) -> Instruction | None:
    match = re.match(r"^(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
    if not match:
        return None
    rest = line[match.end():]
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode_match = re.match(r"^([\w\-]+)\(", rest)
    if not opcode_match:
        return None
    open_at = opcode_match.end() - 1
    close_at = _matching(rest, open_at)
    operand_text = rest[open_at + 1: close_at]
    operands = tuple(re.findall(r"%([\w.\-]+)", operand_text)) or tuple(
        part.split()[-1] for part in _split_top_level(operand_text) if part.strip()
    )
    return Instruction(match.group(1), shape, opcode_match.group(1), operands, rest[close_at + 1:])


def _matching(text: str, open_at: int) -> int:
    """Index of the bracket closing the one at `open_at` (any of (), {}, [])."""
    depth = 0
    for index in range(open_at, len(text)):
        char = text[index]
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
            if depth == 0:
                return index
    return len(text) - 1


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return parts


def shape_bytes(shape: str) -> float:
    """Bytes of every array in a shape text (a tuple's elements summed); layouts and tiling are ignored."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in DTYPE_BYTES:
            continue
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


@dataclasses.dataclass(frozen=True)
class Branch:
    """One branch of an HLO `conditional` (`lax.cond`/`lax.switch`): which conditional, which branch index."""

    conditional: str
    index: int

    def __str__(self) -> str:
        return f"{self.conditional}#{self.index}"


@dataclasses.dataclass(frozen=True)
class ExecutionCounts:
    """Runs per call of the entry: `always` for code that runs unconditionally, `branches` for code under a
    conditional (keyed by computation and the outermost branch it sits in), counted as if that branch were taken
    every time the conditional runs: an upper bound, since exactly one branch runs per execution."""

    always: Mapping[str, int]
    branches: Mapping[tuple[str, Branch], int]
    unknown_trip_counts: tuple[str, ...]


BRANCH_ATTRIBUTES = ("branch_computations", "true_computation", "false_computation")


def count_executions(module: HloModule) -> ExecutionCounts:
    """Walk the call graph from the entry, multiplying by loop trip counts and setting conditional branches apart.

    Which branch of a conditional runs is data-dependent (in a pipeline tick, on the stage and the tick), so it is
    not weighted here; a branch inside a branch is attributed to the outermost one. Reducer computations (`to_apply`
    of a reduce or an all-reduce) and the `-done` halves of async pairs are not followed: the former run per element
    and hold no collectives, the latter would count an async op twice.
    """
    always: dict[str, int] = collections.defaultdict(int)
    branches: dict[tuple[str, Branch], int] = collections.defaultdict(int)
    unknown: list[str] = []

    def visit(name: str, times: int, branch: Branch | None) -> None:
        if branch is None:
            always[name] += times
        else:
            branches[(name, branch)] += times
        for instruction in module.computations[name].instructions:
            if instruction.opcode in ("async-done", "async-update"):
                continue
            factor = _trip_count(instruction, unknown) if instruction.opcode == "while" else 1
            callees = [(attribute, callee) for attribute, callee in instruction.callees()
                       if not (attribute == "to_apply" and instruction.opcode != "call")]
            branch_index = 0
            for attribute, callee in callees:
                if callee not in module.computations:
                    continue
                inner = branch
                if instruction.opcode == "conditional" and attribute in BRANCH_ATTRIBUTES:
                    inner = branch or Branch(instruction.name, branch_index)
                    branch_index += 1
                visit(callee, times * factor, inner)

    visit(module.entry, 1, None)
    return ExecutionCounts(dict(always), dict(branches), tuple(unknown))


def _trip_count(instruction: Instruction, unknown: list[str]) -> int:
    """A while loop's known trip count; 1 (and the loop noted in `unknown`) when XLA did not record one."""
    trip = known_trip_count(instruction)
    if trip is None:
        unknown.append(instruction.name)
        return 1
    return trip


def known_trip_count(instruction: Instruction) -> int | None:
    """A while loop's trip count as XLA recorded it in its backend_config, or None where it did not."""
    trip = _TRIP_COUNT.search(instruction.attributes)
    return None if trip is None else int(trip.group(1))


def execution_counts(module: HloModule) -> tuple[dict[str, int], list[str]]:
    """How many times each unconditionally executed computation runs per call of the entry, and the while loops with
    no known trip count. Computations reachable only through a conditional's branches are left out (see
    `count_executions` for them)."""
    counts = count_executions(module)
    return dict(counts.always), list(counts.unknown_trip_counts)


def fused_computations(module: HloModule) -> set[str]:
    """Computations that are bodies of fusions (and whatever they call), or reducers: not kernels of their own."""
    inside: set[str] = set()
    stack = []
    for computation in module.computations.values():
        for instruction in computation.instructions:
            for attribute, callee in instruction.callees():
                if instruction.opcode in FUSION_OPCODES or (attribute == "to_apply" and instruction.opcode != "call"):
                    stack.append(callee)
    while stack:
        name = stack.pop()
        if name in inside or name not in module.computations:
            continue
        inside.add(name)
        for instruction in module.computations[name].instructions:
            stack.extend(callee for _, callee in instruction.callees())
    return inside


def replica_groups(attributes: str, device_count: int) -> list[list[int]]:
    """The device groups of a collective, from any of XLA's three printed forms; `{}` means all devices."""
    text = _attribute_value(attributes, "replica_groups")
    if text is None:
        pairs = _attribute_value(attributes, "source_target_pairs")
        if pairs is not None:
            return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs)]
        return [list(range(device_count))]
    if text.startswith("mesh[") or text.startswith("maximal_mesh"):
        return _mesh_axes_groups(text)
    if text.startswith("["):
        return _iota_groups(text)
    groups = [[int(i) for i in group.split(",") if i.strip()] for group in re.findall(r"\{([\d,\s]*)\}", text)]
    groups = [group for group in groups if group]
    return groups or [list(range(device_count))]


def _attribute_value(attributes: str, key: str) -> str | None:
    start = attributes.find(f"{key}=")
    if start < 0:
        return None
    start += len(key) + 1
    if attributes.startswith("mesh[", start):
        close = _matching(attributes, start + 4)
        rest = attributes[close + 1:]
        device_ids = re.match(r"^,\s*device_ids=\(", rest)
        if device_ids:
            close = _matching(attributes, close + 1 + device_ids.end() - 1)
        axes_open = attributes.index("{", close)
        return attributes[start: _matching(attributes, axes_open) + 1]
    if attributes.startswith("[", start):  # iota: [G,S]<=[dims]T(perm)
        match = re.match(r"\[[\d,]*\]<=\[[\d,]*\](T\([\d,]*\))?", attributes[start:])
        return match.group(0) if match else None
    if attributes.startswith("{", start):
        return attributes[start: _matching(attributes, start) + 1]
    return None


def _iota_groups(text: str) -> list[list[int]]:
    match = re.match(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", text)
    group_shape = [int(d) for d in match.group(1).split(",")]
    reshape = [int(d) for d in match.group(2).split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if match.group(3):
        ids = ids.transpose([int(p) for p in match.group(3).split(",")])
    return ids.reshape(group_shape[0], -1).tolist()


def _mesh_axes_groups(text: str) -> list[list[int]]:
    """Groups of the mesh-axes form `mesh['a'=2,'b'=4](, device_ids=(...)) {'b', 'a':(1)2}`.

    Devices are the mesh's device array (iota unless listed); a group varies the named axes (or sub-axes: `:(pre)size`
    is the `size` slice of an axis after its first `pre` factor) and fixes the others.
    """
    if text.startswith("maximal_mesh"):
        return [[int(re.search(r"device_id=(\d+)", text).group(1))]]
    mesh_part = text[: _matching(text, 4) + 1]
    names_sizes = re.findall(r"'?([^'=,\[\]]+)'?=(\d+)", mesh_part[5:-1])
    names = [name for name, _ in names_sizes]
    sizes = [int(size) for _, size in names_sizes]
    ids_match = re.search(r"device_ids=\((.*)\)\s*\{", text)
    if ids_match:
        ids = _device_id_array(ids_match.group(1)).reshape(sizes)
    else:
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    axes_text = text[text.rindex("{") + 1: -1]
    refs = []
    for ref in re.findall(r"'?([^',:{}\s]+)'?(?::\((\d+)\)(\d+))?", axes_text):
        name, pre, size = ref
        refs.append((names.index(name), int(pre) if pre else None, int(size) if size else None))
    # Split each mesh dimension into (pre, size, rest) pieces where sub-axes name them.
    split_dims: list[list[int]] = []
    grouped: list[int] = []
    offset = 0
    for dim, full in enumerate(sizes):
        cuts = sorted((pre, size) for d, pre, size in refs if d == dim and pre is not None)
        pieces, piece_of = [], {}
        covered = 1
        for pre, size in cuts:
            if pre != covered:
                pieces.append(pre // covered)
                covered = pre
            piece_of[(pre, size)] = len(pieces)
            pieces.append(size)
            covered *= size
        if covered != full or not pieces:
            pieces.append(full // covered)
        for d, pre, size in refs:
            if d == dim:
                grouped.append(offset + (piece_of[(pre, size)] if pre is not None else 0))
        split_dims.append(pieces)
        offset += len(pieces)
    flat_shape = [piece for pieces in split_dims for piece in pieces]
    ids = ids.reshape(flat_shape)
    kept = [axis for axis in range(len(flat_shape)) if axis not in grouped]
    group_size = math.prod(flat_shape[axis] for axis in grouped)
    return ids.transpose(kept + grouped).reshape(-1, group_size).tolist()


def _device_id_array(text: str) -> np.ndarray:
    """A mesh's listed device ids: an iota tile assignment `[2,4]T(1,0)` or the ids themselves."""
    iota = re.fullmatch(r"\s*\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", text)
    if iota:
        dims = [int(d) for d in iota.group(1).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(2):
            ids = ids.transpose([int(p) for p in iota.group(2).split(",")])
        return ids.reshape(-1)
    return np.array([int(i) for i in re.findall(r"\d+", text)])


def spanned_axes(groups: Sequence[Sequence[int]], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """Mesh axes along which the devices of some group differ (ids are row-major positions in the mesh)."""
    names = list(mesh_shape)
    dims = [mesh_shape[name] for name in names]
    total = math.prod(dims)
    varying: set[str] = set()
    for group in groups:
        if any(device >= total for device in group):
            continue
        coords = np.array(np.unravel_index(list(group), dims)).T
        for axis, name in enumerate(names):
            if len(set(coords[:, axis])) > 1:
                varying.add(name)
    return tuple(name for name in names if name in varying)
