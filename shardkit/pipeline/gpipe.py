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
batch's activations over `pipeline`) and the embedding's gradient comes back the same way in the backward pass.

Circular: the layer stack is cut into p*v chunks and chunk k runs on stage k % p. Chunk k holds model layers
[k*L/(p*v), (k+1)*L/(p*v)), which are not the rows stage k % p stores under `layers -> pipeline`, so the stacked
weights are re-laid out once per step (XLA inserts the exchange; its bytes are weights, not activations).

1F1B cannot run through this hook (it ends at the last layer, so micro-batch i's loss exists only after every
forward): training under it runs shardkit/pipeline/one_f_one_b.py. A plain forward pass under 1f1b (evaluation, no
gradients) runs this GPipe loop, which does the same forward work.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shardkit import microbatch
from shardkit.nn import dropout_stream
from shardkit.pipeline.config import AXIS, PipelineRegion, pipeline_region, stack_automatic_specs, stack_fsdp_dims
from shardkit.pipeline.schedule import PipelineConfig, tick_runs
from shardkit.pipeline.sends import FSDP, gather_stage, psum, send, to_varying


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
        run = jax.shard_map(
            functools.partial(_run_region, layer_fn, region, dims, kept),
            mesh=region.mesh, in_specs=(batch_spec, specs), out_specs=batch_spec, axis_names=region.manual_axes,
        )
        return run(x_BSD, chunks)

    return layer_loop


def _gathered_dims(layout, region: PipelineRegion, stacked_state):
    """Per leaf of the stacked state, the dimension the region gathers over `fsdp` once per step (-1: none, also for
    every leaf when FSDP gathers per use)."""
    leaves, treedef = jax.tree.flatten(stacked_state)
    dims = stack_fsdp_dims(stacked_state, layout.rules) if region.gathers_per_step else [-1] * len(leaves)
    return jax.tree.unflatten(treedef, dims)


def _chunk_spec(chunk, dim: int) -> PartitionSpec:
    """A chunked leaf (v, p, L/(p*v), ...) enters the region split over stages, and over `fsdp` along its FSDP
    dimension (`dim` of the stacked leaf, 2 further on here) when the region gathers it itself."""
    return PartitionSpec(None, AXIS) if dim < 0 else PartitionSpec(None, AXIS, *[None] * dim, FSDP)


def _to_chunks(w_L: jax.Array, config: PipelineConfig) -> jax.Array:
    """(L, ...) -> (v, p, L/(p*v), ...): chunk k = r*p + d holds model layers [k*L/(p*v), (k+1)*L/(p*v))."""
    p, v = config.stages, config.repeats
    return w_L.reshape(v, p, w_L.shape[0] // (p * v), *w_L.shape[1:])


def _run_region(layer_fn, region: PipelineRegion, dims, kept, x_BSD, chunks):
    """Inside the manual region: split into micro-batches, run the ticks, broadcast the last stage's outputs.

    `x_BSD` may be a pytree of arrays that all lead with the batch (a model's layer carry, e.g. models/moe.py's
    residual stream and per-row router statistics): every leaf travels alike.
    """
    p, m, v = region.config.stages, region.config.microbatches, region.config.repeats
    # This stage's (v, layers per chunk, ...), gathered over `fsdp` here when the region does it (once per step), as
    # this data replica's own copy: its gradient is summed (reduce-scattered) over the replicas once, after the tick
    # loop (see shardkit/pipeline/config.py), not inside every tick.
    chunks = jax.tree.map(lambda w, dim, spec: to_varying(gather_stage(w[:, 0], dim + 1 if dim >= 0 else -1, spec)),
                          chunks, dims, kept)
    # This data replica's rows when the region is manual over `data`; micro-batch i takes rows i, i+m, ...
    # The input is the same on every stage: cast once here, so the backward sums its gradient over `pipeline` once,
    # after the loop, rather than one micro-batch per tick inside it.
    x_MbSD = jax.tree.map(lambda x: to_varying(microbatch.split(x, m)), x_BSD)
    stage = jax.lax.axis_index(AXIS)
    with region.context():
        outputs_TbSD = _forward_ticks(layer_fn, region, chunks, x_MbSD, stage)
    last_ticks = np.arange(m) + (v - 1) * m + p - 1
    # Broadcast from the last stage to every rank.
    finished_MbSD = jax.tree.map(lambda out: psum(jnp.where(stage == p - 1, out[last_ticks], 0), AXIS), outputs_TbSD)
    return jax.tree.map(microbatch.merge, finished_MbSD)


class _ForwardCarry(NamedTuple):
    """What a forward tick hands the next: the activation that arrived, and stage 0's items between repeats."""

    received_bSD: Any  # a pytree of arrays when the model's layer carry is one
    loop_MbSD: Any


def _forward_ticks(layer_fn, region: PipelineRegion, chunks, x_MbSD, stage):
    """All forward ticks, as one scan per run of ticks that send alike; returns each tick's stage output."""
    carry = _ForwardCarry(jax.tree.map(lambda x: to_varying(jnp.zeros_like(x[0])), x_MbSD),
                          jax.tree.map(lambda x: to_varying(jnp.zeros_like(x)), x_MbSD))
    outputs = []
    for first, count, pairs in tick_runs(region.config):
        tick = functools.partial(_forward_tick, layer_fn, region, chunks, x_MbSD, stage, pairs)
        carry, out_TbSD = jax.lax.scan(tick, carry, jnp.arange(first, first + count))
        outputs.append(out_TbSD)
    return jax.tree.map(lambda *runs: jnp.concatenate(runs), *outputs)


def _forward_tick(layer_fn, region: PipelineRegion, chunks, x_MbSD, stage, pairs, carry: _ForwardCarry, tick):
    """One tick: pick this stage's input, apply its chunk of layers (rematerialised), send the result on."""
    received_bSD, loop_MbSD = carry
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
    output_bSD = _apply_chunk(layer_fn, chunks, repeat, input_bSD, stream)
    return _ForwardCarry(jax.tree.map(lambda out: send(out, pairs), output_bSD), loop_MbSD), output_bSD


@functools.partial(jax.checkpoint, static_argnums=(0,))
def _apply_chunk(layer_fn, chunks, repeat, x_bSD, stream):
    """This stage's layers of chunk `repeat`, in order, drawing dropout from `stream`. Rematerialised: a tick keeps
    only its input for the backward (and the recompute draws the same masks)."""
    chunk = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, repeat, 0, keepdims=False), chunks)
    with dropout_stream(stream):
        x_bSD, _ = jax.lax.scan(lambda x, layer: (layer_fn(x, layer), None), x_bSD, chunk)
    return x_bSD
