"""Sequence and context parallelism: what a layout that cuts the sequence needs checked and set up.

Two ways of cutting the sequence (see recipes/tp_sp.toml and recipes/cp.toml):
    Megatron-SP  the residual stream (`residual_sequence`: embeddings, norms, dropout, block outputs) is cut along the
                 sequence over `tensor`, so tensor parallelism stops replicating it; attention and the MLP stay cut by
                 heads / hidden units. Around each block the all-reduce becomes an all-gather + reduce-scatter.
    context      the whole sequence is cut over the `sequence` mesh axis, and attention runs context-parallel
                 (shardkit.attention.ring): as ring attention or, with train.context = "allgather", against K/V
                 all-gathered over `sequence`.

Dropout keys: one per step, derived from (seed, step) alone, then folded with the micro-batch, the data-parallel
replica (under per-replica accumulation), the layer and the dropout site. Masks are drawn for the global activation
with JAX's partitionable threefry, so every layout draws the mask a single device would, each device only its shard.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax

from shardkit.errors import ShardkitError
from shardkit.nn import attention_implementation, keys_spec
from shardkit.attention.ring import Plan, context_attention

RING_AXIS = "sequence"
DROPOUT_STREAM = 0xD0  # folded into the seed so dropout draws from a stream distinct from parameter init
SEQUENCE_NAMES = ("sequence", "residual_sequence")
HEAD_NAMES = ("heads", "kv_heads")


def ring_axis(layout) -> str | None:
    """`sequence` when the layout cuts the sequence over it (attention then runs as ring attention), else None."""
    return RING_AXIS if layout.mesh.shape[RING_AXIS] > 1 else None


def context_parallel_attention(q_BSKGE, k_BTKE, v_BTKE, context, causal: bool = True) -> jax.Array:
    """Attention under a layout that cuts the sequence over `context.ring_axis` (a shardkit.nn.ModelContext).

    The variant is the recipe's train.context (`context.context_parallel`); the keys' activation spec from the
    context's rules tells the cuDNN kernel's fully manual region how batch and heads are laid out.
    """
    plan = Plan(context.context_parallel, block_kernel(context, q_BSKGE), causal)
    keys = keys_spec(k_BTKE, context)
    return context_attention(q_BSKGE, k_BTKE, v_BTKE, context.mesh, context.ring_axis, plan, keys)


def block_kernel(context, q_BSKGE) -> str:
    """The block kernel of context-parallel attention, `xla` or `cudnn` (shardkit.attention.blocks): the recipe's
    train.attention resolved for the mesh's devices and the queries' dtype and head size, as plain attention does."""
    return attention_implementation(context.attention, context.nvidia_gpu, q_BSKGE.dtype, q_BSKGE.shape[-1])


def step_dropout_key(train, step) -> jax.Array | None:
    """The dropout key of training step `step` (None when dropout is off or no step is given)."""
    if train.dropout == 0.0 or step is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(train.seed), DROPOUT_STREAM), step)


def check_sequence_layout(recipe, config: Any, mesh_sizes: Mapping[str, int], activations: Mapping) -> None:
    """Raise a ShardkitError naming the field when the sequence or the heads cannot be cut as the layout asks.

    Checked: seq_len against every mesh axis the sequence names map to, no ring inside a pipeline (it cannot compile
    yet), seq_len against 2 x the ring (the zigzag
    layout of causal ring attention), heads and kv_heads against the axes that cut them, and that dropout can promise
    layout-independent masks.
    """
    seq_len = recipe.train.seq_len
    for name in SEQUENCE_NAMES:
        axes = activations.get(name, ())
        degree = math.prod(mesh_sizes[axis] for axis in axes)
        if seq_len % degree:
            raise ShardkitError(
                "train.seq_len",
                f"{seq_len} is not divisible by {degree}, the size of mesh axes {list(axes)} that rule "
                f"rules.activations.{name} cuts the sequence over; use a multiple of {degree}",
            )
    ring = mesh_sizes[RING_AXIS]
    if ring > 1 and mesh_sizes["pipeline"] > 1:
        # The context-parallel region's custom VJP sits inside its shard_map; nested in a pipeline's region, Shardy
        # refuses the result ("all manual axes must come before free axes"), so this layout cannot compile yet.
        raise ShardkitError(
            "mesh.sequence",
            f"context parallelism (mesh.sequence = {ring}) inside a pipeline (mesh.pipeline = {mesh_sizes['pipeline']}) "
            "is not supported yet; use one of them, e.g. mesh.sequence = 1 or mesh.pipeline = 1",
        )
    if ring > 1 and seq_len % (2 * ring):
        raise ShardkitError(
            "train.seq_len",
            f"{seq_len} is not divisible by {2 * ring} = 2 x mesh.sequence ({ring}): causal ring attention gives each "
            f"device two chunks (zigzag load balancing); use a multiple of {2 * ring}",
        )
    _check_heads(config, mesh_sizes, activations)
    if recipe.train.dropout > 0 and not jax.config.jax_threefry_partitionable:
        raise ShardkitError("train.dropout", "needs jax_threefry_partitionable=True (JAX's default) for masks that do "
                            "not depend on the layout; re-enable it or set train.dropout = 0")


def _check_heads(config: Any, mesh_sizes: Mapping[str, int], activations: Mapping) -> None:
    for name in HEAD_NAMES:
        count = getattr(config, name, None)
        axes = activations.get(name, ())
        degree = math.prod(mesh_sizes[axis] for axis in axes)
        if count is not None and count % degree:
            raise ShardkitError(
                f"model.{name}",
                f"{count} {name} cannot be split over {degree} devices (mesh axes {list(axes)}, rule "
                f"rules.activations.{name}); use a tensor degree that divides {count}",
            )
