"""The step-time model against published runs (the README's table), and its NCCL and kernel pieces."""

from __future__ import annotations

import pytest

from shardkit.analysis.predicted.nccl import Fabric, Group, collective_seconds
from shardkit.analysis.predicted.rates import RATES, gemm_seconds
from shardkit.analysis.predicted.step_model import step_time
from shardkit.analysis.predicted.targets import cuda_plugin_available, parse_target, usable_bytes
from shardkit.analysis.search.planned import base_layout, candidate_layout
from shardkit.analysis.search.published import BF16, LLAMA2_7B, RUNS, table
from shardkit.analysis.search.suggest import load_base, rank_layouts

TOLERANCE = 0.15


@pytest.mark.parametrize("run", RUNS, ids=lambda run: f"{run.name} {run.target}")
def test_every_published_row_is_predicted_within_15_percent(run):
    ratio = run.ratio()
    assert abs(ratio - 1) <= TOLERANCE, f"{run.name} on {run.target}: predicted / published = {ratio:.2f}"


def test_one_row_is_the_calibration_and_every_other_is_a_prediction():
    assert [run.calibration for run in RUNS].count(True) == 1
    assert "yes: `kernels.OVERHEAD` is fitted on it" in table()


def test_clusters_that_differ_from_dgx_are_their_own_targets():
    """A3's network (4 x 200 Gb/s per 8 GPUs) and Grand Teton's H100s (2.4 TB/s HBM2e, 500 W) as targets."""
    a3, gt = parse_target("h100-a3:2x8"), parse_target("h100-gtx8")
    assert (a3.gpu, a3.hosts, a3.per_host) == ("h100-a3", 2, 8) and str(gt) == "h100-gtx8"
    assert a3.spec.inter_host_bandwidth * 8 == pytest.approx(4 * 200e9 / 8)
    assert RATES["h100-gt"].memory_bandwidth == 2.4e12 and 835e12 < gt.spec.peak_bf16_flops < 989e12


def test_gradients_are_reduce_scattered_over_fsdp_then_all_reduced_over_data_and_exposed():
    """As XLA:GPU compiles data x fsdp (h100:2x4): the all-reduce over `data` moves the fsdp shard, and it is exposed
    (XLA waits for it at the end of each backward iteration); the reduce-scatter over `fsdp` hides behind compute."""
    target = parse_target("h100-a3:2x8")
    recipe = load_base("recipes/fsdp.toml", (*LLAMA2_7B, *BF16, "mesh.data=2", "mesh.fsdp=8",
                                              "train.global_batch=64", "train.seq_len=4096"))
    time = step_time(candidate_layout(base_layout(recipe), recipe, target), target)
    grads = {(c.item.kind, c.item.axes): c for c in time.comm if c.item.what == "gradients"}
    over_data, over_fsdp = grads[("all-reduce", ("data",))], grads[("reduce-scatter", ("fsdp",))]
    assert over_data.item.bytes == pytest.approx(over_fsdp.item.bytes / 8)
    assert over_data.exposed == over_data.seconds and over_data.link == "inter-host"
    assert over_fsdp.exposed < over_fsdp.seconds / 10


def test_suggest_puts_fsdp8_in_the_top_3_for_llama2_7b_at_42_to_58_percent_mfu():
    target = parse_target("h100x8")
    recipe = load_base("recipes/fsdp.toml", (*LLAMA2_7B, *BF16, "train.global_batch=32", "train.seq_len=4096"))
    ranked, _ = rank_layouts(recipe, target, usable_bytes(target.gpu, 0.9))
    top = [item.candidate.sizes for item in ranked[:3]]
    assert any(sizes["fsdp"] == 8 and all(v == 1 for k, v in sizes.items() if k != "fsdp") for sizes in top), top
    assert 0.42 <= ranked[0].time.mfu <= 0.58, ranked[0].time.mfu


def test_a_node_receives_what_it_lacks_over_all_its_nics():
    """All-gather of 8 GB over 8 nodes x 8 GPUs: each node receives 7/8 of it over its 8 NICs (40 GB/s each), while
    NVLink carries the ring's 63/64 at 360 GB/s; the network sets the time."""
    fabric = Fabric(nvlink=360e9, nic=40e9)
    seconds = collective_seconds("all-gather", 8e9, Group(nodes=8, per_node=8), fabric)
    latency = 8.4e-6 + 56 * 3.4e-6 + 7 * 6.6e-6  # NCCL: base + 63 ring steps, 7 of them between nodes
    assert seconds == pytest.approx(latency + 8e9 * 7 / 8 / (8 * 40e9))
    one_gpu_per_node = collective_seconds("all-gather", 8e9, Group(nodes=8, per_node=1), fabric)
    assert one_gpu_per_node > 7 * seconds


def test_small_collectives_cost_their_latency():
    fabric = Fabric(nvlink=360e9, nic=40e9)
    tiny = collective_seconds("all-reduce", 1024, Group(nodes=1, per_node=8), fabric)
    assert 8.4e-6 + 14 * 3.4e-6 <= tiny < 1e-4  # NCCL's base latency + 2(n-1) NVLink steps


def test_gemms_reach_the_measured_rate_only_when_large():
    h100 = RATES["h100"]
    large = gemm_seconds(h100, 8192, 8192, 8192)
    assert 2 * 8192**3 / large == pytest.approx(798e12, rel=0.1)
    skinny = gemm_seconds(h100, 16, 8192, 8192)  # memory-bound: reads the 128 MiB weight
    assert 2 * 16 * 8192**2 / skinny < 0.1 * 798e12


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
def test_suggest_plan_and_hlo_print_the_same_step_for_one_compiled_layout(tmp_path, capsys):
    """The tiny fsdp recipe compiled for h100x8 by suggest's re-rank, by `plan --target` and by `hlo --target`: each
    prints the replay's step line, and the three lines are the same."""
    import jax

    from shardkit.analysis.predicted.steptime import REPLAY
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.analysis.search.candidates import Candidate
    from shardkit.analysis.search.planned import peak_bytes
    from shardkit.analysis.search.suggest import Ranked, Search, Suggestion, compile_ranked, format_suggestion
    from shardkit.axes import MESH_AXES
    from shardkit.cli import main

    assert len(jax.devices()) == 8  # start the suite's 8 devices before `--target` would set up one
    target = parse_target("h100x8")
    recipe = load_base("recipes/fsdp.toml", ())
    layout = candidate_layout(base_layout(recipe), recipe, target)
    candidate = Candidate(tuple((axis, layout.mesh.shape[axis]) for axis in MESH_AXES), recipe.train.remat,
                          recipe.train.grad_accum)
    ranked = Ranked(candidate, recipe, layout, peak_bytes(layout), step_time(layout, target))
    compile_ranked(ranked, target, target_devices(target))
    assert ranked.compile_error is None and ranked.best_time.source == REPLAY
    usable = usable_bytes(target.gpu, 0.9)
    lines = {"suggest": format_suggestion(Suggestion(recipe, target, usable, [ranked], Search(), 1), 1)}
    assert main(["plan", "recipes/fsdp.toml", "--target", "h100x8"]) == 0
    lines["plan"] = capsys.readouterr().out
    assert main(["hlo", "recipes/fsdp.toml", "--target", "h100x8", "--out", str(tmp_path)]) == 0
    lines["hlo"] = capsys.readouterr().out
    predicted = {name: [line[line.index("predicted step on"):] for line in text.splitlines()
                        if "predicted step on" in line] for name, text in lines.items()}
    assert all(len(found) == 1 for found in predicted.values()), predicted
    assert predicted["suggest"] == predicted["plan"] == predicted["hlo"], predicted


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
@pytest.mark.parametrize("policy, grad_reduce, dtype", [("bf16", "compute", "bf16"), ("float32", "compute", "f32"),
                                                        ("bf16", "float32", "f32")])
def test_compiled_gradient_reductions_move_the_policys_grad_reduce_dtype(policy, grad_reduce, dtype):
    """The tiny fsdp recipe compiled for h100x8: most of the bytes its reduce-scatters and all-reduces move are in
    `Policy.grad_reduce_dtype` (the layers' weights), which is what `plan` states and the analytic model prices; with
    bf16 compute, `precision.grad_reduce = "float32"` moves them to fp32 (shardkit.nn.dot's fp32 weight gradients)."""
    import jax
    import numpy as np

    from shardkit.analysis.compiled.hlo import hlo_summary
    from shardkit.analysis.compiled.hlo_parse import DTYPE_BYTES
    from shardkit.analysis.planning.plan import compile_layout, compiled_reduction_precision
    from shardkit.analysis.predicted.estimate import communication_estimate
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.layout import build_layout

    assert len(jax.devices()) == 8
    target = parse_target("h100x8")
    overrides = (f"precision.policy={policy}", f"precision.grad_reduce={grad_reduce}")
    layout = build_layout(load_base("recipes/fsdp.toml", overrides), target_devices(target))
    compiled = compile_layout(layout)
    ops = hlo_summary(compiled, layout.mesh).collectives.ops
    precision = compiled_reduction_precision(layout, ops)
    by_dtype = precision["compiled"]
    assert max(by_dtype, key=by_dtype.get) == dtype, by_dtype
    assert by_dtype[dtype] > 0.6 * sum(by_dtype.values()), by_dtype
    assert np.dtype(layout.policy.grad_reduce_dtype).itemsize == DTYPE_BYTES[dtype]
    assert precision["policy"] in precision["note"] and dtype in precision["note"]
    # The analytic model prices the reductions in the same dtype: within 5% of the compiled bytes.
    reductions = ("all-reduce", "reduce-scatter")
    analytic = sum(item.bytes for item in communication_estimate(layout) if item.kind in reductions)
    assert analytic == pytest.approx(sum(by_dtype.values()), rel=0.05), (analytic, by_dtype)


BYTES_CASES = [("single", "h100x1", ())] + [(name, "h100x8", ()) for name in (
    "cp", "dp", "fsdp", "fsdp_tp", "moe_ep", "moe_ep_fsdp", "pp", "pp_fsdp_tp", "tp", "tp_sp", "zero1", "zero2")] + [
    ("fsdp", "h100x8", ("model.preset=8b", "precision.policy=bf16", "train.seq_len=4096", "train.global_batch=16"))]


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
@pytest.mark.parametrize("name, target_text, overrides", BYTES_CASES,
                         ids=lambda value: str(value) if isinstance(value, str) else "+".join(value) or "recipe")
def test_analytic_and_compiled_bytes_per_collective_within_5_percent(name, target_text, overrides):
    """Every collective family and mesh-axes row of `plan --target`'s comparison within 5%, rows under 1% of the
    step's compiled bytes (loss and norm scalars, token ids) aside."""
    import jax

    from shardkit.analysis.planning.plan import analytic_vs_compiled, compile_layout
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.layout import build_layout

    assert len(jax.devices()) == 8
    target = parse_target(target_text)
    layout = build_layout(load_base(f"recipes/{name}.toml", overrides), target_devices(target))
    rows = analytic_vs_compiled(layout, compile_layout(layout))["communication"]
    total = sum(row["compiled"] for row in rows)
    off = [row for row in rows if row["compiled"] > 0.01 * total or row["analytic"] > 0.01 * total
           if not row["analytic"] or abs(row["compiled"] / row["analytic"] - 1) > 0.05]
    assert not off, off
