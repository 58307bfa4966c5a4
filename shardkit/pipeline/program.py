"""The tick program: a schedule's grid (shardkit/pipeline/schedule.py) as the static tables the tick executor runs.

One executor (shardkit/pipeline/one_f_one_b.py) trains every schedule of the 1F1B family: 1f1b, interleaved_1f1b and
zero_bubble differ only in these tables. Row = stage, column = tick:

    action[d, t]        an `Action`
    micro[d, t]         the micro-batch it works on; chunk[d, t] the chunk of the stage's layers (virtual stage)
    enters[d, t]        its input is the embedded micro-batch (stage 0, chunk 0), whose backward files the gradient
                        of the embedded batch instead of sending it
    x_slot[d, t]        the activation-buffer slot of its input (stage inputs wait there from arrival to last use)
    dy_slot[d, t]       the gradient-buffer slot of the gradient it pulls back (zero_bubble's W reads it again)
    act_arrival[d, t]   the slot the activation received at the start of tick t goes to (-1: none arrives)
    grad_arrival[d, t]  the same for the gradient received
    sends[t]            (forward pairs, backward pairs) of the ppermutes after tick t

Slots are given out per stage by interval: a slot is free again once its last reader's tick has passed, so the
buffers hold exactly the most stage inputs (and gradients) a stage keeps at once under the schedule.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

import numpy as np

from shardkit.pipeline.schedule import Pairs, PipelineConfig, Work, schedule_grid


class Action(enum.IntEnum):
    """What a stage does at one tick. The last chunk's forward is IDLE: its backward recomputes it with the loss."""

    IDLE = 0
    FORWARD = 1
    BACKWARD = 2  # input and weight gradients at once (1f1b, interleaved_1f1b)
    BACKWARD_LAST = 3  # the last chunk: layers, head and loss, all their gradients
    INPUT_GRAD = 4  # zero_bubble's B: the input gradient only, sent back at once
    INPUT_GRAD_LAST = 5  # ... of the last chunk, with the loss and the head's gradients
    WEIGHT_GRAD = 6  # zero_bubble's W: the stage weights' gradient, from the kept input and gradient
    WEIGHT_GRAD_LAST = 7  # ... of the last chunk, from the kept input and the loss's cotangent


SENDS_BACK = (Action.BACKWARD, Action.BACKWARD_LAST, Action.INPUT_GRAD, Action.INPUT_GRAD_LAST)
READS_GRADIENT = (Action.BACKWARD, Action.INPUT_GRAD, Action.WEIGHT_GRAD)


@dataclasses.dataclass(frozen=True)
class TickProgram:
    """Static tables for the executor (see the module docstring)."""

    action: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    enters: np.ndarray
    x_slot: np.ndarray
    dy_slot: np.ndarray
    act_arrival: np.ndarray
    grad_arrival: np.ndarray
    slots: int  # activation-buffer slots
    grad_slots: int  # gradient-buffer slots
    sends: tuple[tuple[Pairs, Pairs], ...]

    @property
    def ticks(self) -> int:
        return self.action.shape[1]


def _action(work: Work, last: bool, split: bool) -> Action:
    if work.kind == "F":
        return Action.IDLE if last else Action.FORWARD
    if work.kind == "W":
        return Action.WEIGHT_GRAD_LAST if last else Action.WEIGHT_GRAD
    if split:
        return Action.INPUT_GRAD_LAST if last else Action.INPUT_GRAD
    return Action.BACKWARD_LAST if last else Action.BACKWARD


@functools.lru_cache(maxsize=64)
def tick_program(config: PipelineConfig) -> TickProgram:
    """Translate the schedule's grid into the executor's tables (slots assigned, sends and arrivals derived).

    Kept per configuration (the tables are read-only): `suggest` prices the same few configurations for many layouts.
    """
    grid = schedule_grid(config)
    p, v, ticks = config.stages, config.chunks, len(grid[0])
    tables = {name: np.zeros((p, ticks), np.int32) for name in ("action", "micro", "chunk", "enters")}
    for d, row in enumerate(grid):
        for t, work in enumerate(row):
            if work is not None:
                tables["action"][d, t] = _action(work, d == p - 1 and work.repeat == v - 1,
                                                 config.schedule == "zero_bubble")
                tables["micro"][d, t], tables["chunk"][d, t] = work.micro, work.repeat
                tables["enters"][d, t] = d == 0 and work.repeat == 0
    action, micro, chunk, enters = (tables[name] for name in ("action", "micro", "chunk", "enters"))
    sends, act_arrivals, grad_arrivals = _sends(config, action, micro, chunk, enters)
    act_reads = _reads(action, micro, chunk, lambda a, first: a != Action.IDLE and not first, enters)
    grad_reads = _reads(action, micro, chunk, lambda a, first: a in READS_GRADIENT, enters)
    act_arrival, x_slot, slots = _assign_slots(act_arrivals, act_reads, (p, ticks))
    grad_arrival, dy_slot, grad_slots = _assign_slots(grad_arrivals, grad_reads, (p, ticks))
    tables = (action, micro, chunk, enters.astype(bool), x_slot, dy_slot, act_arrival, grad_arrival)
    for table in tables:
        table.flags.writeable = False
    return TickProgram(*tables, slots, grad_slots, tuple(sends))


def _sends(config: PipelineConfig, action, micro, chunk, enters):
    """The ppermute pairs after every tick, and where each sent item arrives: {(stage, chunk, micro): tick}.

    A forward on stage d hands chunk r's output to stage d+1 (the last stage to stage 0, for chunk r+1); a backward
    hands its input gradient to stage d-1 (stage 0 to the last stage, for chunk r-1), except where the input was the
    embedded batch."""
    p, ticks = action.shape
    sends, act_arrivals, grad_arrivals = [], {}, {}
    for t in range(ticks):
        forward, backward = [], []
        for d in range(p):
            a, r, i = Action(action[d, t]), int(chunk[d, t]), int(micro[d, t])
            if a == Action.FORWARD:
                forward.append((d, (d + 1) % p))
                act_arrivals[((d + 1) % p, r + (d == p - 1), i)] = t + 1
            elif a in SENDS_BACK and not enters[d, t]:
                backward.append((d, (d - 1) % p))
                grad_arrivals[((d - 1) % p, r - (d == 0), i)] = t + 1
        sends.append((tuple(forward), tuple(backward)))
    return sends, act_arrivals, grad_arrivals


def _reads(action, micro, chunk, wanted, enters) -> dict:
    """{(stage, chunk, micro): [ticks]} of the actions that read a buffer: `wanted(action, enters)`."""
    reads: dict = {}
    p, ticks = action.shape
    for d in range(p):
        for t in range(ticks):
            if wanted(Action(action[d, t]), bool(enters[d, t])):
                reads.setdefault((d, int(chunk[d, t]), int(micro[d, t])), []).append(t)
    return reads


def _assign_slots(arrivals: dict, reads: dict, shape):
    """Per stage, give each arriving item the lowest slot free at its arrival (its previous holder's last read was
    at an earlier tick). Returns the arrival-slot table, the read-slot table (-1 where nothing is read) and the
    number of slots (at least 1)."""
    arrival_slot, read_slot = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
    slots = 1
    for d in range(shape[0]):
        free_after: list[int] = []  # per slot, the tick of its holder's last read
        items = sorted((tick, key) for key, tick in arrivals.items() if key[0] == d)
        for tick, key in items:
            if key not in reads:
                raise AssertionError(f"tick program: {key} arrives at tick {tick} and is never read")
            if tick >= shape[1]:
                raise AssertionError(f"tick program: {key} arrives after the last tick")
            slot = next((s for s, last in enumerate(free_after) if last < tick), len(free_after))
            if slot == len(free_after):
                free_after.append(0)
            free_after[slot] = max(reads[key])
            if min(reads[key]) < tick:
                raise AssertionError(f"tick program: {key} is read at tick {min(reads[key])} before it arrives")
            arrival_slot[d, tick] = slot
            read_slot[d, reads[key]] = slot
        slots = max(slots, len(free_after))
    return arrival_slot, read_slot, slots


def live_stage_inputs(program: TickProgram) -> list[int]:
    """Per stage, the most stage inputs held at once (arrived, last reader not yet run); stage 0 of a schedule
    without chunks holds none (its inputs are the embedded batch)."""
    peaks = []
    for d in range(program.action.shape[0]):
        held = {}
        peak = 0
        for t in range(program.ticks):
            if program.act_arrival[d, t] >= 0:
                held[int(program.act_arrival[d, t])] = True
            peak = max(peak, len(held))
            slot = int(program.x_slot[d, t])
            if slot >= 0 and not _read_again(program, d, t, slot):
                held.pop(slot, None)
        peaks.append(peak)
    return peaks


def _read_again(program: TickProgram, d: int, t: int, slot: int) -> bool:
    """Whether slot `slot` of stage d is read again after tick t before anything new arrives in it."""
    for later in range(t + 1, program.ticks):
        if program.act_arrival[d, later] == slot:
            return False
        if program.x_slot[d, later] == slot:
            return True
    return False


def tick_blocks(program: TickProgram) -> list[tuple[int, int, int]]:
    """Cover the ticks with (first tick, period, count) blocks whose sends repeat every `period` ticks.

    Each block becomes one scan whose body runs `period` ticks, so the program has a few scans (warm-up, the
    steady state, cool-down) rather than one unrolled tick per step, while every ppermute keeps its static, exact
    pairs. Periods up to 3 (zero_bubble's steady state is F, B, W).
    """
    sends, blocks, tick = program.sends, [], 0
    while tick < len(sends):
        best = (1, 1)
        for period in (1, 2, 3):
            unit = sends[tick:tick + period]
            count = 0
            while len(unit) == period and sends[tick + count * period:tick + (count + 1) * period] == unit:
                count += 1
            if period * count > best[0] * best[1]:
                best = (period, count)
        blocks.append((tick, *best))
        tick += best[0] * best[1]
    return blocks


def block_actions(program: TickProgram, tick: int, period: int, count: int) -> tuple[int, ...]:
    """The actions any stage takes at ticks tick, tick + period, ... (count of them): the branches that tick needs."""
    return tuple(sorted(set(program.action[:, tick:tick + period * count:period].flat)))
