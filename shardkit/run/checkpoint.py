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

A checkpoint that cannot be read (truncated array files, a missing `manifest.ocdbt`, `meta/metadata` that is not
JSON) is skipped for the newest readable one, with one warning line. It is then renamed `N.unreadable` beside the
others, kept for inspection but out of orbax's step listing: orbax silently skips saving any step at or below the
newest step it lists, so leaving it as `N/` would quietly drop the resumed run's saves up to N.

A save that fails (a full disk) raises `SaveFailed` naming the step; orbax renames a step into place only once it has
committed, so the previous checkpoint is still the newest complete one.

Restores take the *target* layout's shardings, so a checkpoint written under one recipe (or device count) resumes
under another with the same model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from shardkit.errors import ShardkitError
from shardkit.precision import PRESETS, Policy, parse_policy
from shardkit.recipe import DataSection, ModelSection
from shardkit.registry import config_json

META_FORMAT = 1
UNREADABLE_SUFFIX = ".unreadable"


class SaveFailed(ShardkitError):
    """A checkpoint could not be written (disk full, quota, permissions). The previous checkpoint is kept."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """The newest readable checkpoint: its step, meta and state, and the newer ones skipped as unreadable, each as
    (step, why, where it was moved)."""

    step: int
    meta: dict[str, Any]
    state: Mapping
    skipped: tuple[tuple[int, str, Path], ...]


class Checkpointer:
    """Saves and restores training state under `directory`, keeping the newest `keep` checkpoints; with `read_only`
    it only reads (nothing is created, cleaned up or deleted)."""

    def __init__(self, directory: Path, keep: int = 1, read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.saving: int | None = None  # the step of the save last started
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=None if read_only else keep,
                save_interval_steps=0 if read_only else 1,
                enable_async_checkpointing=True,
                create=not read_only,
                # Not orbax's own read_only: it only adds a "Given directory is read only" warning on every open (and
                # skips saves and deletes, which a reading Checkpointer never asks for).
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

        Raises:
            SaveFailed: this save, or the previous one still committing, could not be written.
        """
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta)))
        self.wait()  # orbax waits for the previous save here anyway; a failure of its commit is reported as its own
        self.saving = step
        with self._save_errors():
            self.manager.save(step, args=args)

    def wait(self) -> None:
        """Block until every started save has committed.

        Raises:
            SaveFailed: a save could not be written.
        """
        with self._save_errors():
            self.manager.wait_until_finished()

    @contextlib.contextmanager
    def _save_errors(self):
        """Any failure inside orbax's save path (an OSError, or orbax's own wrapping of it) as one `SaveFailed`."""
        try:
            yield
        except Exception as err:  # orbax re-raises a background commit's error as various types
            self.manager.reload()  # orbax forgets its steps after a failed commit; list them again from disk
            # The failed save leaves orbax's pending array writes as coroutines never awaited; Python reports each
            # when it collects them at exit, after the one error line (`sys:1: RuntimeWarning: coroutine
            # 'async_serialize_from_host.<locals>.write_fragment' was never awaited`). They are this failure's.
            warnings.filterwarnings("ignore", r"coroutine '.*' was never awaited", RuntimeWarning)
            kept = self.manager.latest_step()
            raise SaveFailed(
                "checkpoint",
                f"writing the checkpoint of step {self.saving} under {self.directory} failed ({_one_line(err)}); "
                f"the newest complete checkpoint is {'step ' + str(kept) if kept is not None else 'none'}. Free disk "
                "space and rerun the same command to resume from it",
            ) from None

    def restore_newest_readable(self, abstract_state: Mapping, check_meta) -> Restored | None:
        """The newest checkpoint whose meta and state both read back, or None when there is no checkpoint at all.

        Each candidate is tried for real (a full restore), newest first: cheaper checks such as file sizes would miss
        corruption that only the reader sees. Unreadable newer ones are renamed `N.unreadable` (see the module note).

        Args:
            abstract_state: the target layout's abstract state (shapes, dtypes, shardings).
            check_meta: called with each readable checkpoint's step and meta; raises a ShardkitError when this run
                may not resume it.

        Raises:
            ShardkitError: there are checkpoints but none is readable (naming the directory), or `check_meta`'s.
        """
        skipped = []
        for step in reversed(self.all_steps()):
            meta, state, why = self._try_restore(step, abstract_state, check_meta)
            if why is None:
                moved = self._set_aside([step for step, _ in skipped])
                return Restored(step, meta, state, tuple((s, why, moved[s]) for s, why in skipped))
            skipped.append((step, why))
        if skipped:
            reasons = "; ".join(f"step {step}: {why}" for step, why in skipped)
            raise ShardkitError(
                "--out", f"no readable checkpoint in {self.directory} ({reasons}); use a fresh --out, or move the "
                "broken checkpoints out of that directory to start over there",
            )
        return None

    def _try_restore(self, step: int, abstract_state: Mapping, check_meta):
        """(meta, state, None) when `step` reads back in every process, else (None, None, why it did not)."""
        meta, why = self._try(lambda: self.read_meta(step), "meta/metadata is not readable JSON")
        if why is None and not isinstance(meta, dict):
            why = "meta/metadata is not a JSON object"
        if not _all_agree(why is None):
            return None, None, why or "another process could not read its meta"
        check_meta(step, meta)  # a readable checkpoint of another model is refused, not skipped
        state, why = self._try(lambda: self.restore(step, abstract_state), "its state cannot be read")
        if why is not None:
            with _leftovers_dropped():
                gc.collect()  # the failed restore's abandoned reads that nothing holds any more, finalized now, quietly
        if not _all_agree(why is None):
            return None, None, why or "another process could not read its state"
        return meta, state, None

    @staticmethod
    def _try(read, failure: str) -> tuple[Any, str | None]:
        """(what `read` returned, None), or (None, `failure` with the error) when it raised anything."""
        try:
            return read(), None
        except Exception as err:  # orbax and tensorstore raise many types for one unreadable file
            return None, f"{failure} ({_one_line(err)})"

    def _set_aside(self, steps: list[int]) -> dict[int, Path]:
        """Rename unreadable step directories out of orbax's listing, keeping them on disk; {step: new path}."""
        if not steps:
            return {}
        moved = {step: _free_name(self.directory / f"{step}{UNREADABLE_SUFFIX}") for step in steps}
        if jax.process_index() == 0:
            for step, target in moved.items():
                (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("shardkit:set-aside-unreadable")
        self.manager.reload()
        return moved

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
        """Wait for the saves in flight, then let orbax go (also when a save failed: `SaveFailed` is raised after)."""
        try:
            self.wait()
        finally:
            self.manager.close()


def _free_name(path: Path) -> Path:
    candidate, count = path, 0
    while candidate.exists():
        count += 1
        candidate = path.with_name(f"{path.name}.{count}")
    return candidate


def _all_agree(ok: bool) -> bool:
    """True when `ok` holds in every process (a checkpoint only some processes can read is unreadable)."""
    if jax.process_count() == 1:
        return ok
    return bool(multihost_utils.process_allgather(np.int32(ok)).min())


def _one_line(err: BaseException, limit: int = 200) -> str:
    """The error in one short line. Tensorstore's messages nest every layer's context ("CODE: Error opening ...:
    Error reading ...: <the cause> [tensorstore_spec=...]"); the code and the innermost cause are what a user needs."""
    text = " ".join(str(err).split())
    status = re.match(r"([A-Z_]+): ", text)
    if status:
        cause = re.split(r" \[(?:tensorstore_spec|os_error_code)", text)[0].rsplit(": ", 1)[-1]
        text = f"{status.group(1)}: {cause}"
    else:
        text = f"{type(err).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class _OrbaxErrorLogs(logging.Filter):
    """Orbax logs a failed background save as several ERROR records with tracebacks (through absl, and through asyncio
    as "Task/Future exception was never retrieved" when its write tasks are collected); `SaveFailed` reports the failure
    as one line, so ERROR records from orbax's code or carrying an exception raised in it are dropped. Orbax's INFO and
    WARNING records, and every other library's errors, pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        return not (_in_orbax(record.pathname) or _raised_in_orbax(record.exc_info) or _never_retrieved(record))


def _never_retrieved(record: logging.LogRecord) -> bool:
    """asyncio's "Future/Task exception was never retrieved": a failed write's future that orbax dropped. Its exception
    was set, never raised, so no traceback leads through orbax; shardkit is asyncio's only user through orbax's
    saves, and reports a failed save itself."""
    return record.name == "asyncio" and "exception was never retrieved" in record.getMessage()


def _in_orbax(filename: str) -> bool:
    return f"{os.sep}orbax{os.sep}" in filename


def _raised_in_orbax(exc_info) -> bool:
    traceback = exc_info[2] if exc_info else None
    while traceback is not None:
        if _in_orbax(traceback.tb_frame.f_code.co_filename):
            return True
        traceback = traceback.tb_next
    return False


def quiet_orbax_reports() -> None:
    """Leave orbax's and tensorstore's own reports of what shardkit already reports in one line to shardkit: save
    errors, closed-event-loop tracebacks after a failed restore. Process-wide (logging filters and the unraisable
    hook), so only the command line calls it, once; a library user keeps their own logging."""
    _leave_save_errors_to_shardkit()
    _quiet_closed_event_loop_reports()


def _leave_save_errors_to_shardkit() -> None:
    for name in ("absl", "asyncio"):  # orbax logs through absl; its asyncio tasks' unretrieved errors through asyncio
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _OrbaxErrorLogs) for existing in logger.filters):
            logger.addFilter(_OrbaxErrorLogs())


def _quiet_closed_event_loop_reports() -> None:
    """When a restore fails, orbax's reads still in flight outlive it: tensorstore's report to orbax's already closed
    asyncio loop, and Python prints each report as an unraisable "Event loop is closed" traceback; and each abandoned
    read coroutine (`_read_array_index_and_device_put`), finalized whenever its task is let go (often steps later),
    turns the close into "Exception: Encountered error while reading array index" ("Exception ignored in: <coroutine
    ...>"). Those (and only those: `_abandoned_read_report`) are dropped; anything else still reaches the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "shardkit_quiet", False):
        return

    def hook(unraisable):
        if not _abandoned_read_report(unraisable):
            previous(unraisable)

    hook.shardkit_quiet = True
    sys.unraisablehook = hook


def _abandoned_read_report(unraisable) -> bool:
    """Whether an unraisable report is one of a failed restore's leftovers (see `_quiet_closed_event_loop_reports`)."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
        return True
    code = getattr(unraisable.object, "cr_code", None)  # a coroutine finalized with an error
    return code is not None and _in_orbax(code.co_filename)


@contextlib.contextmanager
def _leftovers_dropped():
    """Within: unraisable reports of a failed restore's leftovers dropped (`_abandoned_read_report`), whatever hook
    is installed, so that collecting them (`gc.collect` after a failed restore) prints nothing."""
    previous = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None if _abandoned_read_report(unraisable) else previous(unraisable)
    try:
        yield
    finally:
        sys.unraisablehook = previous


def state_kind(policy: Policy) -> dict[str, Any]:
    """What a precision policy puts in the train state: parameter dtype, fp32 master copy, loss-scale counters.

    Two policies with the same kind have checkpoints of identical structure and dtypes (e.g. `float32` and `bf16`,
    which differ only in the compute dtype), so either can resume the other's checkpoint.
    """
    kind = {
        "params": np.dtype(policy.param_dtype).name,
        "master": policy.master_weights,
        "loss_scale": policy.loss_scaling,
    }
    if policy.fp8:  # only then, so the kinds of checkpoints written before fp8 existed still match
        kind["fp8"] = True
    return kind


def model_meta(recipe, config) -> dict[str, Any]:
    """What must match for a checkpoint to be resumed, and what `export` needs to read it without the recipe file."""
    return {
        "format": META_FORMAT,
        "model": recipe.model.name,
        "config": config_json(config),
        "precision": recipe.precision.policy,
        "state_kind": state_kind(recipe.precision.parsed),
        "seed": recipe.train.seed,
        "data": _json_round_trip(dataclasses.asdict(recipe.data)),
        "recipe": {"name": recipe.name, "tables": _json_round_trip(_plain(recipe.raw))},
    }


def check_compatible(saved: Mapping[str, Any], current: Mapping[str, Any], directory: Path, step: int) -> str | None:
    """Raise a `ShardkitError` when `current` may not resume the `saved` checkpoint at `step`, naming every key of
    the model (or of the data) that differs. The layout (mesh, rules, precision of the same state kind) may change.

    A checkpoint at step 0 (an import, `shardkit import-hf`) has seen no data, so any data may continue it.
    Returns a one-line note when the resume is allowed but changes something (another compatible precision policy).
    """
    _check_model(saved, current, directory)
    if step > 0:
        _check_data(saved, current, directory)
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
    saved_preset, current_preset = _preset(saved), _preset(current)
    _refuse_differences("model", saved.get("config", {}), current["config"], directory,
                        preset=saved_preset if saved_preset != current_preset else None)


def _preset(meta: Mapping[str, Any]) -> str:
    """The model preset a checkpoint's (or a recipe's) metadata was written with."""
    return meta.get("recipe", {}).get("tables", {}).get("model", {}).get("preset", ModelSection.preset)


def _check_data(saved: Mapping[str, Any], current: Mapping[str, Any], directory: Path) -> None:
    _refuse_differences("data", _saved_data(saved), current["data"], directory)


def _saved_data(saved: Mapping[str, Any]) -> Mapping[str, Any]:
    """The checkpoint's [data] table; checkpoints from before it was kept have it in their recipe tables."""
    if "data" in saved:
        return saved["data"]
    table = saved.get("recipe", {}).get("tables", {}).get("data", {})
    try:
        return dataclasses.asdict(DataSection(**table))
    except (TypeError, ShardkitError):
        return table


_ABSENT = object()


def _refuse_differences(section: str, saved: Mapping[str, Any], current: Mapping[str, Any], directory: Path,
                        preset: str | None = None) -> None:
    """One error naming every `section.key` whose value differs, each value in readable form, and what would resume:
    the checkpoint's preset where it differs from the recipe's, `--set` flags for the values a `--set` can give
    (numbers, strings, booleans), a value the checkpoint left unset (None) as to be left unset, and for the rest (enums,
    dtypes, tuples, nested dataclasses, a value the checkpoint lacks) that a `--set` cannot give them."""
    keys = [key for key in sorted(set(saved) | set(current)) if saved.get(key, _ABSENT) != current.get(key, _ABSENT)]
    if not keys:
        return
    differences = ", ".join(
        f"{section}.{key}={_readable(saved.get(key, _ABSENT))} (this recipe: {_readable(current.get(key, _ABSENT))})"
        for key in keys
    )
    flags = [f"--set model.preset={json.dumps(preset)}"] if preset is not None else []
    flags += [f"--set {section}.{key}={json.dumps(saved[key])}" for key in keys if _settable(saved.get(key, _ABSENT))]
    values = {key: saved.get(key, _ABSENT) for key in keys}
    unset = [f"{section}.{key}" for key in keys if values[key] is None]
    fixed = [f"{section}.{key}" for key in keys if values[key] is not None and not _settable(values[key])]
    ways = [" ".join(flags)] if flags else []
    if unset:
        ways.append(f"{', '.join(unset)} unset (as in the checkpoint)")
    if fixed and preset is None:
        what = "the model's config" if section == "model" else "the recipe"
        ways.append(f"{what} the checkpoint was trained with ({', '.join(fixed)} cannot be given with --set)")
    raise ShardkitError(
        f"{section}.{keys[0]}" if len(keys) == 1 else section,
        f"checkpoint in {directory} was trained with {differences}; resume with {' and '.join(ways)} or use a "
        "fresh --out",
    )


def _settable(value: Any) -> bool:
    """Whether `--set section.key=VALUE` can give this saved value: a number, a string or a boolean."""
    return isinstance(value, (bool, int, float, str))


def _readable(value: Any) -> str:
    """A saved config value (`config_json`'s tagged JSON) as a reader writes it: `AttentionType.GLOBAL`, `bfloat16`,
    `P('fsdp', None)`, tuples in parentheses, nested dataclasses as `(field=value, ...)`."""
    if value is _ABSENT:
        return "(absent)"
    if isinstance(value, list):
        return "(" + ", ".join(_readable(item) for item in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, dict):
        if len(value) == 1 and next(iter(value)) in ("enum", "dtype", "callable", "repr"):
            tag, text = next(iter(value.items()))
            return text.rpartition(":")[2] if tag == "enum" else text
        if list(value) == ["PartitionSpec"] and isinstance(value["PartitionSpec"], list):
            return "P(" + ", ".join(_readable(entry) for entry in value["PartitionSpec"]) + ")"
        return "(" + ", ".join(f"{key}={_readable(item)}" for key, item in value.items()) + ")"
    return repr(value)


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
    parts.append("FP8 scaling state" if kind.get("fp8") else "no FP8 scaling state")
    return ", ".join(parts)


def _plain(value: Any) -> Any:
    """Mappings (the recipe keeps read-only ones) as dicts, all the way down."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _json_round_trip(value: Any) -> Any:
    """The value as it will read back from JSON (tuples become lists), so saved and current compare equal."""
    return json.loads(json.dumps(value))
