"""Model FLOPs and MFU: what a training step computes, counted from the model's shapes alone.

FLOPs count a multiply-add as two. A mixture of experts counts its active parameters (top_k of its experts), the
MFU convention. Nothing here compiles or allocates; `shardkit.run.loop` imports it for the `mfu` column without the
rest of the analytic model.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax

# The dimensions the analytic model's transformer formulas read (models/llama.py's): a model whose config lacks any of
# them (a user's own architecture) is counted by its parameters alone, with no attention or per-layer terms.
TRANSFORMER_FIELDS = ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")


def is_transformer(config) -> bool:
    """Whether a model config has every dimension the analytic transformer formulas need (`TRANSFORMER_FIELDS`)."""
    return all(map(functools.partial(hasattr, config), TRANSFORMER_FIELDS))  # map: asked for every layout


def training_flops_per_token(config: Any, parameters: int, seq_len: int) -> float:
    """6 x parameters (forward 2, backward 4) plus causal attention scores and values.

    The attention term is 12 * layers * (heads * head_dim) * seq_len: it counts the full square of the score matrix
    (as the PaLM and Megatron MFU formulas do), not the causal half. The embedding lookup is counted in `parameters`
    as if it were a matmul, which slightly overstates the FLOPs for untied embeddings: the convention MFU papers use.
    """
    attention = 0.0
    if is_transformer(config):
        attention = 12.0 * config.layers * config.heads * config.head_dim * seq_len
    return 6.0 * parameters + attention


def mfu(flops_per_step: float, step_seconds: float, devices: int, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    return flops_per_step / step_seconds / (devices * peak)


def flops_per_step(layout) -> float:
    """Model training FLOPs of one step over all devices (see `training_flops_per_token`; a mixture of experts
    counts its active parameters, `active_parameters`)."""
    parameters = active_parameters(layout)
    train = layout.recipe.train
    return training_flops_per_token(layout.config, parameters, train.seq_len) * train.global_batch * train.seq_len


def expert_parameter_elements(layout) -> float:
    """Elements of the parameters on the logical `experts` axis (0 for a dense model)."""
    leaves = zip(jax.tree.leaves(layout.abstract_params),
                 jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple)))
    return float(sum(math.prod(leaf.shape) for leaf, logical in leaves if "experts" in logical))


def active_parameters(layout) -> float:
    """Parameters one token uses: all of a dense model's; a mixture of experts counts top_k of its `experts`
    experts (the MFU convention: model FLOPs of the routed tokens, not of the padded slots)."""
    total = float(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(layout.abstract_params)))
    config = layout.config
    if not hasattr(config, "experts"):
        return total
    experts = expert_parameter_elements(layout)
    return total - experts + experts * config.top_k / config.experts
