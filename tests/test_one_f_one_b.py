"""The 1F1B family (1f1b, interleaved_1f1b, zero_bubble): tick programs against a sequential reference, equivalence
with one device (alone and with FSDP x TP), memory, bytes.

Tolerance for equivalence: fp32, 1e-5 (tests/equivalence.py's criterion: losses relative, gradients relative plus 1e-5
of the leaf's largest entry). 1F1B runs the same per-row operations as one device; what changes is the order of sums
(a stacked weight's gradient is summed over micro-batches, the mean over tokens is taken per micro-batch first), which
moves fp32 results by a few ulps, far below 1e-5, while a wrong cotangent, a lost micro-batch or a stage applied to the
wrong input is off by percents.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.pipeline import (
    PipelineConfig,
    bubble_fraction,
    collective_permute_bytes,
    idle_fraction,
    microbatch_activation_bytes,
    one_f_one_b_grid,
    pipeline_config,
    schedule_grid,
)
from shardkit.pipeline.program import READS_GRADIENT, SENDS_BACK, Action, live_stage_inputs, tick_blocks, tick_program
from shardkit.registry import load_model_class
from shardkit.step import build_step
from shardkit.testing import requires_devices
from tests.equivalence import assert_traces_close, trace
from tests.helpers import assert_gradients_reduced_over_data_once, permuted_bytes, recipe

FP32_RTOL = 1e-5
ONE_F_ONE_B = "pipeline.schedule=1f1b"
SHAPES = [(2, 1), (2, 4), (3, 5), (4, 2), (4, 4), (4, 8), (4, 16), (8, 3), (8, 16)]
# (schedule, p, m, v) for the tick programs of every schedule of the family.
PROGRAMS = [("1f1b", p, m, 1) for p, m in SHAPES] + [
    ("zero_bubble", p, m, 1) for p, m in SHAPES] + [
    ("interleaved_1f1b", p, m, v) for p, m, v in [(2, 2, 2), (2, 4, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (3, 6, 2)]]


# ---- the tick program against a sequential reference ----------------------------------------------------------------
def simulate(program, p: int, v: int) -> dict:
    """Run the tick program on symbols: ("act", d, r, i) is micro-batch i's input to chunk r of stage d, ("grad", d,
    r, i) the gradient at that chunk's output. Every read is checked against what the sequential model would hand
    that stage, and every arrival lands in the slot its reader reads.

    Returns how often each (stage, chunk, "F"/"B"/"W", micro-batch) ran.
    """
    runs = {}
    activations = [dict() for _ in range(p)]
    gradients = [dict() for _ in range(p)]
    received, received_grad = [None] * p, [None] * p  # what the ppermutes delivered (None: zeros)
    for tick in range(program.ticks):
        out_forward, out_backward = [None] * p, [None] * p
        for d in range(p):
            if program.act_arrival[d, tick] >= 0:
                assert received[d] is not None, (tick, d)
                activations[d][int(program.act_arrival[d, tick])] = received[d]
            if program.grad_arrival[d, tick] >= 0:
                assert received_grad[d] is not None, (tick, d)
                gradients[d][int(program.grad_arrival[d, tick])] = received_grad[d]
            action, i, r = Action(program.action[d, tick]), int(program.micro[d, tick]), int(program.chunk[d, tick])
            if action != Action.IDLE and not program.enters[d, tick]:
                assert activations[d].get(int(program.x_slot[d, tick])) == ("act", d, r, i), (tick, d, action)
            if action in READS_GRADIENT:
                assert gradients[d].get(int(program.dy_slot[d, tick])) == ("grad", d, r, i), (tick, d, action)
            if action == Action.FORWARD:
                out_forward[d] = ("act", (d + 1) % p, r + (d == p - 1), i)
            if action in SENDS_BACK and not program.enters[d, tick]:
                out_backward[d] = ("grad", (d - 1) % p, r - (d == 0), i)
            if action != Action.IDLE:
                kind = "F" if action == Action.FORWARD else "W" if action.name.startswith("WEIGHT") else "B"
                runs[(d, r, kind, i)] = runs.get((d, r, kind, i), 0) + 1
        forward_pairs, backward_pairs = program.sends[tick]
        received, received_grad = [None] * p, [None] * p
        for source, target in forward_pairs:
            received[target] = out_forward[source]
        for source, target in backward_pairs:
            received_grad[target] = out_backward[source]
        assert {s for s, _ in forward_pairs} == {d for d in range(p) if out_forward[d]}  # nothing idle is sent
        assert {s for s, _ in backward_pairs} == {d for d in range(p) if out_backward[d]}
    return runs


@pytest.mark.parametrize("schedule,p,m,v", PROGRAMS)
def test_tick_program_computes_what_the_sequential_model_does(schedule, p, m, v):
    runs = simulate(tick_program(PipelineConfig(p, m, v, schedule)), p, v)
    # Every chunk runs every backward (and under zero_bubble every W) once; forwards once, except the last chunk's,
    # folded into its backward.
    kinds = "FBW" if schedule == "zero_bubble" else "FB"
    expected = {(d, r, kind, i): 1 for d in range(p) for r in range(v) for kind in kinds for i in range(m)
                if (d, r, kind) != (p - 1, v - 1, "F")}
    assert runs == expected


@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_holds_at_most_p_stage_inputs_and_consumes_gradients_at_once(p, m):
    program = tick_program(PipelineConfig(p, m, schedule="1f1b"))
    assert program.slots <= min(p, m) and max(live_stage_inputs(program)) <= min(p, m)
    assert program.grad_slots == 1
    assert len(program.sends) == len(one_f_one_b_grid(PipelineConfig(p, m, schedule="1f1b"))[0])


@pytest.mark.parametrize("p,m", SHAPES)
def test_zero_bubble_holds_at_most_2p_minus_d_stage_inputs(p, m):
    """Stage d runs at most 2p - 1 - d micro-batches between F and W (shardkit.pipeline.schedule.zero_bubble_grid),
    plus the one that arrived before its F: 2p - d stage inputs, against 1F1B's p - d + 1."""
    program = tick_program(PipelineConfig(p, m, schedule="zero_bubble"))
    assert all(live <= min(2 * p - d, m) for d, live in enumerate(live_stage_inputs(program)))


@pytest.mark.parametrize("schedule,p,m,v", PROGRAMS)
def test_tick_blocks_cover_every_tick_with_repeating_sends(schedule, p, m, v):
    program = tick_program(PipelineConfig(p, m, v, schedule))
    covered = []
    for first, period, count in tick_blocks(program):
        ticks = range(first, first + period * count)
        covered.extend(ticks)
        assert all(program.sends[t] == program.sends[first + (t - first) % period] for t in ticks)
    assert covered == list(range(program.ticks))
    if schedule == "1f1b":
        assert len(tick_blocks(program)) <= 4 * p  # warm-up, steady state, cool-down: not one block per micro-batch


# ---- the model protocol ---------------------------------------------------------------------------------------------
_mlp = sys.modules[load_model_class("mlp").__module__]


class Unsplit(nnx.Module):
    """A model with a layer stack but no embed / unembed / LAYER_STACK: fine for gpipe, not splittable for 1F1B."""

    Config = _mlp.MLPConfig
    PRESETS = {"tiny": _mlp.MLPConfig()}

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.inner = _mlp.DeepMLP(cfg, rngs=rngs)

    def __call__(self, tokens_BS):
        return self.inner(tokens_BS)


def test_a_model_without_the_split_is_refused_naming_the_schedule():
    layout = build_layout(recipe("pp", ONE_F_ONE_B, f"model.name={__name__}:Unsplit"))
    with pytest.raises(ShardkitError, match=r"pipeline\.schedule.*embed"):
        build_step(layout)


# ---- equivalence with one device, loss scaling, collective-permute bytes, memory ------------------------------------
INTERLEAVED = ("pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2")
ZERO_BUBBLE = "pipeline.schedule=zero_bubble"
# Every case but 1f1b on pp runs 2 stages and as many micro-batches as stages (m = p = 2): each schedule's whole tick
# program, warm-up, a steady state (every stage runs a micro-batch's forward beside another's backward) and drain, at
# the fewest tick switches to compile. The schedules differ only in the executor's tables (program.py), not in its
# code per stage: 1f1b on pp's 4 stages (the recipe's m = 8, the base of the m = 32 memory comparison below) runs the
# stages between the first and the last, and the tick-program tests above hold every schedule's tables at 3, 4 and 8
# stages to the sequential model. pp's other cases keep pp's data replicas (pp.toml cut to `mesh.pipeline=2`, data 4)
# for the data-parallel reduction; pp_fsdp_tp's hold FSDP x TP and the head split. The global batch stays the
# recipe's and every case has the recipe's 4 layers (interleaved: one a chunk), so one one-device trace serves all.
TWO_STAGES = ("mesh.pipeline=2", "pipeline.microbatches=2")
CASES = {
    "pp": ("pp", (ONE_F_ONE_B,)),
    "pp_fsdp_tp": ("pp_fsdp_tp", (ONE_F_ONE_B, *TWO_STAGES)),
    "pp interleaved_1f1b": ("pp", (*INTERLEAVED, *TWO_STAGES)),
    "pp_fsdp_tp interleaved_1f1b": ("pp_fsdp_tp", (*INTERLEAVED, *TWO_STAGES)),
    "pp zero_bubble": ("pp", (ZERO_BUBBLE, *TWO_STAGES)),
    "pp_fsdp_tp zero_bubble": ("pp_fsdp_tp", (ZERO_BUBBLE, *TWO_STAGES)),
}
# The schedule's part of the training step is its gradients program (`StepBuilder.gradients`, which the step calls
# and every case compiles on its own): the optimizer update around it does not depend on the schedule, nor does
# evaluation (GPipe's forward loop under the whole family; with repeats the circular loop, which
# tests/test_eval_matches_train.py holds). So one case, 1f1b on pp_fsdp_tp (pipeline, FSDP and TP with the head
# split), also runs STEPS optimizer steps and evaluation against one device's (`assert_traces_close`), while every
# other case compiles only what it changes, its gradients program, held to one device's first-batch loss and
# gradients. 1f1b on pp differs from it only in the layout around the same schedule: its gradients program holds pp's
# data-parallel reduction and bytes below, and the step and evaluation around a pipeline on pp are trained against
# one device by tests/test_own_models.py (`test_stacked_model_pipelines_like_one_device`) and tests/test_five_d.py.
# The trained case compiles the step and evaluation only (its first-batch loss is its first step's; its sends are
# read off the step, which runs the gradients program once): its loss scaling is the executor's, held under 1f1b by
# 1f1b on pp and with the head split by pp_fsdp_tp's other schedules (UNTRAINED).
TRAINED = ("pp_fsdp_tp",)
UNTRAINED = [name for name in CASES if name not in TRAINED]
# The second step's loss is computed after the first step's update, so an update applied wrongly (a stage's weights
# given another's gradient, or none) shows in it.
STEPS = 2


def run(r, devices=None) -> dict:
    """The compiled gradients (scale as an argument) of `r`: first-batch loss and gradients at scale 1, gradients
    at 2^12."""
    got = trace(r, steps=0, devices=devices)
    return {"layout": got.builder.layout, "gradients": got.gradients, "program": got.gradients, "trace": got,
            "loss": first_loss(got), "unscaled": got.grads_at_scale(1.0), "scaled": got.grads_at_scale(2.0**12)}


def train(r) -> dict:
    """STEPS compiled steps of `r` (the first step's gradients read back from it) and its evaluation."""
    got = trace(r, steps=STEPS)
    return {"layout": got.builder.layout, "program": got.compiled, "trace": got}


def first_loss(got) -> float:
    """The loss of the compiled gradients program at the initial parameters on the first batch."""
    return float(got.gradients(got.first_params, got.first_batch, np.float32(1))[0])


@pytest.fixture(scope="module")
def one_device():
    """The one-device reference trace, traced once for the module: every case has its model and batch. It runs STEPS
    steps for the trained case (its first-batch gradients read back from the first step), which the untrained cases
    share."""
    return trace(recipe("single"), steps=STEPS, devices=jax.devices()[:1])


@pytest.fixture(scope="module", params=list(CASES))
def case(request, one_device):
    name, overrides = CASES[request.param]
    got = (train if request.param in TRAINED else run)(recipe(name, *overrides))
    assert got["layout"].config == one_device.builder.layout.config, "every case is held to the one reference"
    return {**got, "want": one_device}


@pytest.mark.slow
@requires_devices(8)
def test_trains_like_one_device(case):
    """First-batch loss and gradients as one device's; for TRAINED each step's loss and evaluation's instead of the
    gradients program's loss."""
    got, want = case["trace"], case["want"]
    if len(got.losses):
        assert_traces_close(got, want, FP32_RTOL)
    else:
        np.testing.assert_allclose(case["loss"], first_loss(want), rtol=FP32_RTOL, atol=0)
        assert_traces_close(got, dataclasses.replace(want, losses=got.losses), FP32_RTOL)


@pytest.mark.slow
@requires_devices(8)
@pytest.mark.parametrize("case", UNTRAINED, indirect=True)
def test_loss_scaling_divides_out(case):
    """Scale 2^12 multiplies the cotangent and `gradients` divides it out again: a scale not applied, or applied
    twice, is off by 4096x. Both from the compiled gradients program."""
    for path, expected in case["unscaled"].items():
        np.testing.assert_allclose(case["scaled"][path], expected, rtol=FP32_RTOL, atol=0, err_msg=path)


@pytest.mark.slow
@requires_devices(8)
def test_sends_each_activation_and_gradient_once(case):
    """Only real work crosses a boundary: activation x m x (v*p - 1) forward, the same backward, nothing from idle
    ticks (in the gradients program, or the step that runs it once)."""
    layout = case["layout"]
    expected = collective_permute_bytes(pipeline_config(layout.recipe), microbatch_activation_bytes(layout))
    pipeline_groups = layout.mesh.size // layout.mesh.shape["pipeline"]
    sends = permuted_bytes(case["program"].as_text(), lambda op_name: op_name.endswith("ppermute"))
    assert sends / pipeline_groups == expected


@pytest.mark.slow
@requires_devices(8)
def test_reduces_gradients_over_data_once_per_step(case):
    """Each data replica accumulates its own stage and head gradients through the ticks; one sum after the loop."""
    if case["layout"].mesh.shape["data"] == 1:
        pytest.skip("no data-parallel axis in this layout")
    assert_gradients_reduced_over_data_once(case["gradients"], case["layout"])


@pytest.mark.slow
@requires_devices(8)
def test_1f1b_memory_grows_only_by_the_region_edges(case):
    """Compiled temp memory at m = 32 against m = 8, same micro-batch size (so the global batch grows 4x).

    Per extra micro-batch the step may grow by the region's edges only, as under GPipe: the embedded micro-batch, its
    copy split into micro-batches, its gradient out of the region, and that gradient as the embedding's backward
    (which runs after the region, on the whole batch, since the region holds only the head: README, "FSDP inside a
    pipeline") reads it: 4 stage inputs (3 while the embedding's backward ran per replica inside the region). The
    stage-input buffer stays p slots; were it m slots (every micro-batch's input kept until its backward, as autodiff
    of a forward loop keeps it), the growth would reach 5. GPipe grows by about 15 stage inputs per micro-batch here
    (bench/pipeline.py).
    """
    if case["layout"].recipe.mesh.pipeline != 4 or not case["layout"].recipe.pipeline.schedule == "1f1b":
        pytest.skip("measured on the pp layout under 1f1b only")
    r = recipe("pp", ONE_F_ONE_B, "pipeline.microbatches=32", "train.global_batch=64")
    builder = build_step(build_layout(r))
    tokens = jax.ShapeDtypeStruct((64, r.train.seq_len + 1), np.int32, sharding=builder.batch_sharding())
    large = jax.jit(builder.gradients).lower(builder.abstract_state()["params"], tokens, np.float32(1)).compile()
    assert case["layout"].recipe.pipeline.microbatches == 8 and case["layout"].recipe.train.global_batch == 16
    growth = large.memory_analysis().temp_size_in_bytes - case["gradients"].memory_analysis().temp_size_in_bytes
    per_micro_batch = growth / (32 - 8) / microbatch_activation_bytes(case["layout"])
    assert per_micro_batch < 5, f"temp memory grew by {per_micro_batch:.2f} stage inputs per extra micro-batch"


# ---- the new schedules: bubbles, validation, what they refuse --------------------------------------------------------
@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 4), (3, 6, 2)])
def test_interleaved_divides_the_bubble_by_virtual_stages(p, m, v):
    config = PipelineConfig(p, m, v, "interleaved_1f1b")
    assert bubble_fraction(config) == pytest.approx((p - 1) / (v * m + p - 1))
    assert idle_fraction(schedule_grid(config)) == pytest.approx(bubble_fraction(config))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16), (3, 5)])
def test_zero_bubble_has_zb_h1s_bubble(p, m):
    """ZB-H1 with unit-time F, B and W: (p-1) idle ticks per stage over 3m ticks of work, a third of 1F1B's bubble
    time (1F1B's backward being B + W, two ticks)."""
    config = PipelineConfig(p, m, schedule="zero_bubble")
    assert idle_fraction(schedule_grid(config)) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert bubble_fraction(config) == pytest.approx((p - 1) / (3 * m + p - 1))


def test_interleaved_needs_micro_batches_in_groups_of_stages():
    with pytest.raises(ShardkitError, match=r"pipeline\.microbatches.*multiple of 4"):
        build_layout(recipe("pp", *INTERLEAVED, "model.layers=8", "mesh.data=1",
                            "mesh.pipeline=4", "mesh.fsdp=2", "pipeline.microbatches=6", "train.global_batch=12"))


def test_repeats_only_for_chunked_schedules():
    with pytest.raises(ShardkitError, match=r"pipeline\.repeats"):
        build_layout(recipe("pp", ZERO_BUBBLE, "pipeline.repeats=2", "model.layers=8"))
