"""The optimizer: AdamW with linear warmup and cosine decay, clipped by global norm."""

from __future__ import annotations

from typing import Mapping

import jax
import optax

from shardkit.recipe import OptimizerSection


def learning_rate_schedule(section: OptimizerSection, steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step."""
    warmup = min(section.warmup, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=section.lr, warmup_steps=warmup,
        decay_steps=max(steps, warmup + 1), end_value=section.lr * section.min_lr_ratio,
    )


def decay_mask(logical: Mapping) -> Mapping:
    """Weight decay on matrices only: a parameter with two or more logical axes besides `layers`."""
    return jax.tree.map(
        lambda axes: sum(name != "layers" for name in axes) >= 2, logical, is_leaf=lambda x: isinstance(x, tuple)
    )


def make_optimizer(section: OptimizerSection, steps: int, logical: Mapping) -> optax.GradientTransformation:
    """AdamW with the schedule above, after clipping by global norm; no decay on norm scales (see `decay_mask`)."""
    return optax.chain(
        optax.clip_by_global_norm(section.clip),
        optax.adamw(
            learning_rate_schedule(section, steps), b1=section.b1, b2=section.b2, eps=section.eps,
            weight_decay=section.weight_decay, mask=decay_mask(logical),
        ),
    )
