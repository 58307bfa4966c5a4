"""Golden shardings for every (model, recipe) pair, and plan's per-device shapes equal to the real shards."""

from __future__ import annotations

import jax
import pytest

from shardkit.analysis.planning.plan import parameter_rows
from shardkit.layout import build_layout, init_params, path_str
from shardkit.testing import assert_params_sufficiently_sharded, check_golden, sharding_specs
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
