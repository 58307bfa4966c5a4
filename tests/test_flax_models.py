"""Models written with flax.nnx only and annotated the Flax way (tests/flax_models.py) plan, train like one device and
pipeline where their layers are stacked; models that cannot work end in one line naming the class or the parameter."""

from __future__ import annotations

import jax
import pytest

from shardkit.cli import main
from jax.sharding import PartitionSpec

from shardkit.layout import build_layout, flax_axis_rules
from shardkit.step import build_step
from shardkit.testing import sharding_specs
from tests.equivalence import assert_traces_close, trace
from tests.helpers import recipe

MODELS = "tests.flax_models"


def model(name: str) -> str:
    return f"model.name={MODELS}:{name}"


@pytest.mark.parametrize("name, prefix", [("ListModel", "blocks/0/"), ("ScanModel", "blocks/"),
                                          ("BridgeModel", "block/")])
def test_flax_annotations_are_sharded_by_the_recipe(name, prefix):
    specs = sharding_specs(build_layout(recipe("fsdp_tp", model(name))))
    stacked = [None] if name == "ScanModel" else []
    assert specs["embedding/embedding"] == ["tensor", "fsdp"]
    assert specs["final_norm/scale"] == ["fsdp"]
    if name == "BridgeModel":  # Linen's with_logical_partitioning through nnx.bridge.ToNNX
        assert specs[prefix + "Dense_0/kernel"] == ["fsdp", "tensor"]
        assert specs[prefix + "Dense_1/kernel"] == ["tensor", "fsdp"]
        return
    assert specs[prefix + "up/kernel"] == stacked + ["fsdp", "tensor"]
    assert specs[prefix + "down/kernel"] == stacked + ["tensor", "fsdp"]
    assert specs[prefix + "norm/scale"] == stacked + ["fsdp"]
    assert specs[prefix + "up/bias"] == stacked + ["tensor"]


def test_stacked_flax_model_is_split_over_pipeline_stages():
    specs = sharding_specs(build_layout(recipe("pp", model("StackedModel"))))
    assert specs["blocks/up/kernel"] == ["pipeline", None, None]


@pytest.mark.parametrize("name, fragment", [
    ("NoPresets", "model.name: tests.flax_models:NoPresets lacks PRESETS; add a dict of named configs"),
    ("LinenOnly", "model.name: tests.flax_models:LinenOnly is a Linen module; wrap it in an nnx.Module"),
    ("BareLinenModel", "model: block is a Linen LinenMLP not wrapped for NNX; use nnx.bridge.ToNNX"),
    ("UnannotatedModel", "model: parameter proj/kernel (64, 64) has no logical axis names; annotate it the Flax way"),
])
def test_models_that_cannot_work_end_in_one_line(name, fragment, capsys):
    assert main(["plan", "fsdp", "--no-compile", "--set", model(name)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("shardkit: error: " + fragment), err


def test_a_name_no_rule_maps_is_refused_by_name(capsys):
    assert main(["plan", "fsdp", "--no-compile", "--set", model("ListModel"), "--set", "rules.params.mlp=[]",
                 "--set", "rules.activations.mystery=[]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mystery" in err, err


@pytest.mark.slow
def test_unstacked_layers_refuse_a_pipeline_in_one_line(capsys):
    argv = ["train", "pp", "--steps", "1", "--out", "unused", "--set", model("ScanModel"), "--set", "model.layers=4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardkit: error: mesh.pipeline: ScanModel has no layer stack a pipeline can split"), err


@pytest.fixture(scope="module")
def single_device_traces():
    return {name: trace(recipe("single", model(name)), devices=jax.devices()[:1]) for name in ("ListModel", "ScanModel")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ListModel", "ScanModel"])
@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp", "tp_sp"])
def test_flax_model_trains_like_one_device(name, layout, single_device_traces):
    """fp32, the suite's 1e-5 (tests/test_equivalence.py says why that bound is safe)."""
    reference = single_device_traces[name]
    assert_traces_close(trace(recipe(layout, model(name))), reference, rtol=1e-5)
    assert reference.losses[-1] < reference.losses[0]


@pytest.mark.slow
def test_stacked_flax_model_pipelines_like_one_device():
    reference = trace(recipe("single", model("StackedModel")), devices=jax.devices()[:1])
    assert_traces_close(trace(recipe("pp", model("StackedModel"))), reference, rtol=1e-5)


def _sharding_constraints(name: str) -> list[str]:
    """The specs of the sharding constraints in the traced evaluation step of a model under fsdp_tp."""
    builder = build_step(build_layout(recipe("fsdp_tp", model(name))))
    params = builder.abstract_state()["params"]
    jaxpr = jax.make_jaxpr(builder.eval_loss)(params, builder.abstract_batch())
    return [str(eqn.params["sharding"].spec) for eqn in _equations(jaxpr.jaxpr) if eqn.primitive.name == "sharding_constraint"]


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.core.jaxprs_in_params(eqn.params):
            yield from _equations(sub)


def test_flax_logical_constraints_are_resolved_by_the_recipes_activation_rules():
    """Flax's own `with_logical_constraint` in a model is laid out by the recipe's activation rules, one constraint
    per block, on top of what the same model without them has (none: outside shardkit they are no-ops)."""
    plain, constrained = _sharding_constraints("ListModel"), _sharding_constraints("ConstrainedModel")
    added = list(constrained)
    for spec in plain:
        added.remove(spec)
    rules = dict(flax_axis_rules(build_layout(recipe("fsdp_tp")).rules.activations))
    expected = str(PartitionSpec(*(rules[name] for name in ("batch", "sequence", "embed"))))
    assert "fsdp" in expected and added == [expected] * 2
