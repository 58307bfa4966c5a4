"""Pipeline schedules as data: the shape of a schedule, its grid of ticks, the stage pairs that send, bubble math.

Pure arithmetic on `PipelineConfig` (no JAX): the executors (shardkit/pipeline/gpipe.py, one_f_one_b.py) run these
grids, `plan` draws them (shardkit/pipeline/chart.py) and `shardkit.analysis.predicted.estimate` counts their bytes.

Schedules, with p stages, m micro-batches, v repeats (virtual stages per device):
    gpipe     all forwards, then all backwards (the backward is JAX's autodiff of the forward loop).
    circular  the layer stack is cut into p*v chunks; chunk k runs on stage k % p, so each micro-batch goes around
              the ring v times and the bubble shrinks by v.
    1f1b      one forward, one backward: at most p micro-batches of stage inputs alive per stage.
    interleaved_1f1b
              Megatron's interleaved 1F1B: v chunks per device as under circular (chunk k on stage k % p), run
              1F1B-style in groups of p micro-batches per chunk; the bubble shrinks by v, p micro-batches' inputs
              per chunk alive at most (m must be a multiple of p).
    zero_bubble
              ZB-H1 (Qi et al. 2023): the backward split into an input-gradient pass ("B", sent back at once) and a
              weight-gradient pass ("W", deferred); the W passes fill the bubble 1F1B leaves in its cool-down, with
              1F1B's bound on micro-batches in flight.

Time is counted in ticks: one tick is one stage applying one chunk (L/(p*v) layers) to one micro-batch. A backward
tick is counted as long as a forward one; under zero_bubble the B and W passes are one tick each.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

Pairs = tuple[tuple[int, int], ...]  # (source stage, target stage) of one ppermute

# The schedules trained by the tick executor (shardkit/pipeline/one_f_one_b.py), the loss inside the last stage.
TICK_SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")
# The schedules whose layer stack is cut into `repeats` chunks per stage.
CHUNKED_SCHEDULES = ("circular", "interleaved_1f1b")


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The shape of one pipeline: stages p, micro-batches m, repeats v, the schedule's name, and when FSDP gathers a
    stage's weights (`fsdp_gather`: "per_step" or "per_use", shardkit/pipeline/config.py).

    A layout's own, with the stage count resolved from its mesh, is `Layout.pipeline`; its flags (`enabled`,
    `one_f_one_b`) are what the rest of shardkit asks instead of reading the mesh and the recipe again.
    """

    stages: int
    microbatches: int
    repeats: int = 1
    schedule: str = "gpipe"
    fsdp_gather: str = "per_step"

    @property
    def enabled(self) -> bool:
        """Whether there is a pipeline at all (more than one stage)."""
        return self.stages > 1

    @property
    def one_f_one_b(self) -> bool:
        """Whether training runs the tick executor of the 1F1B family (shardkit/pipeline/one_f_one_b.py: 1f1b,
        interleaved_1f1b, zero_bubble) rather than autodiff of a forward loop."""
        return self.enabled and self.schedule in TICK_SCHEDULES

    @property
    def chunks(self) -> int:
        """Chunks of the layer stack per stage (virtual stages): `repeats` under circular and interleaved_1f1b."""
        return self.repeats if self.schedule in CHUNKED_SCHEDULES else 1

    @property
    def items(self) -> int:
        """Forward work items per stage: every micro-batch once per repeat."""
        return self.microbatches * self.repeats

    @property
    def forward_ticks(self) -> int:
        return self.items + self.stages - 1


# ---- grids ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Work:
    """One tick of one stage: forward ("F"), backward ("B"; under zero_bubble the input gradient only) or weight
    gradient ("W", zero_bubble) of micro-batch `micro` in repeat (chunk) `repeat`."""

    kind: str
    micro: int
    repeat: int = 0


def forward_grid(config: PipelineConfig) -> list[list[Work | None]]:
    """grid[stage][tick] for the forward pass of gpipe and circular: stage d runs item j = tick - d.

    Item j is micro-batch j % m in repeat j // m: micro-batches enter in order, and after a full turn of the ring a
    micro-batch comes back to stage 0 for its next repeat, m ticks after it first entered.
    """
    p, m = config.stages, config.microbatches
    grid: list[list[Work | None]] = [[None] * config.forward_ticks for _ in range(p)]
    for stage in range(p):
        for item in range(config.items):
            grid[stage][item + stage] = Work("F", item % m, item // m)
    return grid


def gpipe_grid(config: PipelineConfig) -> list[list[Work | None]]:
    """All forwards, then all backwards in reverse (autodiff's order): the last stage turns around first.

    The backward of item j on stage d runs at tick T + (items-1-j) + (p-1-d), T being the forward ticks.
    """
    p, items, ticks = config.stages, config.items, config.forward_ticks
    grid = [row + [None] * ticks for row in forward_grid(config)]
    for stage in range(p):
        for item in range(items):
            grid[stage][ticks + (items - 1 - item) + (p - 1 - stage)] = Work("B", item % config.microbatches,
                                                                              item // config.microbatches)
    return grid


def one_f_one_b_grid(config: PipelineConfig) -> list[list[Work | None]]:
    """1F1B (PipeDream-flush): stage d warms up with p-1-d forwards, then alternates one forward, one backward.

    Built by simulation with unit-time forward and backward ticks; a stage keeps at most p - d micro-batches of
    activations alive, against m for gpipe.
    """
    p, m = config.stages, config.microbatches
    done_f = [[None] * m for _ in range(p)]  # tick at which stage d finished forward of micro-batch i
    done_b = [[None] * m for _ in range(p)]
    plans = []
    for d in range(p):
        warm = min(p - 1 - d, m)
        order = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while f < m or b < m:
            if f < m:
                order.append(("F", f))
                f += 1
            if b < m:
                order.append(("B", b))
                b += 1
        plans.append(order)
    grid: list[list[Work | None]] = [[] for _ in range(p)]
    cursor = [0] * p
    tick = 0
    while any(cursor[d] < len(plans[d]) for d in range(p)):
        for d in range(p):
            grid[d].append(None)
            if cursor[d] >= len(plans[d]):
                continue
            kind, i = plans[d][cursor[d]]
            ready = (d == 0 or _before(done_f[d - 1][i], tick)) if kind == "F" else (
                _before(done_f[d][i], tick) if d == p - 1 else _before(done_b[d + 1][i], tick))
            if ready:
                grid[d][tick] = Work(kind, i)
                (done_f if kind == "F" else done_b)[d][i] = tick
                cursor[d] += 1
        tick += 1
    return grid


def _before(finished: int | None, tick: int) -> bool:
    return finished is not None and finished < tick


def interleaved_orders(config: PipelineConfig) -> list[list[Work]]:
    """Megatron's interleaved 1F1B, per stage the order of its work: forwards walk the chunks in groups of p
    micro-batches (chunk 0 for micro-batches 0..p-1, chunk 1 for the same, ...), backwards the chunks in reverse;
    stage d warms up with 2(p-1-d) + (v-1)p forwards, then alternates one forward, one backward."""
    p, m, v = config.stages, config.microbatches, config.repeats
    total = m * v

    def item(k: int, backward: bool) -> Work:
        group, within = divmod(k, p)
        chunk = group % v
        micro = (group // v) * p + within
        return Work("B" if backward else "F", micro, v - 1 - chunk if backward else chunk)

    orders = []
    for d in range(p):
        warm = total if m == p else min(2 * (p - 1 - d) + (v - 1) * p, total)
        order = [item(k, False) for k in range(warm)]
        for k in range(total - warm):
            order += [item(warm + k, False), item(k, True)]
        order += [item(k, True) for k in range(total - warm, total)]
        orders.append(order)
    return orders


def interleaved_grid(config: PipelineConfig) -> list[list[Work | None]]:
    """Interleaved 1F1B's grid: `interleaved_orders` run with unit-time ticks, each item as soon as its input is
    there (the previous chunk's stage finished it at an earlier tick)."""
    orders = interleaved_orders(config)
    return _run_orders(config, lambda d, done, tick: orders[d][len(done[d])] if len(done[d]) < len(orders[d])
                       and _ready(config, done, d, orders[d][len(done[d])], tick) else None,
                       sum(map(len, orders)))


def zero_bubble_grid(config: PipelineConfig) -> list[list[Work | None]]:
    """ZB-H1 by greedy list scheduling with unit-time F, B and W ticks. Each tick a stage runs, by priority: the B
    of its oldest micro-batch whose gradient is there (so gradients are consumed at once and stage d-1 is never kept
    waiting), else the next F if its input is there, fewer than p - d micro-batches await their B (1F1B's bound)
    and fewer than 2p - 1 - d await their W, else its oldest pending W, else nothing.

    The second bound is what ZB-H1's bubble costs here: a micro-batch between its F and its W keeps its stage input
    (the backward recomputes the stage from it), at most 2p - 1 - d of them against 1F1B's p - d; with p - d the
    deferred W passes cannot fill the cool-down (tests/test_schedules.py holds the bubble to (p-1)/(3m+p-1))."""
    p, m = config.stages, config.microbatches

    def choose(d, done, tick):
        kinds = [w.kind for w in done[d]]
        f, b, w = kinds.count("F"), kinds.count("B"), kinds.count("W")
        if b < f and _ready(config, done, d, Work("B", b), tick):
            return Work("B", b)
        if f < m and f - b < p - d and f - w < 2 * p - 1 - d and _ready(config, done, d, Work("F", f), tick):
            return Work("F", f)
        return Work("W", w) if w < b else None

    return _run_orders(config, choose, 3 * p * m)


def _ready(config: PipelineConfig, done, d: int, work: Work, tick: int) -> bool:
    """Whether `work` on stage d has its input: an F the previous chunk's activation (or nothing, for chunk 0 on
    stage 0), a B the next chunk's gradient (or its own F, for the last chunk on the last stage), a W its own B;
    each finished at an earlier tick."""
    p, v = config.stages, config.chunks
    if work.kind == "F":
        if d == 0 and work.repeat == 0:
            return True
        source = (d - 1, work.repeat) if d > 0 else (p - 1, work.repeat - 1)
        return _finished(done, source[0], Work("F", work.micro, source[1]), tick)
    if work.kind == "W":
        return _finished(done, d, Work("B", work.micro, work.repeat), tick)
    if d == p - 1 and work.repeat == v - 1:
        return _finished(done, d, Work("F", work.micro, work.repeat), tick)
    source = (d + 1, work.repeat) if d < p - 1 else (0, work.repeat + 1)
    return _finished(done, source[0], Work("B", work.micro, source[1]), tick)


def _finished(done, d: int, work: Work, tick: int) -> bool:
    finished = done[d].get(work)
    return finished is not None and finished < tick


def _run_orders(config: PipelineConfig, choose, items: int) -> list[list[Work | None]]:
    """Tick by tick, each stage runs what `choose(stage, done, tick)` picks (None: idle), until `items` have run.
    `done[d]` maps each finished Work of stage d to its tick, in the order they ran."""
    p = config.stages
    done: list[dict[Work, int]] = [dict() for _ in range(p)]
    grid: list[list[Work | None]] = [[] for _ in range(p)]
    tick = 0
    while sum(map(len, done)) < items:
        for d in range(p):
            work = choose(d, done, tick)
            grid[d].append(work)
            if work is not None:
                done[d][work] = tick
        tick += 1
        if tick > 4 * items + 4 * p:
            raise AssertionError(f"schedule {config.schedule!r} deadlocked for {config}")
    return grid


def schedule_grid(config: PipelineConfig) -> list[list[Work | None]]:
    """The schedule's grid of ticks (forward and backward); each backward tick counted as long as a forward one."""
    grids = {"1f1b": one_f_one_b_grid, "interleaved_1f1b": interleaved_grid, "zero_bubble": zero_bubble_grid}
    return grids.get(config.schedule, gpipe_grid)(config)  # circular: gpipe_grid walks repeats through forward_grid



# ---- bubble and memory ---------------------------------------------------------------------------------------------
def bubble_fraction(config: PipelineConfig) -> float:
    """The idle share of the step from theory: (p-1)/(v*m + p-1), v = 1 for gpipe and 1F1B; zero_bubble (ZB-H1 with
    unit-time F, B and W) (p-1)/(3m + p-1), a third of 1F1B's bubble time over its 3m ticks of work."""
    p, m = config.stages, config.microbatches
    if config.schedule == "zero_bubble":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (config.chunks * m + p - 1)


def idle_fraction(grid: Sequence[Sequence[Work | None]]) -> float:
    """The idle share of a grid: empty stage-ticks over all stage-ticks."""
    cells = [cell for row in grid for cell in row]
    return sum(cell is None for cell in cells) / len(cells)


def peak_live_activations(grid: Sequence[Sequence[Work | None]]) -> list[int]:
    """Per stage, the most micro-batches (of one chunk each) whose forward has run and whose last backward pass (B,
    or W where the grid splits the backward) has not yet finished."""
    last = "W" if any(cell is not None and cell.kind == "W" for row in grid for cell in row) else "B"
    peaks = []
    for row in grid:
        live = peak = 0
        for cell in row:
            if cell is not None and cell.kind in ("F", last):
                live += 1 if cell.kind == "F" else -1
                peak = max(peak, live)
        peaks.append(peak)
    return peaks



# ---- sends ---------------------------------------------------------------------------------------------------------
def forward_sends(config: PipelineConfig, tick: int) -> Pairs:
    """The (source, target) stage pairs that carry a real activation after forward tick `tick`.

    Stage d hands its item to d+1; the last stage hands an item back to stage 0 only when the micro-batch has another
    repeat to run. Stages that are idle (bubble) send nothing, so the bytes on the wire are exactly
    activation bytes x micro-batches x repeats x boundaries.
    """
    p, m, v = config.stages, config.microbatches, config.repeats
    pairs = []
    for stage in range(p):
        item = tick - stage
        if not 0 <= item < m * v:
            continue
        if stage < p - 1:
            pairs.append((stage, stage + 1))
        elif item < (v - 1) * m:
            pairs.append((stage, 0))
    return tuple(pairs)


def tick_runs(config: PipelineConfig) -> list[tuple[int, int, Pairs]]:
    """Consecutive forward ticks with the same sends, as (first tick, count, pairs): each run is one scan."""
    return list(_tick_runs(config))


@functools.lru_cache(maxsize=256)
def _tick_runs(config: PipelineConfig) -> tuple[tuple[int, int, Pairs], ...]:
    """`tick_runs`, kept per configuration: `suggest` prices the same few configurations for many layouts."""
    runs: list[tuple[int, int, Pairs]] = []
    for tick in range(config.forward_ticks):
        pairs = forward_sends(config, tick)
        if runs and runs[-1][2] == pairs:
            first, count, _ = runs[-1]
            runs[-1] = (first, count + 1, pairs)
        else:
            runs.append((tick, 1, pairs))
    return tuple(runs)


def boundary_sends(config: PipelineConfig) -> int:
    """Activation transfers per forward pass: every (micro-batch, repeat) crosses every boundary it meets."""
    return sum(len(forward_sends(config, tick)) for tick in range(config.forward_ticks))


def collective_permute_bytes(config: PipelineConfig, activation_bytes: int) -> int:
    """Analytic collective-permute bytes per step: activation x micro-batches x stage boundaries, forward and backward.

    A micro-batch crosses p-1 boundaries per turn of the ring and v turns, plus the v-1 hops from the last stage back
    to the first: m * (v*p - 1) transfers. `activation_bytes` is one micro-batch's activation as one device holds it.
    """
    p, m, v = config.stages, config.microbatches, config.repeats
    return 2 * activation_bytes * m * (v * p - 1)

