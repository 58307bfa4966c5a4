"""The library API (shardkit.api) in a user's own loop: the docs' example, recipes from names, dicts and Recipe
values, a user loss and optimizer, the eval step, and checkpoints restored onto another layout."""

from __future__ import annotations

import importlib.util
import logging
import re
import sys

import jax
import numpy as np
import optax
import pytest

import shardkit
from shardkit.errors import ShardkitError
from tests.helpers import ROOT

EXAMPLE = ROOT / "examples" / "train_own_model.py"


@pytest.fixture(scope="module")
def example():
    """The example imported as a module (so its model class is importable by `module:Class`, as a script's is)."""
    spec = importlib.util.spec_from_file_location("train_own_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_own_model"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["train_own_model"]


def test_docs_show_the_example_that_runs():
    """The library page's example (docs/guide/library.md) is the file the next test runs, so the two cannot drift
    apart."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "guide" / "library.md").read_text(), re.S)
    assert any(block.strip() and block.strip() in EXAMPLE.read_text() and "Trainer.build" in block for block in blocks)


@pytest.mark.slow
def test_example_trains_its_own_model_under_fsdp_tp(example, capsys):
    losses = example.main(steps=12)
    assert losses[-1] < 0.5 * losses[0]
    assert "step 11" in capsys.readouterr().out


def _batch(rows=16, length=65, seed=0):
    rng = np.random.default_rng(seed)
    return ((rng.integers(0, 256, (rows, 1)) + 7 * np.arange(length)) % 256).astype(np.int32)


def test_recipe_from_name_dict_and_recipe(example):
    by_name = shardkit.load("fsdp_tp", model=example.MyModel)
    assert by_name.model.name == "train_own_model:MyModel" and by_name.mesh.tensor == 4
    from_dict = shardkit.load({"mesh": {"fsdp": -1}, "train": {"steps": 3}}, "train.seed=5", model=example.MyModel)
    assert (from_dict.mesh.fsdp, from_dict.train.steps, from_dict.train.seed) == (-1, 3, 5)
    again = shardkit.load(from_dict, "train.steps=4")
    assert again.train.steps == 4 and again.model.name == from_dict.model.name


def test_bad_recipe_input_names_the_field(example):
    with pytest.raises(ShardkitError, match="train.steps"):
        shardkit.load("fsdp", "train.steps=0", model=example.MyModel)
    with pytest.raises(ShardkitError, match="no built-in recipe"):
        shardkit.load("no_such_recipe")


@pytest.fixture(scope="module")
def trainer(example):
    return shardkit.Trainer.build(shardkit.load("fsdp", model=example.MyModel), example.loss_fn, optax.adamw(1e-2))


def test_trainer_exposes_the_layout(trainer):
    assert dict(trainer.mesh.shape)["fsdp"] == 8
    assert tuple(trainer.state_shardings["params"]["up"]["kernel"].spec) == ("fsdp", None)
    assert trainer.batch_sharding.spec == jax.sharding.PartitionSpec(("fsdp",))


@pytest.mark.slow
def test_step_eval_and_checkpoint_round_trip(trainer, example, tmp_path):
    state = trainer.init()
    batch = trainer.shard(_batch())
    loss_before, _ = trainer.eval_step(state["params"], batch)
    state, metrics = trainer.step(state, batch)
    assert set(metrics) == {"loss", "grad_norm"} and np.isclose(float(metrics["loss"]), float(loss_before))
    trainer.save(tmp_path / "ckpt", state)
    other = shardkit.Trainer.build(shardkit.load("fsdp_tp", model=example.MyModel), example.loss_fn,
                                   optax.adamw(1e-2))
    restored = other.restore(tmp_path / "ckpt")
    assert int(restored["step"]) == 1
    assert restored["params"]["up"]["kernel"].sharding.spec == other.state_shardings["params"]["up"]["kernel"].spec
    got, _ = other.eval_step(restored["params"], other.shard(_batch(seed=1)))
    want, _ = trainer.eval_step(state["params"], trainer.shard(_batch(seed=1)))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def test_restore_logs_nothing_and_names_another_optimizer(trainer, example, tmp_path, caplog):
    trainer.save(tmp_path / "ckpt", trainer.init())
    caplog.clear()
    assert int(trainer.restore(tmp_path / "ckpt")["step"]) == 0
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING], caplog.text  # read only=...
    sgd = shardkit.Trainer.build(shardkit.load("fsdp", model=example.MyModel), example.loss_fn, optax.sgd(1e-2))
    with pytest.raises(ShardkitError) as caught:
        sgd.restore(tmp_path / "ckpt")
    assert caught.value.field == "checkpoint" and "\n" not in str(caught.value)
    assert "opt_state: 7 arrays in the checkpoint (such as opt_state.0.count)" in str(caught.value), caught.value
    assert "build the Trainer with the optimizer" in str(caught.value)


def test_load_checks_the_model_class(example):
    with pytest.raises(ShardkitError, match="int is not a flax.nnx.Module subclass"):
        shardkit.load("fsdp", model=int)

    class Local(example.MyModel):
        pass

    with pytest.raises(ShardkitError, match=r"Local is defined inside a function; define it at module level"):
        shardkit.load("fsdp", model=Local)
