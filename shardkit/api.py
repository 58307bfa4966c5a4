"""shardkit as a library, for a user's own training loop; the CLI's runner (shardkit/run/loop.py) is built on the
same pieces (`build_layout`, `build_step`, `Checkpointer`).

    recipe = shardkit.load("fsdp_tp", model=MyModel)          # built-in name, TOML path, dict of tables, or Recipe
    trainer = shardkit.Trainer.build(recipe, loss_fn, optax.adamw(1e-3))
    state = trainer.init()                                     # every parameter born in its own shards
    for batch in my_batches():
        state, metrics = trainer.step(state, trainer.shard(batch))
    trainer.save("ckpt", state)

`loss_fn(model, batch) -> (loss, metrics)` gets the NNX model (merged from the sharded parameters, in the policy's
compute dtype) and the batch as given (an array or a pytree of arrays, rows first); `metrics` is a dict of scalars.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.layout import Layout, build_layout
from shardkit.recipe import Recipe, apply_override, load_recipe, recipe_from_tables
from shardkit.registry import check_model_class, model_import_path
from shardkit.run.checkpoint import Checkpointer, model_meta
from shardkit.step import StepBuilder, build_step

LossFn = Callable[[nnx.Module, Any], tuple[jax.Array, dict]]


def load(source: str | Path | Mapping | Recipe, *overrides: str, model: type | None = None) -> Recipe:
    """A validated recipe.

    Args:
        source: a built-in recipe name (`fsdp_tp`), a TOML file, a mapping of TOML tables, or a `Recipe`.
        *overrides: `section.key=value` strings, as the CLI's `--set` (not with a `Recipe`).
        model: a model class (an `nnx.Module` following `shardkit.registry.ModelProtocol`) to use instead of the
            recipe's `model.name`; it must be importable from its module (a class defined in a script is).

    Raises:
        ShardkitError: naming the field that is invalid.
    """
    if model is not None:
        overrides = (*overrides, f'model.name="{_model_name(model)}"')
    if isinstance(source, Recipe):
        if overrides:
            return recipe_from_tables(_with_overrides(source.raw, overrides), name=source.name)
        return source
    if isinstance(source, Mapping):
        return recipe_from_tables(_with_overrides(source, overrides))
    return load_recipe(source, list(overrides))


def _model_name(model: type) -> str:
    """The `module:Class` name of a model class given to `load`, after checking that it is one and can be imported."""
    check_model_class(model, getattr(model, "__qualname__", repr(model)))
    if "<locals>" in model.__qualname__:  # no import path reaches it: the recipe could not name it
        raise ShardkitError("model", f"{model.__qualname__} is defined inside a function; define it at module level "
                            f"(in {model.__module__}) so that the recipe can name it as module:Class")
    return model_import_path(model)


def _with_overrides(tables: Mapping, overrides: tuple[str, ...]) -> dict:
    """A deep, mutable copy of the tables with the overrides applied (the caller's mapping is left as it was)."""
    plain = _plain(tables)
    for override in overrides:
        apply_override(plain, override)
    return plain


def _plain(value: Any) -> Any:
    return {key: _plain(item) for key, item in value.items()} if isinstance(value, Mapping) else value


@dataclasses.dataclass(frozen=True)
class Trainer:
    """A recipe's resolved layout and its jitted steps, with the user's loss and optimizer. Build with `build`."""

    builder: StepBuilder

    @classmethod
    def build(cls, recipe: Recipe, loss_fn: LossFn | None = None,
              optimizer: optax.GradientTransformation | None = None, devices=None) -> Trainer:
        """Resolve the layout (mesh, rules, every parameter's sharding) and the step.

        Args:
            recipe: from `load`.
            loss_fn: `(model, batch) -> (loss, metrics)`; None: the recipe's next-token loss on token rows
                (batch, seq_len + 1), as `shardkit train` runs.
            optimizer: any optax transformation; None: the recipe's `[optimizer]` (AdamW with its schedule).
            devices: devices for the mesh (default: all).

        Raises:
            ShardkitError: the recipe cannot run on these devices, or a user loss under the 1F1B schedule (whose
                loss runs inside the last stage).
        """
        layout = build_layout(recipe, devices)
        builder = build_step(layout)
        if loss_fn is not None and layout.pipeline.one_f_one_b:
            raise ShardkitError("pipeline.schedule", "a user loss_fn runs under 'gpipe' or 'circular', not '1f1b'")
        if optimizer is not None:
            builder = dataclasses.replace(builder, optimizer=optimizer, schedule=None)
        return cls(dataclasses.replace(builder, loss_fn=loss_fn))

    @property
    def layout(self) -> Layout:
        """Mesh, rules, model class and config, abstract parameters and their logical names."""
        return self.builder.layout

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.builder.mesh

    @property
    def state_shardings(self) -> dict:
        """The `NamedSharding` of every leaf of the state (`step`, `params`, `opt_state`, ...)."""
        return self.builder.state_shardings()

    @property
    def batch_sharding(self) -> NamedSharding:
        """Rows of every batch leaf split over the activation rule for `batch`, other dimensions whole."""
        axes = tuple(a for a in self.layout.rules.activations["batch"] if self.mesh.shape[a] > 1)
        return NamedSharding(self.mesh, PartitionSpec(axes or None))

    def init(self, seed: int | None = None) -> dict:
        """The step-0 state, each leaf initialised directly into its shards (seed: the recipe's `train.seed`)."""
        return self.builder.init_state(self.layout.recipe.train.seed if seed is None else seed)

    def shard(self, batch: Any) -> Any:
        """Place a host batch (array or pytree, rows first) on the mesh as the step expects it.

        Raises:
            ShardkitError: on `batch` when a leaf's rows do not split evenly over the batch's devices.
        """
        devices = math.prod(self.mesh.shape[axis] for axis in _spec_axes(self.batch_sharding.spec))
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            rows = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
            if rows is None or rows % devices:
                where = jax.tree_util.keystr(path) or "the batch"
                raise ShardkitError("batch", f"{where} has {'no rows' if rows is None else f'{rows} rows'}, which do "
                                    f"not split over the {devices} devices the batch is sharded on; give a multiple "
                                    f"of {devices} rows")
        return jax.device_put(batch, self.batch_sharding)

    def step(self, state: dict, batch: Any) -> tuple[dict, dict]:
        """One optimizer step; `state` is donated. Returns the new state and the metrics (loss, grad_norm, ...)."""
        return self._jitted_step(state, batch)

    @functools.cached_property
    def _jitted_step(self) -> Callable:
        return jax.jit(self.builder.step, in_shardings=(self.state_shardings, self.batch_sharding),
                       out_shardings=(self.state_shardings, self.builder.replicated()), donate_argnums=0)

    def eval_step(self, params: Any, batch: Any) -> tuple[jax.Array, dict]:
        """The loss and metrics of `params` (e.g. `state["params"]`) on a batch, without gradients or dropout."""
        return self._jitted_eval(params, batch)

    @functools.cached_property
    def _jitted_eval(self) -> Callable:
        def evaluate(params, batch):
            with self.layout.context(training=False):  # as evaluation runs: no dropout, no remat
                return self.builder.loss_with_aux(params, batch)

        return jax.jit(evaluate, in_shardings=(self.state_shardings["params"], self.batch_sharding))

    def model(self, params: Any) -> nnx.Module:
        """The NNX model over (sharded) parameters, e.g. for generation in the user's code."""
        return nnx.merge(self.layout.graphdef, params)

    def save(self, directory: str | Path, state: dict) -> None:
        """Write `state` as a checkpoint at its own step under `directory` (waits until it is committed)."""
        step = int(jax.device_get(state["step"]))
        with contextlib.closing(Checkpointer(Path(directory), keep=self.layout.recipe.checkpoint.keep)) as checkpoints:
            checkpoints.save(step, state, model_meta(self.layout.recipe, self.layout.config))

    def restore(self, directory: str | Path, step: int | None = None) -> dict:
        """The state saved under `directory` (default: its newest step), placed on this trainer's layout.

        Raises:
            ShardkitError: on `checkpoint` when `directory` holds no checkpoint, or one whose state has other arrays
                (another optimizer or model), naming them.
        """
        with contextlib.closing(Checkpointer(Path(directory), read_only=True)) as checkpoints:
            step = checkpoints.latest_step() if step is None else step
            if step is None:
                raise ShardkitError("checkpoint", f"no checkpoint under {str(directory)!r}")
            abstract_state = self.builder.abstract_state()
            try:
                return checkpoints.restore(step, abstract_state)
            except ValueError:  # orbax's "tree structures do not match", a page long; said in one line when so
                _raise_if_other_arrays(checkpoints.directory, step, abstract_state)
                raise


def _spec_axes(spec: PartitionSpec) -> set[str]:
    """The mesh axes a PartitionSpec names."""
    return {axis for entry in spec if entry is not None for axis in ((entry,) if isinstance(entry, str) else entry)}


def _raise_if_other_arrays(directory: Path, step: int, abstract_state: Mapping) -> None:
    """One error naming each part of the state (`opt_state`, `params`, ...) whose arrays differ between the checkpoint
    at `step` and this trainer's state; nothing when they have the same arrays."""
    saved = _array_paths(ocp.StandardCheckpointHandler().metadata(directory / str(step) / "state"))
    here = _array_paths(abstract_state)
    differing = [part for part in sorted(set(saved) | set(here)) if saved.get(part) != here.get(part)]
    if not differing:
        return
    described = "; ".join(_difference(part, saved.get(part, set()), here.get(part, set())) for part in differing)
    raise ShardkitError(
        "checkpoint", f"the state at step {step} in {directory} has other arrays than this trainer's: {described}; "
        "build the Trainer with the optimizer (and model) the checkpoint was saved with",
    )


def _difference(part: str, saved: set[str], here: set[str]) -> str:
    """E.g. `opt_state: 7 arrays in the checkpoint (such as opt_state.0.count), 0 here`."""
    return (f"{part}: {len(saved)} arrays in the checkpoint{_example(part, saved, here)}, "
            f"{len(here)} here{_example(part, here, saved)}")


def _example(part: str, paths: set[str], others: set[str]) -> str:
    """One array of `paths` that `others` lacks, as ` (such as opt_state.0.count)`."""
    missing = sorted(paths - others)
    return f" (such as {part}.{missing[0]})" if missing else ""


def _array_paths(tree: Any) -> dict[str, set[str]]:
    """Each top-level entry's array paths, e.g. `opt_state` -> {`0.mu.up.kernel`, ...}, spelt alike for a checkpoint's
    dicts and lists and the live state's namedtuples and tuples."""
    paths: dict[str, set[str]] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        names = [str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path]
        paths.setdefault(names[0], set()).add(".".join(names[1:]))
    return paths
