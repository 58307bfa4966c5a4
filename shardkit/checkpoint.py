"""Checkpoints with orbax: asynchronous saves of the whole state, with the recipe and model configuration beside it.

A checkpoint at step N is `checkpoints/N/` holding two items: `state` (the train state dict: step, params, opt_state,
and master / loss_scale when the policy keeps them) and `meta` (JSON: model name and configuration, precision policy,
the kind of state it implies, seed, and the recipe's tables).

Why a run killed at any moment resumes exactly:
- Orbax writes each step into `N.orbax-checkpoint-tmp-<time>/` and renames it to `N/` only once every item has
  committed, and its step listing skips temporary directories; a run killed mid-save therefore leaves nothing that
  `latest_step` would pick up, and the leftover is removed when the next run opens the directory.
- Old checkpoints are deleted only after the new one has committed, so a kill never leaves zero checkpoints.
- The RNG is part of the state without being an array in it: every random stream (the data batch at step s today,
  dropout keys later) is a pure function of (seed, step). The step is in `state`, the seed in `meta`, and a resume with
  another seed is refused, so the restored (seed, step) pair is the whole RNG state.

Restores take the *target* layout's shardings, so a checkpoint written under one recipe (or device count) resumes
under another with the same model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from shardkit.errors import ShardkitError
from shardkit.precision import PRESETS, Policy, parse_policy

META_FORMAT = 1


class Checkpointer:
    """Saves and restores training state under `directory`, keeping the newest `keep` checkpoints."""

    def __init__(self, directory: Path, keep: int = 1, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep,
                save_interval_steps=0 if read_only else 1,
                enable_async_checkpointing=True,
                create=not read_only,
                read_only=read_only,
                # Leftovers of a save that a kill -9 interrupted: never listed as steps, removed here.
                cleanup_tmp_directories=not read_only,
            ),
        )

    def latest_step(self) -> int | None:
        """The newest *complete* checkpoint's step (partly written ones are never listed)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Mapping, meta: Mapping[str, Any]) -> None:
        """Start an asynchronous save of `state` at `step`; returns once the device arrays are copied to host.

        The copy to host happens before this returns, so the caller may donate `state` to the next step right away.
        """
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

    def restore_params_to_host(self, step: int, abstract_params: Mapping, key: str = "params") -> dict:
        """Only the parameters at `step` (or the fp32 `master` copy), gathered whole into numpy arrays on this host."""
        dtype = np.float32 if key == "master" else None
        item = {key: jax.tree.map(lambda leaf: np.empty((), dtype or leaf.dtype), abstract_params)}
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
        return self.manager.restore(step, args=ocp.args.Composite(state=args))["state"][key]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def state_kind(policy: Policy) -> dict[str, Any]:
    """What a precision policy puts in the train state: parameter dtype, fp32 master copy, loss-scale counters.

    Two policies with the same kind have checkpoints of identical structure and dtypes (e.g. `float32` and `bf16`,
    which differ only in the compute dtype), so either can resume the other's checkpoint.
    """
    return {
        "params": np.dtype(policy.param_dtype).name,
        "master": policy.master_weights,
        "loss_scale": policy.loss_scaling,
    }


def model_meta(recipe, config) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed, and what `export` needs to read it without the recipe file."""
    return {
        "format": META_FORMAT,
        "model": recipe.model.name,
        "config": _json_round_trip(dataclasses.asdict(config)),
        "precision": recipe.precision.policy,
        "state_kind": state_kind(parse_policy(recipe.precision.policy)),
        "seed": recipe.train.seed,
        "recipe": {"name": recipe.name, "tables": _json_round_trip(_plain(recipe.raw))},
    }


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], directory: Path) -> str | None:
    """Raise a `ShardkitError` naming the first field that keeps `current` from resuming the `saved` checkpoint.

    Returns a one-line note when the resume is allowed but changes something (another compatible precision policy).
    """
    _check_model(saved, current, directory)
    if saved.get("seed") != current["seed"]:
        raise ShardkitError(
            "train.seed",
            f"checkpoint in {directory} was trained with seed {saved.get('seed')}, not {current['seed']}: the seed "
            f"fixes every batch and random stream, so resume with --set train.seed={saved.get('seed')} or use a "
            "fresh --out",
        )
    return _check_precision(saved, current, directory)


def _check_model(saved: Mapping[str, Any], current: Mapping[str, Any], directory: Path) -> None:
    if saved.get("model") != current["model"]:
        raise ShardkitError(
            "model.name", f"checkpoint in {directory} is of model {saved.get('model')!r}, not {current['model']!r}"
        )
    saved_config = saved.get("config", {})
    for key in sorted(set(saved_config) | set(current["config"])):
        mine, theirs = current["config"].get(key), saved_config.get(key)
        if mine != theirs:
            raise ShardkitError(
                f"model.{key}",
                f"checkpoint in {directory} has {key}={theirs!r} but this recipe has {key}={mine!r}; "
                f"use --set model.{key}={json.dumps(theirs)} or a fresh --out",
            )


def _check_precision(saved: Mapping[str, Any], current: Mapping[str, Any], directory: Path) -> str | None:
    saved_policy = saved.get("precision")
    saved_kind = saved.get("state_kind") or state_kind(parse_policy(saved_policy))
    if saved_kind != current["state_kind"]:
        valid = sorted(name for name, policy in PRESETS.items() if state_kind(policy) == saved_kind)
        raise ShardkitError(
            "precision.policy",
            f"checkpoint in {directory} holds a {saved_policy!r} state ({_describe(saved_kind)}) but "
            f"{current['precision']!r} trains another ({_describe(current['state_kind'])}); policies that can resume "
            f"it: {valid or [saved_policy]}, or use a fresh --out",
        )
    if saved_policy != current["precision"]:
        return f"resuming a {saved_policy!r} checkpoint with precision {current['precision']!r} (same state layout)"
    return None


def _describe(kind: Mapping[str, Any]) -> str:
    parts = [f"{kind['params']} parameters"]
    parts.append("an fp32 master copy" if kind["master"] else "no master copy")
    parts.append("a loss scale" if kind["loss_scale"] else "no loss scale")
    return ", ".join(parts)


def _plain(value: Any) -> Any:
    """Mappings (the recipe keeps read-only ones) as dicts, all the way down."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _json_round_trip(value: Any) -> Any:
    """The value as it will read back from JSON (tuples become lists), so saved and current compare equal."""
    return json.loads(json.dumps(value))
