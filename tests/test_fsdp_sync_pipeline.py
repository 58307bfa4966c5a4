"""`train.fsdp_sync = "per_step"` with accumulation under a GPipe pipeline with FSDP (shardkit/pipeline/held.py): the
stage weights gathered over `fsdp` once per step, before the accumulation loop, each pass taking that copy, and the
stage gradients summed whole through the passes and reduced once after the loop; and still the training one device
does.

Figures: the tiny Llama, fp32, 8 fake CPU devices as pipeline 2 x fsdp 4, 2 accumulation micro-batches of 8 rows,
each run as 2 pipeline micro-batches of one row a device. Collective counts are executions per step (loop bodies
multiplied by their trip counts). XLA:CPU hoists the default's loop-invariant stage gathers out of the accumulation
loop itself (their ops keep the loop body's name), so the default is told apart by where the gathers were written
and by its gradient reductions, which XLA cannot hoist: the default reduce-scatters the stage gradients in every
pass.

Equivalence tolerance: fp32, 1e-5 relative (tests/test_equivalence.py's rule): only the order of fp32 sums changes.
"""

from __future__ import annotations

import math

import jax
import pytest

from shardkit.analysis.compiled import hlo as si
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.pipeline import held
from shardkit.step import build_step, check_step_layout
from tests.equivalence import FP32_RTOL, assert_traces_close, trace
from tests.helpers import recipe

PP_FSDP = ("mesh.tensor=1", "mesh.fsdp=4", "train.grad_accum=2", "pipeline.microbatches=2")  # pipeline 2 x fsdp 4
STEPS = 2
LOOP = "/while/body/"  # in the name of every op written inside the accumulation loop


def _collectives(layout, compiled):
    return si.hlo_summary(compiled, layout.mesh).collectives


def _stage_bytes(layout) -> int:
    """One stage's layer weights, fp32 (the tiny Llama's layers split over the 2 stages)."""
    stack = layout.abstract_params[layout.model_class.LAYER_STACK]
    return sum(math.prod(leaf.shape) * 4 for leaf in jax.tree.leaves(stack)) // layout.mesh.shape["pipeline"]


@pytest.fixture(scope="module")
def single():
    return trace(recipe("single"), steps=STEPS, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def per_step():
    run = trace(recipe("pp_fsdp_tp", *PP_FSDP, "train.fsdp_sync=per_step"), steps=STEPS)
    return run.builder.layout, run, _collectives(run.builder.layout, run.compiled)


@pytest.fixture(scope="module")
def circular_data_fsdp():
    """pipeline 2 x data 2 x fsdp 2, circular (2 repeats of one layer a chunk): the held copy one per replica of both
    data axes, its gradient reduced over both once."""
    return trace(recipe("pp_fsdp_tp", *PP_FSDP, "mesh.fsdp=2", "mesh.data=2", "pipeline.schedule=circular",
                        "pipeline.repeats=2", "train.fsdp_sync=per_step"), steps=STEPS)


@pytest.fixture(scope="module")
def per_microbatch():
    layout = build_layout(recipe("pp_fsdp_tp", *PP_FSDP))
    return layout, _collectives(layout, build_step(layout).compile())


@pytest.mark.slow
def test_per_step_under_a_pipeline_trains_like_one_device(per_step, single):
    assert_traces_close(per_step[1], single, FP32_RTOL)


@pytest.mark.slow
def test_per_step_under_circular_with_data_and_fsdp_trains_like_one_device(circular_data_fsdp, single):
    assert held.holds_stage(circular_data_fsdp.builder.layout)
    assert_traces_close(circular_data_fsdp, single, FP32_RTOL)


@pytest.mark.slow
def test_stage_weights_are_gathered_once_before_the_accumulation_loop(per_step, per_microbatch):
    """Per step: every stage weight gathered over fsdp once, written outside the loop, exactly one stage's bytes; no
    gather of weights is written inside it (what remains there are the loss region's activation rows, the same in
    both modes). The default writes the stage gathers inside every pass."""
    layout, _, collectives = per_step
    outside = [op for op in collectives.select("all-gather", ("fsdp",)) if LOOP not in op.op_name]
    assert all(op.count == 1 for op in outside), [(op.count, op.op_name) for op in outside]
    assert sum(op.bytes for op in outside) == _stage_bytes(layout)
    default_layout, default = per_microbatch
    inside = [op for op in default.select("all-gather", ("fsdp",)) if LOOP in op.op_name]
    assert sum(op.bytes for op in inside) >= _stage_bytes(default_layout)
    assert not [op for op in default.select("all-gather", ("fsdp",)) if LOOP not in op.op_name]
    per_step_inside = sum(op.bytes for op in collectives.select("all-gather", ("fsdp",)) if LOOP in op.op_name)
    assert per_step_inside == sum(op.bytes for op in inside) - _stage_bytes(layout)


@pytest.mark.slow
def test_stage_gradients_are_reduced_once_after_the_accumulation_loop(per_step, per_microbatch):
    """Per step: the stage gradients cross fsdp once, after the loop (XLA:CPU's all-reduce; a stage's bytes, the
    scalars XLA combines with them adding a few), where the default reduce-scatters a stage's gradient in each of
    the 2 passes; the other reduce-scatters (the loss region's head, per pass) are the same in both."""
    layout, _, collectives = per_step
    once = [op for op in collectives.select("all-reduce", ("fsdp",)) if op.count == 1]
    assert sum(op.bytes for op in once) == pytest.approx(_stage_bytes(layout), rel=1e-3)
    _, default = per_microbatch
    assert not [op for op in default.select("all-reduce", ("fsdp",)) if op.bytes >= 512 and op.count == 1]
    passes = layout.recipe.train.grad_accum
    saved = default.bytes("reduce-scatter", ("fsdp",)) - collectives.bytes("reduce-scatter", ("fsdp",))
    assert saved == passes * _stage_bytes(layout)


def test_per_step_under_the_1f1b_family_is_refused_naming_gpipe_and_circular():
    with pytest.raises(ShardkitError, match=r"train\.fsdp_sync") as error:
        build_layout(recipe("pp_fsdp_tp", "train.grad_accum=2", "train.fsdp_sync=per_step",
                            "pipeline.schedule=1f1b"))
    assert "'gpipe' and 'circular'" in str(error.value) and "per_microbatch" in str(error.value)


def test_per_step_with_per_use_gathers_is_refused_naming_the_stage_gather():
    with pytest.raises(ShardkitError, match=r"train\.fsdp_sync") as error:
        build_layout(recipe("pp_fsdp_tp", "train.grad_accum=2", "train.fsdp_sync=per_step",
                            "pipeline.fsdp_gather=per_use"))
    assert "pipeline.fsdp_gather = 'per_step'" in str(error.value)


def test_per_step_with_a_model_that_scans_its_own_layers_is_refused_by_name():
    """The held copy replaces the layer stack `scan_stack` hands the pipeline; tests/flax_models.py's ScanModel has
    none (the pipeline finds its own scan in the traced forward)."""
    layout = build_layout(recipe("pp_fsdp_tp", "model.name=tests.flax_models:ScanModel", "train.grad_accum=2",
                                 "train.fsdp_sync=per_step"))
    with pytest.raises(ShardkitError, match=r"train\.fsdp_sync") as error:
        check_step_layout(layout)
    assert "ScanModel" in str(error.value) and "per_microbatch" in str(error.value)
