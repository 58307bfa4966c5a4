"""The fp8 policy inside GPipe and circular pipelines (each stage carrying its own layers' FP8 scaling state) and with
gradient accumulation (per-replica and through a pipeline's passes): the scaling state updates as on one device.

"As on one device" for the scaling state: the step's next state is what one device running the whole batch in one
pass would record. The scales are computed from the previous histories, the same in every pass, and each amax
history's new entry is the largest |value| over all rows: the maximum over micro-batches, data replicas and
pipeline ticks (bubble ticks left out), not their mean (`shardkit.precision.combine_fp8`). Each pass's output
gradients are one device's too (its loss is scaled by 1 / passes before it is differentiated), so the gradient
histories hold one device's magnitudes.

What is compared, and how closely. The weights' histories (`rhs`) are exact: every layout holds the same weights after
the same updates. The first layer's input histories (`lhs` of attn/q, k, v at layer 0: the normed embeddings, each
row computed alone) are exact after the first step. The rest of the activations and the output gradients pass
through FP8 quantization, where a bf16 rounding that differs between layouts (another summation order) moves a value
across an e4m3/e5m2 rounding boundary; at the first step the gradient scale is 1 and the e5m2 output gradients are
mostly subnormal, two bits or fewer. So those are held to one device's within GRAD_AMAX_RTOL, and the losses within
LOSS_RTOL, both far inside the factor of the micro-batch or replica count that a sum or an unscaled pass would give.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardkit.analysis.predicted.targets import cuda_plugin_available
from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.recipe import load_recipe
from shardkit.step import build_step
from tests.helpers import ROOT

STEPS = 4
LOSS_RTOL = 2e-3  # measured: at most 7.1e-4
GRAD_AMAX_RTOL = 0.5  # measured: at most 0.36 (GPipe and circular), 0 (per-replica accumulation)
FIRST_LAYER_INPUT_SITES = ("attn/k", "attn/q", "attn/v")

LAYOUTS = {
    "no_pipeline": ("fsdp.toml", ()),
    # pipeline 2 x data 4, circular (2 repeats of one layer a chunk), 2 micro-batches, 2 passes of accumulation.
    # GPipe is this schedule at one repeat: the same tick loop (shardkit/pipeline/gpipe.py: the forward grid, the
    # scaling state fanned out to each tick and its next value the maximum over the real ones), where circular
    # also carries stage 0's items between repeats; so this case holds GPipe's scaling state too, and GPipe's own
    # h100x8 program is checked below (test_the_stages_matmuls_compile_to_cublaslt_fp8_gemms_for_an_h100).
    "circular_accumulation": ("pp.toml", ("mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.repeats=2",
                                          "pipeline.microbatches=2", "train.grad_accum=2")),
    # data 2 x fsdp 4, per-replica accumulation over 2 micro-batches (4 passes)
    "replica_accumulation": ("fsdp.toml", ("mesh.data=2", "mesh.fsdp=4", "train.grad_accum=2")),
}


def _builder(recipe: str, *overrides: str):
    return build_step(build_layout(load_recipe(ROOT / "recipes" / recipe, ["precision.policy=fp8", *overrides])))


class Run:
    """A few fp8 steps of one layout on one fixed batch: the losses and the scaling state after each step."""

    def __init__(self, recipe: str, overrides):
        builder = _builder(recipe, *overrides)
        step = builder.jit()
        state = builder.init_state(seed=0)
        train = builder.recipe.train
        tokens = jax.random.randint(jax.random.key(0), (train.global_batch, train.seq_len + 1), 0,
                                    builder.layout.config.vocab)
        self.losses, self.fp8 = [], []
        for _ in range(STEPS):
            state, metrics = step(state, tokens)
            self.losses.append(float(metrics["loss"]))
            self.fp8.append(jax.tree.map(np.asarray, state["fp8"]))


@pytest.fixture(scope="module")
def runs():
    return {}


def _run(runs, name) -> Run:
    if name not in runs:
        runs[name] = Run(*LAYOUTS[name])
    return runs[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in LAYOUTS if name != "no_pipeline"])
def test_fp8_learns_and_its_scaling_state_updates_as_on_one_device(runs, name):
    one, run = _run(runs, "no_pipeline"), _run(runs, name)
    assert run.losses[-1] < run.losses[0] - 0.05, run.losses  # it learns
    np.testing.assert_allclose(run.losses, one.losses, rtol=LOSS_RTOL)
    first, first_one = run.fp8[0], one.fp8[0]
    for site, state in first.items():
        # The weights' amax: exact, every layer (each stage recorded its own layers'); the rest of each history zero.
        np.testing.assert_array_equal(state["rhs_amax_history"], first_one[site]["rhs_amax_history"], err_msg=site)
        for name_ in ("lhs_amax_history", "grad_amax_history"):
            history = state[name_]
            assert (history[:, 0] > 0).all() and (history[:, 1:] == 0).all(), (site, name_)
        # The output gradients' amax: one device's magnitude, the largest over the micro-batches and replicas.
        np.testing.assert_allclose(state["grad_amax_history"][:, 0], first_one[site]["grad_amax_history"][:, 0],
                                   rtol=GRAD_AMAX_RTOL, err_msg=site)
    for site in FIRST_LAYER_INPUT_SITES:  # the largest over every row, not a micro-batch's or a mean of them
        np.testing.assert_allclose(first[site]["lhs_amax_history"][0, 0], first_one[site]["lhs_amax_history"][0, 0],
                                   rtol=1e-6, err_msg=site)
    # The second step's weight scales follow from the first step's weight histories: exact too.
    for site, state in run.fp8[1].items():
        np.testing.assert_array_equal(state["rhs_scale"], one.fp8[1][site]["rhs_scale"], err_msg=site)


def test_a_stages_scaling_state_takes_the_largest_next_value_of_its_real_ticks():
    """Through the tick loop the state's gradient (its next value) is the maximum over the ticks that ran a
    micro-batch, where autodiff would sum every tick's; a bubble tick's is left out."""
    from shardkit.pipeline.gpipe import _fan_out_max

    next_values = jnp.asarray([[1.0, 5.0, 2.0], [7.0, 1.0, 1.0], [3.0, 3.0, 9.0]])
    real = jnp.asarray([True, True, False])

    def ticks(state):
        def tick(carry, tick_inputs):
            next_value, is_real = tick_inputs
            used, carry = _fan_out_max(carry, is_real)
            return carry, (used * next_value).sum()  # the use's gradient: this tick's next value

        return jax.lax.scan(tick, state, (next_values, real))[1].sum()

    np.testing.assert_array_equal(jax.grad(ticks)(jnp.zeros(3)), [7.0, 5.0, 2.0])


def test_fp8_sites_are_found_through_a_pipeline_whose_loss_region_splits_rows_over_fsdp():
    """The sites are found by tracing the loss abstractly; a GPipe loss region split over fsdp (pp_fsdp_tp) needs the
    recipe's micro-batch there, not a one-row stand-in (which failed inside shard_map)."""
    builder = _builder("pp_fsdp_tp.toml")
    assert builder.fp8_sites and builder.fp8_sites == _builder("pp.toml").fp8_sites


def test_the_1f1b_family_refuses_fp8_naming_the_schedules_that_carry_it():
    with pytest.raises(ShardkitError) as error:
        _builder("pp.toml", "pipeline.schedule=1f1b")
    assert error.value.field == "precision.policy"
    assert "'gpipe'" in str(error.value) and "'circular'" in str(error.value)


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="compiling for an H100 target needs the jax[cuda12] plugin")
def test_the_stages_matmuls_compile_to_cublaslt_fp8_gemms_for_an_h100(tmp_path):
    """recipes/pp.toml on two stages (pipeline 2 x data 4, GPipe, 2 micro-batches, one layer a stage) under fp8 for
    h100x8: the layers' matmuls are cuBLASLt FP8 GEMMs,
    e4m3 x e4m3 forward and with an e5m2 output gradient backward, every one of them inside the pipeline region's
    tick loop (by its op_name: XLA unrolls short runs of ticks, the name keeps where it came from)."""
    settings = ("precision.policy=fp8", "mesh.pipeline=2", "pipeline.microbatches=2", "model.layers=2")
    assert main(["hlo", str(ROOT / "recipes" / "pp.toml"), *[arg for setting in settings for arg in ("--set", setting)],
                 "--target", "h100x8", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "optimized_hlo.txt").read_text()
    types = dict(re.findall(r"^\s*%(\S+) = \(?([a-z0-9]+)\[", text, re.M))
    gemms = [line for line in text.splitlines() if 'custom_call_target="__cublas$lt$matmul$f8"' in line]
    operands = [tuple(types.get(name.lstrip("%")) for name in
                      re.search(r"custom-call\(([^)]*)\)", line).group(1).split(", ")[:2]) for line in gemms]
    sites = 7  # attention q, k, v, o; MLP gate, up, down
    assert operands.count(("f8e4m3fn", "f8e4m3fn")) >= sites
    assert sum("f8e5m2" in pair for pair in operands) >= 2 * sites
    outside = [line for line in gemms if "/shard_map/while/body/" not in re.search(r'op_name="([^"]*)"', line)[1]]
    assert not outside, outside[:3]


# ---- precision.grad_reduce = "float32" under GPipe and circular ----------------------------------------------------
GRAD_REDUCE_CASES = {"gpipe": (), "circular": ("pipeline.schedule=circular", "pipeline.repeats=2", "model.layers=8")}


@functools.cache
def _lowered_for_h100(schedule: str, mode: str):
    """pp_fsdp_tp under bf16 with `precision.grad_reduce = mode`, laid out for h100x8: its layout and lowered step
    (lowered once for the tests that read its StableHLO and the one that compiles it)."""
    from shardkit.analysis.predicted.targets import parse_target, target_devices
    from tests.helpers import recipe

    layout = build_layout(recipe("pp_fsdp_tp", *GRAD_REDUCE_CASES[schedule], "precision.policy=bf16",
                                 f"precision.grad_reduce={mode}"), target_devices(parse_target("h100x8")))
    return layout, build_step(layout).lower()


@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for compile-only GPU devices")
@pytest.mark.parametrize("schedule", GRAD_REDUCE_CASES)
def test_float32_grad_reduce_under_gpipe_and_circular_reduce_scatters_the_stage_gradients_in_fp32(schedule):
    """A GPipe or circular stage gathers its weights in the compute dtype and holds them in fp32, cast back in each
    tick, so autodiff sums the ticks' gradients in fp32 and the stage's reduce-scatter over `fsdp` moves fp32
    (pp_fsdp_tp lowered for h100x8, bf16: on a CPU mesh every bf16 sum in a pipeline region is widened anyway). Under
    `compute` every reduce-scatter is bf16; under `float32` all but the head's (outside the stages) are fp32."""
    reducer_types = {}
    for mode in ("compute", "float32"):
        layout, lowered = _lowered_for_h100(schedule, mode)
        reducer_types[mode] = re.findall(r"stablehlo.reduce_scatter\"[^^]*\^bb0\(%\w+: tensor<(\w+)>",
                                         lowered.as_text())
    assert set(reducer_types["compute"]) == {"bf16"}, reducer_types
    stage_weights = len(jax.tree.leaves(layout.abstract_params[layout.model_class.LAYER_STACK]))
    assert reducer_types["float32"].count("f32") == stage_weights, reducer_types
    assert reducer_types["float32"].count("bf16") <= 1, reducer_types  # the head's


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
def test_compiled_gpipe_stage_gradient_reduce_scatters_move_fp32():
    """pp_fsdp_tp (GPipe, bf16) compiled for h100x8: under `precision.grad_reduce = "float32"` the stages' weight
    gradients cross `fsdp` in fp32, so the compiled reduce-scatters' fp32 bytes are the stage weights' (the bf16 ones
    left are the head's); under `compute` they are bf16."""
    from shardkit.analysis.compiled.hlo import hlo_summary
    from shardkit.xla_flags import compile_lowered

    layout, lowered = _lowered_for_h100("gpipe", "float32")  # the step whose StableHLO the test above reads
    ops = hlo_summary(compile_lowered(lowered, layout.recipe, layout.mesh), layout.mesh).collectives.ops
    scattered: dict[str, float] = {}
    for op in ops:
        if op.kind == "reduce-scatter" and op.group_size > 1:
            for dtype, value in op.bytes_by_dtype().items():
                scattered[dtype] = scattered.get(dtype, 0.0) + op.count * value
    stack = layout.abstract_params[layout.model_class.LAYER_STACK]
    stage_bytes = sum(leaf.size for leaf in jax.tree.leaves(stack)) // layout.mesh.shape["pipeline"] * 4
    assert scattered.get("f32", 0) >= stage_bytes // layout.mesh.shape["tensor"], (scattered, stage_bytes)
    assert scattered.get("f32", 0) > 2 * scattered.get("bf16", 0), scattered


@pytest.mark.slow
def test_float32_grad_reduce_under_gpipe_gives_one_devices_gradients():
    """pp_fsdp_tp (pipeline 2 x fsdp 2 x tensor 2, GPipe) under bf16 with `precision.grad_reduce = "float32"`: its
    first-batch gradients are the unpipelined layout's (fsdp 8, the same setting) within bf16's equivalence tolerance,
    every parameter (the stages' weights summed through the ticks and reduced in fp32)."""
    from tests.equivalence import BF16_RTOL, trace
    from tests.helpers import recipe

    settings = ("precision.policy=bf16", "precision.grad_reduce=float32")
    pipelined = trace(recipe("pp_fsdp_tp", *settings), steps=0).grads
    one = trace(recipe("fsdp", *settings), steps=0).grads
    assert pipelined.keys() == one.keys()
    for path, want in one.items():
        error = np.linalg.norm(pipelined[path] - want) / np.linalg.norm(want)
        assert error < BF16_RTOL, (path, error)
