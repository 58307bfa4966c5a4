"""Pipeline parallelism: schedules as data, ppermute helpers, the `layer_loop` that runs them, bubble math and charts.

The model is not touched. `scan_stack` hands the pipeline its per-layer function and the stacked layer parameters
(leading `layers` axis, sharded over the `pipeline` mesh axis); the pipeline replaces the scan over layers with a
`jax.shard_map` that is manual over `pipeline`, so FSDP and tensor parallelism keep working inside every stage.

Data parallelism. When the mesh has `data` > 1 (leading the batch's activation rule), the region is manual over `data`
too (`manual_data_axes`): each data replica runs its own pipeline on its rows, its stages' weights enter as a
per-replica copy (`to_varying`, once, before the tick loop) and the loop accumulates that replica's own weight
gradients; the transpose of the copy is one psum over `data` at the region's edge, after the loop: one gradient
reduction per step, as plain data parallelism has. With `data` left automatic, every tick's weight gradient is a
contraction over rows sharded over `data` feeding a replicated loop-carried sum, so XLA all-reduced it once per
tick (m + p - 1 times per step). `fsdp` stays automatic: FSDP gathers a stage's weights for every use and
reduce-scatters their gradient after every use, inside the loop; that is its memory/traffic trade, not a defect.
Dropout inside the stages (train.dropout > 0) draws its masks per (data replica, micro-batch, stage, layer), under
every schedule; they are not the masks one device would draw over the whole batch.

Where things live. The embedding and the output head (final norm, projection, loss) run *outside* the pipeline region,
under the ordinary automatic sharding, on every pipeline rank. Three reasons: the model is one function and the
pipeline sees only its layer stack (the `layer_loop` hook), so the model file needs no change; the head's softmax over
the vocabulary is sharded by the same rules as without a pipeline; and the stages stay equal in cost (a first or last
stage that also owns the embedding or a large vocabulary head is the slowest stage and sets the pace of all). The price
is paid at the two edges of the region: the pipeline's output is broadcast from the last stage (one all-reduce of the
batch's activations over `pipeline`) and the embedding's gradient comes back the same way in the backward pass.

Schedules, with p stages, m micro-batches, v repeats (virtual stages per device):
    gpipe     all forwards, then all backwards (the backward is JAX's autodiff of the forward loop).
    circular  the layer stack is cut into p*v chunks; chunk k runs on stage k % p, so each micro-batch goes around
              the ring v times and the bubble shrinks by v. Chunk k holds model layers [k*L/(p*v), (k+1)*L/(p*v)), which
              are not the rows stage k % p stores under `layers -> pipeline`, so the stacked weights are re-laid out
              once per step (XLA inserts the exchange; its bytes are weights, not activations).
    1f1b      one forward, one backward: at most p micro-batches of stage inputs alive per stage. The `layer_loop`
              hook cannot run it (it ends at the last layer, so micro-batch i's loss exists only after every forward),
              so training runs shardkit/one_f_one_b.py instead: the embedding in the first stage, the head and loss
              in the last, each stage's backward written with `jax.vjp`, on the grid `one_f_one_b_grid` draws here.
              A plain forward pass under 1f1b (no gradients) uses this module's GPipe loop.

Time is counted in ticks: one tick is one stage applying one chunk (L/(p*v) layers) to one micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.nn import dropout_stream

AXIS = "pipeline"
Pairs = tuple[tuple[int, int], ...]


class PipelineBubbleWarning(UserWarning):
    """Fewer micro-batches than stages: most of every stage's time is bubble."""


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The shape of one pipeline: stages p, micro-batches m, repeats v, and the schedule's name."""

    stages: int
    microbatches: int
    repeats: int = 1
    schedule: str = "gpipe"

    @property
    def items(self) -> int:
        """Forward work items per stage: every micro-batch once per repeat."""
        return self.microbatches * self.repeats

    @property
    def forward_ticks(self) -> int:
        return self.items + self.stages - 1


def pipeline_config(recipe) -> PipelineConfig:
    """The recipe's pipeline: stage count from the mesh section, the rest from `[pipeline]`."""
    section = recipe.pipeline
    return PipelineConfig(recipe.mesh.pipeline, section.microbatches, section.repeats, section.schedule)


# ---- validation ----------------------------------------------------------------------------------------------------
def validate_pipeline(recipe, layers: int | None, mesh_sizes) -> None:
    """Check a pipelined recipe against its model and mesh; raises ShardkitError, warns on a large bubble.

    Args:
        recipe: the validated recipe.
        layers: the model's number of stacked layers (its config's `layers`), None if it has no such field.
        mesh_sizes: the resolved mesh, axis -> size.
    """
    stages = mesh_sizes[AXIS]
    if stages == 1:
        return
    if layers is None:
        raise ShardkitError("mesh.pipeline", "the model's config has no `layers` field, so it has no layer stack to "
                            "pipeline; use mesh.pipeline=1")
    section, train = recipe.pipeline, recipe.train
    m, v = section.microbatches, section.repeats
    if v > 1 and section.schedule != "circular":
        raise ShardkitError("pipeline.repeats", f"only the circular schedule uses repeats; got repeats={v} with "
                            f"schedule={section.schedule!r} (set pipeline.schedule=\"circular\" or repeats=1)")
    if layers % (stages * v):
        raise ShardkitError("model.layers", f"{layers} layers cannot be split into {stages} stages x {v} repeats; "
                            f"use a multiple of {stages * v} layers or change mesh.pipeline / pipeline.repeats")
    if train.grad_accum > 1 and mesh_sizes["data"] > 1:
        # The per-replica accumulation vmaps the step over `data` (spmd_axis_name), which the pipeline's shard_map
        # cannot sit under yet; with the data axis at 1 (fsdp for the batch) accumulation works.
        raise ShardkitError("train.grad_accum", f"gradient accumulation with a pipeline needs mesh.data=1 (got "
                            f"{mesh_sizes['data']}); put the batch replicas on mesh.fsdp or set train.grad_accum=1")
    batch = train.global_batch // train.grad_accum
    if batch % m:
        raise ShardkitError("pipeline.microbatches", f"the batch of {batch} sequences (train.global_batch / "
                            f"train.grad_accum) is not divisible by {m} micro-batches; use a divisor of {batch}")
    replicas = mesh_sizes["data"] * mesh_sizes["fsdp"]
    if (batch // m) % replicas:
        raise ShardkitError("pipeline.microbatches", f"each micro-batch of {batch // m} sequences must split over the "
                            f"{replicas} data x fsdp replicas; use fewer micro-batches or a larger train.global_batch")
    if v > 1 and m < stages:
        raise ShardkitError("pipeline.microbatches", f"the circular schedule needs at least as many micro-batches as "
                            f"stages ({stages}), got {m}")
    if m < stages:
        bubble = bubble_fraction(PipelineConfig(stages, m, v, section.schedule))
        warnings.warn(f"pipeline.microbatches={m} is fewer than the {stages} stages: the bubble is {bubble:.0%} of "
                      f"the step ((p-1)/(m+p-1)); use at least {stages}, ideally {4 * stages}",
                      PipelineBubbleWarning, stacklevel=2)


# ---- schedules as data ---------------------------------------------------------------------------------------------
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


# ---- charts --------------------------------------------------------------------------------------------------------
def text_gantt(grid: Sequence[Sequence[Work | None]], config: PipelineConfig) -> str:
    """Stages down, ticks across: `F3` is micro-batch 3's forward, `b3` its backward, `..` a bubble.

    With repeats, a forward cell shows the micro-batch and the repeat as `F3'` (repeat 1), `F3"` (repeat 2), ...
    """
    width = max(len(_cell_label(cell)) for row in grid for cell in row) + 1
    lines = [f"schedule {config.schedule}: p={config.stages} stages, m={config.microbatches} micro-batches, "
             f"v={config.repeats}; bubble {bubble_fraction(config):.1%} (theory), {idle_fraction(grid):.1%} (this grid)"]
    for stage, row in enumerate(grid):
        lines.append(f"stage {stage} |" + "".join(_cell_label(cell).ljust(width) for cell in row).rstrip())
    return "\n".join(lines)


def _cell_label(cell: Work | None) -> str:
    if cell is None:
        return ".."
    mark = ("'" * cell.repeat) if cell.repeat < 3 else f"^{cell.repeat}"
    return (f"F{cell.micro}" if cell.kind == "F" else f"b{cell.micro}") + mark


def svg_gantt(grid: Sequence[Sequence[Work | None]], config: PipelineConfig) -> str:
    """The same chart as an SVG document: blue forwards, orange backwards, grey bubbles, a title with the bubble."""
    cell_w, cell_h, left, top = 28, 26, 70, 34
    ticks = max(len(row) for row in grid)
    width, height = left + ticks * cell_w + 10, top + len(grid) * cell_h + 10
    title = (f"{config.schedule}: p={config.stages}, m={config.microbatches}, v={config.repeats}; "
             f"bubble {bubble_fraction(config):.1%}")
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
             f'font-size="11">', f'<text x="4" y="18" font-size="13">{title}</text>']
    for stage, row in enumerate(grid):
        y = top + stage * cell_h
        parts.append(f'<text x="4" y="{y + 17}">stage {stage}</text>')
        for tick, cell in enumerate(row):
            x = left + tick * cell_w
            fill = "#e6e6e6" if cell is None else _FORWARD_COLOURS[cell.repeat % 3] if cell.kind == "F" else "#f4a259"
            parts.append(f'<rect x="{x}" y="{y}" width="{cell_w - 2}" height="{cell_h - 2}" fill="{fill}"/>')
            if cell is not None:
                parts.append(f'<text x="{x + 3}" y="{y + 16}">{_cell_label(cell)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


_FORWARD_COLOURS = ("#7fb3e0", "#4f8fc7", "#2d6aa3")


# ---- ppermute helpers ----------------------------------------------------------------------------------------------
def send(x: jax.Array, pairs: Pairs) -> jax.Array:
    """Move `x` from each source stage to its target stage; stages that receive nothing get zeros."""
    if not pairs:
        return jnp.zeros_like(x)
    return jax.lax.ppermute(x, AXIS, perm=list(pairs))


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


# ---- the executor --------------------------------------------------------------------------------------------------
def make_layer_loop(mesh, config: PipelineConfig, inner_context: Callable[[], Any],
                    data_axes: tuple[str, ...] = ()) -> Callable:
    """The `layer_loop(layer_fn, x_BSD, stacked_state) -> x_BSD` that runs the stack as a pipeline on `mesh`.

    Args:
        mesh: the layout's mesh; `pipeline` and `data_axes` become manual inside, every other axis stays automatic.
        config: stages (the mesh's pipeline size), micro-batches, repeats and schedule.
        inner_context: a context manager factory entered inside the manual region (activation rules without the
            manual axes, since they cannot be named there).
        data_axes: the data-parallel axes the batch is split over manually (`manual_data_axes`), or ().
    """
    batch_spec = PartitionSpec(data_axes or None)

    def layer_loop(layer_fn: Callable, x_BSD: jax.Array, stacked_state) -> jax.Array:
        chunks = jax.tree.map(lambda w: _to_chunks(w, config), stacked_state)
        specs = jax.tree.map(lambda _: PartitionSpec(None, AXIS), chunks)
        region = jax.shard_map(
            functools.partial(_run_pipeline, layer_fn, config, inner_context),
            mesh=mesh, in_specs=(batch_spec, specs), out_specs=batch_spec, axis_names={AXIS, *data_axes},
        )
        return region(x_BSD, chunks)

    return layer_loop


def _to_chunks(w_L: jax.Array, config: PipelineConfig) -> jax.Array:
    """(L, ...) -> (v, p, L/(p*v), ...): chunk k = r*p + d holds model layers [k*L/(p*v), (k+1)*L/(p*v))."""
    p, v = config.stages, config.repeats
    return w_L.reshape(v, p, w_L.shape[0] // (p * v), *w_L.shape[1:])


def _run_pipeline(layer_fn, config: PipelineConfig, inner_context, x_BSD, chunks):
    """Inside the manual region: split into micro-batches, run the ticks, broadcast the last stage's outputs.

    `x_BSD` may be a pytree of arrays that all lead with the batch (a model's layer carry, e.g. models/moe.py's
    residual stream and per-row router statistics): every leaf travels alike.
    """
    p, m, v = config.stages, config.microbatches, config.repeats
    # This stage's (v, layers per chunk, ...), as this data replica's own copy: its gradient is summed over the
    # replicas here, once, after the tick loop (see the module docstring), not inside every tick.
    chunks = jax.tree.map(lambda w: to_varying(w[:, 0]), chunks)
    batch = jax.tree.leaves(x_BSD)[0].shape[0]  # this data replica's rows when the region is manual over `data`
    # Micro-batch i takes (this replica's) rows i, i+m, ...: a slice of every fsdp shard, so the split moves no data.
    # The input is the same on every stage: cast once here, so the backward sums its gradient over `pipeline` once,
    # after the loop, rather than one micro-batch per tick inside it.
    x_MbSD = _tree(lambda x: to_varying(x.reshape(batch // m, m, *x.shape[1:]).swapaxes(0, 1)), x_BSD)
    stage = jax.lax.axis_index(AXIS)
    with inner_context():
        outputs_TbSD = _run_ticks(layer_fn, config, chunks, x_MbSD, stage)
    last_ticks = np.arange(m) + (v - 1) * m + p - 1
    # Broadcast from the last stage to every rank.
    finished_MbSD = _tree(lambda out: psum(jnp.where(stage == p - 1, out[last_ticks], 0), AXIS), outputs_TbSD)
    return _tree(lambda out, x: out.swapaxes(0, 1).reshape(x.shape), finished_MbSD, x_BSD)


def _tree(fn, *trees):
    """`jax.tree.map` over the activation pytree the pipeline carries (one array for most models)."""
    return jax.tree.map(fn, *trees)


def _run_ticks(layer_fn, config: PipelineConfig, chunks, x_MbSD, stage):
    """All forward ticks, as one scan per run of ticks that send alike; returns each tick's stage output."""
    zeros_bSD = _tree(lambda x: to_varying(jnp.zeros_like(x[0])), x_MbSD)
    loop_MbSD = _tree(lambda x: to_varying(jnp.zeros_like(x)), x_MbSD)  # stage 0's items between repeats
    carry = (zeros_bSD, loop_MbSD)
    outputs = []
    for first, count, pairs in tick_runs(config):
        tick = functools.partial(_tick, layer_fn, config, chunks, x_MbSD, stage, pairs)
        carry, out_TbSD = jax.lax.scan(tick, carry, jnp.arange(first, first + count))
        outputs.append(out_TbSD)
    return _tree(lambda *runs: jnp.concatenate(runs), *outputs)


def _tick(layer_fn, config: PipelineConfig, chunks, x_MbSD, stage, pairs, carry, tick):
    """One tick: pick this stage's input, apply its chunk of layers (rematerialised), send the result on."""
    received_bSD, loop_MbSD = carry
    p, m, v = config.stages, config.microbatches, config.repeats
    first_bSD = _tree(lambda x: x[jnp.minimum(tick, m - 1)], x_MbSD)
    if v > 1:
        # What the last stage sent after tick-1 is item tick-p, due back at stage 0 at tick (tick-p)+m.
        loop_MbSD = _tree(lambda loop, got: jax.lax.dynamic_update_index_in_dim(loop, got, (tick - p) % m, 0),
                          loop_MbSD, received_bSD)
        first_bSD = _tree(lambda first, loop: jnp.where(tick < m, first, loop[tick % m]), first_bSD, loop_MbSD)
    input_bSD = _tree(lambda first, got: jnp.where(stage == 0, first, got), first_bSD, received_bSD)
    repeat = jnp.clip((tick - stage) // m, 0, v - 1)
    output_bSD = _apply_chunk(layer_fn, chunks, repeat, input_bSD, _dropout_stream_index(config, stage, tick))
    return (_tree(lambda out: send(out, pairs), output_bSD), loop_MbSD), output_bSD


def _dropout_stream_index(config: PipelineConfig, stage, tick) -> jax.Array:
    """Dropout masks distinct per (data replica, micro-batch, stage), as 1F1B draws them: without this, every
    micro-batch (and, with the region manual over `data`, every replica) would reuse the same masks."""
    manual = jax.sharding.get_abstract_mesh().manual_axes
    replica = jax.lax.axis_index("data") if "data" in manual else 0
    micro = (tick - stage) % config.microbatches  # the item this stage works on at this tick, whatever its repeat
    return ((replica * config.microbatches + micro) * config.stages + stage).astype(jnp.uint32)


@functools.partial(jax.checkpoint, static_argnums=(0,))
def _apply_chunk(layer_fn, chunks, repeat, x_bSD, stream):
    """This stage's layers of chunk `repeat`, in order, drawing dropout from `stream`. Rematerialised: a tick keeps
    only its input for the backward (and the recompute draws the same masks)."""
    chunk = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, repeat, 0, keepdims=False), chunks)
    with dropout_stream(stream):
        x_bSD, _ = jax.lax.scan(lambda x, layer: (layer_fn(x, layer), None), x_bSD, chunk)
    return x_bSD


def to_varying(x: jax.Array) -> jax.Array:
    """`x` as a per-device value over every manual axis of the enclosing region (a no-op where it already is).

    Inside a region, an input replicated over a manual axis (a stage's weights over `data`) that meets per-device
    values is cast to varying where it is used; inside a loop body that cast's transpose, a psum, would run every
    iteration. Casting once, before the loop, puts the psum of its gradient there instead. On a CPU mesh a bf16 `x`
    is cast in fp32 (exact both ways), so that psum sums in fp32: see `psum`.
    """
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(axis for axis in jax.sharding.get_abstract_mesh().manual_axes if axis not in varying)
    if not missing:
        return x
    if _sum_bf16_in_fp32(x):
        return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)
    return jax.lax.pcast(x, missing, to="varying")


def psum(x: jax.Array, axes) -> jax.Array:
    """`jax.lax.psum` over manual axes of a pipeline region; on a CPU mesh a bf16 `x` is summed in fp32.

    Why: XLA:CPU (jax 0.10.2) aborts the process compiling a bf16 psum inside a `jax.shard_map` that is manual over
    only some of the mesh's axes, as the pipeline regions are ("hlo_instruction.cc:1615] Invalid binary instruction
    opcode copy", SIGABRT). JAX lowers the psum's reducer there with a sharding annotation on its result, which Shardy
    exports as `copy(add)`; XLA:CPU's AllReducePromotion pass, which widens every bf16 all-reduce to fp32, rebuilds
    the reducer as a binary op of the root's opcode, `copy`, and fails a CHECK. An fp32 sum gives it nothing to widen
    and is the sum it meant to compute (fp32, rounded back to bf16). Other meshes are untouched: XLA:GPU widens no
    float all-reduce and compiles the bf16 psum as it is. Minimal repro: tests/xla_cpu_bf16_psum_abort.py.
    """
    if _sum_bf16_in_fp32(x):
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
    return jax.lax.psum(x, axes)


def _sum_bf16_in_fp32(x: jax.Array) -> bool:
    """Whether `x` is bf16 and the enclosing region's mesh is on CPU (where `psum` must widen it)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return x.dtype == jnp.bfloat16 and platform == "cpu"


def manual_data_axes(layout) -> tuple[str, ...]:
    """The data-parallel axes a pipeline region is manual over besides `pipeline`: ("data",) or ().

    ("data",) when the mesh's `data` axis is > 1 and leads the batch's activation rule (so a replica's rows are one
    contiguous block and the manual split moves nothing); the region then reduces stage gradients over `data` once
    per step. Otherwise `data` stays automatic.
    """
    batch_axes = layout.rules.activations["batch"]
    return ("data",) if layout.mesh.shape["data"] > 1 and batch_axes[:1] == ("data",) else ()


def inner_rules(layout, data_axes: tuple[str, ...]):
    """The activation rules inside a pipeline region: without `pipeline` and `data_axes`, which are manual there."""
    rules = layout.rules.without_axis(AXIS)
    for axis in data_axes:
        rules = rules.without_axis(axis)
    return rules.activations


def layer_loop_for(layout) -> Callable | None:
    """The pipeline `layer_loop` for a layout whose mesh has a `pipeline` axis larger than 1, else None."""
    stages = layout.mesh.shape[AXIS]
    if stages == 1:
        return None
    from shardkit.nn import model_context

    config = dataclasses.replace(pipeline_config(layout.recipe), stages=stages)
    if config.schedule == "1f1b":
        # Training under 1F1B does not run through this hook (shardkit/one_f_one_b.py computes the gradients); a plain
        # forward pass of the model (evaluation) has no backward to interleave, and GPipe's forward is the same work.
        config = dataclasses.replace(config, schedule="gpipe")
    data_axes = manual_data_axes(layout)
    rules = inner_rules(layout, data_axes)

    def inner_context():
        # Inside the region `pipeline` (and `data`) are Manual: constraints must name the region's abstract mesh.
        return model_context(mesh=jax.sharding.get_abstract_mesh(), activation_rules=rules)

    return make_layer_loop(layout.mesh, config, inner_context, data_axes)


def microbatch_activation_bytes(layout) -> int:
    """One micro-batch's layer-boundary activation (b x S x D in the compute dtype) as one device holds it."""
    from shardkit.precision import parse_policy

    recipe = layout.recipe
    rows = recipe.train.global_batch // recipe.train.grad_accum // recipe.pipeline.microbatches
    replicas = layout.mesh.shape["data"] * layout.mesh.shape["fsdp"]
    itemsize = np.dtype(parse_policy(recipe.precision.policy).compute_dtype).itemsize
    return rows // replicas * recipe.train.seq_len * layout.config.embed * itemsize


# ---- plan ----------------------------------------------------------------------------------------------------------
def pipeline_summary(layout) -> dict | None:
    """The `plan` entry for a pipelined layout (None without one): bubble, sends, activation memory, text Gantt."""
    stages = layout.mesh.shape[AXIS]
    if stages == 1:
        return None
    config = dataclasses.replace(pipeline_config(layout.recipe), stages=stages)
    grid = schedule_grid(config)
    activation = microbatch_activation_bytes(layout)
    return {
        "stages": stages, "microbatches": config.microbatches, "repeats": config.repeats,
        "schedule": config.schedule, "layers_per_stage": layout.config.layers // stages,
        "bubble_fraction": bubble_fraction(config), "grid_idle_fraction": idle_fraction(grid),
        "microbatch_activation_bytes": activation,
        "collective_permute_bytes": collective_permute_bytes(config, activation) * layout.recipe.train.grad_accum,
        "peak_live_microbatches": peak_live_activations(grid),
        "gantt": text_gantt(grid, config),
    }


def format_summary(summary: dict) -> str:
    """The pipeline section of `shardkit plan`'s text output."""
    return "\n".join([
        f"pipeline: {summary['stages']} stages x {summary['layers_per_stage']} layers, {summary['microbatches']} "
        f"micro-batches, schedule {summary['schedule']}, repeats {summary['repeats']}",
        f"  bubble (p-1)/(v*m+p-1) = {summary['bubble_fraction']:.1%}; activations sent per step (forward and "
        f"backward, per pipeline group): {summary['collective_permute_bytes']:,} bytes",
        f"  micro-batches alive per stage at peak: {summary['peak_live_microbatches']}",
        "", summary["gantt"],
    ])


def write_svg_gantt(layout, path) -> None:
    """Write the layout's schedule as an SVG Gantt chart (`shardkit plan --gantt FILE.svg`)."""
    from pathlib import Path

    config = dataclasses.replace(pipeline_config(layout.recipe), stages=layout.mesh.shape[AXIS])
    Path(path).write_text(svg_gantt(schedule_grid(config), config))
