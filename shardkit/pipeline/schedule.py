"""Pipeline schedules as data: the shape of a schedule, its grid of ticks, the stage pairs that send, bubble math.

Pure arithmetic on `PipelineConfig` (no JAX): the executors (shardkit/pipeline/gpipe.py, one_f_one_b.py) run these
grids, `plan` draws them (shardkit/pipeline/chart.py) and `shardkit.analysis.estimate` counts their bytes.

Schedules, with p stages, m micro-batches, v repeats (virtual stages per device):
    gpipe     all forwards, then all backwards (the backward is JAX's autodiff of the forward loop).
    circular  the layer stack is cut into p*v chunks; chunk k runs on stage k % p, so each micro-batch goes around
              the ring v times and the bubble shrinks by v.
    1f1b      one forward, one backward: at most p micro-batches of stage inputs alive per stage.

Time is counted in ticks: one tick is one stage applying one chunk (L/(p*v) layers) to one micro-batch.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

Pairs = tuple[tuple[int, int], ...]  # (source stage, target stage) of one ppermute


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
        """Whether training runs the 1F1B executor (shardkit/pipeline/one_f_one_b.py) rather than autodiff."""
        return self.enabled and self.schedule == "1f1b"

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
    """One tick of one stage: forward ("F") or backward ("B") of micro-batch `micro` in repeat `repeat`."""

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
                order.append(("F", f)); f += 1
            if b < m:
                order.append(("B", b)); b += 1
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


def schedule_grid(config: PipelineConfig) -> list[list[Work | None]]:
    """The schedule's grid of ticks (forward and backward); each backward tick counted as long as a forward one."""
    if config.schedule == "1f1b":
        return one_f_one_b_grid(config)
    return gpipe_grid(config)  # circular too: gpipe_grid walks repeats through forward_grid



# ---- bubble and memory ---------------------------------------------------------------------------------------------
def bubble_fraction(config: PipelineConfig) -> float:
    """The idle share of the step from theory: (p-1)/(v*m + p-1); v = 1 for gpipe and 1F1B."""
    p, v = config.stages, config.repeats if config.schedule == "circular" else 1
    return (p - 1) / (v * config.microbatches + p - 1)


def idle_fraction(grid: Sequence[Sequence[Work | None]]) -> float:
    """The idle share of a grid: empty stage-ticks over all stage-ticks."""
    cells = [cell for row in grid for cell in row]
    return sum(cell is None for cell in cells) / len(cells)


def peak_live_activations(grid: Sequence[Sequence[Work | None]]) -> list[int]:
    """Per stage, the most micro-batches whose forward has run and whose backward has not yet finished."""
    peaks = []
    for row in grid:
        live = peak = 0
        for cell in row:
            if cell is not None:
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
    runs: list[tuple[int, int, Pairs]] = []
    for tick in range(config.forward_ticks):
        pairs = forward_sends(config, tick)
        if runs and runs[-1][2] == pairs:
            first, count, _ = runs[-1]
            runs[-1] = (first, count + 1, pairs)
        else:
            runs.append((tick, 1, pairs))
    return runs


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

