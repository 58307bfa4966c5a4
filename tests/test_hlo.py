"""Collective accounting from the optimized HLO: parser rules on hand-written HLO, then the real steps of each layout.

Figures for the tiny Llama, fp32, 8 fake CPU devices. XLA:CPU reduces with all-reduce (+ dynamic-slice) where
XLA:GPU emits reduce-scatter, so a "gradient reduction" here is all-reduce + reduce-scatter bytes.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.analysis.compiled import hlo as si
from shardkit.analysis.compiled import hlo_parse
from shardkit.analysis.predicted.targets import cuda_plugin_available
from shardkit.cli import main
from shardkit.layout import build_layout
from shardkit.step import build_step
from tests.helpers import recipe

NESTED_HLO = """HloModule jit_f, entry_computation_layout={()->f32[8]{0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %v = f32[16]{0} get-tuple-element(%p), index=1
  %ar = f32[16]{0} all-reduce(%v), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %ar)
}

%inner_cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  ROOT %w = (s32[], f32[16]{0}) while(%p), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"4"}}
}

%outer_cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%wrapped_rs (q: f32[64]) -> f32[8] {
  %q = f32[64]{0} parameter(0)
  ROOT %rs = f32[8]{0} reduce-scatter(%q), channel_id=3, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[8], s: (s32[], f32[16])) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %s = (s32[], f32[16]{0}) parameter(1)
  %loop = (s32[], f32[16]{0}) while(%s), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"3"}}
  %ag-start = (f32[8]{0}, f32[64]{0}) all-gather-start(%a), channel_id=2, replica_groups=mesh['x'=2,'y'=4] {'y','x'}, dimensions={0}
  %ag-done = f32[64]{0} all-gather-done(%ag-start)
  %rs-start = ((f32[64]{0}), f32[8]{0}) async-start(%ag-done), calls=%wrapped_rs
  ROOT %rs-done = f32[8]{0} async-done(%rs-start), calls=%wrapped_rs
}
"""


def test_nested_loops_multiply_and_async_pairs_count_once():
    summary = si.collectives_from_module(hlo_parse.parse_hlo(NESTED_HLO), {"x": 2, "y": 4})
    assert summary.count("all-reduce") == 12  # 3 outer x 4 inner trips
    assert summary.bytes("all-reduce") == 12 * 16 * 4
    assert summary.count("all-gather") == 1 and summary.bytes("all-gather") == 64 * 4  # the gathered buffer
    assert summary.count("reduce-scatter") == 1 and summary.bytes("reduce-scatter") == 64 * 4  # the reduced buffer
    # [2,4]<=[4,2]T(1,0) groups {0,2,4,6} and {1,3,5,7}: devices differing along both x and y of a 2x4 mesh.
    assert summary.select("all-reduce")[0].axes == ("x", "y")
    assert summary.wire_bytes("all-reduce") == pytest.approx(12 * 64 * 2 * 3 / 4)


CONDITIONAL_HLO = """HloModule jit_g, entry_computation_layout={()->f32[16]{0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_scale (f: f32[16]) -> f32[16] {
  %f = f32[16]{0} parameter(0)
  ROOT %m = f32[16]{0} multiply(%f, %f)
}

%branch_small (b0: f32[16]) -> f32[16] {
  %b0 = f32[16]{0} parameter(0)
  ROOT %ar0 = f32[16]{0} all-reduce(%b0), channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
}

%small_body (q: (s32[], f32[4])) -> (s32[], f32[4]) {
  %q = (s32[], f32[4]{0}) parameter(0)
  %w = f32[4]{0} get-tuple-element(%q), index=1
  %ar2 = f32[4]{0} all-reduce(%w), channel_id=5, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %u = (s32[], f32[4]{0}) tuple(%j, %ar2)
}

%small_cond (q: (s32[], f32[4])) -> pred[] {
  %q = (s32[], f32[4]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%branch_big (b1: f32[16]) -> f32[16] {
  %b1 = f32[16]{0} parameter(0)
  %slice = f32[8]{0} slice(%b1), slice={[0:8]}
  %ag = f32[64]{0} all-gather(%slice), channel_id=6, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %cp = f32[16]{0} collective-permute(%b1), channel_id=7, source_target_pairs={{0,2},{2,4},{4,6},{1,3},{3,5},{5,7}}
  %z = s32[] constant(0)
  %small = f32[4]{0} slice(%b1), slice={[0:4]}
  %init = (s32[], f32[4]{0}) tuple(%z, %small)
  %inner = (s32[], f32[4]{0}) while(%init), condition=%small_cond, body=%small_body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %fb = f32[16]{0} fusion(%cp), kind=kLoop, calls=%fused_scale
}

%tick_body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %v = f32[16]{0} get-tuple-element(%p), index=1
  %ar = f32[16]{0} all-reduce(%v), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add
  %i = s32[] get-tuple-element(%p), index=0
  %which = s32[] constant(1)
  %branched = f32[16]{0} conditional(%which, %ar, %ar), branch_computations={%branch_small, %branch_big}
  %scaled = f32[16]{0} fusion(%branched), kind=kLoop, calls=%fused_scale
  ROOT %t = (s32[], f32[16]{0}) tuple(%i, %scaled)
}

%tick_cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (s: (s32[], f32[16])) -> f32[16] {
  %s = (s32[], f32[16]{0}) parameter(0)
  %loop = (s32[], f32[16]{0}) while(%s), condition=%tick_cond, body=%tick_body, backend_config={"known_trip_count":{"n":"5"}}
  %out = f32[16]{0} get-tuple-element(%loop), index=1
  ROOT %e = f32[16]{0} exponential(%out)
}
"""
PIPELINE_BY_DATA = {"pipeline": 4, "data": 2}  # device = 2 * pipeline + data


def test_conditional_branches_stay_out_of_the_totals_and_are_bounded_by_the_costliest_branch():
    """A `lax.switch` inside a 5-trip loop: only one branch runs per trip, so branch collectives are not counted as
    if every branch ran (that would give 20 all-reduces); they are reported apart, bounded by the costliest branch."""
    module = hlo_parse.parse_hlo(CONDITIONAL_HLO)
    summary = si.collectives_from_module(module, PIPELINE_BY_DATA)
    assert summary.count("all-reduce") == 5 and summary.bytes("all-reduce") == 5 * 16 * 4  # the loop's own
    assert summary.count("all-gather") == 0 and summary.count("collective-permute") == 0
    branches = {(op.name, str(op.branch), op.count) for op in summary.conditional_ops}
    assert branches == {("ar0", "branched#0", 5), ("ag", "branched#1", 5), ("cp", "branched#1", 5),
                        ("ar2", "branched#1", 10)}
    # Per trip: branch 0 all-reduces 64 B; branch 1 gathers 256 B, permutes 6 pairs x 64 B over 2 pipelines
    # (192 B per pipeline) and all-reduces 2 x 16 B. The bound takes the costlier branch per trip.
    assert summary.conditional_bytes() == 5 * (256 + 192 + 32)
    assert summary.conditional_bytes("all-reduce") == 5 * max(64, 32)
    data = summary.to_json()
    assert set(data) == {"all-reduce", "conditional"}
    assert data["conditional"]["all-gather"]["bytes"] == 5 * 256 and data["conditional"]["all-reduce"]["count"] == 10
    fusion = si.fusion_summary(module)
    assert (fusion["fusions"], fusion["fusions_in_branches"], fusion["fusion_instructions"]) == (5, 5, 2)
    assert [(item["name"], item["kind"], item["count"]) for item in fusion["unfused_elementwise"]] == [
        ("e", "softmax", 1)]


def test_async_fusions_are_kernels_and_their_bodies_are_fused():
    """XLA:GPU of jax 0.11.2 (the H200-compiled 1b step in tests/data/h200_hlo) launches a layer scan's
    dynamic-(update-)slice fusions as `fusion-start`/`fusion-done` pairs: each start is a fused kernel, and the
    computation it calls is a fusion body, not a list of unfused elementwise kernels."""
    text = gzip.open(Path(__file__).parent / "data" / "h200_hlo" / "1b_none_4096x4.hlo.gz", "rt").read()
    module = hlo_parse.parse_hlo(text)
    starts = {instruction.name for computation in module.computations.values()
              for instruction in computation.instructions if instruction.opcode == "fusion-start"}
    assert starts, "the fixture no longer holds asynchronous fusions"
    fusion = si.fusion_summary(module)
    assert fusion["unfused_elementwise"] == []
    fused = hlo_parse.fused_computations(module)
    kernels = {instruction.name for name, computation in module.computations.items() if name not in fused
               for instruction in computation.instructions if instruction.opcode in ("fusion", "fusion-start")}
    assert starts <= kernels and fusion["fusion_instructions"] == len(kernels)


def test_collective_permute_bytes_sum_one_groups_pairs():
    """Six pairs over a pipeline=4 x data=2 mesh are two pipelines of three sends: 3 x 64 B per pipeline."""
    hlo = CONDITIONAL_HLO.replace("branch_computations={%branch_small, %branch_big}",
                                  "branch_computations={%branch_big, %branch_small}")
    summary = si.collectives_from_module(hlo_parse.parse_hlo(hlo), PIPELINE_BY_DATA)
    (permute,) = summary.select("collective-permute", ops=summary.conditional_ops)
    assert (permute.pairs, permute.axes, permute.bytes) == (6, ("pipeline",), 3 * 64)
    no_mesh = si.collectives_from_module(hlo_parse.parse_hlo(hlo))  # groups from the pairs' connected components
    assert no_mesh.select("collective-permute", ops=no_mesh.conditional_ops)[0].bytes == 3 * 64


@pytest.mark.parametrize(
    "attributes, expected",
    [
        ("replica_groups={{0,4},{1,5},{2,6},{3,7}}, x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=[2,4]<=[8], x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=[4,2]<=[2,4]T(1,0), x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['a'=2,'b'=4] {'a'}, x", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("replica_groups=mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}, x", [[0, 1, 2, 3], [4, 5, 6, 7]]),
        ("replica_groups=mesh['a'=8] {'a':(2)2}, x", [[0, 2], [1, 3], [4, 6], [5, 7]]),
        ("source_target_pairs={{0,1},{1,2}}, x", [[0, 1], [1, 2]]),
        ("replica_groups={}, x", [list(range(8))]),
    ],
)
def test_replica_group_forms(attributes, expected):
    assert hlo_parse.replica_groups(attributes, 8) == expected


def test_axes_follow_the_mesh_device_order():
    """On a mesh whose devices are permuted, groups still name the mesh axis the reduction runs over."""
    devices = np.asarray(jax.devices())[[3, 0, 6, 1, 7, 2, 5, 4]].reshape(2, 4)
    mesh = Mesh(devices, ("a", "b"))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("a", "b")))
    out = NamedSharding(mesh, PartitionSpec("a"))
    summary = si.summarize(jax.jit(lambda x: x.sum(axis=1), out_shardings=out), x)
    (op,) = summary.collectives.select("all-reduce")
    assert op.axes == ("b",) and op.group_size == 4


# ---- the training step of each layout ---------------------------------------------------------------------------------
# The suite compiles with XLA:CPU's classic emitters (tests/conftest.py), which leave scalar loop counters and a few
# small elementwise ops outside fusions; what XLA fuses by default is compiled with its fusion emitters back on.
XLA_CPU_DEFAULT_FUSION = {"xla_cpu_use_fusion_emitters": True}


def _summary(name: str, *overrides: str, compiler_options: dict | None = None):
    layout = build_layout(recipe(name, *overrides))
    compiled = build_step(layout).lower().compile(compiler_options=compiler_options)
    return layout, si.hlo_summary(compiled, layout.mesh)


def _param_bytes(layout) -> int:
    return sum(math.prod(leaf.shape) * 4 for leaf in jax.tree.leaves(layout.abstract_params))


def _reduction_bytes(summary, axes) -> float:
    return summary.collectives.bytes("all-reduce", axes) + summary.collectives.bytes("reduce-scatter", axes)


@pytest.fixture(scope="module")
def dp():
    return _summary("dp")


@pytest.fixture(scope="module")
def dp_accum():
    return _summary("dp", "train.global_batch=32", "train.grad_accum=4")


@pytest.fixture(scope="module")
def fsdp():
    return _summary("fsdp", compiler_options=XLA_CPU_DEFAULT_FUSION)


@pytest.fixture(scope="module")
def tp():
    return _summary("tp")


@pytest.mark.slow
def test_dp_reduces_gradients_of_parameter_size(dp):
    layout, summary = dp
    assert _reduction_bytes(summary, ("data",)) == pytest.approx(_param_bytes(layout), rel=0.05)
    assert set(summary.collectives.by_kind()) == {"all-reduce"}


@pytest.mark.slow
def test_dp_accumulation_still_reduces_once_per_step(dp_accum):
    layout, summary = dp_accum
    params = _param_bytes(layout)
    assert _reduction_bytes(summary, ("data",)) == pytest.approx(params, rel=0.05)  # not 4x
    big = [op for op in summary.collectives.select("all-reduce") if op.bytes > 0.01 * params]
    assert sum(op.count for op in big) == 1, big  # one fused gradient all-reduce, outside the micro-batch loop


def _layer_and_outside_bytes(layout) -> tuple[int, dict[str, int]]:
    per_layer, outside = 0, {}
    for (path, leaf) in jax.tree_util.tree_flatten_with_path(layout.abstract_params)[0]:
        name = "/".join(str(getattr(key, "key", key)) for key in path)
        if name.startswith("blocks/"):
            per_layer += math.prod(leaf.shape) * 4
        else:
            outside[name] = math.prod(leaf.shape) * 4
    return per_layer, outside


@pytest.mark.slow
def test_fsdp_gathers_between_one_and_two_times_the_parameters(fsdp):
    """1.73x here, and why: each layer's weights are gathered in the forward loop and again in the backward loop
    (XLA does not keep the gathered copy between the two scans), the head and final norm once (their forward gather
    is reused in the backward pass), and the embedding never: the lookup on the sharded table exchanges rows with an
    all-to-all. The only non-parameter all-gather is the int32 token batch (16 x 64 x 4 bytes)."""
    layout, summary = fsdp
    layers_bytes, outside = _layer_and_outside_bytes(layout)
    tokens = 16 * 64 * 4
    expected = 2 * layers_bytes + outside["head_DV"] + 2 * outside["final_norm_D"] + tokens
    gathered = summary.collectives.bytes("all-gather", ("fsdp",))
    assert gathered == expected
    ratio = (gathered - tokens) / _param_bytes(layout)
    assert 1.0 < ratio < 2.0, ratio


@pytest.mark.slow
def test_fsdp_reduces_gradients_of_parameter_size(fsdp):
    """All gradients but the embedding's are all-reduced (XLA:CPU; reduce-scatter on GPU); the embedding's gradient
    rows go back through the all-to-all of the lookup, so reduction + embedding = parameters (scalars aside)."""
    layout, summary = fsdp
    _, outside = _layer_and_outside_bytes(layout)
    reduced = _reduction_bytes(summary, ("fsdp",))
    assert reduced + outside["embedding_VD"] == pytest.approx(_param_bytes(layout), rel=0.001)
    assert summary.collectives.count("all-to-all", ("fsdp",)) == 2  # the lookup and its transpose


@pytest.mark.slow
def test_fsdp_accumulation_gathers_per_micro_batch():
    """The default, `train.fsdp_sync = "per_microbatch"`: parameters are gathered once per micro-batch (4x).

    Gathering once per step would keep the full parameters alive through the loop, which FSDP exists to avoid, so it
    is the opt-in other mode, `"per_step"`, pinned by tests/test_accumulation.py; this test pins that the default
    still gathers per micro-batch, so a change to either shows up."""
    layout, one = _summary("fsdp", "train.global_batch=32")
    _, four = _summary("fsdp", "train.global_batch=32", "train.grad_accum=4")
    tokens = 32 * 65 * 4  # the token batch also crosses the fsdp axis, once per step
    ratio = (four.collectives.bytes("all-gather") - tokens) / (one.collectives.bytes("all-gather") - tokens)
    assert ratio == pytest.approx(4.0, rel=0.05), f"gathered {ratio:.2f}x per step with 4 micro-batches"


@pytest.mark.slow
def test_tp_all_reduces_four_activations_per_layer_plus_itemised_remainder(tp):
    """Megatron: two all-reduces of b*s*h per layer forward (attention out, MLP down) and two backward. XLA reduces
    the backward input gradients of q, k and v separately (3 instead of 1) and of gate and up (2 instead of 1):
    3 extra per layer. Outside the layers: the embedding lookup (vocab-sharded table) and the head's input gradient,
    one activation each, plus the softmax statistics and scalars of the vocab-sharded cross entropy."""
    layout, summary = tp
    layers = layout.config.layers
    b, s, h = 16 // layout.mesh.shape["data"], 64, layout.config.embed
    activation = b * s * h * 4
    in_layers = sum(op.count * op.bytes for op in summary.collectives.select("all-reduce", ("tensor",))
                    if "while" in op.op_name)
    assert in_layers == (4 + 3) * layers * activation
    outside = summary.collectives.bytes("all-reduce", ("tensor",)) - in_layers
    softmax_stats = 3 * b * s * 4  # max, sum and the target logit, per row
    assert outside == pytest.approx(2 * activation + softmax_stats, abs=64 + 8)  # + loss/grad-norm scalars


@pytest.mark.slow
def test_fusion_summary_counts_kernels(fsdp):
    """XLA fuses every elementwise op of the step (norms, SwiGLU, softmax, rotary): none is left as a kernel of its
    own. Loop bodies run once per layer, so kernels launched exceed the fusion instructions in the program; the exact
    counting rules are pinned on hand-written HLO (test_conditional_branches_...)."""
    _, summary = fsdp
    assert summary.fusion["unfused_elementwise"] == []
    assert summary.fusion["fusions"] > summary.fusion["fusion_instructions"] > 0
    assert summary.fusion["fusions_in_branches"] == 0  # no lax.cond/switch in this step


@pytest.mark.slow
def test_hlo_command_writes_artifacts(tmp_path, capsys):
    out = tmp_path / "hlo"
    assert main(["hlo", "recipes/dp.toml", "--out", str(out)]) == 0
    assert (out / "stablehlo.mlir").read_text().startswith("module")
    assert "HloModule" in (out / "optimized_hlo.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["collectives"]["all-reduce"]["count"] >= 1 and summary["collectives"]["all-reduce"]["bytes"] > 0
    assert summary["memory"]["peak_bytes"] > 0 and summary["flops"]["flops"] > 0
    assert "all-reduce" in capsys.readouterr().out


# ---- compiling for a GPU from this CPU machine --------------------------------------------------------------------------
def test_missing_plugin_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setattr("shardkit.analysis.predicted.targets.cuda_plugin_available", lambda: False)
    assert main(["plan", "recipes/fsdp.toml", "--target", "h100x8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--target" in err and 'pip install "jax[cuda12]' in err


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason='needs the jax[cuda12] plugin: pip install "jax[cuda12]==0.10.2"')
def test_fsdp_on_h100x8_reduce_scatters_gradients():
    """recipes/fsdp.toml compiled for h100x8 as `plan`/`hlo --target` compile it (`compile_layout`: the recipe's GPU
    compiler options), the program test_predict's fsdp case and test_overlap's `hlo --target` compile (one compile on
    their shared worker, tests/conftest.py's `SAME_WORKER`): the layers' and head's gradients are reduce-scattered
    over `fsdp`, exactly the parameter bytes with the embedding's, and no gradient is all-reduced."""
    from shardkit.analysis.planning.plan import compile_layout
    from shardkit.analysis.predicted.targets import parse_target, target_devices

    layout = build_layout(recipe("fsdp"), target_devices(parse_target("h100x8")))
    summary = si.hlo_summary(compile_layout(layout), layout.mesh)
    _, outside = _layer_and_outside_bytes(layout)
    scattered = summary.collectives.bytes("reduce-scatter", ("fsdp",))
    assert scattered + outside["embedding_VD"] == pytest.approx(_param_bytes(layout), rel=0.001)
    assert summary.collectives.count("all-reduce") <= 2  # scalars only: no gradient all-reduce on the GPU
    assert summary.memory["peak_bytes"] > summary.memory["argument_size_in_bytes"] > 0
    assert summary.flops is None  # no cost analysis on the compile-only path


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason='needs the jax[cuda12] plugin: pip install "jax[cuda12]==0.10.2"')
def test_tp_on_h100x8_all_reduces_exactly_four_activations_per_layer():
    """On the GPU pipeline XLA reassociates the q/k/v (and gate/up) input-gradient all-reduces into one, so the
    layers send Megatron's four b*s*h activations per layer and nothing more; the three extra ones seen on XLA:CPU
    (test above) are that backend's, not the layout's. Compiled as `plan --target` compiles it, test_predict's tp
    program (one compile on their shared worker)."""
    from shardkit.analysis.planning.plan import compile_layout
    from shardkit.analysis.predicted.targets import parse_target, target_devices

    layout = build_layout(recipe("tp"), target_devices(parse_target("h100x8")))
    summary = si.hlo_summary(compile_layout(layout), layout.mesh)
    b, s, h = 16 // layout.mesh.shape["data"], 64, layout.config.embed
    activation = b * s * h * 4
    in_layers = sum(op.count * op.bytes for op in summary.collectives.select("all-reduce", ("tensor",))
                    if "while" in op.op_name)
    assert in_layers == 4 * layout.config.layers * activation


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero1", "zero2"])
def test_zero_moves_the_volume_of_data_parallelism(name):
    """ZeRO-1/2: a gradient reduction and an all-gather of the updated parameters over `data`, each of the parameter
    bytes (the design's "same volume as DP"; on XLA:CPU the reduce-scatter shows as all-reduce + slice)."""
    layout, summary = _summary(name)
    params = _param_bytes(layout)
    assert _reduction_bytes(summary, ("data",)) == pytest.approx(params, rel=0.05)
    assert summary.collectives.bytes("all-gather", ("data",)) == pytest.approx(params, rel=0.05)
