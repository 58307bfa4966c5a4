"""`shardkit import-hf` and `shardkit export --format hf`: Hugging Face Llama checkpoints in and out of a run.

Import writes a run directory that `shardkit train` continues from (fine-tuning):

    RUN_DIR/checkpoints/0/     the state at step 0: the imported parameters and a fresh optimizer state
    RUN_DIR/recipe.toml        the recipe it was imported under, its [model] table set to the checkpoint's config
    RUN_DIR/hf_config.json     the original config.json, which export starts from (keeps ids and other fields)

Every process reads, for each of its devices, only the block of each parameter that device holds (a rectangle of
each memory-mapped tensor), and the parameters are born sharded: no process ever holds a whole checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from shardkit.errors import ShardkitError
from shardkit.hf.config import hf_config, llama_config_fields
from shardkit.hf.export import load_run_params, new_output_dir
from shardkit.hf.tensors import (
    CONFIG_FILE,
    IGNORED_SUFFIXES,
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsDir,
    TensorMap,
    hf_names,
    hf_shape,
    iter_tensors,
    read_block,
    read_hf_config,
    tensor_maps,
    to_hf_matrix,
    write_safetensors,
)
from shardkit.layout import build_layout
from shardkit.recipe import RUN_RECIPE, Recipe, recipe_from_tables, to_toml, toml_value
from shardkit.registry import load_model_class
from shardkit.run.checkpoint import Checkpointer, model_meta
from shardkit.step import build_step

ORIGINAL_CONFIG = "hf_config.json"
# Without --recipe the import lays the parameters out FSDP over every device (any layout can resume it).
DEFAULT_TABLES = {"mesh": {"fsdp": -1}}
DEFAULT_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size


@dataclasses.dataclass(frozen=True)
class Imported:
    """What `import_hf` wrote: the recipe it used (model table filled in) and the `--set` flags naming the model."""

    recipe: Recipe
    model_table: Mapping[str, Any]

    def model_flags(self) -> str:
        """`--set model.KEY=VALUE ...` that give any recipe this model (strings bare: --set reads them as strings)."""
        shown = lambda value: value if isinstance(value, str) else toml_value(value)
        return " ".join(f"--set model.{key}={shown(value)}" for key, value in self.model_table.items())


def import_hf(hf_dir: str | Path, out_dir: str | Path, recipe: Recipe | None = None) -> Imported:
    """Convert the Hugging Face Llama checkpoint in `hf_dir` into a step-0 checkpoint in the new run `out_dir`.

    Args:
        hf_dir: a `save_pretrained` directory: config.json and model.safetensors (or shards with their index).
        out_dir: the run directory to create (must hold no checkpoints yet).
        recipe: the layout to write it under (default: FSDP over every device); its model table is replaced.

    Raises:
        ShardkitError: a field or tensor shardkit's Llama cannot represent, missing files, or a used `out_dir`.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    original = read_hf_config(hf_dir)
    table = model_table(llama_config_fields(original))
    recipe = _with_model(recipe if recipe is not None else recipe_from_tables(DEFAULT_TABLES, "import"), table)
    if (out_dir / "checkpoints").exists():
        raise ShardkitError("--out", f"{out_dir} already holds checkpoints/; import into a new run directory")
    tensors = SafetensorsDir(hf_dir)
    layout = build_layout(recipe)
    maps = tensor_maps(layout.config.tie_embeddings)
    check_tensors(tensors, maps, layout.abstract_params, layout.config.layers)
    builder = build_step(layout)
    params = sharded_params(tensors, maps, layout, builder.state_shardings()["params"], builder.policy.param_dtype)
    state = builder.state_from_params(params)
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(out_dir / "checkpoints", recipe.checkpoint.keep)
    try:
        checkpointer.save(0, state, model_meta(recipe, layout.config))
    finally:
        checkpointer.close()
    if jax.process_index() == 0:
        (out_dir / ORIGINAL_CONFIG).write_text(json.dumps(original, indent=2) + "\n")
        (out_dir / RUN_RECIPE).write_text(to_toml(recipe.raw))
    return Imported(recipe, table)


def model_table(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe [model] table naming this configuration: a preset when one matches exactly (the real models have
    theirs), else `tiny` with every field that differs from it."""
    llama = load_model_class("llama")
    try:
        config = llama.Config(**fields)
    except ValueError as err:
        raise ShardkitError("config.json", str(err)) from None
    for name, preset in llama.PRESETS.items():
        if preset == config:
            return {"name": "llama", "preset": name}
    base = llama.PRESETS["tiny"]
    changed = {key: value for key, value in fields.items() if getattr(base, key) != value}
    return {"name": "llama", "preset": "tiny", **changed}


def _with_model(recipe: Recipe, table: Mapping[str, Any]) -> Recipe:
    tables = {key: dict(value) if isinstance(value, Mapping) else value for key, value in recipe.raw.items()}
    tables["model"] = dict(table)
    return recipe_from_tables(tables, recipe.name)


def check_tensors(tensors: SafetensorsDir, maps: list[TensorMap], abstract_params: Mapping, layers: int) -> None:
    """Every tensor the model needs is there with the right shape, and nothing is left that it would drop."""
    expected = {}
    for tensor_map in maps:
        shape = _lookup(abstract_params, tensor_map.path).shape
        for name in hf_names(tensor_map, layers):
            expected[name] = hf_shape(tensor_map, shape[1:] if tensor_map.stacked else shape)
    present = tensors.names()
    for name, shape in expected.items():
        if name not in present:
            raise ShardkitError(name, f"tensor missing from the checkpoint's safetensors files in {tensors.directory}")
        if tensors.shape(name) != shape:
            raise ShardkitError(name, f"has shape {list(tensors.shape(name))}, but config.json implies {list(shape)}")
    tied_head = {"lm_head.weight"} if not any(m.path == "head_DV" for m in maps) else set()  # tied: lm_head = embedding
    extra = sorted(present - set(expected) - tied_head)
    extra = [name for name in extra if not name.endswith(IGNORED_SUFFIXES)]
    if extra:
        raise ShardkitError(extra[0], "has no counterpart in shardkit's Llama (biases and extra modules are not "
                                      "supported)")


def sharded_params(tensors: SafetensorsDir, maps, layout, shardings: Mapping, dtype) -> dict:
    """The parameters as sharded arrays, each device's block read from the safetensors files by its own callback."""
    params: dict = {}
    layers = layout.config.layers
    for tensor_map in maps:
        shape = _lookup(layout.abstract_params, tensor_map.path).shape
        callback = _block_reader(tensors, tensor_map, shape, layers, np.dtype(dtype))
        array = jax.make_array_from_callback(shape, _lookup(shardings, tensor_map.path), callback)
        _assign(params, tensor_map.path, array)
    return params


def _block_reader(tensors: SafetensorsDir, tensor_map: TensorMap, shape, layers: int, dtype: np.dtype):
    def read(index: tuple[slice, ...]) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if not tensor_map.stacked:
            return read_block(tensors.tensor(tensor_map.name), tensor_map, shape, index).astype(dtype)
        blocks = [
            read_block(tensors.tensor(tensor_map.name.format(layer)), tensor_map, shape[1:], index[1:])
            for layer in range(*index[0].indices(layers))
        ]
        return np.stack(blocks).astype(dtype)

    return read


def export_hf(run_dir: str | Path, to_dir: str | Path, step: int | None = None,
              shard_bytes: int = DEFAULT_SHARD_BYTES) -> dict[str, Any]:
    """Write a llama run's parameters as a Hugging Face directory (config.json, safetensors, index when split).

    Parameters are written in float32 (the fp32 master copy under bf16-params). Returns {"step", "files"}.

    Raises:
        ShardkitError: the run is not of the llama model, no such checkpoint, or `to_dir` is not empty.
    """
    run_dir, to_dir = Path(run_dir), Path(to_dir)
    partial = new_output_dir(to_dir)
    step, meta, params = load_run_params(run_dir, step)
    if meta["model"] != "llama":
        raise ShardkitError("--format", f"hf export needs a llama run; {run_dir} trained {meta['model']!r}")
    config = load_model_class("llama").Config(**meta["config"])
    tensors = hf_tensors(params, config)
    original_path = run_dir / ORIGINAL_CONFIG
    original = json.loads(original_path.read_text()) if original_path.is_file() else None
    partial.mkdir(parents=True)
    files = _write_shards(partial, tensors, shard_bytes)
    (partial / CONFIG_FILE).write_text(json.dumps(hf_config(config, original), indent=2, sort_keys=True) + "\n")
    if to_dir.exists():
        to_dir.rmdir()  # empty, checked by new_output_dir
    partial.rename(to_dir)
    return {"step": step, "files": files}


def hf_tensors(params: Mapping, config) -> dict[str, np.ndarray]:
    """{Hugging Face name: float32 array} for a llama parameter tree (host arrays)."""
    tensors = {}
    for tensor_map in tensor_maps(config.tie_embeddings):
        array = np.asarray(_lookup(params, tensor_map.path), np.float32)
        if tensor_map.stacked:
            for layer in range(config.layers):
                tensors[tensor_map.name.format(layer)] = to_hf_matrix(array[layer], tensor_map)
        else:
            tensors[tensor_map.name] = to_hf_matrix(array, tensor_map)
    return tensors


def _write_shards(directory: Path, tensors: Mapping[str, np.ndarray], shard_bytes: int) -> list[str]:
    groups = list(iter_tensors({name: array.nbytes for name, array in tensors.items()}, shard_bytes))
    if len(groups) == 1:
        write_safetensors(directory / SINGLE_FILE, tensors)
        return [SINGLE_FILE]
    files, weight_map = [], {}
    for number, group in enumerate(groups, start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(directory / file, {name: tensors[name] for name in group})
        weight_map.update({name: file for name in group})
        files.append(file)
    index = {"metadata": {"total_size": sum(array.nbytes for array in tensors.values())}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files + [INDEX_FILE]


def _lookup(tree: Mapping, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def _assign(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    tree[leaf] = value
