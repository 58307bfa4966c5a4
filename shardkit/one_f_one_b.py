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

Where things run (inside a `jax.shard_map` manual over `pipeline` only; FSDP and TP stay automatic inside):
    stage 0        embeds its micro-batch and applies its layers; its backward recomputes both and ends in the
                   embedding gradient, so neither the embedded batch nor its gradient ever crosses the pipeline;
    stage d        applies its layers to the activation that stage d-1 sent;
    stage p-1      applies its layers, the head and the fp32 cross entropy, and differentiates them at once.
The embedding and head parameters (everything outside the stack) are read only on the first and last stage; their
gradients are summed over `pipeline` once at the end (one all-reduce of those parameters' size).

Memory. A stage keeps only the inputs of the micro-batches whose backward has not run yet, in a buffer of K slots
(K = p for this grid; `TickProgram.slots`). The backward of a stage recomputes its forward from the stored input with
`jax.vjp`, so the activations inside a stage exist for one micro-batch at a time. Stage 0 stores nothing: it
recomputes from the tokens.

Time. The tick program is `one_f_one_b_grid` from shardkit/pipeline.py: at every tick each stage does one forward,
one backward or nothing. The activation a stage sends may wait in the receiver's buffer until its forward tick; the
gradient a stage sends is consumed by its predecessor on the very next tick (checked when the program is built).
Sends carry only real work, so the collective-permute bytes are activation x m x (p-1), forward and backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.nn import dropout_stream, model_context, scan_stack
from shardkit.pipeline import AXIS, Pairs, PipelineConfig, one_f_one_b_grid, pipeline_config, send

# What a stage does at one tick. The last stage's forward is IDLE: its backward recomputes the forward anyway.
IDLE, FORWARD_FIRST, FORWARD, BACKWARD_FIRST, BACKWARD, BACKWARD_LAST = range(6)
PROTOCOL = ("LAYER_STACK", "embed", "unembed")


# ---- the tick program: the 1F1B grid as per-(stage, tick) tables ----------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TickProgram:
    """Static tables for the executor; row = stage, column = tick.

    action[d, t]   one of IDLE, FORWARD_FIRST, FORWARD, BACKWARD_FIRST, BACKWARD, BACKWARD_LAST
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


def _action(kind: str, stage: int, stages: int) -> int:
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
    missing = [name for name in PROTOCOL if not hasattr(model_class, name)]
    if missing or not isinstance(getattr(model_class, "LAYER_STACK", None), str):
        raise ShardkitError("pipeline.schedule", f"'1f1b' needs the model split into embed(tokens), a layer stack and "
                            f"unembed(x); {model_class.__name__} lacks {missing or ['a string LAYER_STACK']} (see "
                            f"shardkit/one_f_one_b.py); use 'gpipe' or 'circular'")


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """The model's three parts as functions of raw parameters, each cast to the compute dtype before use.

    `outer` is every parameter outside the layer stack; `stack` is (a stage's slice of) the stacked layers.
    """

    graphdef: Any
    stack_name: str
    cast: Callable

    def _view(self, outer, stack):
        return nnx.merge(self.graphdef, self.cast({**outer, self.stack_name: stack}))

    def layers(self, model, x_bSD):
        return scan_stack(getattr(model, self.stack_name), x_bSD)

    def first(self, outer, stack, tokens_bS):
        """Stage 0: embedding, then its layers."""
        model = self._view(outer, stack)
        return self.layers(model, _varying(model.embed(tokens_bS)))

    def middle(self, outer, stack, x_bSD):
        return self.layers(self._view(outer, stack), x_bSD)

    def last(self, outer, stack, x_bSD, targets_bS):
        """The last stage: its layers, the head, and the summed fp32 cross entropy of the micro-batch."""
        model = self._view(outer, stack)
        logits_bSV = model.unembed(self.layers(model, x_bSD)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits_bSV, targets_bS).sum()


def _varying(x: jax.Array) -> jax.Array:
    """Mark a value computed from pipeline-invariant inputs (the embedding) as per-stage, like the stage's layers."""
    return x if AXIS in jax.typeof(x).manual_axis_type.varying else jax.lax.pcast(x, AXIS, to="varying")


# ---- the executor -------------------------------------------------------------------------------------------------
def value_and_grad(layout, policy, scale) -> Callable:
    """`(params, tokens_BS1) -> (scale * mean loss, its fp32 gradients)`, run as a 1F1B pipeline.

    The same contract as `jax.value_and_grad` of `StepBuilder.loss` times `scale`: the mean is over every token of
    the batch given, the gradients have the parameters' tree structure (the stack's `layers` axis whole again).

    Args:
        layout: a layout whose mesh has a `pipeline` axis > 1 and whose model follows the protocol above.
        policy: the precision policy; parameters are cast to its compute dtype inside every stage.
        scale: the loss scale (1.0 without loss scaling), a scalar.
    """
    check_model(layout.model_class)
    config = dataclasses.replace(pipeline_config(layout.recipe), stages=layout.mesh.shape[AXIS])
    program = tick_program(config)
    staged = StagedModel(layout.graphdef, layout.model_class.LAYER_STACK, policy.cast_to_compute)
    inner_rules = layout.rules.without_axis(AXIS).activations

    def inner_context():
        # Inside the region `pipeline` is Manual: constraints name the region's abstract mesh, and the stack is a scan.
        return model_context(mesh=jax.sharding.get_abstract_mesh(), activation_rules=inner_rules, layer_loop=None)

    def run(params, tokens_BS1):
        p, m = config.stages, config.microbatches
        outer = {key: value for key, value in params.items() if key != staged.stack_name}
        stack_PL = jax.tree.map(lambda w: w.reshape(p, w.shape[0] // p, *w.shape[1:]), params[staged.stack_name])
        batch, length = tokens_BS1.shape
        # Micro-batch i takes rows i, i+m, ...: a slice of every data/fsdp shard, as in the GPipe executor.
        tokens_MbS1 = tokens_BS1.reshape(batch // m, m, length).swapaxes(0, 1)
        stage_specs = jax.tree.map(lambda _: PartitionSpec(AXIS), stack_PL)
        region = jax.shard_map(
            functools.partial(_run_stages, staged, config, program, inner_context),
            mesh=layout.mesh, axis_names={AXIS},
            in_specs=(PartitionSpec(), stage_specs, PartitionSpec(), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), stage_specs),
        )
        cotangent = scale / (batch * (length - 1))  # d(scale * mean loss) / d(one token's loss)
        loss_sum, outer_grads, stack_grads_PL = region(outer, stack_PL, tokens_MbS1, cotangent)
        stack_grads = jax.tree.map(lambda g: g.reshape(p * g.shape[1], *g.shape[2:]), stack_grads_PL)
        return loss_sum * cotangent, {**outer_grads, staged.stack_name: stack_grads}

    return run


def _run_stages(staged: StagedModel, config: PipelineConfig, program: TickProgram, inner_context,
                outer, stack_PL, tokens_MbS1, cotangent):
    """Inside the manual region: run every tick block, then gather the loss and the outer gradients over stages."""
    stack = jax.tree.map(lambda w: w[0], stack_PL)  # this stage's layers
    # Differentiating an invariant input from inside a stage's branch would transpose its implicit broadcast into a
    # psum over `pipeline` that only that stage reaches (a deadlock); as a per-stage copy, its gradient stays local.
    outer = jax.tree.map(_varying, outer)
    stage = jax.lax.axis_index(AXIS)
    with inner_context():
        x_shape = jax.eval_shape(staged.first, outer, stack, tokens_MbS1[0, :, :-1])
        branches = _branches(staged, config, outer, stack, tokens_MbS1, stage, cotangent)
        carry = _initial_carry(program, x_shape, outer, stack)
        for first, period, count in tick_blocks(program):
            ticks = [functools.partial(_tick, branches, program, stage, program.sends[first + k],
                                       block_actions(program, first + k, period, count)) for k in range(period)]
            carry, _ = jax.lax.scan(lambda c, t: (_run_ticks(ticks, c, t), None), carry,
                                    jnp.arange(first, first + period * count, period))
    loss_sum, outer_grads, stack_grads = carry[3]
    # Only the last stage has a loss and only the first and last have outer gradients: the sums broadcast them.
    loss_sum, outer_grads = jax.lax.psum((loss_sum, outer_grads), AXIS)
    return loss_sum, outer_grads, jax.tree.map(lambda g: g[None], stack_grads)


def _run_ticks(ticks, carry, first_tick):
    for offset, tick in enumerate(ticks):
        carry = tick(carry, first_tick + offset)
    return carry


def _initial_carry(program: TickProgram, x_shape, outer, stack):
    """(stage-input buffer, activation received, gradient received, (loss sum, outer grads, stack grads)) as zeros."""
    varying = lambda x: jax.lax.pcast(x, AXIS, to="varying")
    zeros_bSD = varying(jnp.zeros(x_shape.shape, x_shape.dtype))
    buffer_KbSD = varying(jnp.zeros((program.slots, *x_shape.shape), x_shape.dtype))
    f32_zeros = lambda tree: jax.tree.map(lambda w: varying(jnp.zeros(w.shape, jnp.float32)), tree)
    accumulators = (varying(jnp.float32(0)), f32_zeros(outer), f32_zeros(stack))
    return buffer_KbSD, zeros_bSD, zeros_bSD, accumulators


def block_actions(program: TickProgram, tick: int, period: int, count: int) -> tuple[int, ...]:
    """The actions any stage takes at ticks tick, tick + period, ... (count of them): the branches that tick needs."""
    return tuple(sorted(set(program.action[:, tick:tick + period * count:period].flat)))


def _tick(branches, program: TickProgram, stage, pairs: tuple[Pairs, Pairs], actions: tuple[int, ...], carry, tick):
    """One tick: file the activation that arrived, run this stage's action, send activations on and gradients back.

    Only the `actions` that occur at this tick are compiled into its switch (warm-up ticks hold no backward code).
    """
    buffer_KbSD, received_bSD, gradient_bSD, accumulators = carry
    slots = program.slots
    arrived = jnp.asarray(program.arrival)[stage, tick]
    slot = jnp.maximum(arrived, 0) % slots
    kept_bSD = jnp.where(arrived >= 0, received_bSD, buffer_KbSD[slot])
    buffer_KbSD = jax.lax.dynamic_update_index_in_dim(buffer_KbSD, kept_bSD, slot, 0)
    action, micro = jnp.asarray(program.action)[stage, tick], jnp.asarray(program.micro)[stage, tick]
    position = np.zeros(len(branches), np.int32)
    position[list(actions)] = np.arange(len(actions))
    accumulators, forward_bSD, backward_bSD = jax.lax.switch(
        jnp.asarray(position)[action], [branches[a] for a in actions], accumulators, micro, buffer_KbSD[micro % slots], gradient_bSD)
    forward_pairs, backward_pairs = pairs
    return buffer_KbSD, send(forward_bSD, forward_pairs), send(backward_bSD, backward_pairs), accumulators


def _branches(staged: StagedModel, config: PipelineConfig, outer, stack, tokens_MbS1, stage, cotangent):
    """The six actions, indexed by the action codes; each maps (accumulators, micro, input, gradient in) to
    (accumulators, activation to send forward, gradient to send backward)."""

    def stream(micro):
        # Dropout masks distinct per (micro-batch, stage), and the same in a backward's recompute as in the forward.
        return dropout_stream(micro * config.stages + stage)

    def inputs(micro):
        return jax.lax.dynamic_index_in_dim(tokens_MbS1, micro, 0, keepdims=False)[:, :-1]

    def targets(micro):
        return jax.lax.dynamic_index_in_dim(tokens_MbS1, micro, 0, keepdims=False)[:, 1:]

    def idle(acc, micro, x_bSD, dy_bSD):
        return acc, jnp.zeros_like(x_bSD), jnp.zeros_like(x_bSD)

    def forward_first(acc, micro, x_bSD, dy_bSD):
        with stream(micro):
            return acc, staged.first(outer, stack, inputs(micro)).astype(x_bSD.dtype), jnp.zeros_like(x_bSD)

    def forward(acc, micro, x_bSD, dy_bSD):
        with stream(micro):
            return acc, staged.middle(outer, stack, x_bSD).astype(x_bSD.dtype), jnp.zeros_like(x_bSD)

    def backward_first(acc, micro, x_bSD, dy_bSD):
        with stream(micro):
            _, pullback = jax.vjp(lambda o, s: staged.first(o, s, inputs(micro)), outer, stack)
            d_outer, d_stack = pullback(dy_bSD)
        return _accumulate(acc, 0.0, d_outer, d_stack), jnp.zeros_like(x_bSD), jnp.zeros_like(x_bSD)

    def backward(acc, micro, x_bSD, dy_bSD):
        with stream(micro):
            _, pullback = jax.vjp(lambda s, x: staged.middle(outer, s, x), stack, x_bSD)
            d_stack, dx_bSD = pullback(dy_bSD)
        return _accumulate(acc, 0.0, None, d_stack), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)

    def backward_last(acc, micro, x_bSD, dy_bSD):
        with stream(micro):
            loss, pullback = jax.vjp(lambda o, s, x: staged.last(o, s, x, targets(micro)), outer, stack, x_bSD)
            d_outer, d_stack, dx_bSD = pullback(_varying(cotangent.astype(loss.dtype)))
        return _accumulate(acc, loss, d_outer, d_stack), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)

    return [idle, forward_first, forward, backward_first, backward, backward_last]


def _accumulate(acc, loss, d_outer, d_stack):
    """Add one micro-batch's loss and gradients (fp32) to the running sums; None adds nothing."""
    loss_sum, outer_sum, stack_sum = acc
    add = lambda total, g: total + g.astype(jnp.float32)
    outer_sum = outer_sum if d_outer is None else jax.tree.map(add, outer_sum, d_outer)
    return loss_sum + loss, outer_sum, jax.tree.map(add, stack_sum, d_stack)
