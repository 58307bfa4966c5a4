"""The optimizer: AdamW with linear warmup and cosine decay, clipped by global norm, and its defaults per model.

Defaults come from the model preset (`optimizer_settings`): a preset with published training settings carries them
(the model class's optional `OPTIMIZER_PRESETS`, preset name -> settings, e.g. Llama 3 8B's peak rate 3e-4); any
other preset gets `BASE_SETTINGS` with its peak rate set by the width rule (`width_rule_lr`). Whatever the recipe's
`[optimizer]` or `--set optimizer.KEY=...` gives wins over both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import optax

from shardkit.recipe import OptimizerSection, Recipe

# The settings every recipe trained with before presets carried their own, tuned on the tiny presets (width 64):
# they reach the synthetic data's floor in a few dozen steps. A preset without published settings starts from these.
BASE_SETTINGS = {"lr": 3e-3, "warmup": 5, "min_lr_ratio": 0.1, "weight_decay": 0.1, "b1": 0.9, "b2": 0.95, "eps": 1e-8,
                 "clip": 1.0}
# The width rule's constant: peak lr = WIDTH_RULE_LR / embed, capped at BASE_SETTINGS' rate.
WIDTH_RULE_LR = 0.5


def width_rule_lr(embed: int) -> float:
    """The peak learning rate of a model `embed` wide without published settings: 0.5 / embed, at most 3e-3.

    Adam's update moves every weight by about lr, so a hidden matrix's output moves by about lr x its fan-in: keeping
    that change the same as the model widens means lr proportional to 1 / width (the muP rule for Adam's hidden
    weights, Yang et al. 2022, "Tensor Programs V"). The constant is fitted to the GPT-3 table (Brown et al. 2020,
    Table 2.1: 6e-4 at width 768, 2e-4 at 2048, 1.2e-4 at 4096, 0.6e-4 at 12288), which falls about as 1 / width;
    0.5 / embed lies within a factor 1.7 of each of its rows. The cap keeps the tiny presets (width 64) at the rate
    they were tuned at.
    """
    return min(BASE_SETTINGS["lr"], WIDTH_RULE_LR / embed)


def preset_settings(model_cls: type, preset: str, config: Any) -> dict[str, Any]:
    """The optimizer defaults of a model preset: its published settings over `BASE_SETTINGS` when the class carries
    them (`OPTIMIZER_PRESETS[preset]`), else `BASE_SETTINGS` with the width rule's rate (when the config has
    `embed`)."""
    published = getattr(model_cls, "OPTIMIZER_PRESETS", {}).get(preset)
    if published is not None:
        return {**BASE_SETTINGS, **published}
    width = getattr(config, "embed", None)
    return {**BASE_SETTINGS, "lr": width_rule_lr(width)} if isinstance(width, int) else dict(BASE_SETTINGS)


def optimizer_settings(recipe: Recipe, model_class: type, config: Any) -> OptimizerSection:
    """The recipe's optimizer with every field set: what `[optimizer]` gives, the model preset's defaults for the
    rest. `model_class` and `config` are the recipe's model as resolved once (`Layout.model_class`,
    `Layout.config`)."""
    defaults = preset_settings(model_class, recipe.model.preset, config)
    return OptimizerSection(**{**defaults, **recipe.optimizer.given()})


def with_optimizer_settings(recipe: Recipe, model_class: type, config: Any) -> Recipe:
    """`recipe` with its optimizer resolved (`optimizer_settings`): what `shardkit show` and a run's recipe.toml
    print, so that the written file reruns with the same settings whatever the defaults become."""
    return dataclasses.replace(recipe, optimizer=optimizer_settings(recipe, model_class, config))


def learning_rate_schedule(section: OptimizerSection, steps: int) -> optax.Schedule:
    """`section` resolved (`optimizer_settings`). Linear warmup to `lr`, then cosine decay to `lr * min_lr_ratio` at
    the last step.

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
    """AdamW with the schedule above, after clipping by global norm; no decay on norm scales (see `decay_mask`).
    `section` is resolved (`optimizer_settings`)."""
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
