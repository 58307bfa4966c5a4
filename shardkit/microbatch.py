"""Micro-batches: a batch cut into them and put back together, and gradient accumulation as a transform.

Gradient accumulation and the pipeline schedules (shardkit/pipeline/) both cut the batch so that micro-batch i takes
rows i, i + M, i + 2M, ...: a strided slice, so each micro-batch is spread evenly over the devices that shard the
batch and the split moves no data between them.

Accumulation (`accumulate`) wraps a value-and-grad function `(params, tokens_BS1) -> (loss, fp32 grads)` into one of
the same contract over `train.grad_accum` micro-batches (Levanter's `microbatched`): the loss and gradients of the
micro-batches are summed in fp32 in a scan and averaged, each micro-batch drawing its own dropout masks. Replicas over
`replica_axes` (data; fsdp under train.fsdp_sync = "per_step") accumulate their own gradients and reduce once after
the loop; other axes, fsdp by default, communicate inside every micro-batch.

Under the fp8 policy the gradients are `shardkit.precision.Fp8Trained`: the FP8 scaling state's next values of the
micro-batches and replicas combine by maximum (`shardkit.precision.combine_fp8`), not by mean, and the step scales
each pass's loss by 1 / `passes` before differentiating it (`shardkit.step.StepBuilder.gradients_with_aux`), so that
each pass's output gradients, whose amax the state records, are those one device computes for the whole batch.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.nn import dropout_stream, model_context
from shardkit.precision import Fp8Trained, combine_fp8

# (params, tokens_BS1) -> ((loss, auxiliary metric sums), fp32 grads); the sums (a dict, empty for dense models) add
# up over micro-batches and replicas.
ValueAndGrad = Callable[[Any, jax.Array], tuple[tuple[jax.Array, dict], Any]]


def split(x_B_: jax.Array, count: int) -> jax.Array:
    """(B, ...) -> (count, B / count, ...): micro-batch i holds rows i, i + count, i + 2 * count, ..."""
    return x_B_.reshape(x_B_.shape[0] // count, count, *x_B_.shape[1:]).swapaxes(0, 1)


def merge(x_Mb_: jax.Array) -> jax.Array:
    """The inverse of `split`: (M, b, ...) -> (b * M, ...), each row back in its place."""
    count, rows = x_Mb_.shape[:2]
    return x_Mb_.swapaxes(0, 1).reshape(rows * count, *x_Mb_.shape[2:])


def by_replica(x: jax.Array, replicas: int, axis: int = 0) -> jax.Array:
    """Cut dimension `axis` (rows) into `replicas` contiguous blocks, (..., B, ...) -> (..., R, B / R, ...): block r
    holds the rows that a batch sharded over R devices keeps on device r (a per-replica vmap's share)."""
    return x.reshape(*x.shape[:axis], replicas, x.shape[axis] // replicas, *x.shape[axis + 1:])


# ---- gradient accumulation ------------------------------------------------------------------------------------------
def replica_axes(layout) -> tuple[str, ...]:
    """The mesh axes whose devices accumulate their own gradients over the micro-batches, reduced once per step.

    Empty without accumulation. `data` whenever it is > 1: its replicas hold whole parameters, so this costs nothing.
    `fsdp` only under `train.fsdp_sync = "per_step"` (and when it shards the batch), since its replicas must first
    gather the parameters and then keep them, and an unreduced gradient, for the whole step.

    Empty under a pipeline too: its region is manual over the data axes itself (shardkit/pipeline/config.py), each
    replica running its own pipeline on its rows, so the accumulation loop is a plain scan of pipeline passes, each
    pass reducing its stage gradients over the replicas once, at the region's edge (one reduction per micro-batch of
    the accumulation, none per pipeline micro-batch). A per-replica vmap cannot hold the region's shard_map.
    """
    train, sizes = layout.recipe.train, layout.mesh.shape
    if train.grad_accum == 1 or layout.pipeline.enabled:
        return ()
    axes = ("data",) if sizes["data"] > 1 else ()
    if train.fsdp_sync == "per_step" and sizes["fsdp"] > 1 and "fsdp" in layout.rules.activations["batch"]:
        axes += ("fsdp",)
    return axes


def passes(layout) -> int:
    """How many separate passes one step's gradient is averaged from: micro-batches, times the replicas of
    per-replica accumulation (each of which takes the mean loss of its own rows)."""
    sizes = layout.mesh.shape
    return layout.recipe.train.grad_accum * math.prod(sizes[axis] for axis in replica_axes(layout))


def accumulate(value_and_grad: ValueAndGrad, layout) -> ValueAndGrad:
    """`value_and_grad` over the layout's `train.grad_accum` micro-batches: the mean loss and fp32 gradients of the
    whole batch (the function itself when there is one micro-batch)."""
    count, axes = layout.recipe.train.grad_accum, replica_axes(layout)
    if count == 1:
        return value_and_grad
    if axes:
        return _per_replica(value_and_grad, count, layout, axes)
    return microbatched(value_and_grad, count)


class Sums(NamedTuple):
    """The accumulation loop's state: the loss (per replica under per-replica accumulation) and gradients so far."""

    loss: jax.Array
    grads: Any


def add_gradients(total, grads):
    """Gradients summed; under the fp8 policy (`Fp8Trained`) the scaling state's next values combined by maximum."""
    if isinstance(grads, Fp8Trained):
        return Fp8Trained(jax.tree.map(jnp.add, total.params, grads.params), combine_fp8(total.fp8, grads.fp8))
    return jax.tree.map(jnp.add, total, grads)


def _weights(tree):
    """The parameters' part of a tree of parameters or gradients (`Fp8Trained`: without the scaling state)."""
    return tree.params if isinstance(tree, Fp8Trained) else tree


def _with_weights(tree, weights):
    """`tree` with its parameters' part replaced by `weights` (see `_weights`)."""
    return tree._replace(params=weights) if isinstance(tree, Fp8Trained) else weights


def microbatched(value_and_grad: ValueAndGrad, count: int) -> ValueAndGrad:
    """`value_and_grad` run on `count` micro-batches in a scan, their losses and gradients summed and averaged."""

    def run(params, tokens_BS1):
        micro_AbS1 = split(tokens_BS1, count)
        zero = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        def body(sums: Sums, micro):
            tokens_bS1, index = micro
            with dropout_stream(index):  # each micro-batch its own dropout masks
                (loss, aux), grads = value_and_grad(params, tokens_bS1)
            return Sums(sums.loss + loss, add_gradients(sums.grads, grads)), aux

        micro_indices = jnp.arange(count, dtype=jnp.uint32)
        sums, aux_A = jax.lax.scan(body, Sums(jnp.float32(0), zero), (micro_AbS1, micro_indices))
        mean = jax.tree.map(lambda g: g / count, _weights(sums.grads))
        return (sums.loss / count, _sum_leading(aux_A, 1)), _with_weights(sums.grads, mean)

    return run


def _per_replica(value_and_grad: ValueAndGrad, count: int, layout, axes: tuple[str, ...]) -> ValueAndGrad:
    """Accumulate each replica's own gradient through the micro-batch loop, and reduce over `axes` once, after it.

    A replica is one slice of the batch over the mesh `axes` (see `replica_axes`). Written as a vmap over them
    (spmd_axis_name), so each replica's partial gradient is a slice of a (replicas, ...) buffer sharded over `axes`:
    nothing inside the loop needs a cross-replica sum. This is what DDP's `no_sync` does, expressed for the SPMD
    partitioner. When `axes` include `fsdp`, the parameters are gathered over it once, before the loop, and every
    micro-batch reads that copy (train.fsdp_sync = "per_step"; TrainSection states the memory it costs).
    """
    mesh = layout.mesh
    replicas = math.prod(mesh.shape[axis] for axis in axes)
    local_rules = layout.rules.without_axes(axes)
    local_specs = layout.specs(local_rules.params)  # a replica's parameters: whole over `axes`
    local_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), local_specs)
    # Laid out like a replica's parameters plus the replica axis: the scatter over `data` (ZeRO-2) or `fsdp` comes
    # after the loop.
    buffer_shardings = jax.tree.map(lambda spec: NamedSharding(mesh, PartitionSpec(axes, *spec)), local_specs)

    def replica_value_and_grad(params, tokens_bS1):
        with dropout_stream(jax.lax.axis_index("replica")):  # replicas must not share dropout masks
            return value_and_grad(params, tokens_bS1)

    per_replica = jax.vmap(replica_value_and_grad, in_axes=(None, 0), spmd_axis_name=axes, axis_name="replica")

    def run(params, tokens_BS1):
        micro_ARrS1 = by_replica(split(tokens_BS1, count), replicas, axis=1)
        # The step's one parameter all-gather; a no-op under plain data parallelism (nothing is sharded over `axes`).
        params = _with_weights(params, jax.lax.with_sharding_constraint(_weights(params), local_shardings))

        def body(sums: Sums, micro):
            tokens_RrS1, index = micro
            with model_context(activation_rules=local_rules.activations), dropout_stream(index):
                (loss_R, aux_R), grads = per_replica(params, tokens_RrS1)
            grad_sum = add_gradients(sums.grads, grads)
            grad_sum = _with_weights(grad_sum, jax.lax.with_sharding_constraint(_weights(grad_sum), buffer_shardings))
            return Sums(sums.loss + loss_R, grad_sum), aux_R

        # The loss too is summed per replica and averaged after the loop: no cross-replica sum per micro-batch.
        replica_sharding = NamedSharding(mesh, PartitionSpec(axes))
        zero_R = jax.lax.with_sharding_constraint(jnp.zeros((replicas,), jnp.float32), replica_sharding)
        zero = jax.tree.map(lambda p: jnp.zeros((replicas, *p.shape), jnp.float32), params)
        zero = _with_weights(zero, jax.lax.with_sharding_constraint(_weights(zero), buffer_shardings))
        micro_indices = jnp.arange(count, dtype=jnp.uint32)
        sums, aux_AR = jax.lax.scan(body, Sums(zero_R, zero), (micro_ARrS1, micro_indices))
        loss_sum_R, grad_sum = sums
        loss = loss_sum_R.mean() / count
        mean = jax.tree.map(lambda g: g.mean(axis=0) / count, _weights(grad_sum))
        if isinstance(grad_sum, Fp8Trained):  # the replicas' next scaling states: their maximum
            grad_sum = grad_sum._replace(fp8=jax.tree.map(lambda s: s.max(axis=0), grad_sum.fp8))
        return (loss, _sum_leading(aux_AR, 2)), _with_weights(grad_sum, mean)

    return run


def _sum_leading(aux, dims: int) -> dict:
    """Auxiliary sums stacked by the loop (micro-batches, and replicas), summed over those `dims` leading axes."""
    return jax.tree.map(lambda a: a.sum(axis=tuple(range(dims))), aux)
