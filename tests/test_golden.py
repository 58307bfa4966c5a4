"""Golden shardings for every (model, recipe) pair, and plan's per-device shapes equal to the real shards."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from shardkit.analysis.planning.plan import parameter_rows
from shardkit.layout import build_layout, init_params, param_initializer, path_str
from shardkit.testing import assert_params_sufficiently_sharded, check_golden, sharding_specs
from shardkit.xla_flags import run_once_options
from tests.helpers import ROOT, recipe

RECIPES = ["single", "dp", "fsdp", "tp", "fsdp_tp", "zero1", "zero2", "tp_sp", "cp", "pp", "pp_fsdp_tp"]
MODELS = ["llama", "mlp"]


def _layout(model: str, name: str):
    devices = jax.devices()[:1] if name == "single" else None
    return build_layout(recipe(name, f"model.name={model}"), devices)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", RECIPES)
def test_golden_shardings(model, name):
    check_golden(ROOT / "tests" / "golden" / f"{model}__{name}.json", sharding_specs(_layout(model, name)))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", ["fsdp", "tp", "fsdp_tp"])
def test_plan_shapes_are_the_real_shards(model, name):
    """Each device holds exactly the shard `plan` reports, and never a full copy of a sharded parameter."""
    layout = _layout(model, name)
    params = init_params(layout, seed=0)
    rows = {row["path"]: row for row in parameter_rows(layout)}
    for path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        row = rows[path_str(path)]
        for shard in array.addressable_shards:
            assert list(shard.data.shape) == row["device_shape"], path_str(path)
        if row["device_shape"] != row["shape"]:
            assert all(shard.data.size < array.size for shard in array.addressable_shards)


@pytest.mark.parametrize("model", MODELS)
def test_fsdp_shards_every_large_parameter(model):
    assert_params_sufficiently_sharded(_layout(model, "fsdp"), min_bytes=4096)


def test_unsharded_parameter_is_reported():
    with pytest.raises(AssertionError, match="not sharded over all 8 devices"):
        assert_params_sufficiently_sharded(_layout("llama", "dp"), min_bytes=4096)


def test_init_compiles_without_llvm_optimisation_on_cpu_and_keeps_the_optimised_values():
    """The parameters' initialisation runs once, so on XLA:CPU it compiles without LLVM's optimisation of the machine
    code (`run_once_options`; XLA's defaults on a GPU). Its values are an optimised compile's to float rounding."""
    assert run_once_options(types.SimpleNamespace(devices=np.array([types.SimpleNamespace(platform="cuda")]))) is None
    layout = _layout("mlp", "fsdp")
    assert run_once_options(layout.mesh) == {"xla_backend_optimization_level": 0}
    key = jax.random.key(0)
    optimised = (jax.jit(param_initializer(layout), out_shardings=layout.param_shardings).lower(key)
                 .compile(compiler_options={"xla_backend_optimization_level": 3})(key))
    got = init_params(layout, seed=0)
    assert jax.tree.structure(got) == jax.tree.structure(optimised)
    for path, value in jax.tree_util.tree_flatten_with_path(got)[0]:
        want = optimised
        for entry in path:
            want = want[entry.key]
        assert value.sharding == want.sharding, path_str(path)
        np.testing.assert_allclose(np.asarray(value), np.asarray(want), rtol=1e-6, atol=1e-7, err_msg=path_str(path))
