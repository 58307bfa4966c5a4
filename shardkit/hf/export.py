"""Leaving shardkit: a run's parameters, unsharded, as plain numpy files with their logical names.

`shardkit export RUN_DIR --to DIR` writes

    DIR/index.json                 {"format", "step", "model", "config", "precision", "params": {path: entry}}
    DIR/params/<path>.npy          one array per parameter, e.g. params/layers/attn/wq.npy

where each entry is `{"file", "shape", "dtype", "saved_dtype", "logical"}` and `logical` lists the parameter's logical
axis names (`["layers", "embed", "heads", "head_dim"]`). Reading it back needs numpy only:

    index = json.load(open("DIR/index.json"))
    wq = np.load("DIR/" + index["params"]["layers/attn/wq"]["file"])

numpy `.npy` rather than safetensors: no new dependency, memory-mappable (`np.load(..., mmap_mode="r")`), readable
everywhere. numpy has no bfloat16, so bf16 parameters are written as float32 (exact: every bf16 value is a float32
value) and `saved_dtype` says what they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from shardkit.errors import ShardkitError
from shardkit.layout import abstract_model, path_str
from shardkit.recipe import RulesSection, recipe_from_tables
from shardkit.registry import config_json, load_model_class, model_config
from shardkit.run.checkpoint import Checkpointer

EXPORT_FORMAT = "shardkit-export/1"
NUMPY_NATIVE = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"}


def export_run(run_dir: str | Path, to_dir: str | Path, step: int | None = None) -> dict[str, Any]:
    """Write the parameters of `run_dir`'s checkpoint at `step` (default: latest) under `to_dir`; returns the index.

    Raises:
        ShardkitError: no checkpoint there, no such step, or `to_dir` already holds files.
    """
    to_dir = Path(to_dir)
    partial = new_output_dir(to_dir)  # renamed into place once complete
    step, meta, params = load_run_params(Path(run_dir), step)
    cls = load_model_class(meta["model"])
    _, _, logical = abstract_model(cls, saved_config(cls, meta), run_rules(meta))
    entries = {}
    flat_logical = dict(jax.tree_util.tree_flatten_with_path(logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    for key_path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = path_str(key_path)
        entries[path] = _write_array(partial, path, np.asarray(array), flat_logical[key_path])
    index = {
        "format": EXPORT_FORMAT, "step": step, "model": meta["model"], "config": meta["config"],
        "precision": meta["precision"], "params": entries,
    }
    (partial / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    if to_dir.exists():
        to_dir.rmdir()  # empty, checked above
    partial.rename(to_dir)
    return index


def new_output_dir(to_dir: Path) -> Path:
    """Refuse a non-empty `to_dir`; returns the `.partial` sibling to write into (renamed to `to_dir` when done)."""
    if to_dir.exists() and any(to_dir.iterdir()):
        raise ShardkitError("--to", f"{to_dir} exists and is not empty; give a new directory")
    partial = to_dir.with_name(to_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    return partial


def load_run_params(run_dir: Path, step: int | None = None) -> tuple[int, dict[str, Any], dict]:
    """(step, meta, parameters as host numpy arrays) of a run's checkpoint at `step` (default: the latest).

    Under bf16-params the optimizer's fp32 master copy is the model (the bf16 copy is only its rounding), so that is
    what is returned.

    Raises:
        ShardkitError: no checkpoints in `run_dir`, or no checkpoint at `step`.
    """
    checkpointer = _open_checkpoints(Path(run_dir))
    try:
        step = _pick_step(checkpointer, step, run_dir)
        meta = checkpointer.read_meta(step)
        cls = load_model_class(meta["model"])
        _, abstract_params, _ = abstract_model(cls, saved_config(cls, meta), run_rules(meta))
        key = "master" if meta.get("state_kind", {}).get("master") else "params"
        return step, meta, checkpointer.restore_params_to_host(step, abstract_params, key)
    finally:
        checkpointer.close()


def run_rules(meta: Mapping[str, Any]) -> RulesSection:
    """The `[rules]` a run trained with (its path rules name the parameters the model's own names do not)."""
    recipe = meta.get("recipe", {})
    return recipe_from_tables(recipe.get("tables", {}), recipe.get("name", "recipe")).rules


def saved_config(cls: type, meta: Mapping[str, Any]) -> Any:
    """The model config a checkpoint was trained with: rebuilt from the run's recipe (preset and overrides) where that
    saves as the checkpoint's config (any field types: enums, dtypes, tuples, nested dataclasses); else read back from
    the metadata where every field is a plain number, string or boolean.

    Raises:
        ShardkitError: neither gives the config the checkpoint was trained with (the model's preset changed since).
    """
    saved = meta["config"]
    recipe = meta.get("recipe", {})
    section = recipe_from_tables(recipe.get("tables", {}), recipe.get("name", "recipe")).model
    try:
        config = model_config(cls, section)
    except ShardkitError:
        config = None
    if config is not None and config_json(config) == saved:
        return config
    if all(value is None or isinstance(value, (bool, int, float, str)) for value in saved.values()):
        return cls.Config(**saved)
    changed = [] if config is None else sorted(key for key, value in config_json(config).items()
                                               if saved.get(key) != value)
    raise ShardkitError("model", f"{meta['model']}'s preset {section.preset!r} no longer builds the config the "
                                 f"checkpoint was trained with (fields {changed} differ); restore the model's preset "
                                 "as it was")


def load_export(directory: str | Path, mmap: bool = False) -> dict[str, np.ndarray]:
    """`{parameter path: array}` of an export directory (numpy only; `mmap` maps the files instead of reading them)."""
    directory = Path(directory)
    index = json.loads((directory / "index.json").read_text())
    return {
        path: np.load(directory / entry["file"], mmap_mode="r" if mmap else None)
        for path, entry in index["params"].items()
    }


def _open_checkpoints(run_dir: Path) -> Checkpointer:
    directory = run_dir / "checkpoints"
    if not directory.is_dir():
        raise ShardkitError("RUN_DIR", f"{run_dir} has no checkpoints/; pass the --out directory of `shardkit train`")
    return Checkpointer(directory, read_only=True)


def _pick_step(checkpointer: Checkpointer, step: int | None, run_dir) -> int:
    steps = checkpointer.all_steps()
    if not steps:
        raise ShardkitError("RUN_DIR", f"{run_dir}/checkpoints holds no complete checkpoint")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ShardkitError("--step", f"no checkpoint at step {step} in {run_dir}; valid steps are {steps}")
    return step


def _write_array(root: Path, path: str, array: np.ndarray, logical: tuple) -> Mapping[str, Any]:
    saved_dtype = array.dtype.name
    if saved_dtype not in NUMPY_NATIVE:
        array = array.astype(np.float32)  # bfloat16 and friends: exact in float32, and plain numpy can read it
    *folders, name = path.split("/")
    file = Path("params", *folders, name + ".npy")
    (root / file).parent.mkdir(parents=True, exist_ok=True)
    np.save(root / file, array, allow_pickle=False)
    return {
        "file": file.as_posix(), "shape": list(array.shape), "dtype": array.dtype.name, "saved_dtype": saved_dtype,
        "logical": list(logical),
    }
