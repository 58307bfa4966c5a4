"""Checkpoints with orbax: asynchronous saves of the whole state, with the recipe and model configuration beside it.

Orbax writes each step into a temporary directory and renames it only once complete, so a run killed mid-save leaves
no checkpoint that `latest_step` would pick up. Restores take the *target* layout's shardings, so a checkpoint written
under one recipe (or device count) resumes under another with the same model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping

import orbax.checkpoint as ocp

from shardkit.errors import ShardkitError


class Checkpointer:
    """Saves and restores training state under `directory`, keeping the newest `keep` checkpoints."""

    def __init__(self, directory: Path, keep: int):
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Mapping, meta: Mapping[str, Any]) -> None:
        """Start an asynchronous save of `state` at `step`; returns once the device arrays are copied to host."""
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta)))
        )

    def wait(self) -> None:
        """Block until every started save has committed."""
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict[str, Any]:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, abstract_state: Mapping) -> Mapping:
        """The state at `step`, each leaf placed with the sharding in `abstract_state` (the target layout's)."""
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        return restored["state"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def model_meta(recipe, config) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed: model name, its full config, the precision policy."""
    return {
        "model": recipe.model.name,
        "config": dataclasses.asdict(config),
        "precision": recipe.precision.policy,
        "seed": recipe.train.seed,
    }


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], directory: Path) -> None:
    """A clear error naming the first differing model dimension (or model, or precision) between two runs."""
    if saved.get("model") != current["model"]:
        raise ShardkitError("model.name", f"checkpoint in {directory} is of model {saved.get('model')!r}, not {current['model']!r}")
    for key, value in current["config"].items():
        if saved["config"].get(key) != value:
            raise ShardkitError(
                f"model.{key}",
                f"checkpoint in {directory} has {key}={saved['config'].get(key)!r} but this recipe has {key}={value!r}; "
                "use a fresh --out or the same model",
            )
    if saved.get("precision") != current["precision"]:
        raise ShardkitError(
            "precision.policy",
            f"checkpoint in {directory} was trained with {saved.get('precision')!r}, not {current['precision']!r}",
        )
