"""1F1B (PipeDream-flush) training: loss and gradients computed stage by stage, without autodiff of the whole model.

Why not autodiff. Under GPipe and circular the pipeline is a `layer_loop` inside the model and the backward pass is
JAX's transpose of the forward loop, so every micro-batch's forward has run before any backward starts: m
micro-batches of stage inputs stay alive. 1F1B starts the backward of micro-batch i before the forward of micro-batch
i + p, which needs i's loss, so the head and the loss move into the last stage and each stage writes its own backward.

The model protocol (optional; models/llama.py and models/mlp.py follow it). A model class may define
    LAYER_STACK                 the attribute name of its stacked layers (built with `shardkit.nn.stack`);
    embed(tokens_BS) -> x_BSD   everything before the stack;
    unembed(x_BSD) -> logits_BSV  everything after it (final norm and head);
such that `__call__(tokens)` is exactly `unembed(scan_stack(getattr(self, LAYER_STACK), embed(tokens)))`.
A model without them gets a ShardkitError naming `pipeline.schedule` when it is trained with schedule "1f1b".

Where things run. The embedding runs before the region on the whole batch (automatic sharding), and its backward
after it, from the gradient of the embedded batch, per data replica (`embedding_grads_per_replica`). Inside a
`jax.shard_map` manual over `pipeline` (and over `data` when it is > 1: `shardkit.pipeline.config.manual_data_axes`;
FSDP and TP stay automatic inside):
    stage 0        applies its layers to its micro-batch of the embedded batch; its backward files the gradient of
                   that micro-batch for the embedding's backward;
    stage d        applies its layers to the activation that stage d-1 sent;
    stage p-1      applies its layers, the head and the fp32 cross entropy, and differentiates them at once.
The head's parameters (with the embedding's, the `unstacked` ones) are read only on the last stage; their gradients,
the loss and the embedded batch's gradient are summed over `pipeline` once at the end (all-reduces, as GPipe's region
edges pay for the embedded batch).
Data parallelism: each data replica runs its own 1F1B on its rows and accumulates its own gradients (its parameters
enter as per-replica copies, so no vjp inside a tick sums over `data`); the gradients and the loss are summed over
`data` once: the stages' inside the region after the tick loop, the head's and the embedding's after the region,
added per replica first. With `data` automatic, XLA all-reduced each backward tick's weight gradient.
Why the embedding is not in stage 0: inside this region, with the table sharded over fsdp and tensor, XLA's SPMD
partitioner aborts on the embedding gather ("Check failed: partition_group_list.num_replica_groups() * ..." in
spmd_partitioner_util.cc, jax 0.10.2), even outside the tick switch.

Memory. A stage keeps only the inputs of the micro-batches whose backward has not run yet, in a buffer of K slots
(K = min(p, m) for this grid; `TickProgram.slots`). The backward of a stage recomputes its forward from the stored
input with `jax.vjp`, so the activations inside a stage exist for one micro-batch at a time. The region's edges (the
embedded batch and its gradient) are whole-batch tensors, as under GPipe.

Time. The tick program is `one_f_one_b_grid` (shardkit/pipeline/schedule.py): at every tick each stage does one forward,
one backward or nothing. The activation a stage sends may wait in the receiver's buffer until its forward tick; the
gradient a stage sends is consumed by its predecessor on the very next tick (checked when the program is built).
Sends carry only real work, so the collective-permute bytes are activation x m x (p-1), forward and backward.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from shardkit import microbatch
from shardkit.data.packing import Packing, document_rows
from shardkit.errors import ShardkitError
from shardkit.loss import cross_entropy_sum as lean_cross_entropy_sum
from shardkit.loss import logits_cross_entropy_sum
from shardkit.nn import dropout_stream, model_context, scan_stack
from shardkit.registry import model_capabilities
from shardkit.pipeline.config import AXIS, PipelineRegion, fsdp_dim, pipeline_region
from shardkit.pipeline.schedule import Pairs, PipelineConfig, one_f_one_b_grid
from shardkit.pipeline.sends import FSDP, gather_stage, psum, reduce_scatter_stage, send, to_varying


class Action(enum.IntEnum):
    """What a stage does at one tick. The last stage's forward is IDLE: its backward recomputes the forward anyway."""

    IDLE = 0
    FORWARD_FIRST = 1
    FORWARD = 2
    BACKWARD_FIRST = 3
    BACKWARD = 4
    BACKWARD_LAST = 5


# The actions by their own names too: the tick program's tables and its tests read them so.
IDLE, FORWARD_FIRST, FORWARD, BACKWARD_FIRST, BACKWARD, BACKWARD_LAST = Action


# ---- the tick program: the 1F1B grid as per-(stage, tick) tables ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TickProgram:
    """Static tables for the executor; row = stage, column = tick.

    action[d, t]   an `Action`
    micro[d, t]    the micro-batch that action works on (0 when idle)
    arrival[d, t]  the micro-batch whose activation stage d receives at the start of tick t (-1 for none)
    slots          the stage-input buffer's size; micro-batch i lives in slot i % slots
    sends[t]       (forward pairs, backward pairs) of the ppermutes after tick t
    """

    action: np.ndarray
    micro: np.ndarray
    arrival: np.ndarray
    slots: int
    sends: tuple[tuple[Pairs, Pairs], ...]

    @property
    def ticks(self) -> int:
        return self.action.shape[1]


def tick_program(config: PipelineConfig) -> TickProgram:
    """Translate the 1F1B grid into the executor's tables, and check the two timing facts the executor relies on."""
    grid = one_f_one_b_grid(config)
    p, ticks = config.stages, len(grid[0])
    action = np.full((p, ticks), IDLE, np.int32)
    micro = np.zeros((p, ticks), np.int32)
    for stage, row in enumerate(grid):
        for tick, cell in enumerate(row):
            if cell is not None:
                action[stage, tick] = _action(cell.kind, stage, p)
                micro[stage, tick] = cell.micro
    arrival = np.full((p, ticks), -1, np.int32)
    sends = []
    for tick in range(ticks):
        forward = tuple((d, d + 1) for d in range(p) if action[d, tick] in (FORWARD_FIRST, FORWARD))
        backward = tuple((d, d - 1) for d in range(p) if action[d, tick] in (BACKWARD, BACKWARD_LAST))
        for source, target in forward:
            if tick + 1 < ticks:
                arrival[target, tick + 1] = micro[source, tick]
        sends.append((forward, backward))
    _check_gradients_are_consumed_at_once(action, micro)
    return TickProgram(action, micro, arrival, _buffer_slots(action, micro, arrival, config.microbatches), tuple(sends))


def _action(kind: str, stage: int, stages: int) -> Action:
    if kind == "F":
        return FORWARD_FIRST if stage == 0 else IDLE if stage == stages - 1 else FORWARD
    return BACKWARD_FIRST if stage == 0 else BACKWARD_LAST if stage == stages - 1 else BACKWARD


def _check_gradients_are_consumed_at_once(action: np.ndarray, micro: np.ndarray) -> None:
    """Stage d's backward of micro-batch i must come the tick after stage d+1's: the gradient is not buffered."""
    p, ticks = action.shape
    for stage in range(p - 1):
        for tick in range(ticks):
            if action[stage, tick] in (BACKWARD_FIRST, BACKWARD):
                sender = action[stage + 1, tick - 1] if tick else IDLE
                if sender not in (BACKWARD, BACKWARD_LAST) or micro[stage + 1, tick - 1] != micro[stage, tick]:
                    raise AssertionError(f"1F1B grid: stage {stage}'s backward at tick {tick} has no gradient waiting")


def _buffer_slots(action: np.ndarray, micro: np.ndarray, arrival: np.ndarray, microbatches: int) -> int:
    """The fewest slots K such that micro-batch i + K arrives only after micro-batch i's backward read its slot."""
    p, _ = action.shape
    arrived, consumed = {}, {}
    for stage in range(1, p):
        for tick in np.flatnonzero(arrival[stage] >= 0):
            arrived[stage, int(arrival[stage, tick])] = tick
        for tick in np.flatnonzero(np.isin(action[stage], (BACKWARD, BACKWARD_LAST))):
            consumed[stage, int(micro[stage, tick])] = tick
    for slots in range(1, microbatches + 1):
        if all(arrived[d, i + slots] > consumed[d, i] for d in range(1, p) for i in range(microbatches - slots)):
            return slots
    return microbatches


def live_stage_inputs(program: TickProgram) -> list[int]:
    """Per stage, the most stage inputs held at once (arrived, backward not yet run); stage 0 holds none."""
    peaks = [0]
    for stage in range(1, program.action.shape[0]):
        live = peak = 0
        for tick in range(program.ticks):
            live += int(program.arrival[stage, tick] >= 0)
            peak = max(peak, live)
            live -= int(program.action[stage, tick] in (BACKWARD, BACKWARD_LAST))
        peaks.append(peak)
    return peaks


def tick_blocks(program: TickProgram) -> list[tuple[int, int, int]]:
    """Cover the ticks with (first tick, period, count) blocks whose sends repeat every `period` ticks.

    Each block becomes one scan whose body runs `period` ticks, so the program has a few scans (warm-up, the
    alternating steady state, cool-down) rather than one unrolled tick per step, while every ppermute keeps its
    static, exact pairs.
    """
    sends, blocks, tick = program.sends, [], 0
    while tick < len(sends):
        best = (1, 1)
        for period in (1, 2):
            unit = sends[tick:tick + period]
            count = 0
            while len(unit) == period and sends[tick + count * period:tick + (count + 1) * period] == unit:
                count += 1
            if period * count > best[0] * best[1]:
                best = (period, count)
        blocks.append((tick, *best))
        tick += best[0] * best[1]
    return blocks


# ---- the model protocol -------------------------------------------------------------------------------------------
def check_model(model_class: type) -> None:
    """Raise a ShardkitError naming `pipeline.schedule` when the model cannot be split into embed, stack, unembed."""
    missing = model_capabilities(model_class).staged_missing
    if missing:
        raise ShardkitError("pipeline.schedule", f"'1f1b' needs the model split into embed(tokens), a layer stack and "
                            f"unembed(x); {model_class.__name__} lacks {list(missing)} (see "
                            f"shardkit/pipeline/one_f_one_b.py); use 'gpipe' or 'circular'")


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """The model's three parts as functions of raw parameters, each cast to the compute dtype before use.

    `unstacked` is every parameter outside the layer stack (embedding, final norm, head); `stack` is (a stage's slice
    of) the stacked layers. `packing`: the rows are packed documents; every stage reads its micro-batch's positions
    and segment ids off its tokens (`rows`).
    """

    graphdef: Any
    stack_name: str
    cast: Callable
    packing: Packing | None = None

    def _view(self, unstacked, stack):
        return nnx.merge(self.graphdef, self.cast({**unstacked, self.stack_name: stack}))

    def _layers(self, model, x_bSD, rows):
        return scan_stack(getattr(model, self.stack_name), x_bSD, *rows)

    def rows(self, tokens_bS1) -> tuple:
        """What the layers take after the activation, for a micro-batch's tokens (inputs and targets)."""
        return document_rows(self.packing, tokens_bS1[:, :-1])

    def embed(self, unstacked, stack, tokens_BS):
        """The embedding, run before the pipeline region on the whole batch."""
        return self._view(unstacked, stack).embed(tokens_BS)

    def stage_layers(self, unstacked, stack, x_bSD, rows=()):
        """A stage's share of the layer stack (`stack`) applied to its input."""
        return self._layers(self._view(unstacked, stack), x_bSD, rows)

    def last_stage_loss(self, unstacked, stack, x_bSD, targets_bS, rows=()):
        """The last stage: its layers, the head, and the summed fp32 cross entropy of the micro-batch (the lean loss,
        shardkit/loss.py, when the model gives its final hidden state and head weight)."""
        model = self._view(unstacked, stack)
        x_bSD = self._layers(model, x_bSD, rows)
        if model_capabilities(type(model)).lean_loss:
            return lean_cross_entropy_sum(model.final_hidden(x_bSD), model.head_weight(), targets_bS)
        return logits_cross_entropy_sum(model.unembed(x_bSD).astype(jnp.float32), targets_bS)


# ---- the executor -------------------------------------------------------------------------------------------------
def value_and_grad(layout, policy, scale, packing: Packing | None = None) -> Callable:
    """`(params, tokens_BS1) -> (scale * mean loss, its fp32 gradients)`, run as a 1F1B pipeline.

    The same contract as `jax.value_and_grad` of `StepBuilder.loss` times `scale`: the mean is over every token of
    the batch given, the gradients have the parameters' tree structure (the stack's `layers` axis whole again).

    Args:
        layout: a layout whose `pipeline.one_f_one_b` and whose model follows the protocol above (`check_model`,
            which `shardkit.step.build_step` runs before anything is traced).
        policy: the precision policy; parameters are cast to its compute dtype inside every stage.
        scale: the loss scale (1.0 without loss scaling), a scalar.
        packing: packed documents (their positions and segment ids come from each micro-batch's tokens), or None.
    """
    region = pipeline_region(layout)
    program = tick_program(region.config)
    staged = StagedModel(layout.graphdef, layout.model_class.LAYER_STACK, policy.cast_to_compute, packing)
    p, m, data_axes = region.config.stages, region.config.microbatches, region.data_axes
    dims = _gathered_dims(layout, region)

    def run(params, tokens_BS1):
        unstacked = {key: value for key, value in params.items() if key != staged.stack_name}
        stack = params[staged.stack_name]
        if region.gathers_per_step:
            stack = policy.cast_to_compute(stack)  # gathered once per step, in the dtype every stage computes in
        stack_PL = jax.tree.map(lambda w: w.reshape(p, w.shape[0] // p, *w.shape[1:]), stack)
        batch, length = tokens_BS1.shape
        embedded_BSD = staged.embed(unstacked, stack, tokens_BS1[:, :-1])
        stage_specs = jax.tree.map(_stage_spec, stack_PL, dims)
        rows = PartitionSpec(None, data_axes or None)  # (micro-batch, rows, ...): each data replica its own rows
        run_stages = jax.shard_map(
            functools.partial(_run_stages, staged, region, program, dims),
            mesh=region.mesh, axis_names=region.manual_axes,
            in_specs=(PartitionSpec(), stage_specs, rows, rows, PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(data_axes or None), stage_specs, rows),
        )
        cotangent = scale / (batch * (length - 1))  # d(scale * mean loss) / d(one token's loss)
        loss_sum, unstacked_grads_R, stack_grads_PL, d_embedded_MbSD = run_stages(
            unstacked, stack_PL, microbatch.split(embedded_BSD, m), microbatch.split(tokens_BS1, m), cotangent)
        d_embedded_BSD = microbatch.merge(d_embedded_MbSD)
        d_unstacked_R = embedding_grads_per_replica(staged, layout, data_axes, unstacked, stack, tokens_BS1[:, :-1],
                                                    d_embedded_BSD)
        # The head's (region) and the embedding's gradients of each replica added first, then summed over the
        # replicas: one reduction over `data` for the parameters outside the stack, even where they are tied.
        unstacked_grads = jax.tree.map(lambda g, d: (g + d.astype(jnp.float32)).sum(0), unstacked_grads_R,
                                       d_unstacked_R)
        stack_grads = jax.tree.map(lambda g: g.reshape(p * g.shape[1], *g.shape[2:]), stack_grads_PL)
        return loss_sum * cotangent, {**unstacked_grads, staged.stack_name: stack_grads}

    return run


def _gathered_dims(layout, region: PipelineRegion):
    """Per leaf of the layer stack, the dimension the region gathers over `fsdp` once per step (-1: none, also for
    every leaf when FSDP gathers per use)."""
    logical = layout.logical[layout.model_class.LAYER_STACK]
    dim = (lambda names: fsdp_dim(names, layout.rules)) if region.gathers_per_step else (lambda names: -1)
    return jax.tree.map(dim, logical, is_leaf=lambda x: isinstance(x, tuple))


def _stage_spec(w_PL, dim: int) -> PartitionSpec:
    """A stage-split leaf (p, L/p, ...) enters the region split over stages, and over `fsdp` along its FSDP dimension
    (`dim` of the stacked leaf, one further on here) when the region gathers it itself."""
    return PartitionSpec(AXIS) if dim < 0 else PartitionSpec(AXIS, *[None] * dim, FSDP)


def embedding_grads_per_replica(staged: StagedModel, layout, data_axes, unstacked, stack, tokens_BS, d_embedded_BSD):
    """The embedding's backward on each data replica's rows: gradients with a leading replica axis, not yet summed.

    A vmap over the replicas (`spmd_axis_name`, as train.py's per-replica accumulation), in the automatic layout:
    the embedding cannot run inside the pipeline region (see the module docstring). One replica when `data_axes` is
    empty.
    """
    replicas = math.prod(layout.mesh.shape[axis] for axis in data_axes)
    rules = layout.rules.without_axes(data_axes)  # inside the vmap, a replica's rows are whole over `data`

    def one_replica(tokens_bS, d_embedded_bSD):
        with model_context(activation_rules=rules.activations):
            _, pullback = jax.vjp(lambda u: staged.embed(u, stack, tokens_bS), unstacked)
            return pullback(d_embedded_bSD)[0]

    per_replica = jax.vmap(one_replica, spmd_axis_name=data_axes or None)
    return per_replica(microbatch.by_replica(tokens_BS, replicas), microbatch.by_replica(d_embedded_BSD, replicas))


class _Sums(NamedTuple):
    """What a stage accumulates through the ticks, in fp32: its loss, and the gradients of the parameters it reads."""

    loss: jax.Array
    unstacked: Any
    stack: Any

    def add(self, loss, d_unstacked, d_stack) -> "_Sums":
        """Add one micro-batch's loss and gradients; None adds nothing."""
        add = lambda total, g: total + g.astype(jnp.float32)
        unstacked = self.unstacked if d_unstacked is None else jax.tree.map(add, self.unstacked, d_unstacked)
        stack = self.stack if d_stack is None else jax.tree.map(add, self.stack, d_stack)
        return _Sums(self.loss + loss, unstacked, stack)


class _TickCarry(NamedTuple):
    """The state one tick hands the next."""

    buffer_KbSD: jax.Array  # stage inputs waiting for their backward, micro-batch i in slot i % K
    activation_bSD: jax.Array  # what the previous stage sent after the last tick
    gradient_bSD: jax.Array  # what the next stage sent back after the last tick
    sums: _Sums
    d_embedded_MbSD: jax.Array  # the embedded batch's gradient, filed by stage 0's backwards


def _run_stages(staged: StagedModel, region: PipelineRegion, program: TickProgram, dims,
                unstacked, stack_PL, embedded_MbSD, tokens_MbS1, cotangent):
    """Inside the manual region: run every tick block, then sum over stages the loss, the head's gradients and the
    gradient of the embedded batch, and over data replicas the loss and the stages' gradients (once per step).

    Returns the loss sum, the head's gradients per data replica (a leading axis, summed in `run` together with the
    embedding's), the stage gradients and the embedded batch's gradient."""
    # Differentiating an invariant input from inside a stage's branch would transpose its implicit broadcast into a
    # psum over `pipeline` that only that stage reaches (a deadlock), and over `data` into a psum every tick; as
    # per-stage, per-replica copies, their gradients stay local until the sums below.
    # This stage's layers, gathered over `fsdp` here, once, when the region does it.
    stack = jax.tree.map(lambda w, dim: to_varying(gather_stage(w[0], dim)), stack_PL, dims)
    unstacked = jax.tree.map(to_varying, unstacked)
    replica = region.replica_index()
    work = _StageWork(staged, region, unstacked, stack, embedded_MbSD, tokens_MbS1, jax.lax.axis_index(AXIS), replica,
                      cotangent)
    with region.context():
        carry = _initial_carry(program, embedded_MbSD, unstacked, stack)
        for first, period, count in tick_blocks(program):
            ticks = [functools.partial(_stage_tick, work, program, program.sends[first + k],
                                       block_actions(program, first + k, period, count)) for k in range(period)]
            carry, _ = jax.lax.scan(lambda c, t: (_run_period(ticks, c, t), None), carry,
                                    jnp.arange(first, first + period * count, period))
    data_axes = region.data_axes
    # Only the last stage has a loss and head gradients, only the first the embedded batch's: the sums broadcast them.
    # The data replicas' sum of the stage gradients is their one reduction over `data` this step (the embedded batch's
    # gradient stays per replica: its rows are the replica's own).
    loss_sum = jax.lax.psum(carry.sums.loss, (AXIS, *data_axes))
    unstacked_grads = jax.tree.map(lambda g: g[None], jax.lax.psum(carry.sums.unstacked, AXIS))  # per replica
    stack_grads = _reduce_stage_gradients(region, carry.sums.stack, dims, stack)
    d_embedded_MbSD = psum(carry.d_embedded_MbSD, AXIS)  # bf16 under a bf16 policy: see shardkit.pipeline.sends.psum
    return loss_sum, unstacked_grads, jax.tree.map(lambda g: g[None], stack_grads), d_embedded_MbSD


def _reduce_stage_gradients(region: PipelineRegion, sums, dims, stack):
    """The stage gradients summed over the data replicas, once: an all-reduce over `data`, and under a per-step FSDP
    gather a reduce-scatter over `fsdp` onto the weights' shards, in the gathered `stack`'s dtype (the compute dtype,
    which is the policy's gradient-reduction dtype)."""
    data_axes = tuple(axis for axis in region.data_axes if axis != FSDP)
    sums = jax.lax.psum(sums, data_axes) if data_axes else sums
    if not region.gathers_per_step:
        return sums
    return jax.tree.map(lambda g, dim, w: reduce_scatter_stage(g.astype(w.dtype), dim).astype(jnp.float32),
                        sums, dims, stack)


def _run_period(ticks, carry: _TickCarry, first_tick) -> _TickCarry:
    """One step of a tick block's scan: its `period` ticks in a row."""
    for offset, tick in enumerate(ticks):
        carry = tick(carry, first_tick + offset)
    return carry


def _initial_carry(program: TickProgram, embedded_MbSD, unstacked, stack) -> _TickCarry:
    """Every buffer, received tensor and sum at zero."""
    zeros_bSD = to_varying(jnp.zeros_like(embedded_MbSD[0]))
    buffer_KbSD = to_varying(jnp.zeros((program.slots, *embedded_MbSD.shape[1:]), embedded_MbSD.dtype))
    f32_zeros = lambda tree: jax.tree.map(lambda w: to_varying(jnp.zeros(w.shape, jnp.float32)), tree)
    sums = _Sums(to_varying(jnp.float32(0)), f32_zeros(unstacked), f32_zeros(stack))
    return _TickCarry(buffer_KbSD, zeros_bSD, zeros_bSD, sums, to_varying(jnp.zeros_like(embedded_MbSD)))


def block_actions(program: TickProgram, tick: int, period: int, count: int) -> tuple[int, ...]:
    """The actions any stage takes at ticks tick, tick + period, ... (count of them): the branches that tick needs."""
    return tuple(sorted(set(program.action[:, tick:tick + period * count:period].flat)))


# The branch of the tick switch that runs each action. Stage 0 runs the middle stages' branches on its micro-batch of
# the embedded batch (the embedding runs before the region).
BRANCH = {IDLE: "idle", FORWARD_FIRST: "forward", FORWARD: "forward", BACKWARD_FIRST: "backward",
          BACKWARD: "backward", BACKWARD_LAST: "backward_last"}


def _stage_tick(work: "_StageWork", program: TickProgram, pairs: tuple[Pairs, Pairs], actions: tuple[int, ...],
                carry: _TickCarry, tick) -> _TickCarry:
    """One tick: file the activation that arrived, run this stage's action, send activations on and gradients back.

    Only the branches of the `actions` that occur at this tick are compiled into its switch (a warm-up tick holds no
    backward code). Stage 0 reads its input from the embedded batch and files its input gradient there.
    """
    arrived = jnp.asarray(program.arrival)[work.stage, tick]
    slot = jnp.maximum(arrived, 0) % program.slots
    kept_bSD = jnp.where(arrived >= 0, carry.activation_bSD, carry.buffer_KbSD[slot])
    buffer_KbSD = jax.lax.dynamic_update_index_in_dim(carry.buffer_KbSD, kept_bSD, slot, 0)
    action, micro = jnp.asarray(program.action)[work.stage, tick], jnp.asarray(program.micro)[work.stage, tick]
    x_bSD = buffer_KbSD[micro % program.slots]
    if {FORWARD_FIRST, BACKWARD_FIRST} & set(actions):
        embedded_bSD = jax.lax.dynamic_index_in_dim(work.embedded_MbSD, micro, 0, keepdims=False)
        x_bSD = jnp.where(work.stage == 0, embedded_bSD.astype(x_bSD.dtype), x_bSD)
    names = list(dict.fromkeys(BRANCH[a] for a in actions))
    index = np.zeros(len(BRANCH), np.int32)
    index[list(actions)] = [names.index(BRANCH[a]) for a in actions]
    sums, forward_bSD, backward_bSD = jax.lax.switch(
        jnp.asarray(index)[action], [getattr(work, name) for name in names], carry.sums, micro, x_bSD,
        carry.gradient_bSD)
    d_embedded_MbSD = carry.d_embedded_MbSD
    if BACKWARD_FIRST in actions:
        # Stage 0's backward ends at the embedded micro-batch (nothing is sent back from stage 0); the embedding's own
        # backward runs once, after the region, in the automatic layout.
        kept_bSD = jnp.where(action == BACKWARD_FIRST, backward_bSD.astype(d_embedded_MbSD.dtype),
                             jax.lax.dynamic_index_in_dim(d_embedded_MbSD, micro, 0, keepdims=False))
        d_embedded_MbSD = jax.lax.dynamic_update_index_in_dim(d_embedded_MbSD, kept_bSD, micro, 0)
    forward_pairs, backward_pairs = pairs
    return _TickCarry(buffer_KbSD, send(forward_bSD, forward_pairs), send(backward_bSD, backward_pairs), sums,
                      d_embedded_MbSD)


@dataclasses.dataclass(frozen=True)
class _StageWork:
    """One stage inside the region: its parameters, the tokens, and the branches of the tick switch.

    A branch maps (sums, micro, stage input, gradient received) to (sums, activation to send forward, gradient to
    send backward).
    """

    staged: StagedModel
    region: PipelineRegion
    unstacked: Any
    stack: Any
    embedded_MbSD: jax.Array
    tokens_MbS1: jax.Array
    stage: jax.Array
    replica: jax.Array | int  # the data replica (0 when the region is not manual over `data`)
    cotangent: jax.Array

    def stream(self, micro):
        return dropout_stream(self.region.stream_index(self.replica, micro, self.stage))

    def tokens(self, micro):
        return jax.lax.dynamic_index_in_dim(self.tokens_MbS1, micro, 0, keepdims=False)

    def idle(self, sums: _Sums, micro, x_bSD, dy_bSD):
        return sums, jnp.zeros_like(x_bSD), jnp.zeros_like(x_bSD)

    def forward(self, sums: _Sums, micro, x_bSD, dy_bSD):
        with self.stream(micro):
            y_bSD = self.staged.stage_layers(self.unstacked, self.stack, x_bSD, self.staged.rows(self.tokens(micro)))
        return sums, y_bSD.astype(x_bSD.dtype), jnp.zeros_like(x_bSD)

    def backward(self, sums: _Sums, micro, x_bSD, dy_bSD):
        """Recompute the stage's forward from its stored input, and pull the received gradient through it."""
        rows = self.staged.rows(self.tokens(micro))
        with self.stream(micro):
            _, pullback = jax.vjp(lambda s, x: self.staged.stage_layers(self.unstacked, s, x, rows), self.stack, x_bSD)
            d_stack, dx_bSD = pullback(dy_bSD)
        return sums.add(0.0, None, d_stack), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)

    def backward_last(self, sums: _Sums, micro, x_bSD, dy_bSD):
        """Layers, head and loss forward, then their backward from d(scaled mean loss) / d(token loss)."""
        targets_bS, rows = self.tokens(micro)[:, 1:], self.staged.rows(self.tokens(micro))
        with self.stream(micro):
            loss, pullback = jax.vjp(lambda u, s, x: self.staged.last_stage_loss(u, s, x, targets_bS, rows),
                                     self.unstacked, self.stack, x_bSD)
            d_unstacked, d_stack, dx_bSD = pullback(to_varying(self.cotangent.astype(loss.dtype)))
        return sums.add(loss, d_unstacked, d_stack), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)
