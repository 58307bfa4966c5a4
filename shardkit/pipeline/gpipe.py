"""GPipe and circular schedules: the `layer_loop` that runs the model's layer stack as a pipeline.

The model is not touched. `scan_stack` hands the pipeline its per-layer function and the stacked layer parameters
(leading `layers` axis, sharded over the `pipeline` mesh axis); the pipeline replaces the scan over layers with a
`jax.shard_map` that is manual over `pipeline` (and the region's data axes, shardkit/pipeline/config.py), so FSDP and
tensor parallelism keep working inside every stage. The backward pass is JAX's autodiff of this forward loop.

Where things live. The embedding and the output head (final norm, projection, loss) run *outside* the pipeline region,
under the ordinary automatic sharding, on every pipeline rank. Three reasons: the model is one function and the
pipeline sees only its layer stack (the `layer_loop` hook), so the model file needs no change; the head's softmax over
the vocabulary is sharded by the same rules as without a pipeline; and the stages stay equal in cost (a first or last
stage that also owns the embedding or a large vocabulary head is the slowest stage and sets the pace of all). The price
is paid at the two edges of the region: the pipeline's output is broadcast from the last stage (one all-reduce of the
batch's activations over `pipeline`) and the embedding's gradient comes back the same way in the backward pass. Where
the region gathers over `fsdp` itself, the loss (not the final norm) runs in a second region (`cross_entropy_for`)
in which each stage takes 1/p of the rows, so no two pipeline ranks compute the same loss.

Circular: the layer stack is cut into p*v chunks and chunk k runs on stage k % p. Chunk k holds model layers
[k*L/(p*v), (k+1)*L/(p*v)), which are not the rows stage k % p stores under `layers -> pipeline`, so the stacked
weights are re-laid out once per step (XLA inserts the exchange; its bytes are weights, not activations).

The FP8 scaling state (the fp8 policy) rides along the stacked weights, marked (`shardkit.nn.Fp8Stack`): each stage
carries its own layers' state through the tick loop, and since its gradient is its next value, the ticks' and the
data replicas' next values combine by maximum, bubble ticks left out (`_fan_out_max`, `to_varying_max`), not by sum.
Under `precision.grad_reduce = "float32"` a stage's weights are gathered in the compute dtype and held in fp32 through
the tick loop, cast back in each tick (`_gather_widened`): autodiff then sums the ticks' weight gradients in fp32, and
the stage's reduce-scatter over `fsdp` and sum over `data` move fp32 (under `pipeline.fsdp_gather = "per_use"`,
XLA's own per-use gathers see the fp32 copy).

1F1B cannot run through this hook (it ends at the last layer, so micro-batch i's loss exists only after every
forward): training under it runs shardkit/pipeline/one_f_one_b.py. A plain forward pass under 1f1b (evaluation, no
gradients) runs this GPipe loop, which does the same forward work.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shardkit import microbatch
from shardkit.axes import FSDP, PIPELINE, SEQUENCE
from shardkit.loss import chunk_count, chunk_positions, cross_entropy_sum
from shardkit.manual import psum, to_varying, to_varying_max
from shardkit.nn import dropout_stream, is_fp8_stack
from shardkit.pipeline import head_split, held
from shardkit.pipeline.config import (
    PipelineRegion,
    fsdp_dim,
    manual_data_axes,
    pipeline_region,
    stack_automatic_specs,
    stack_fsdp_dims,
    unrolled_layers,
)
from shardkit.pipeline.head_split import split_by_vocab
from shardkit.pipeline.schedule import PipelineConfig, tick_runs
from shardkit.pipeline.sends import gather_stage, reduce_scatter_stage, send


def layer_loop_for(layout) -> Callable | None:
    """The pipeline `layer_loop(layer_fn, x_BSD, stacked_state) -> x_BSD` of a layout, or None without a pipeline
    (the model then scans its layers as usual)."""
    if not layout.pipeline.enabled:
        return None
    region = pipeline_region(layout)
    batch_spec = PartitionSpec(region.data_axes or None)

    def layer_loop(layer_fn: Callable, x_BSD: jax.Array, stacked_state) -> jax.Array:
        chunks = jax.tree.map(lambda w: _to_chunks(w, region.config), stacked_state)
        dims = _gathered_dims(layout, region, stacked_state)
        # A stage's block of a chunked leaf, (v, L/(p*v), ...): its split over the region's automatic axes.
        kept = jax.tree.unflatten(jax.tree.structure(stacked_state), stack_automatic_specs(stacked_state, region, 1))
        specs = jax.tree.map(_chunk_spec, chunks, dims)
        chunks, dims, specs, held_flags = _with_held(region, stacked_state, chunks, dims, specs)
        run = jax.shard_map(
            functools.partial(_run_region, layer_fn, region, dims, kept, layout.policy.weight_grad_dtype, held_flags),
            mesh=region.mesh, in_specs=(batch_spec, specs), out_specs=batch_spec, axis_names=region.manual_axes,
        )
        return run(x_BSD, chunks)

    return layer_loop


def _with_held(region: PipelineRegion, stacked_state, chunks, dims, specs):
    """Under `train.fsdp_sync = "per_step"` with accumulation (shardkit/pipeline/held.py), the weights' chunks
    replaced by the step's held copy, (replicas, v, p, ...) in the stacked leaf's dtype, which enters whole over
    `fsdp` (nothing to gather) and per data replica (its gradient leaves the region unreduced); and which leaves are
    held (in `jax.tree.leaves` order). Else the arguments as they are, none held."""
    copies = held.held_leaves(stacked_state)
    leaves, treedef = jax.tree.flatten(chunks)
    if copies is None:
        return chunks, dims, specs, (False,) * len(leaves)
    unflatten = functools.partial(jax.tree.unflatten, treedef)
    stacked = jax.tree.leaves(stacked_state)
    chunks = unflatten([leaf if copy is None else copy.astype(w.dtype)
                        for leaf, copy, w in zip(leaves, copies, stacked)])
    dims = unflatten([dim if copy is None else -1 for dim, copy in zip(jax.tree.leaves(dims), copies)])
    spec_leaves = jax.tree.leaves(specs, is_leaf=_is_spec)
    specs = unflatten([spec if copy is None else held.held_spec(region) for spec, copy in zip(spec_leaves, copies)])
    return chunks, dims, specs, tuple(copy is not None for copy in copies)


HEAD_LOGICAL = ("embed", "vocab")  # the output head's logical axes (`head_weight()`, the tied table's transpose too)
# Token rows per device in one chunk of GPipe's loss. Its logits are this many rows x the whole vocabulary (split by
# vocabulary, `fsdp` x as many rows x a f-th of it), fp32 and compute dtype, one chunk live at a time: fewer rows a
# chunk lower the peak until the chunk loop's own buffers dominate.
LOSS_CHUNK_ROWS = 256


def cross_entropy_for(layout) -> Callable | None:
    """GPipe's and circular's lean loss `(hidden_BSD, head_DV, targets_BS, output_dtype) -> summed cross entropy`,
    or None where the step's own `shardkit.loss.cross_entropy_sum` runs it (no pipeline, a 1F1B-family schedule, a
    region that does not gather over `fsdp` itself, or rows that do not split over the stages).

    The loss runs after the layer region, on every pipeline rank. Left to the automatic layout, each rank computed
    it for all of its data replica's rows at once (their fp32 and compute-dtype logits a large share of the step's
    peak), and chunking those rows all-reduced the head's gradient once per chunk. Here it runs in a second region,
    manual over the same axes (and `sequence`: `_loss_region`): each stage takes 1/p of its replica's rows,
    LOSS_CHUNK_ROWS rows at a time, and the head's gradient accumulates on the device through the chunks; it crosses
    `pipeline`, `fsdp` (and `sequence`) once, after them. The head is split over `fsdp` by vocabulary where it can
    be, as the 1F1B family's (shardkit/pipeline/head_split.py: each chunk's rows gathered over `fsdp` instead), else
    gathered once."""
    stage_rows = loss_stage_rows(layout)
    if stage_rows is None:
        return None
    region, contexts = _loss_region(layout)
    dim = fsdp_dim(HEAD_LOGICAL, layout.rules)
    vocab = head_split.vocab_dim(HEAD_LOGICAL) if head_split.splits(layout, region, HEAD_LOGICAL) else -1
    head = _LossHead(dim, vocab, region.automatic_spec(HEAD_LOGICAL), head_split.vocab_blocks(layout, region))
    chunks = chunk_count(stage_rows, layout.recipe.train.seq_len // contexts, LOSS_CHUNK_ROWS)
    data_axes = tuple(axis for axis in region.data_axes if axis != SEQUENCE)
    batch_spec = PartitionSpec(data_axes, SEQUENCE) if contexts > 1 else PartitionSpec(data_axes)
    head_spec = PartitionSpec() if dim < 0 else PartitionSpec(*[None] * dim, FSDP)

    def loss_sum(hidden_BSD, head_DV, targets_BS, output_dtype):
        run = jax.shard_map(
            functools.partial(_stage_rows_loss, region, head, chunks, jnp.dtype(output_dtype)),
            mesh=region.mesh, in_specs=(batch_spec, head_spec, batch_spec), out_specs=PartitionSpec(),
            axis_names=region.manual_axes,
        )
        return run(hidden_BSD, head_DV, targets_BS)

    return loss_sum


def loss_stage_rows(layout) -> int | None:
    """The sequences each device's loss takes in GPipe's loss region (`cross_entropy_for`: 1/p of its data replica's),
    or None where that region does not run (also for models without the lean loss's final hidden state and head
    weight, which the step differentiates through their full logits)."""
    if not layout.pipeline.enabled or layout.pipeline.one_f_one_b or not layout.capabilities.lean_loss:
        return None
    data_axes = manual_data_axes(layout)  # the region's (`pipeline_region`), without deriving its rules
    train, p = layout.recipe.train, layout.pipeline.stages
    replica_rows = train.global_batch // train.grad_accum // _replicas(layout.mesh.shape, data_axes)
    if "fsdp" not in data_axes or replica_rows % p:  # `PipelineRegion.gathers_per_step`
        return None
    return replica_rows // p


def loss_context_ranks(layout) -> int:
    """How many context ranks split the positions of each row in GPipe's loss region (`_loss_region`; 1: none)."""
    return layout.mesh.shape.get(SEQUENCE, 1)


def _loss_region(layout) -> tuple[PipelineRegion, int]:
    """The loss region and how many context ranks it takes the rows' positions over. Under context parallelism the
    region is manual over `sequence` too, each context rank taking its own positions: left automatic there, the
    head's gradient of every chunk was summed over `sequence` inside the chunk loop, and the chunks' logits were not
    kept apart. Manual, the head is cast to varying over `sequence` once, so its gradient crosses it once, with the
    other manual axes' sum."""
    region = pipeline_region(layout)
    contexts = loss_context_ranks(layout)
    if contexts == 1:
        return region, 1
    manual = (PIPELINE, *region.data_axes, SEQUENCE)
    return dataclasses.replace(region, data_axes=(*region.data_axes, SEQUENCE),
                               rules=layout.rules.without_axes(manual)), contexts


class _LossHead(NamedTuple):
    """How the loss region holds the head: its FSDP dimension (-1: none), the vocabulary dimension it is split along
    over `fsdp` (-1: gathered instead), its split over the automatic axes, and the vocabulary's blocks over them."""

    fsdp_dim: int
    vocab_dim: int
    kept: PartitionSpec
    vocab_blocks: int


def _replicas(mesh_shape, data_axes: tuple[str, ...]) -> int:
    """How many data replicas a region's manual data axes make."""
    return int(np.prod([mesh_shape[axis] for axis in data_axes]))


def _stage_rows_loss(region: PipelineRegion, head: _LossHead, chunks: int, output_dtype, hidden_BSD, head_DV,
                     targets_BS):
    """Inside the loss region: this stage's 1/p of the replica's rows, their summed cross entropy, summed over every
    rank. The head is cast to varying once, on its shard, so its gradient is summed over `pipeline` and the data
    axes once, after the chunk loop and its way back over `fsdp` (a quarter of the bytes at fsdp 4)."""
    p = region.config.stages
    stage = jax.lax.axis_index(PIPELINE)
    rows = hidden_BSD.shape[0] // p
    # Cast to varying over `pipeline` before the slice (which would cast it there itself): its transpose sums the
    # hidden state's gradient over the stages, and `to_varying` makes that sum one a CPU mesh can compile.
    hidden_bSD = jax.lax.dynamic_slice_in_dim(to_varying(hidden_BSD), stage * rows, rows)
    targets_bS = jax.lax.dynamic_slice_in_dim(targets_BS, stage * rows, rows)
    head_DV = _after(to_varying(head_DV), jax.lax.stop_gradient(hidden_bSD).reshape(-1)[0])
    if head.vocab_dim >= 0:
        head_DVf = split_by_vocab(head_DV, head.fsdp_dim, head.vocab_dim, head.kept)
        loss_fn = functools.partial(_split_head_loss, chunks, output_dtype, head.vocab_blocks)
        loss = _in_context(region, loss_fn)(hidden_bSD, head_DVf, targets_bS)
    else:
        head_DV = gather_stage(head_DV, head.fsdp_dim, head.kept)
        rows_per_chunk = math.ceil(hidden_bSD.shape[0] * hidden_bSD.shape[1] / chunks)
        loss_fn = functools.partial(cross_entropy_sum, output_dtype=output_dtype, chunk_rows=rows_per_chunk)
        loss = _in_context(region, loss_fn)(hidden_bSD, head_DV, targets_bS)
    return psum(loss, tuple(sorted(region.manual_axes)))


def _split_head_loss(chunks: int, output_dtype, vocab_blocks: int, hidden_bSD, head_DVf, targets_bS):
    """The rows' summed cross entropy with the head split by vocabulary (`head_split.cross_entropy_sum`), one chunk
    of positions at a time (`shardkit.loss.chunk_positions`); under autodiff the head's gradient sums through the
    chunks in the compute dtype, as the 1F1B family's through its ticks."""

    # A Python loop, not a scan: a scan's stacked residuals (the chunks' gathered rows) are zeros XLA makes at the
    # step's start and holds through the layer region. Each chunk runs `_after`
    # the one before, forward and backward, so one chunk's logits are live at a time.
    total = to_varying(jnp.zeros((), jnp.float32))
    for index in range(chunks):
        hidden_cSD = _after(chunk_positions(hidden_bSD, index, chunks), total)
        total = total + head_split.cross_entropy_sum(hidden_cSD, head_DVf, chunk_positions(targets_bS, index, chunks),
                                                     output_dtype, vocab_blocks)
    return total


def _in_context(region: PipelineRegion, fn: Callable) -> Callable:
    """`fn` with its forward and its backward traced in the region's model context. Why: the losses' custom VJPs
    (shardkit/loss.py, head_split.py) pin their logits' layout from the context, and autodiff traces a custom VJP's
    backward after the region's `with` block has closed, where the step's own rules would name the manual axes."""

    @jax.custom_vjp
    def run(*args):
        with region.context():
            return fn(*args)

    def forward(*args):
        with region.context():
            return jax.vjp(fn, *args)

    def backward(pullback, d_out):
        with region.context():
            return pullback(d_out)

    run.defvjp(forward, backward)
    return run


@jax.custom_vjp
def _after(w: jax.Array, x: jax.Array) -> jax.Array:
    """`w`, made to depend on the scalar `x` in the forward, and `x`'s gradient on `w`'s in the backward: XLA then
    cannot run what reads `w` before `x` exists, nor the backward of what made `x` before `w`'s gradient exists. Why:
    XLA scheduled the head's gather and XLA:CPU's fp32 copies of it before the
    layer region, which they lived through, and ran the loss's chunks side by side (their logits all live at once). XLA
    removes `optimization_barrier` on CPU before scheduling; a float times zero it does not fold (NaN semantics), so
    adding a zero drawn from `x` (from `w`'s gradient) keeps the order. A non-finite `x` or gradient spreads, in a step
    that is already non-finite."""
    return w + _zero_from(x, w.dtype)


def _after_forward(w, x):
    return _after(w, x), jnp.zeros_like(x)


def _after_backward(x_zero, d_w):
    return d_w, _zero_from(d_w, x_zero.dtype)


def _zero_from(x: jax.Array, dtype) -> jax.Array:
    return (jax.lax.stop_gradient(x).reshape(-1)[0] * 0).astype(dtype)


_after.defvjp(_after_forward, _after_backward)


def _gathered_dims(layout, region: PipelineRegion, stacked_state):
    """Per leaf of the stacked state, the dimension the region gathers over `fsdp` once per step (-1: none, also for
    every leaf when FSDP gathers per use)."""
    leaves, treedef = jax.tree.flatten(stacked_state)
    dims = stack_fsdp_dims(stacked_state, layout.rules) if region.gathers_per_step else [-1] * len(leaves)
    return jax.tree.unflatten(treedef, dims)


def _chunk_spec(chunk, dim: int) -> PartitionSpec:
    """A chunked leaf (v, p, L/(p*v), ...) enters the region split over stages, and over `fsdp` along its FSDP
    dimension (`dim` of the stacked leaf, 2 further on here) when the region gathers it itself."""
    return PartitionSpec(None, PIPELINE) if dim < 0 else PartitionSpec(None, PIPELINE, *[None] * dim, FSDP)


def _to_chunks(w_L: jax.Array, config: PipelineConfig) -> jax.Array:
    """(L, ...) -> (v, p, L/(p*v), ...): chunk k = r*p + d holds model layers [k*L/(p*v), (k+1)*L/(p*v))."""
    p, v = config.stages, config.repeats
    return w_L.reshape(v, p, w_L.shape[0] // (p * v), *w_L.shape[1:])


def _run_region(layer_fn, region: PipelineRegion, dims, kept, wide, held_flags, x_BSD, chunks):
    """Inside the manual region: split into micro-batches, run the ticks, broadcast the last stage's outputs.

    `x_BSD` may be a pytree of arrays that all lead with the batch (a model's layer carry, e.g. models/moe.py's
    residual stream and per-row router statistics): every leaf travels alike. `wide` (None: not used) is the dtype the
    stage's weight gradients are summed through the ticks and reduced across replicas in (`precision.grad_reduce =
    "float32"`: `Policy.weight_grad_dtype`): the gathered weights are held in it and cast to their own dtype in each
    tick (`_gather_widened`), so autodiff sums the ticks' gradients in it and the replicas' reduction moves it.
    `held_flags`: which leaves (in `jax.tree.leaves` order) are a held copy (`_with_held`), taken as they are.
    """
    p, m, v = region.config.stages, region.config.microbatches, region.config.repeats
    # This stage's (v, layers per chunk, ...), gathered over `fsdp` here when the region does it (once per step), as
    # this data replica's own copy: its gradient is summed (reduce-scattered) over the replicas once, after the tick
    # loop (see shardkit/pipeline/config.py), not inside every tick. The FP8 scaling state's gradient (its next value)
    # takes the maximum over the replicas instead (`to_varying_max`).
    fp8 = _fp8_flags(chunks)
    narrow = tuple(_narrow_dtype(w, wide, is_fp8) for w, is_fp8 in zip(jax.tree.leaves(chunks), jax.tree.leaves(fp8)))

    def enter(w, dim, spec, is_fp8, narrow, is_held):
        dim = dim + 1 if dim >= 0 else -1
        if is_held:  # this replica's whole copy, varying over every manual axis: no gather, no sum at the edge
            return w[0, :, 0] if narrow is None else w[0, :, 0].astype(wide)
        if is_fp8:
            return to_varying_max(w[:, 0])
        if narrow is not None:
            return to_varying(_gather_widened(w[:, 0], dim, spec, wide))
        return to_varying(gather_stage(w[:, 0], dim, spec))

    leaves, treedef = jax.tree.flatten(chunks)
    chunks = jax.tree.unflatten(treedef, [
        enter(*args) for args in zip(leaves, jax.tree.leaves(dims), jax.tree.leaves(kept, is_leaf=_is_spec),
                                     jax.tree.leaves(fp8), narrow, held_flags)])
    # This data replica's rows when the region is manual over `data`; micro-batch i takes rows i, i+m, ...
    # The input is the same on every stage: cast once here, so the backward sums its gradient over `pipeline` once,
    # after the loop, rather than one micro-batch per tick inside it.
    x_MbSD = jax.tree.map(lambda x: to_varying(microbatch.split(x, m)), x_BSD)
    stage = jax.lax.axis_index(PIPELINE)
    with region.context():
        outputs_TbSD = _forward_ticks(layer_fn, region, _StageState(chunks, tuple(jax.tree.leaves(fp8)), narrow),
                                      x_MbSD, stage)
    # The last stage's outputs are those of ticks (v-1)*m + p-1 on, m of them: a static slice, whose transpose is a
    # pad (an index array's would be a scatter-add into zeros that XLA made at the step's start, fp32 on CPU, live
    # through the forward). Broadcast from the last stage to every rank.
    first = (v - 1) * m + p - 1
    finished_MbSD = jax.tree.map(lambda out: psum(jnp.where(stage == p - 1, out[first:first + m], 0), PIPELINE),
                                 outputs_TbSD)
    return jax.tree.map(microbatch.merge, finished_MbSD)


def _fp8_flags(tree):
    """`tree` with each array leaf replaced by whether it belongs to the FP8 scaling state (`shardkit.nn.Fp8Stack`)."""
    return jax.tree.map(lambda node: jax.tree.map(lambda _: is_fp8_stack(node), node), tree, is_leaf=is_fp8_stack)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _narrow_dtype(w: jax.Array, wide, is_fp8: bool):
    """The dtype a stage weight is used in when its gradient is summed in the wider `wide` (`_gather_widened`); None
    for leaves kept as they are (no `wide`, the FP8 scaling state, integers, weights as wide already)."""
    if wide is None or is_fp8 or not jnp.issubdtype(w.dtype, jnp.floating):
        return None
    return w.dtype if jnp.dtype(w.dtype).itemsize < jnp.dtype(wide).itemsize else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_widened(w: jax.Array, dim: int, kept: PartitionSpec, wide) -> jax.Array:
    """`gather_stage(w, dim, kept)` (moved in w's dtype) held in `wide`, whose backward reduce-scatters the gradient
    over `fsdp` in `wide` and rounds it to w's dtype after the sum."""
    return gather_stage(w, dim, kept).astype(wide)


def _gather_widened_forward(w, dim, kept, wide):
    return _gather_widened(w, dim, kept, wide), jnp.zeros((0,), w.dtype)


def _gather_widened_backward(dim, kept, wide, empty, g):
    summed = g if dim < 0 else reduce_scatter_stage(g, dim, kept)
    return (summed.astype(empty.dtype),)


_gather_widened.defvjp(_gather_widened_forward, _gather_widened_backward)


class _StageState(NamedTuple):
    """A stage's chunks (weights, dropout indices, FP8 scaling state), which of their leaves (in `jax.tree.leaves`
    order) are the FP8 scaling state, and the dtype each leaf is used in where it is held wider (None: as held)."""

    chunks: Any
    fp8: tuple[bool, ...]
    narrow: tuple = ()

    def for_tick(self, scaling) -> Any:
        """The chunks one tick uses: the FP8 scaling state's leaves replaced by `scaling`, widened weights cast to
        their own dtype (in the tick, so that autodiff sums the ticks' gradients in the wide dtype)."""
        chunks = self.with_scaling(scaling) if scaling else self.chunks
        if not any(dtype is not None for dtype in self.narrow):
            return chunks
        leaves, treedef = jax.tree.flatten(chunks)
        return jax.tree.unflatten(treedef, [leaf if dtype is None else leaf.astype(dtype)
                                            for leaf, dtype in zip(leaves, self.narrow)])

    def scaling(self) -> tuple:
        """The FP8 scaling state's leaves."""
        return tuple(leaf for leaf, is_fp8 in zip(jax.tree.leaves(self.chunks), self.fp8) if is_fp8)

    def with_scaling(self, scaling) -> Any:
        """The chunks with the FP8 scaling state's leaves replaced by `scaling` (the ones a tick uses)."""
        leaves, treedef = jax.tree.flatten(self.chunks)
        given = iter(scaling)
        return jax.tree.unflatten(treedef, [next(given) if is_fp8 else leaf for leaf, is_fp8 in zip(leaves, self.fp8)])


class _ForwardCarry(NamedTuple):
    """What a forward tick hands the next: the activation that arrived, stage 0's items between repeats, and the
    stage's FP8 scaling state (empty without it), carried so that its uses' gradients combine by maximum
    (`_fan_out_max`)."""

    received_bSD: Any  # a pytree of arrays when the model's layer carry is one
    loop_MbSD: Any
    scaling: tuple


def _forward_ticks(layer_fn, region: PipelineRegion, stage_state: _StageState, x_MbSD, stage):
    """All forward ticks, as one scan per run of ticks that send alike; returns each tick's stage output."""
    carry = _ForwardCarry(jax.tree.map(lambda x: to_varying(jnp.zeros_like(x[0])), x_MbSD),
                          jax.tree.map(lambda x: to_varying(jnp.zeros_like(x)), x_MbSD), stage_state.scaling())
    outputs = []
    for first, count, pairs in tick_runs(region.config):
        tick = functools.partial(_forward_tick, layer_fn, region, stage_state, x_MbSD, stage, pairs)
        carry, out_TbSD = (_unrolled_scan if region.unrolled else jax.lax.scan)(tick, carry,
                                                                                 jnp.arange(first, first + count))
        outputs.append(out_TbSD)
    return jax.tree.map(lambda *runs: jnp.concatenate(runs), *outputs)


def _unrolled_scan(tick, carry, ticks):
    """`jax.lax.scan(tick, carry, ticks)` as a Python loop (`PipelineRegion.unrolled`)."""
    outputs = []
    for index in range(ticks.shape[0]):
        carry, out = tick(carry, ticks[index])
        outputs.append(out)
    return carry, jax.tree.map(lambda *outs: jnp.stack(outs), *outputs)


def _forward_tick(layer_fn, region: PipelineRegion, stage_state: _StageState, x_MbSD, stage, pairs,
                  carry: _ForwardCarry, tick):
    """One tick: pick this stage's input, apply its chunk of layers (rematerialised), send the result on."""
    received_bSD, loop_MbSD, scaling = carry
    p, m, v = region.config.stages, region.config.microbatches, region.config.repeats
    first_bSD = jax.tree.map(lambda x: x[jnp.minimum(tick, m - 1)], x_MbSD)
    if v > 1:
        # What the last stage sent after tick-1 is item tick-p, due back at stage 0 at tick (tick-p)+m.
        loop_MbSD = jax.tree.map(lambda loop, got: jax.lax.dynamic_update_index_in_dim(loop, got, (tick - p) % m, 0),
                                 loop_MbSD, received_bSD)
        first_bSD = jax.tree.map(lambda first, loop: jnp.where(tick < m, first, loop[tick % m]), first_bSD, loop_MbSD)
    input_bSD = jax.tree.map(lambda first, got: jnp.where(stage == 0, first, got), first_bSD, received_bSD)
    repeat = jnp.clip((tick - stage) // m, 0, v - 1)
    micro = (tick - stage) % m  # the item this stage works on at this tick, whatever its repeat
    stream = region.stream_index(region.replica_index(), micro, stage)
    used = scaling
    if scaling:
        # A bubble tick's input is a stand-in (zeros, or an item already done): its amax must not reach the state.
        real = (tick >= stage) & (tick - stage < v * m)
        used, scaling = _fan_out_max(scaling, real)
    chunks = stage_state.for_tick(used)
    output_bSD = _apply_chunk(layer_fn, chunks, repeat, input_bSD, stream, region.unrolled)
    return _ForwardCarry(jax.tree.map(lambda out: send(out, pairs), output_bSD), loop_MbSD, scaling), output_bSD


@jax.custom_vjp
def _fan_out_max(scaling, real):
    """`(scaling, scaling)`: the FP8 scaling state once for this tick's use and once for the ticks after, whose
    gradients (next values) combine by maximum where autodiff would add them, and this tick's only when `real` (not a
    bubble). So the state's next value is what one pass over every micro-batch gives: each amax history's new entry
    the largest over the micro-batches, the scales (the same in every use) unchanged."""
    return scaling, scaling


def _fan_out_max_forward(scaling, real):
    return (scaling, scaling), real


def _fan_out_max_backward(real, d_used_and_next):
    d_used, d_next = d_used_and_next
    return jax.tree.map(lambda used, later: jnp.maximum(jnp.where(real, used, 0), later), d_used, d_next), None


_fan_out_max.defvjp(_fan_out_max_forward, _fan_out_max_backward)


@functools.partial(jax.checkpoint, static_argnums=(0, 5))
def _apply_chunk(layer_fn, chunks, repeat, x_bSD, stream, unrolled: bool = False):
    """This stage's layers of chunk `repeat`, in order, drawing dropout from `stream`. Rematerialised: a tick keeps
    only its input for the backward (and the recompute draws the same masks)."""
    chunk = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, repeat, 0, keepdims=False), chunks)
    chunk, x_bSD = _gradients_together(chunk, x_bSD)
    with dropout_stream(stream):
        if unrolled:  # PipelineRegion.unrolled
            return unrolled_layers(layer_fn, x_bSD, chunk)
        x_bSD, _ = jax.lax.scan(lambda x, layer: (layer_fn(x, layer), None), x_bSD, chunk)
    return x_bSD


@jax.custom_vjp
def _gradients_together(chunk, x_bSD):
    """The identity on a tick's chunk and input, whose backward passes both gradients through one
    `optimization_barrier`: the tick's weight gradient and input gradient are then made together, before the input
    gradient is sent on. Why: without it XLA:GPU fused the input gradients of the inlined single-tick runs into one
    fusion at the backward's end and scheduled their weight-gradient GEMMs there too, so each run's split-K partial
    sums and recomputed MLP tensors stayed live until then."""
    return chunk, x_bSD


def _gradients_together_forward(chunk, x_bSD):
    return (chunk, x_bSD), None


def _gradients_together_backward(_, d_chunk_and_x):
    return jax.lax.optimization_barrier(d_chunk_and_x)


_gradients_together.defvjp(_gradients_together_forward, _gradients_together_backward)
