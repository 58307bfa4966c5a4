"""The optimizer: AdamW with linear warmup and cosine decay, clipped by global norm."""

from __future__ import annotations

from typing import Mapping

import jax
import optax

from shardkit.recipe import OptimizerSection


def learning_rate_schedule(section: OptimizerSection, steps: int) -> optax.Schedule:
    """Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at the last step.

    The warmup starts at lr / (warmup + 1) rather than 0 (torchtitan's convention), so the first step trains.
    """
    warmup = min(section.warmup, max(steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=section.lr / (warmup + 1), peak_value=section.lr, warmup_steps=warmup,
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


def schedule_count(opt_state) -> jax.Array:
    """How many updates the optimizer has applied (skipped fp16 steps do not count): the schedule's position."""
    counts = optax.tree.get_all_with_path(opt_state, "count")
    for path, count in counts:
        if any(getattr(key, "tuple_name", None) == "ScaleByScheduleState" for key in path):
            return count
    raise ValueError("the optimizer has no learning-rate schedule state")
