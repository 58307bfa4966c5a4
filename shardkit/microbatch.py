"""Micro-batches: a batch cut into them and put back together, the one way every part of shardkit cuts it.

Gradient accumulation (shardkit/train.py) and the pipeline schedules (shardkit/pipeline/) both cut the batch so that
micro-batch i takes rows i, i + M, i + 2M, ...: a strided slice, so each micro-batch is spread evenly over the devices
that shard the batch and the split moves no data between them.
"""

from __future__ import annotations

import jax


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
