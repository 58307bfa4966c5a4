"""The collectives a pipeline region writes by hand: ppermute between stages, and the FSDP gather and reduce-scatter
of a stage's weights. `send` is checked against a sequential reference in tests/test_pipeline.py; the casts and sums
any manual region uses are in `shardkit.manual`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shardkit.axes import FSDP, PIPELINE
from shardkit.manual import psum, sum_bf16_in_fp32
from shardkit.pipeline.schedule import Pairs


def send(x: jax.Array, pairs: Pairs) -> jax.Array:
    """Move `x` from each source stage to its target stage; stages that receive nothing get zeros."""
    if not pairs:
        return jnp.zeros_like(x)
    return jax.lax.ppermute(x, PIPELINE, perm=list(pairs))


def gather_stage(w: jax.Array, dim: int, kept: PartitionSpec | None = None) -> jax.Array:
    """A stage weight's FSDP shards all-gathered along `dim` (-1: not sharded over `fsdp`, returned as it is).

    Inside a region manual over `fsdp` (`pipeline.fsdp_gather = "per_step"`), once before the tick loop. Its gradient
    is `reduce_scatter_stage`'s, so under autodiff the gradient also crosses `fsdp` once, after the loop. `kept` is the
    weight's split over the region's automatic axes (`PipelineRegion.automatic_spec`, e.g. `tensor` on its heads;
    None: not split): the gather runs on those shards (`on_shards`), so tensor parallelism inside the stage is kept.
    """
    return w if dim < 0 else on_shards(lambda shard: _all_gather_fsdp(shard, dim), w, kept)


def on_shards(fn, x: jax.Array, kept: PartitionSpec | None) -> jax.Array:
    """`fn(x)` on each device's shard of `x` along the automatic mesh axes `kept` names, in a nested region manual
    over them. Why: XLA's partitioner replicates the operand of a collective written in a partly manual region over
    the automatic axes first, so an all-gather over `fsdp` of a weight split over `tensor` gathered it over `tensor`
    too (forward, and its gradient before the reduce-scatter) and moved the whole of it over `fsdp`."""
    entries = [entry for entry in kept or () if entry is not None]
    axes = {axis for entry in entries for axis in ((entry,) if isinstance(entry, str) else entry)}
    if not axes:
        return fn(x)
    return jax.shard_map(fn, in_specs=kept, out_specs=kept, axis_names=axes)(x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _all_gather_fsdp(w: jax.Array, dim: int) -> jax.Array:
    return jax.lax.all_gather(w, FSDP, axis=dim, tiled=True)


def _all_gather_fsdp_forward(w, dim):
    return _all_gather_fsdp(w, dim), None


def _all_gather_fsdp_backward(dim, _, g):
    return (reduce_scatter_stage(g, dim),)


_all_gather_fsdp.defvjp(_all_gather_fsdp_forward, _all_gather_fsdp_backward)


def reduce_scatter_stage(g: jax.Array, dim: int, kept: PartitionSpec | None = None) -> jax.Array:
    """A stage gradient summed over the `fsdp` replicas and scattered back onto the weight's shards along `dim`
    (-1: a weight `gather_stage` left whole, whose gradient is summed whole), on the shards `kept` names (see
    `gather_stage`). On a CPU mesh a bf16 `g` is summed in fp32, for the reason `psum` gives (XLA:CPU aborts compiling
    a bf16 reduce-scatter in a partly manual region too).
    """
    return on_shards(lambda shard: _reduce_scatter_fsdp(shard, dim), g, kept)


def _reduce_scatter_fsdp(g: jax.Array, dim: int) -> jax.Array:
    if dim < 0:
        return psum(g, FSDP)
    if sum_bf16_in_fp32(g):
        return jax.lax.psum_scatter(g.astype(jnp.float32), FSDP, scatter_dimension=dim, tiled=True).astype(g.dtype)
    return jax.lax.psum_scatter(g, FSDP, scatter_dimension=dim, tiled=True)
