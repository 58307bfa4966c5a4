"""Every parallelism inside a pipeline (the 5D layout): accumulation with data parallelism, context and expert
parallelism inside the stages, and every pair of mesh axes building without a "not supported" refusal.

Equivalence runs on 16 fake CPU devices in a process of its own (tests/five_d_worker.py; the suite's own process has
8), fp32, held to one device within tests/equivalence.py's FP32_RTOL (1e-5): a pipeline and accumulation only
reorder fp32 sums (tests/test_pipeline.py's docstring says why that is the tolerance).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import sys

import jax
import pytest

from shardkit.analysis.predicted.targets import cuda_plugin_available, parse_target, target_devices
from shardkit.axes import EXPERT, MESH_AXES, PIPELINE
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.step import build_step, check_step_layout
from tests.helpers import ROOT, fresh_process_env, recipe

WORKER_TIMEOUT_S = 3600

# pipeline 2 x context 2 x fsdp 2 x tensor 2 (all-gather K/V) under GPipe; pipeline 2 x ring context 2 x data 2 x
# tensor 2 with train.grad_accum = 2 under 1F1B, and pipeline 2 x ring context 2 x data 2 x fsdp 2 with
# train.grad_accum = 2 under circular with packed documents (one layer per chunk).
# Ring context under GPipe is the circular case's code path with one repeat (GPipe and circular are one `layer_loop`,
# shardkit/pipeline/gpipe.py: the same ring hops and zigzag reorder inside the stages, the same region per data
# replica and pass of the accumulation), so the circular case holds it. Under the 1F1B family the rows enter in the
# load-balanced order and the ring's hops are all-gathers on CPU (shardkit.attention.ring.Plan.tick_branch), so the
# 1F1B case, context beside tensor parallelism in the stages, also holds all-gather context under 1F1B; FSDP inside
# 1F1B stages is tests/test_one_f_one_b.py's pp_fsdp_tp cases.
# One layer per stage (model.layers=2) and as many micro-batches as stages, where the case is not about a stage's scan
# over layers: m = p still runs the schedule's warm-up, steady state and drain.
ONE_LAYER = "model.layers=2"
CP_TP = ["mesh.sequence=2", ONE_LAYER, "pipeline.microbatches=2"]
# 16 sequences, 8 a pass of the accumulation, 4 a pipeline micro-batch, 2 (1F1B: data) or 1 (circular: data x fsdp)
# a replica.
CP_RING_ACCUMULATED = ["mesh.data=2", "mesh.sequence=2", "train.context=ring", "train.grad_accum=2",
                       "pipeline.microbatches=2"]
ACCUMULATION_CASES = [
    ["pp_fsdp_tp", ["mesh.tensor=2", "mesh.fsdp=1", *CP_RING_ACCUMULATED, ONE_LAYER, "pipeline.schedule=1f1b"]],
    ["pp_fsdp_tp", ["mesh.tensor=1", "mesh.fsdp=2", *CP_RING_ACCUMULATED, "pipeline.schedule=circular",
                    "pipeline.repeats=2", "data.packing=documents", "data.eos_id=3"]],
]
CONTEXT_CASES = [["pp_fsdp_tp", CP_TP], *ACCUMULATION_CASES]
# MoE with capacity routing, so that drop counts are compared too: pipeline 2 x context 2 x expert 2 x fsdp 2 under
# GPipe (the router statistics carried through the stages with the residual stream), and pipeline 2 x expert 4 x
# fsdp 2 under zero_bubble (each chunk's statistics and its share of the auxiliary loss summed stage by stage, its
# gradient split between the B and W ticks). Zero bubble holds 1f1b's MoE path: the 1F1B family shares the chunks'
# statistics and loss shares, zero bubble splitting each backward further; 1f1b itself is held to one device by
# tests/test_one_f_one_b.py and compiled with experts for h100x8 below.
CAPACITY = ["model.routing=capacity", "model.capacity_factor=1.0"]
EXPERT_CASES = [
    ["moe_ep", ["mesh.pipeline=2", "mesh.sequence=2", "mesh.expert=2", "mesh.data=1", "mesh.fsdp=2",
                "pipeline.microbatches=2", ONE_LAYER, *CAPACITY]],
    ["moe_ep", ["mesh.pipeline=2", "mesh.expert=4", "mesh.data=1", "mesh.fsdp=2", "pipeline.microbatches=2", ONE_LAYER,
                *CAPACITY, "pipeline.schedule=zero_bubble"]],
]


@pytest.fixture(scope="module")
def worker_output() -> str:
    """Every equivalence case of this module run by one tests/five_d_worker.py on 16 devices: one process start, and
    the cases that differ only in their mesh, schedule, accumulation or context mode share a one-device reference
    (the context cases all the same one, except the packed documents')."""
    result = subprocess.run([sys.executable, "-m", "tests.five_d_worker", "16",
                             json.dumps(CONTEXT_CASES + EXPERT_CASES)],
                            cwd=ROOT, env=fresh_process_env(), capture_output=True, text=True,
                            timeout=WORKER_TIMEOUT_S)
    return result.stdout + result.stderr[-4000:] if result.returncode else result.stdout


def assert_cases_passed(output: str, cases: list) -> None:
    for name, overrides in cases:
        assert f"ok {' '.join([name, *overrides])}\n" in output, output


@pytest.mark.slow
def test_accumulation_with_pipeline_and_data_parallelism_is_one_device(worker_output):
    """pipeline 2 x data 2 x fsdp 2 or tensor 2 (x ring context 2) with train.grad_accum = 2, under circular (GPipe's
    loop) and 1F1B: each replica runs its own pipeline per pass of the accumulation, and the passes' gradients add up
    to one device's whole batch. The cases are two of the context test's (CONTEXT_CASES): one worker runs them
    once."""
    assert_cases_passed(worker_output, ACCUMULATION_CASES)


@pytest.mark.slow
def test_context_parallelism_inside_pipelines_is_one_device(worker_output):
    assert_cases_passed(worker_output, CONTEXT_CASES)


@pytest.mark.slow
def test_expert_parallelism_inside_a_pipeline_is_one_device(worker_output):
    assert_cases_passed(worker_output, EXPERT_CASES)


def test_accumulation_with_a_pipeline_and_data_replicas_is_accepted():
    """The issue's command: `recipes/pp.toml --set mesh.pipeline=2 --set mesh.data=2 --set mesh.fsdp=2 --set
    train.grad_accum=2` builds and passes the step's checks (no compile)."""
    layout = build_layout(recipe("pp", "mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "train.grad_accum=2",
                                 "pipeline.microbatches=2"))
    check_step_layout(layout)


# ---- every pair of mesh axes ---------------------------------------------------------------------------------------
PAIRS = list(itertools.combinations(MESH_AXES, 2))
# A pair with `pipeline` is built under every schedule (interleaved_1f1b with 2 chunks per stage).
SCHEDULES = {"gpipe": (), "circular": ("pipeline.repeats=2",), "1f1b": (),
             "interleaved_1f1b": ("pipeline.repeats=2",), "zero_bubble": ()}
PAIR_LAYOUTS = [(first, second, schedule) for first, second in PAIRS
                for schedule in (SCHEDULES if PIPELINE in (first, second) else [None])]


def pair_recipe(first: str, second: str, schedule: str | None = None):
    """The tiny model (the MoE one where `expert` is in the pair) on a 2 x 2 mesh of the two axes, under `schedule`
    where `pipeline` is one of them."""
    model = ("model.name=moe", "model.preset=moe-tiny") if EXPERT in (first, second) else ()
    pipeline = ("pipeline.microbatches=2", f"pipeline.schedule={schedule}", *SCHEDULES[schedule]) if schedule else ()
    return recipe("single", *model, *pipeline, f"mesh.{first}=2", f"mesh.{second}=2")


@pytest.mark.parametrize("first, second, schedule", PAIR_LAYOUTS, ids=lambda value: str(value))
def test_every_pair_of_mesh_axes_builds_without_a_not_supported_refusal(first, second, schedule):
    """No two parallelisms refuse each other, under any pipeline schedule: every pair builds its layout and passes
    the step's checks (nothing is compiled; the equivalence tests above and in each axis's own module train them)."""
    try:
        check_step_layout(build_layout(pair_recipe(first, second, schedule), jax.devices()[:4]))
    except ShardkitError as error:
        assert "not supported" not in str(error), str(error)
        raise


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for compile-only GPU devices")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_context_parallelism_inside_a_pipeline_runs_cudnn_attention_on_h100x8(schedule):
    """recipes/pp_cp.toml in bf16 (head_dim 64, `train.attention=cudnn`) compiled for 8 H100s: every block of the
    context-parallel attention inside the stages is a cuDNN flash-attention call. Under GPipe each backward call comes
    with three forward ones: the forward pass, the tick's rematerialisation and the nested region's own recompute
    (shardkit/nested.py); under 1F1B (rows in the load-balanced order, no reorder inside the tick switch) each
    backward branch's calls come with two forward ones (the branch's recompute and the nested region's) and the
    forward ticks' branches add their own."""
    rec = recipe("pp_cp", "train.attention=cudnn", "precision.policy=bf16", "model.head_dim=64", "model.layers=2",
                 "model.embed=128", "model.heads=4", "model.kv_heads=2", "pipeline.microbatches=2",
                 "train.global_batch=8", f"pipeline.schedule={schedule}")
    text = build_step(build_layout(rec, target_devices(parse_target("h100x8")))).compile().as_text()
    calls = lambda target: text.count(f'custom_call_target="{target}"')
    backward, forward = calls("__cudnn$fmhaSoftmaxBackward"), calls("__cudnn$fmhaSoftmax")
    paired = forward == 3 * backward if schedule == "gpipe" else forward > 2 * backward
    assert backward > 0 and paired, (forward, backward)


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for compile-only GPU devices")
def test_experts_and_ring_context_under_1f1b_compile_for_h100x8():
    """MoE pipeline 2 x ring context 2 x expert 2 under 1f1b, bf16, compiled by XLA:GPU's partitioner for 8 H100s:
    the experts' all-to-alls and the ring's hops (collective-permutes on GPU: the all-gather hop is CPU's only) sit in
    the tick switch's branches. One layer a stage: the branches run the stage's scan over its layers, whatever
    their number."""
    rec = recipe("moe_ep", "mesh.pipeline=2", "mesh.sequence=2", "mesh.expert=2", "mesh.data=1", "mesh.fsdp=1",
                 "train.context=ring", "precision.policy=bf16", "pipeline.schedule=1f1b", "pipeline.microbatches=2",
                 ONE_LAYER)
    text = build_step(build_layout(rec, target_devices(parse_target("h100x8")))).compile().as_text()
    in_branches = lambda op, primitive: re.findall(
        rf"= [^\n]* {op}(?:-start)?\([^\n]*op_name=\"[^\"]*/cond/branch_\d+_fun/[^\"]*/{primitive}\"", text)
    assert in_branches("all-to-all", "all_to_all") and in_branches("collective-permute", "ppermute")
