"""Sequence and context parallelism: what a layout that cuts the sequence needs checked and set up.

Two ways of cutting the sequence (see recipes/tp_sp.toml and recipes/cp.toml):
    Megatron-SP  the residual stream (`residual_sequence`: embeddings, norms, dropout, block outputs) is cut along the
                 sequence over `tensor`, so tensor parallelism stops replicating it; attention and the MLP stay cut by
                 heads / hidden units. Around each block the all-reduce becomes an all-gather + reduce-scatter.
    context      the whole sequence is cut over the `sequence` mesh axis, and attention runs context-parallel
                 (shardkit.attention.ring): as ring attention or, with train.context = "allgather", against K/V
                 all-gathered over `sequence`.

The load-balanced order. Causal context-parallel attention balances its work by giving device d chunks d and 2n-1-d
of the sequence (zigzag, shardkit.attention.ring). The training step decides that order once: where
`balanced_ring` allows it, the rows enter the model already in it (`in_balanced_order`: tokens, targets, rotary
positions and segment ids permuted alike, along the sequence, before the embedding; the tokens are whole along the
sequence there, so the permute moves no data), and no layer reorders its queries and outputs. The loss is a sum over
tokens, so it is the same in either order.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from shardkit.attention.ring import Plan, balanced_order, context_attention
from shardkit.axes import SEQUENCE as RING_AXIS
from shardkit.errors import ShardkitError
from shardkit.rules import logical_degree

SEQUENCE_NAMES = ("sequence", "residual_sequence")
HEAD_NAMES = ("heads", "kv_heads")


def ring_axis(mesh_sizes: Mapping[str, int]) -> str | None:
    """`sequence` when the mesh cuts the sequence over it (attention then runs context-parallel), else None."""
    return RING_AXIS if mesh_sizes[RING_AXIS] > 1 else None


def context_parallel_attention(q_BSKGE, k_BTKE, v_BTKE, mesh, axis: str, mode: str, kernel: str, causal: bool,
                               kv_spec, segments_BS=None, balanced: bool = False,
                               tick_branch: bool = False) -> jax.Array:
    """Attention under a layout that cuts the sequence over `axis`: `mode` is the recipe's train.context (ring |
    allgather), `kernel` the block kernel the layout chose (xla | cudnn); the keys' activation spec `kv_spec` tells
    the cuDNN kernel's fully manual region how batch and heads are laid out. `segments_BS`: packed documents'
    segment ids, or None. `balanced`: the sequence is in the load-balanced order already (`in_balanced_order`).
    `tick_branch`: inside a branch of the 1F1B tick switch (`shardkit.attention.ring.Plan.tick_branch`)."""
    plan = Plan(mode, kernel, causal, balanced=balanced, tick_branch=tick_branch)
    return context_attention(q_BSKGE, k_BTKE, v_BTKE, mesh, axis, plan, kv_spec, segments_BS)


def balanced_ring(layout) -> int:
    """The ring size when the training step puts its rows in the load-balanced order once, else 0 (rows stay in
    order and each causal context-parallel layer reorders its own queries).

    Not with: a pipeline (its stages cut the rows themselves), dropout (its masks are drawn by position in the
    contiguous order), capacity routing (it drops choices by position), cuDNN's packed all-gather (it attends
    contiguous blocks), or a model without the lean loss split or without rotary `positions_BS` to follow the tokens.
    """
    setup, recipe = layout.attention, layout.recipe
    ring = layout.mesh.shape[setup.ring_axis] if setup.ring_axis is not None else 1
    cudnn_packed = setup.packed and setup.choice.kernel == "cudnn" and not setup.ring
    if ring == 1 or layout.pipeline.enabled or recipe.train.dropout > 0 or cudnn_packed:
        return 0
    if getattr(layout.config, "routing", None) == "capacity" or not layout.capabilities.lean_loss:
        return 0
    takes_positions = "positions_BS" in inspect.signature(layout.model_class.__call__).parameters
    return ring if takes_positions else 0


def in_balanced_order(ring: int, inputs_BS: jax.Array, targets_BS: jax.Array,
                      rows: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Inputs, targets and what each layer takes after x_BSD (`rows`: packed documents' positions and segment ids;
    without packing, the rotary positions 0 .. S - 1), every one in the load-balanced order of `ring` devices."""
    if not rows:
        rows = (jnp.broadcast_to(jnp.arange(inputs_BS.shape[1]), inputs_BS.shape),)
    order = balanced_order(inputs_BS.shape[1], ring)
    return tuple(x[:, order] for x in (inputs_BS, targets_BS, *rows))


def check_sequence_layout(recipe, config: Any, mesh_sizes: Mapping[str, int], activations: Mapping) -> None:
    """Raise a ShardkitError naming the field when the sequence or the heads cannot be cut as the layout asks.

    Checked: seq_len against every mesh axis the sequence names map to, seq_len against 2 x the ring (the zigzag
    layout of causal ring attention), heads and kv_heads against the axes that cut them, and that dropout can promise
    layout-independent masks.
    """
    seq_len = recipe.train.seq_len
    for name in SEQUENCE_NAMES:
        axes = activations.get(name, ())
        degree = logical_degree(activations, name, mesh_sizes)
        if seq_len % degree:
            raise ShardkitError(
                "train.seq_len",
                f"{seq_len} is not divisible by {degree}, the size of mesh axes {list(axes)} that rule "
                f"rules.activations.{name} cuts the sequence over; use a multiple of {degree}",
            )
    ring = mesh_sizes[RING_AXIS]
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
        degree = logical_degree(activations, name, mesh_sizes)
        if count is not None and count % degree:
            raise ShardkitError(
                f"model.{name}",
                f"{count} {name} cannot be split over {degree} devices (mesh axes {list(axes)}, rule "
                f"rules.activations.{name}); use a tensor degree that divides {count}",
            )
