"""The tick executor: 1F1B-family training (1f1b, interleaved_1f1b, zero_bubble), loss and gradients computed stage
by stage, without autodiff of the whole model. The schedules differ only in their tick program (program.py).

Why not autodiff. Under GPipe and circular the pipeline is a `layer_loop` inside the model and the backward pass is
JAX's transpose of the forward loop, so every micro-batch's forward has run before any backward starts: m
micro-batches of stage inputs stay alive. 1F1B starts the backward of micro-batch i before the forward of micro-batch
i + p, which needs i's loss, so the head and the loss move into the last stage and each stage writes its own backward.

The model protocol (optional; models/llama.py and models/mlp.py follow it). A model class may define
    LAYER_STACK                 the attribute name of its stacked layers (built with `shardkit.nn.stack`);
    embed(tokens_BS) -> x_BSD   everything before the stack;
    unembed(x_BSD) -> logits_BSV  everything after it (final norm and head);
such that `__call__(tokens)` is exactly `unembed(scan_stack(getattr(self, LAYER_STACK), embed(tokens)))`.
A model without them gets a ShardkitError naming `pipeline.schedule` when it is trained under these schedules.
A model with an auxiliary loss (`layers_with_aux`, models/moe.py) runs each chunk of its stack through
`layers_with_aux(x, *rows, first_layer=k)`: the chunk's router statistics start afresh at layer group k, its share of
the auxiliary loss joins the stage's loss (and its gradient the chunk's backward), and its metric sums are summed
over the ticks, stages and replicas like the loss. Only the activation travels between stages.

Where things run. The embedding runs before the region on the whole batch (automatic sharding), and its backward
after it, from the gradient of the embedded batch, in the automatic layout. Inside a
`jax.shard_map` manual over `pipeline` (and over `data` when it is > 1: `shardkit.pipeline.config.manual_data_axes`;
FSDP and TP stay automatic inside):
    stage 0        applies its layers to its micro-batch of the embedded batch; its backward files the gradient of
                   that micro-batch for the embedding's backward;
    stage d        applies its layers to the activation that stage d-1 sent;
    stage p-1      applies its layers, the head and the fp32 cross entropy, and differentiates them at once.
With v chunks (interleaved_1f1b) chunk r of stage d holds layers [(r*p + d) L/(pv), ...): the last stage hands chunk
r's output to stage 0 for chunk r+1, and "stage 0" / "stage p-1" above mean chunk 0 of stage 0 / chunk v-1 of stage
p-1. Under zero_bubble a backward is two ticks: B (the input gradient, sent back at once) and W (the weights').
Only the head's parameters (those the last stage's loss reads, `used_keys`) enter the region. When the region gathers
over `fsdp`, the final norm is gathered once and its gradient reduce-scattered; the head itself is split over `fsdp`
by vocabulary (shardkit/pipeline/head_split.py: an all-to-all in and out, the micro-batch's rows gathered for the
loss instead). Their gradients are summed over `pipeline` once at the end, as are the loss and the embedded batch's
gradient.
Data parallelism: each data replica runs its own 1F1B on its rows and accumulates its own gradients (its parameters
enter as per-replica copies, so no vjp inside a tick sums over `data`); the gradients and the loss are summed over
`data` once, inside the region after the tick loop; the embedding's backward runs after the region in the automatic
layout. With `data` automatic, XLA all-reduced each backward tick's weight gradient.
Why the embedding is not in stage 0: inside this region, with the table sharded over fsdp and tensor, XLA's SPMD
partitioner aborts on the embedding gather ("Check failed: partition_group_list.num_replica_groups() * ..." in
spmd_partitioner_util.cc, jax 0.10.2), even outside the tick switch.

Memory. A stage keeps only the inputs of the micro-batches whose last backward pass has not run yet, in a buffer of
`TickProgram.slots` slots (and received gradients in `grad_slots`: one under 1f1b, where each is consumed at once).
The backward of a stage recomputes its forward from the stored input with `jax.vjp`, so the activations inside a
stage exist for one micro-batch at a time. The region's edges (the embedded batch and its gradient) are whole-batch
tensors, as under GPipe.

Time. The tick program (shardkit/pipeline/program.py) runs the schedule's grid (shardkit/pipeline/schedule.py): at
every tick each stage does one action or nothing. Sends carry only real work, so the collective-permute bytes are
activation x m x (v*p - 1), forward and backward.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import Literal
from jax.sharding import PartitionSpec

from shardkit import microbatch
from shardkit.attention.context import in_balanced_order
from shardkit.axes import FSDP, PIPELINE
from shardkit.data.packing import Packing, document_rows
from shardkit.errors import ShardkitError
from shardkit.loss import cross_entropy_sum as lean_cross_entropy_sum
from shardkit.loss import logits_cross_entropy_sum
from shardkit.manual import psum, to_varying
from shardkit.nn import constrain, current_context, dropout_stream, model_context, scan_stack
from shardkit.pipeline import head_split
from shardkit.pipeline.config import PipelineRegion, fsdp_dim, pipeline_region
from shardkit.pipeline.head_split import split_by_vocab, unsplit_by_vocab
from shardkit.pipeline.program import SENDS_BACK, Action, TickProgram, block_actions, tick_blocks, tick_program
from shardkit.pipeline.schedule import Pairs
from shardkit.pipeline.sends import gather_stage, reduce_scatter_stage, send
from shardkit.registry import model_capabilities


# ---- the model protocol -------------------------------------------------------------------------------------------
def check_model(model_class: type, schedule: str = "1f1b") -> None:
    """Raise a ShardkitError naming `pipeline.schedule` when the model cannot be split into embed, stack, unembed."""
    missing = model_capabilities(model_class).staged_missing
    if missing:
        raise ShardkitError("pipeline.schedule", f"{schedule!r} needs the model split into embed(tokens), a layer "
                            f"stack and unembed(x); {model_class.__name__} lacks {list(missing)} (see "
                            f"shardkit/pipeline/one_f_one_b.py); use 'gpipe' or 'circular'")


@dataclasses.dataclass(frozen=True)
class StagedModel:
    """The model's three parts as functions of raw parameters, each cast to the compute dtype before use.

    `unstacked` is the parameters outside the layer stack (embedding, final norm, head) by their top-level key; inside
    the region only the head's (`head_keys`, what the last stage's loss reads) are passed, the others stand in as
    zeros that nothing reads (XLA drops them). `stack` is one chunk of a stage's layers. What the layers take after
    the activation (`rows`: packed documents' positions and segment ids, the rotary positions under context
    parallelism) comes with each micro-batch (`in_step_order`).
    """

    graphdef: Any
    stack_name: str
    cast: Callable
    # The head split over `fsdp` by vocabulary (shardkit.pipeline.head_split): the vocabulary's blocks over the
    # region's automatic axes (1: none), or 0 where the head is gathered.
    head_split_blocks: int = 0
    # The dtype the stage and head gradients are summed through the ticks and reduced across devices in: the policy's
    # `grad_reduce_dtype` (the compute dtype, or fp32 under precision.grad_reduce = "float32").
    sum_dtype: Any = jnp.float32
    # The model has an auxiliary loss (`layers_with_aux`: see the module docstring).
    aux_loss: bool = False

    def _view(self, unstacked, stack):
        return nnx.merge(self.graphdef, self.cast({**unstacked, self.stack_name: stack}))

    def _layers(self, model, x_bSD, rows, first_layer):
        """The stack's layers: (x_bSD, the auxiliary loss in token-loss units, its metric sums). A model with an
        auxiliary loss (`layers_with_aux`, models/moe.py) runs its chunk from layer group `first_layer` on; its loss
        is a mean over the micro-batch's rows, weighed here as the rows x positions token losses it stands beside."""
        if not self.aux_loss:
            return scan_stack(getattr(model, self.stack_name), x_bSD, *rows), to_varying(jnp.float32(0)), {}
        y_bSD, aux_loss, sums = model.layers_with_aux(x_bSD, *rows, first_layer=first_layer)
        return y_bSD, aux_loss * (x_bSD.shape[0] * x_bSD.shape[1]), sums

    def embed(self, unstacked, stack, tokens_BS):
        """The embedding, run before the pipeline region on the whole batch."""
        return self._view(unstacked, stack).embed(tokens_BS)

    def stage_layers(self, unstacked, stack, x_bSD, rows=(), first_layer=0):
        """A stage's chunk of the layer stack (`stack`, from layer group `first_layer` on) applied to its input:
        (output, auxiliary loss in token-loss units, metric sums)."""
        return self._layers(self._view(unstacked, stack), x_bSD, rows, first_layer)

    def last_stage_loss(self, unstacked, stack, x_bSD, targets_bS, rows=(), first_layer=0):
        """The last chunk: its layers, the head, and the summed fp32 cross entropy of the micro-batch (the lean loss,
        shardkit/loss.py, when the model gives its final hidden state and head weight), plus the chunk's auxiliary
        loss in token-loss units; and the chunk's metric sums.

        The lean loss's own chunking decides its tiles: one tile of a micro-batch's rows peaks lower than smaller
        tiles, whose loop carries the head's gradient in fp32."""
        model = self._view(unstacked, stack)
        x_bSD, aux, sums = self._layers(model, x_bSD, rows, first_layer)
        if self.head_split_blocks:
            loss = head_split.cross_entropy_sum(model.final_hidden(x_bSD), model.head_weight(), targets_bS,
                                                vocab_blocks=self.head_split_blocks)
        elif model_capabilities(type(model)).lean_loss:
            loss = lean_cross_entropy_sum(model.final_hidden(x_bSD), model.head_weight(), targets_bS)
        else:
            loss = logits_cross_entropy_sum(model.unembed(x_bSD).astype(jnp.float32), targets_bS)
        return loss + aux, sums


def used_keys(fn: Callable, unstacked: dict, *args) -> tuple[str, ...]:
    """The top-level keys of `unstacked` whose parameters `fn(unstacked, *args)` reads: its jaxpr's inputs that reach
    an output, by a backward pass over the equations (traced on abstract values, nothing runs; the layer stack as a
    plain scan, as inside the region)."""
    with model_context(layer_loop=None):
        jaxpr = jax.make_jaxpr(fn)(unstacked, *args).jaxpr
    needed = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if not isinstance(v, Literal))
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(unstacked)[0]]
    return tuple(sorted({path[0].key for path, var in zip(paths, jaxpr.invars) if var in needed}))


# ---- the executor -------------------------------------------------------------------------------------------------


def value_and_grad(layout, policy, scale, packing: Packing | None = None) -> Callable:
    """`(params, tokens_BS1) -> ((scale * mean loss, auxiliary metric sums), its fp32 gradients)`, run as a pipeline
    of the 1F1B family.

    The same contract as `jax.value_and_grad(..., has_aux=True)` of `StepBuilder.loss_with_aux` times `scale`: the
    mean is over every token of the batch given (plus the model's auxiliary loss, models/moe.py), the metric sums are
    over its rows (empty for a model without an auxiliary loss), the gradients have the parameters' tree structure
    (the stack's `layers` axis whole again).

    Args:
        layout: a layout whose `pipeline.one_f_one_b` and whose model follows the protocol above (`check_model`,
            which `shardkit.step.build_step` runs before anything is traced).
        policy: the precision policy; parameters are cast to its compute dtype inside every stage.
        scale: the loss scale (1.0 without loss scaling), a scalar.
    """
    region = pipeline_region(layout)
    program = tick_program(region.config)
    staged = StagedModel(layout.graphdef, layout.model_class.LAYER_STACK, policy.cast_to_compute,
                         sum_dtype=policy.grad_reduce_dtype, aux_loss=layout.capabilities.aux_loss)
    p, v, m, data_axes = region.config.stages, region.config.chunks, region.config.microbatches, region.data_axes
    dims = _gathered_dims(layout, region)
    kept = _kept_specs(layout, region)

    def run(params, tokens_BS1):
        unstacked = {key: value for key, value in params.items() if key != staged.stack_name}
        stack = params[staged.stack_name]
        # Cast before the region: the stage weights and the head are gathered (once per step) in the compute dtype.
        stack_VPC = jax.tree.map(lambda w: _to_chunks(w, p, v), policy.cast_to_compute(stack))
        batch, length = tokens_BS1.shape
        inputs_BS, targets_BS, rows_BS = in_step_order(layout, packing, tokens_BS1)
        embedded_BSD = staged.embed(unstacked, stack, inputs_BS)
        one_chunk = jax.tree.map(lambda w: w[0, 0], stack_VPC)
        head_keys = used_keys(lambda u: staged.last_stage_loss(u, one_chunk, embedded_BSD, targets_BS)[0], unstacked)
        head = policy.cast_to_compute({key: unstacked[key] for key in head_keys})
        head_dims = _head_dims(layout, region, head_keys)
        vocab_dims = head_split.split_dims(layout, region, head_keys)
        blocks = head_split.vocab_blocks(layout, region) if any(d >= 0 for d in jax.tree.leaves(vocab_dims)) else 0
        split_staged = dataclasses.replace(staged, head_split_blocks=blocks)
        head_kept = {key: kept[key] for key in head_keys}
        absent = {key: jax.tree.map(lambda w: jax.ShapeDtypeStruct(w.shape, policy.compute_dtype), value)
                  for key, value in unstacked.items() if key not in head_keys}
        rows = PartitionSpec(None, data_axes or None)  # (micro-batch, rows, ...): each data replica its own rows
        head_specs, stage_specs = jax.tree.map(_head_spec, head_dims), jax.tree.map(_stage_spec, stack_VPC, dims)
        run_stages = jax.shard_map(
            functools.partial(_run_stages, split_staged, region, program, (dims, kept[staged.stack_name]),
                              (head_dims, head_kept, vocab_dims), absent),
            mesh=region.mesh, axis_names=region.manual_axes,
            in_specs=(head_specs, stage_specs, rows, rows, (rows,) * len(rows_BS), PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), head_specs, stage_specs, rows),
        )
        cotangent = scale / (batch * (length - 1))  # d(scale * mean loss) / d(one token's loss)
        split = lambda x: microbatch.split(x, m)
        with model_context(attention=tick_attention(layout)):
            loss_sum, metrics, head_grads, stack_grads_VPC, d_embedded_MbSD = run_stages(
                head, stack_VPC, split(embedded_BSD), split(targets_BS), tuple(map(split, rows_BS)), cotangent)
        embed_keys = used_keys(lambda u: staged.embed(u, stack, inputs_BS), unstacked)
        _, embed_pullback = jax.vjp(lambda e: staged.embed({**unstacked, **e}, stack, inputs_BS),
                                    {key: unstacked[key] for key in embed_keys})
        d_embedding_R = jax.tree.map(lambda g: g[None], embed_pullback(microbatch.merge(d_embedded_MbSD))[0])
        grads = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), unstacked)
        for key, g in head_grads.items():
            grads[key] = jax.tree.map(lambda total, g: total + g.astype(jnp.float32), grads[key], g)
        for key, g in d_embedding_R.items():  # per replica: summed here, one reduction over the replicas
            grads[key] = jax.tree.map(lambda total, g: total + g.astype(jnp.float32).sum(0), grads[key], g)
        stack_grads = jax.tree.map(lambda g: _from_chunks(g.astype(jnp.float32)), stack_grads_VPC)
        return (loss_sum * cotangent, metrics), {**grads, staged.stack_name: stack_grads}

    return run


def in_step_order(layout, packing: Packing | None, tokens_BS1) -> tuple:
    """The batch's inputs, targets and what each layer takes after the activation (`rows`: packed documents'
    positions and segment ids, or nothing), in the order the stages see the sequence: under context parallelism the
    load-balanced order, decided once here for the whole step (`shardkit.attention.context.in_balanced_order`; the
    rotary positions then travel as a row too), so that no layer reorders its sequence inside the tick switch (see
    `shardkit.attention.ring.Plan.tick_branch`). The loss is a sum over tokens, the same in either order."""
    inputs_BS, targets_BS = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    rows_BS = document_rows(packing, inputs_BS)
    ring = tick_ring(layout)
    if not ring:
        return inputs_BS, targets_BS, rows_BS
    inputs_BS, targets_BS, *rows_BS = in_balanced_order(ring, inputs_BS, targets_BS, rows_BS)
    return inputs_BS, targets_BS, tuple(rows_BS)


def tick_ring(layout) -> int:
    """The context-parallel ring size inside the tick executor's stages (0: the sequence is not cut)."""
    axis = layout.attention.ring_axis
    return layout.mesh.shape[axis] if axis is not None and layout.mesh.shape[axis] > 1 else 0


def tick_attention(layout):
    """The attention setup inside the tick switch: the rows in the load-balanced order when the sequence is cut
    (`in_step_order`), and each stage in its own branch (`shardkit.attention.ring.Plan.tick_branch`)."""
    return dataclasses.replace(current_context().attention, balanced=bool(tick_ring(layout)), tick_branch=True)


def _to_chunks(w_L: jax.Array, stages: int, chunks: int) -> jax.Array:
    """(L, ...) -> (v, p, L/(p*v), ...): chunk r of stage d holds model layers [(r*p + d) * L/(p*v), ...)."""
    return w_L.reshape(chunks, stages, w_L.shape[0] // (stages * chunks), *w_L.shape[1:])


def _from_chunks(w_VPC: jax.Array) -> jax.Array:
    return w_VPC.reshape(-1, *w_VPC.shape[3:])


def _gathered_dims(layout, region: PipelineRegion):
    """Per leaf of the layer stack, the dimension the region gathers over `fsdp` once per step (-1: none, also for
    every leaf when FSDP gathers per use)."""
    logical = layout.logical[layout.model_class.LAYER_STACK]
    dim = (lambda names: fsdp_dim(names, layout.rules)) if region.gathers_per_step else (lambda names: -1)
    return jax.tree.map(dim, logical, is_leaf=lambda x: isinstance(x, tuple))


def _kept_specs(layout, region: PipelineRegion) -> dict:
    """Per parameter, its split over the region's automatic axes (`PipelineRegion.automatic_spec`), which its gather
    and reduce-scatter over `fsdp` keep; the layer stack's as a stage's block of its chunks, (v, L/(p*v), ...)."""
    def kept(key, names):
        return region.automatic_spec(names, leading=1 if key == layout.model_class.LAYER_STACK else 0)
    return {key: jax.tree.map(functools.partial(kept, key), logical, is_leaf=lambda x: isinstance(x, tuple))
            for key, logical in layout.logical.items()}


def _head_dims(layout, region: PipelineRegion, head_keys):
    """`_gathered_dims` of the head's parameters (the keys the last stage's loss reads)."""
    dim = (lambda names: fsdp_dim(names, layout.rules)) if region.gathers_per_step else (lambda names: -1)
    return {key: jax.tree.map(dim, layout.logical[key], is_leaf=lambda x: isinstance(x, tuple)) for key in head_keys}


def _stage_spec(w_VPC, dim: int) -> PartitionSpec:
    """A chunked leaf (v, p, L/(p*v), ...) enters the region split over stages, and over `fsdp` along its FSDP
    dimension (`dim` of the stacked leaf, two further on here) when the region gathers it itself."""
    return PartitionSpec(None, PIPELINE) if dim < 0 else PartitionSpec(None, PIPELINE, *[None] * dim, FSDP)


def _head_spec(dim: int) -> PartitionSpec:
    """A head parameter enters whole, or as its FSDP shards when the region gathers it itself (once per step)."""
    return PartitionSpec() if dim < 0 else PartitionSpec(*[None] * dim, FSDP)


class _Sums(NamedTuple):
    """What a stage accumulates through the ticks: its loss (fp32, the auxiliary loss's share of its chunks
    included), the auxiliary metric sums of its chunks (`metrics`, fp32; each chunk's share of the rows, so that
    the stages' add up to the model's), and the gradients of the parameters it reads (the
    head's, on the last stage; its stage weights', per chunk) in `StagedModel.sum_dtype`: by default the compute
    dtype, as autodiff accumulates a GPipe stage's per-step gathered weights (fp32 sums would hold the stage twice
    over); fp32 under precision.grad_reduce = "float32", each micro-batch's gradient rounded once."""

    loss: jax.Array
    metrics: dict
    head: Any
    stack: Any  # (v, L/(p*v), ...) per leaf

    def add(self, loss, d_head, d_chunk, chunk, metrics=None) -> "_Sums":
        """Add one micro-batch's loss, metric sums and gradients (d_chunk to chunk `chunk`); None adds nothing."""
        add = lambda total, g: total + g.astype(total.dtype)
        head = self.head if d_head is None else jax.tree.map(add, self.head, d_head)
        stack = self.stack if d_chunk is None else jax.tree.map(lambda total, g: _add_to_chunk(total, g, chunk),
                                                                 self.stack, d_chunk)
        summed = self.metrics if metrics is None else jax.tree.map(add, self.metrics, metrics)
        return _Sums(self.loss + loss, summed, head, stack)


def _add_to_chunk(total_V, g, chunk) -> jax.Array:
    """`g` added to chunk `chunk` of `total_V`; with one chunk a plain add (no dynamic slice: XLA adds in place)."""
    if total_V.shape[0] == 1:
        return total_V + g.astype(total_V.dtype)[None]
    updated = total_V[chunk] + g.astype(total_V.dtype)
    return jax.lax.dynamic_update_index_in_dim(total_V, updated, chunk, 0)


class _TickCarry(NamedTuple):
    """The state one tick hands the next."""

    buffer_KbSD: jax.Array  # stage inputs waiting for their last reader (`TickProgram.x_slot`)
    gradients_GbSD: jax.Array  # received gradients waiting for their last reader (`TickProgram.dy_slot`)
    activation_bSD: jax.Array  # what the previous stage sent after the last tick
    gradient_bSD: jax.Array  # what the next stage sent back after the last tick
    sums: _Sums
    d_embedded_MbSD: jax.Array  # the embedded batch's gradient, filed by the backwards of stage 0's chunk 0


def _run_stages(staged: StagedModel, region: PipelineRegion, program: TickProgram, stack_split, head_split_dims,
                absent, head, stack_VPC, embedded_MbSD, targets_MbS, rows_MbS, cotangent):
    """Inside the manual region: run every tick block, then sum over stages the loss, the head's gradients and the
    gradient of the embedded batch, and over data replicas the loss, the head's and the stages' gradients (once per
    step). Returns the loss sum, the head's and the stage gradients and the embedded batch's gradient. `stack_split`
    and `head_split_dims`: per leaf, the dimension gathered over `fsdp` and the split over the automatic axes it
    keeps; the head's also the vocabulary dimension it is split along over `fsdp` (-1: gathered)."""
    (dims, kept), (head_dims, head_kept, vocab_dims) = stack_split, head_split_dims
    # Differentiating an invariant input from inside a stage's branch would transpose its implicit broadcast into a
    # psum over `pipeline` that only that stage reaches (a deadlock), and over `data` into a psum every tick; as
    # per-stage, per-replica copies, their gradients stay local until the sums below.
    # This stage's chunks and the head, gathered over `fsdp` here, once, when the region does it.
    stack = jax.tree.map(lambda w, dim, spec: to_varying(gather_stage(w[:, 0], dim + 1 if dim >= 0 else -1, spec)),
                         stack_VPC, dims, kept)
    # The head is gathered too, or split by vocabulary (`head_split`) where `vocab_dims` says, on its `tensor` shards
    # like the gathers (the loss then reads the vocabulary in `StagedModel.head_split_blocks` blocks).
    head = jax.tree.map(lambda w, dim, spec, vocab: to_varying(split_by_vocab(w, dim, vocab, spec) if vocab >= 0
                                                               else gather_stage(w, dim, spec)),
                        head, head_dims, head_kept, vocab_dims)
    absent = jax.tree.map(lambda w: jnp.zeros(w.shape, w.dtype), absent)
    work = _StageWork(staged, region, head, absent, stack, embedded_MbSD, targets_MbS, rows_MbS,
                      jax.lax.axis_index(PIPELINE),
                      region.replica_index(), cotangent)
    with region.context(), _varying_carry(region, staged):
        carry = _initial_carry(program, embedded_MbSD, head, stack, staged.sum_dtype, work.metrics_shape())
        for first, period, count in tick_blocks(program):
            ticks = [functools.partial(_stage_tick, work, program, program.sends[first + k],
                                       block_actions(program, first + k, period, count)) for k in range(period)]
            carry, _ = jax.lax.scan(lambda c, t: (_run_period(ticks, c, t), None), carry,
                                    jnp.arange(first, first + period * count, period))
    # Only the last stage has a loss and head gradients, only the first the embedded batch's: the sums broadcast them.
    # The data replicas' sums of the head's and the stages' gradients are their one reduction over `data` this step
    # (the embedded batch's gradient stays per replica: its rows are the replica's own).
    loss_sum, metrics = jax.lax.psum((carry.sums.loss, carry.sums.metrics), (PIPELINE, *region.data_axes))
    head_grads = _reduce_gradients(region, carry.sums.head, head_dims, head_kept, over_stages=True,
                                   vocab_dims=vocab_dims)
    stack_grads = _reduce_gradients(region, carry.sums.stack, jax.tree.map(lambda d: d + 1 if d >= 0 else -1, dims),
                                    kept)
    # bf16 under a bf16 policy: see shardkit.pipeline.sends.psum
    d_embedded_MbSD = psum(carry.d_embedded_MbSD, PIPELINE)
    return loss_sum, metrics, head_grads, jax.tree.map(lambda g: g[:, None], stack_grads), d_embedded_MbSD


def _varying_carry(region: PipelineRegion, staged: StagedModel):
    """Where a stage's layers are a plain scan and the model carries more than the activation (router statistics,
    started as zeros that vary over no manual axis), the scan's carry enters as per-device values, as the layers'
    outputs are: a scan's carry must keep its type."""
    if region.unrolled or not staged.aux_loss:
        return contextlib.nullcontext()

    def layer_loop(layer, carry, stacked_state):
        carry, _ = jax.lax.scan(lambda c, state: (layer(c, state), None), jax.tree.map(to_varying, carry),
                                stacked_state)
        return carry

    return model_context(layer_loop=layer_loop)


def _reduce_gradients(region: PipelineRegion, sums, dims, kept, over_stages: bool = False, vocab_dims=None):
    """Gradients summed over the data replicas, once: under a per-step FSDP gather first a reduce-scatter over `fsdp`
    onto the weights' shards (along `dims`), in the sums' dtype (the policy's gradient-reduction dtype,
    `StagedModel.sum_dtype`), then an all-reduce over `data` (and over `pipeline` with `over_stages`: the head's,
    which only the last stage has) of what is left, the shard; on the shards of the automatic axes `kept` names. A
    head parameter split by vocabulary (`vocab_dims` >= 0) holds every row's gradient of its shard already: the
    all-to-all back onto the FSDP shard replaces the reduce-scatter."""
    vocab_dims = jax.tree.map(lambda _: -1, dims) if vocab_dims is None else vocab_dims

    def onto_shard(g, dim, spec, vocab):
        return unsplit_by_vocab(g, dim, vocab, spec) if vocab >= 0 else reduce_scatter_stage(g, dim, spec)

    if region.gathers_per_step:
        sums = jax.tree.map(onto_shard, sums, dims, kept, vocab_dims)
    axes = (PIPELINE,) * over_stages + tuple(axis for axis in region.data_axes if axis != FSDP)
    return jax.tree.map(lambda g: psum(g, axes), sums) if axes else sums


def _run_period(ticks, carry: _TickCarry, first_tick) -> _TickCarry:
    """One step of a tick block's scan: its `period` ticks in a row."""
    for offset, tick in enumerate(ticks):
        carry = tick(carry, first_tick + offset)
    return carry


def _initial_carry(program: TickProgram, embedded_MbSD, head, stack, sum_dtype, metrics) -> _TickCarry:
    """Every buffer, received tensor and sum at zero; the gradient sums in `sum_dtype`, the metric sums (shaped as
    `metrics`) in theirs."""
    zeros_bSD = to_varying(jnp.zeros_like(embedded_MbSD[0]))
    buffer = lambda slots: to_varying(jnp.zeros((slots, *embedded_MbSD.shape[1:]), embedded_MbSD.dtype))
    zeros = lambda tree: jax.tree.map(lambda w: to_varying(jnp.zeros_like(w, sum_dtype)), tree)
    metric_zeros = jax.tree.map(lambda x: to_varying(jnp.zeros(x.shape, x.dtype)), metrics)
    sums = _Sums(to_varying(jnp.float32(0)), metric_zeros, zeros(head), zeros(stack))
    return _TickCarry(buffer(program.slots), buffer(program.grad_slots), zeros_bSD, zeros_bSD, sums,
                      to_varying(jnp.zeros_like(embedded_MbSD)))


# The branch of the tick switch that runs each action.
BRANCH = {Action.IDLE: "idle", Action.FORWARD: "forward", Action.BACKWARD: "backward",
          Action.BACKWARD_LAST: "backward_last", Action.INPUT_GRAD: "input_grad",
          Action.INPUT_GRAD_LAST: "input_grad_last", Action.WEIGHT_GRAD: "weight_grad",
          Action.WEIGHT_GRAD_LAST: "weight_grad_last"}


def _file(buffer, arrived_slot, received):
    """`received` into slot `arrived_slot` of `buffer` (-1: nothing arrived, the buffer is unchanged)."""
    slot = jnp.maximum(arrived_slot, 0)
    kept = jnp.where(arrived_slot >= 0, received, buffer[slot])
    return jax.lax.dynamic_update_index_in_dim(buffer, kept, slot, 0)


def tick_switch(actions: tuple[int, ...]) -> tuple[list[str], np.ndarray]:
    """The tick switch for a tick whose stages take `actions`: its branches' names, and per `Action` the branch that
    runs it.

    A lone working action gets `idle` beside it, with IDLE pointing there (a table that picks one branch everywhere
    is folded by XLA, and a switch of one branch is a plain call: `jax.lax.switch`). Otherwise such a tick's chunk
    scan sits in the step's straight-line code beside the other single-action ticks', and XLA:GPU fuses the zeros
    their residual stacks and weight-gradient carries start from, siblings of one zero constant, into one
    multi-output fusion made before the first of them, so every such tick's buffers and its picked chunk live at
    once. Inside a conditional each branch's buffers
    belong to its own computation and live only while it runs."""
    names = list(dict.fromkeys(BRANCH[a] for a in actions))
    if names != [BRANCH[Action.IDLE]] and len(names) == 1:
        names.append(BRANCH[Action.IDLE])
    return names, np.array([names.index(BRANCH[a]) if BRANCH[a] in names else 0 for a in Action], np.int32)


def _stage_tick(work: "_StageWork", program: TickProgram, pairs: tuple[Pairs, Pairs], actions: tuple[int, ...],
                carry: _TickCarry, tick) -> _TickCarry:
    """One tick: file what arrived, run this stage's action, send activations on and gradients back.

    Only the branches of the `actions` that occur at this tick are compiled into its switch (a warm-up tick holds no
    backward code). Stage 0's chunk 0 reads its input from the embedded batch and files its input gradient there.
    """
    table = lambda name: jnp.asarray(getattr(program, name))[work.stage, tick]
    buffer_KbSD = _file(carry.buffer_KbSD, table("act_arrival"), carry.activation_bSD)
    gradients_GbSD = _file(carry.gradients_GbSD, table("grad_arrival"), carry.gradient_bSD)
    action, micro, chunk, enters = table("action"), table("micro"), table("chunk"), table("enters")
    x_bSD = buffer_KbSD[jnp.maximum(table("x_slot"), 0)]
    embedded_bSD = jax.lax.dynamic_index_in_dim(work.embedded_MbSD, micro, 0, keepdims=False)
    x_bSD = jnp.where(enters, embedded_bSD.astype(x_bSD.dtype), x_bSD)
    dy_bSD = gradients_GbSD[jnp.maximum(table("dy_slot"), 0)]
    names, index = tick_switch(actions)
    branches = [work.branches[name] for name in names]
    sums, forward_bSD, backward_bSD = jax.lax.switch(jnp.asarray(index)[action], branches, carry.sums, micro, chunk,
                                                     x_bSD, dy_bSD)
    d_embedded_MbSD = carry.d_embedded_MbSD
    if set(actions) & set(SENDS_BACK):
        # Stage 0's chunk 0 ends at the embedded micro-batch (nothing is sent back from there); the embedding's own
        # backward runs once, after the region, in the automatic layout.
        files = jnp.logical_and(enters, jnp.isin(action, jnp.asarray(SENDS_BACK)))
        kept_bSD = jnp.where(files, backward_bSD.astype(d_embedded_MbSD.dtype),
                             jax.lax.dynamic_index_in_dim(d_embedded_MbSD, micro, 0, keepdims=False))
        d_embedded_MbSD = jax.lax.dynamic_update_index_in_dim(d_embedded_MbSD, kept_bSD, micro, 0)
    forward_pairs, backward_pairs = pairs
    return _TickCarry(buffer_KbSD, gradients_GbSD, send(forward_bSD, forward_pairs), send(backward_bSD, backward_pairs),
                      sums, d_embedded_MbSD)


def _pinned(branch: Callable) -> Callable:
    """A tick branch whose sent activation and gradient are pinned to (batch, sequence, embed), under context or
    expert parallelism (`PipelineRegion.unrolled`). Why: every branch of a conditional must give its results one
    sharding; with the sequence (or the rows, over `expert`) cut over an automatic axis the layers' results carry
    it, and an idle branch's zeros none, which XLA's verifier refuses ("Inconsistent conditional sharding among
    instructions", jax 0.10.2)."""

    def run(*args):
        sums, forward_bSD, backward_bSD = branch(*args)
        return sums, constrain(forward_bSD, TICK_BSD), constrain(backward_bSD, TICK_BSD)

    return run


TICK_BSD = ("batch", "sequence", "embed")


@dataclasses.dataclass(frozen=True)
class _StageWork:
    """One stage inside the region: its parameters, the tokens, and the branches of the tick switch.

    A branch maps (sums, micro, chunk, stage input, gradient received) to (sums, activation to send forward,
    gradient to send backward).
    """

    staged: StagedModel
    region: PipelineRegion
    head: Any
    absent: Any  # zeros standing in for the parameters outside the stack that the stages do not read
    stack: Any  # (v, L/(p*v), ...) per leaf: this stage's chunks
    embedded_MbSD: jax.Array
    targets_MbS: jax.Array
    rows_MbS: tuple  # what each layer takes after the activation, per micro-batch (`in_step_order`)
    stage: jax.Array
    replica: jax.Array | int  # the data replica (0 when the region is not manual over `data`)
    cotangent: jax.Array

    @functools.cached_property
    def branches(self) -> dict[str, Callable]:
        """Each branch of the tick switch by name, made once for the stage: JAX keeps a traced function's jaxpr
        under the function's identity and argument types, so the ticks whose switches share a branch reuse one trace
        of it instead of tracing the chunk's layers again for each tick."""
        pin = _pinned if self.region.unrolled else (lambda branch: branch)
        return {name: pin(getattr(self, name)) for name in BRANCH.values()}

    def stream(self, micro):
        return dropout_stream(self.region.stream_index(self.replica, micro, self.stage))

    def chunk(self, chunk):
        """The weights of chunk `chunk` of this stage (with one chunk a static view, no copy of the stage)."""
        pick = lambda w: w[0] if w.shape[0] == 1 else jax.lax.dynamic_index_in_dim(w, chunk, 0, keepdims=False)
        return jax.tree.map(pick, self.stack)

    def rows(self, micro) -> tuple:
        return tuple(jax.lax.dynamic_index_in_dim(x, micro, 0, keepdims=False) for x in self.rows_MbS)

    def first_layer(self, chunk):
        """The model's index of the first layer (group) of chunk `chunk` of this stage (`_to_chunks`)."""
        per_chunk = jax.tree.leaves(self.stack)[0].shape[1]
        return (chunk * self.region.config.stages + self.stage) * per_chunk

    def layers(self, chunk_weights, x_bSD, micro, chunk):
        """The chunk's layers: ((output, auxiliary loss in token-loss units), metric sums)."""
        y_bSD, aux, metrics = self.staged.stage_layers({**self.absent, **self.head}, chunk_weights, x_bSD,
                                                       self.rows(micro), self.first_layer(chunk))
        return (y_bSD, aux), metrics

    def loss(self, head, chunk_weights, x_bSD, micro, chunk):
        """The last chunk's loss sum (cross entropy and auxiliary), and its metric sums."""
        targets_bS = jax.lax.dynamic_index_in_dim(self.targets_MbS, micro, 0, keepdims=False)
        return self.staged.last_stage_loss({**self.absent, **head}, chunk_weights, x_bSD, targets_bS,
                                           self.rows(micro), self.first_layer(chunk))

    def metrics_shape(self):
        """The shapes of a chunk's metric sums (empty for a model without an auxiliary loss)."""
        if not self.staged.aux_loss:
            return {}
        x_bSD = to_varying(self.embedded_MbSD[0])  # as a stage input is: per stage
        return jax.eval_shape(lambda: self.layers(self.chunk(0), x_bSD, 0, 0)[1])

    def cotangents(self, dy_bSD, loss):
        """The cotangents of a chunk's (output, auxiliary loss): the received gradient and d(scaled mean loss) /
        d(one token's loss)."""
        return dy_bSD, to_varying(self.cotangent.astype(loss.dtype))

    def idle(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        return sums, jnp.zeros_like(x_bSD), jnp.zeros_like(x_bSD)

    def forward(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        with self.stream(micro):
            (y_bSD, _), _ = self.layers(self.chunk(chunk), x_bSD, micro, chunk)
        return sums, y_bSD.astype(x_bSD.dtype), jnp.zeros_like(x_bSD)

    def backward(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        """Recompute the chunk's forward from its stored input, and pull the received gradient (and the auxiliary
        loss's cotangent) through it."""
        with self.stream(micro):
            (_, aux), pullback, metrics = jax.vjp(lambda c, x: self.layers(c, x, micro, chunk), self.chunk(chunk),
                                                  x_bSD, has_aux=True)
            d_chunk, dx_bSD = pullback(self.cotangents(dy_bSD, aux))
        return sums.add(aux, None, d_chunk, chunk, metrics), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)

    def backward_last(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        """Layers, head and loss forward, then their backward from d(scaled mean loss) / d(token loss)."""
        with self.stream(micro):
            loss, pullback, metrics = jax.vjp(lambda h, c, x: self.loss(h, c, x, micro, chunk), self.head,
                                              self.chunk(chunk), x_bSD, has_aux=True)
            d_head, d_chunk, dx_bSD = pullback(to_varying(self.cotangent.astype(loss.dtype)))
        return sums.add(loss, d_head, d_chunk, chunk, metrics), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)

    def input_grad(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        """Zero bubble's B: the input gradient only (the weights' waits for `weight_grad`)."""
        weights = self.chunk(chunk)
        with self.stream(micro):
            (_, aux), pullback, metrics = jax.vjp(lambda x: self.layers(weights, x, micro, chunk), x_bSD,
                                                  has_aux=True)
            (dx_bSD,) = pullback(self.cotangents(dy_bSD, aux))
        return sums.add(aux, None, None, chunk, metrics), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)

    def input_grad_last(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        """Zero bubble's B of the last chunk: the loss, the head's and the input's gradients."""
        weights = self.chunk(chunk)
        with self.stream(micro):
            loss, pullback, metrics = jax.vjp(lambda h, x: self.loss(h, weights, x, micro, chunk), self.head, x_bSD,
                                              has_aux=True)
            d_head, dx_bSD = pullback(to_varying(self.cotangent.astype(loss.dtype)))
        return sums.add(loss, d_head, None, chunk, metrics), jnp.zeros_like(x_bSD), dx_bSD.astype(x_bSD.dtype)

    def weight_grad(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        """Zero bubble's W: the chunk weights' gradient from the kept input and gradient (nothing is sent; the loss
        and metrics were counted by its B)."""
        with self.stream(micro):
            (_, aux), pullback, _ = jax.vjp(lambda c: self.layers(c, x_bSD, micro, chunk), self.chunk(chunk),
                                            has_aux=True)
            (d_chunk,) = pullback(self.cotangents(dy_bSD, aux))
        return sums.add(0.0, None, d_chunk, chunk), jnp.zeros_like(x_bSD), jnp.zeros_like(x_bSD)

    def weight_grad_last(self, sums: _Sums, micro, chunk, x_bSD, dy_bSD):
        """Zero bubble's W of the last chunk: its weights' gradient through the loss again."""
        with self.stream(micro):
            loss, pullback, _ = jax.vjp(lambda c: self.loss(self.head, c, x_bSD, micro, chunk), self.chunk(chunk),
                                        has_aux=True)
            (d_chunk,) = pullback(to_varying(self.cotangent.astype(loss.dtype)))
        return sums.add(0.0, None, d_chunk, chunk), jnp.zeros_like(x_bSD), jnp.zeros_like(x_bSD)
