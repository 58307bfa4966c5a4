"""Models written with flax.nnx only and annotated the Flax way (tests/flax_models.py) plan, train like one device and
pipeline where their layers are stacked; models that cannot work end in one line naming the class or the parameter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Literal, jaxprs_in_params
from jax.sharding import PartitionSpec

from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout, flax_axis_rules
from shardkit.pipeline import scan_layers
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
    strict = ["--set", "rules.unnamed=refuse"] if name == "UnannotatedModel" else []  # replicated by default
    assert main(["plan", "fsdp", "--no-compile", "--set", model(name), *strict]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("shardkit: error: " + fragment), err


def test_a_name_no_rule_maps_is_refused_by_name(capsys):
    assert main(["plan", "fsdp", "--no-compile", "--set", model("ListModel"), "--set", "rules.params.mlp=[]",
                 "--set", "rules.activations.mystery=[]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "mystery" in err, err


@pytest.mark.slow
def test_unstacked_layers_refuse_a_pipeline_in_one_line(capsys, tmp_path):
    argv = ["train", "pp", "--steps", "1", "--out", str(tmp_path), "--set", model("ListModel"),
            "--set", "model.layers=4"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shardkit: error: mesh.pipeline: ListModel has no layer stack a pipeline can split"), err


@pytest.mark.slow
def test_a_scanned_flax_model_refuses_one_f_one_b_in_one_line(capsys, tmp_path):
    """1F1B needs the model split into embed, stack and unembed, which a model that scans its own layers lacks."""
    argv = ["train", "pp", "--steps", "1", "--out", str(tmp_path), "--set", model("ScanModel"),
            "--set", "pipeline.schedule=1f1b"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("shardkit: error: pipeline.schedule: '1f1b' needs the model split into embed(tokens)"), err


@pytest.fixture(scope="module")
def single_device_traces():
    return {name: trace(recipe("single", model(name)), devices=jax.devices()[:1])
            for name in ("ListModel", "ScanModel")}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ListModel", "ScanModel"])
@pytest.mark.parametrize("layout", ["fsdp_tp", "tp_sp"])
def test_flax_model_trains_like_one_device(name, layout, single_device_traces):
    """fp32, the suite's 1e-5 (tests/test_equivalence.py says why that bound is safe): four steps' losses, the
    evaluation loss and the first step's gradients (read back from the step: no compile of their own). fsdp_tp holds
    what fsdp alone would: the same annotations gathered and reduce-scattered over the fsdp axis (2 devices rather
    than 8, the same collectives on the same dimensions), beside tensor parallelism."""
    reference = single_device_traces[name]
    assert_traces_close(trace(recipe(layout, model(name))), reference, rtol=1e-5)
    assert reference.losses[-1] < reference.losses[0]


# 2 stages of two layers each (a scan inside every stage), as many micro-batches as stages: the warm-up and drain
# of GPipe at the fewest ticks; the Llama on 4 stages is tests/test_pipeline.py's.
TWO_STAGES = ("mesh.pipeline=2", "pipeline.microbatches=2")


@pytest.mark.slow
def test_stacked_flax_model_pipelines_like_one_device():
    reference = trace(recipe("single", model("StackedModel")), devices=jax.devices()[:1])
    assert_traces_close(trace(recipe("pp", model("StackedModel"), *TWO_STAGES)), reference, rtol=1e-5)


@pytest.mark.slow
def test_scanned_flax_model_pipelines_like_one_device(single_device_traces):
    """ScanModel runs its layers with nnx.scan and has no shardkit import: GPipe finds that scan in the traced forward
    pass (shardkit/pipeline/scan_layers.py). Losses over four steps and first-step gradients, fp32, rel 1e-5."""
    assert_traces_close(trace(recipe("pp", model("ScanModel"), *TWO_STAGES)), single_device_traces["ScanModel"],
                        rtol=1e-5)


def _scan_forward(params, x_BD):
    """A forward pass whose layers are a scan over stacked weights `w_LDD`, with an unstacked head `head_D`."""
    def layer(h_BD, w_DD):
        return jnp.tanh(h_BD @ w_DD), None

    h_BD, _ = jax.lax.scan(layer, jax.jit(jnp.sin)(x_BD), params["w_LDD"])
    return jax.nn.relu(h_BD) @ params["head_D"]


def _sequential_loop(layer, carry, stacked_state):
    """A stand-in for a pipeline's layer loop: the layers in order."""
    return jax.lax.scan(lambda c, layer_state: (layer(c, layer_state), None), carry, stacked_state)[0]


STACKED = {"w_LDD": True, "head_D": False}


def _scan_params():
    key_w, key_h = jax.random.split(jax.random.key(0))
    return {"w_LDD": jax.random.normal(key_w, (3, 4, 4)) / 2, "head_D": jax.random.normal(key_h, (4,))}


def test_the_layer_scan_runs_through_the_layer_loop():
    """The interpreter hands the scan body to the layer loop once per layer and binds everything else as is (a jit,
    relu's custom_jvp): same values and gradients as the plain forward pass."""
    calls = []

    def loop(layer, carry, stacked_state):
        calls.append(jax.tree.leaves(stacked_state)[0].shape)
        return _sequential_loop(layer, carry, stacked_state)

    run = scan_layers.with_layer_loop(_scan_forward, STACKED, loop)
    params, x_BD = _scan_params(), jnp.ones((2, 4))
    np.testing.assert_allclose(run(params, x_BD), _scan_forward(params, x_BD), rtol=1e-6)
    got, want = (jax.grad(lambda p, f=f: f(p, x_BD).sum())(params) for f in (run, _scan_forward))
    jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-6), got, want)
    assert calls and calls[0] == (3, 4, 4)


def test_a_layer_scan_with_per_layer_outputs_is_refused_in_one_line():
    def forward(params, x_BD):
        h_BD, ys = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h.sum()), x_BD, params["w_LDD"])
        return h_BD @ params["head_D"] + ys.sum()

    run = scan_layers.with_layer_loop(forward, STACKED, _sequential_loop, model="YsModel")
    with pytest.raises(ShardkitError, match="YsModel's scan over its layers also returns per-layer outputs"):
        run(_scan_params(), jnp.ones((2, 4)))


def test_a_forward_pass_without_a_layer_scan_is_refused():
    def forward(params, x_BD):
        for w_DD in params["w_LDD"]:
            x_BD = jnp.tanh(x_BD @ w_DD)
        return x_BD @ params["head_D"]

    run = scan_layers.with_layer_loop(forward, STACKED, _sequential_loop, model="LoopModel")
    with pytest.raises(ShardkitError, match="LoopModel's forward pass has 0 scans over its 3 stacked layers"):
        run(_scan_params(), jnp.ones((2, 4)))


def test_the_jax_internals_the_scan_interpreter_reads():
    """shardkit/pipeline/scan_layers.py reads scan's parameters and binds equations with `get_bind_params`, both JAX
    internals: if this fails, JAX changed them, and `_layer_scan` / `_bind` must follow."""
    closed = jax.make_jaxpr(_scan_forward)(_scan_params(), jnp.ones((2, 4)))
    scans = [eqn for eqn in closed.jaxpr.eqns if scan_layers._layer_scan(eqn) is not None]
    assert len(scans) == 1
    scan = scan_layers._layer_scan(scans[0])
    assert (scan.num_consts, scan.num_carry, scan.length, scan.reverse) == (0, 1, 3, False)
    assert isinstance(scan.body, ClosedJaxpr)
    params, x_BD = _scan_params(), jnp.ones((2, 4))
    flat = jax.tree.leaves((params, x_BD))
    env = dict(zip(closed.jaxpr.invars, flat))
    for eqn in closed.jaxpr.eqns:  # jit, scan, custom_jvp (relu), dot_general: each bound as traced
        env.update(zip(eqn.outvars, scan_layers._bind(eqn, [v.val if isinstance(v, Literal) else env[v]
                                                              for v in eqn.invars])))
    np.testing.assert_allclose(env[closed.jaxpr.outvars[0]], _scan_forward(params, x_BD), rtol=1e-6)


def _sharding_constraints(name: str) -> list[str]:
    """The specs of the sharding constraints in the traced evaluation step of a model under fsdp_tp."""
    builder = build_step(build_layout(recipe("fsdp_tp", model(name))))
    params = builder.abstract_state()["params"]
    jaxpr = jax.make_jaxpr(builder.eval_loss)(params, builder.abstract_batch())
    return [str(eqn.params["sharding"].spec) for eqn in _equations(jaxpr.jaxpr)
            if eqn.primitive.name == "sharding_constraint"]


def _equations(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
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
