"""The analytic model's pipeline parts: the tick executor's named memory terms, suggest's schedules priced by them,
and, against the compiled pipeline, bytes per step and the peak per device per schedule, analytic / compiled within
[0.9, 1.1] (XLA:GPU's program for h100x8, compiled on this CPU).

Each compiled case is compiled once (a module-scoped fixture) and read by both of its tests. The cases the model does
not yet count are strict xfails naming what differs, so that a fix shows up as an unexpected pass.

At the end, the 1F1B family's tick switches (shardkit/analysis/compiled/tick_branches.py): pp_fsdp_tp compiled for
h100x8 once per case (each schedule, and each with FSDP gathering per use), each stage's modelled bytes
(shardkit/analysis/predicted/tick_bytes.py) / its exact compiled bytes within [0.9, 1.1] per collective family (plan's
matching: all-reduce and reduce-scatter are one family). They sit in this module because its peak cases compile two of
the same programs, which one test process compiles once (tests/compile_only_memo.py).
"""

from __future__ import annotations

import functools

import pytest

from shardkit.analysis.compiled.hlo import collectives_from_module
from shardkit.analysis.compiled.hlo_parse import parse_hlo
from shardkit.analysis.compiled.tick_branches import attribute_ticks, branch_name_bytes, by_kind, exact_tick_bytes
from shardkit.analysis.predicted.targets import cuda_plugin_available, parse_target
from shardkit.analysis.predicted.xla_buffers import SKIP_REASON, matches_jax
from shardkit.analysis.search.suggest import load_base
from tests.helpers import HIGH, LOW, SCHEDULES

# What the buffer tests hold follows one XLA version's buffer assignment: on another they skip rather than drift (the
# tick switches' exact bytes at the end of the module read collectives only, and run on every version).
XLA_BUFFERS = pytest.mark.skipif(not matches_jax(), reason=SKIP_REASON)


# The compiled cases of recipes/pp.toml: one sequence per data replica a micro-batch and two layers per chunk, on 2
# stages (data 4) at m = p = 2 (a warm-up, a steady one-forward-one-backward tick and a drain per stage; the 1F1B
# family's tick loop is unrolled, so its compile grows with stages x micro-batches x chunks), except circular, which
# stays on the recipe's 4 stages at m = 4: with two chunks a stage its re-layout into chunk order is the one that needs
# the collective-permute (v not a multiple of p; at p = 2 the all-to-all alone re-lays it, as under interleaved_1f1b
# here). The shipped recipe (4 stages, one layer a chunk, m = 8, gpipe) is test_pipeline_estimate_shipped.py's. With
# two sequences a replica the heap packs the temporaries up to 2.3 MiB above their live bytes (1f1b 0.87, circular
# 0.88). README, "The analytic model against the compiled pipeline".
TWO_STAGES = ("mesh.pipeline=2", "pipeline.microbatches=2", "train.global_batch=8")
TWO_A_CHUNK = (*TWO_STAGES, "model.layers=4")
TWO_A_CHUNK_CHUNKED = (*TWO_STAGES, "pipeline.repeats=2", "model.layers=8")
FOUR_STAGES_CHUNKED = ("pipeline.microbatches=4", "train.global_batch=8", "pipeline.repeats=2", "model.layers=16")
# pp_fsdp_tp's 1F1B-family cases at m = p = 2: a warm-up, a steady one-forward-one-backward tick and a drain per stage,
# the micro-batch as the recipe has it (two sequences a fsdp shard); the tick loop is unrolled, so its compile grows
# with m. The tick switches' cases at the end of the module compile the same programs.
M_IS_P = ("pipeline.microbatches=2", "train.global_batch=8")
COMPILED = {
    ("pp", "gpipe"): ("pipeline.schedule=gpipe", *TWO_A_CHUNK),
    ("pp", "1f1b"): ("pipeline.schedule=1f1b", *TWO_A_CHUNK),
    ("pp", "zero_bubble"): ("pipeline.schedule=zero_bubble", *TWO_A_CHUNK),
    ("pp", "interleaved_1f1b"): ("pipeline.schedule=interleaved_1f1b", *TWO_A_CHUNK_CHUNKED),
    ("pp", "circular"): ("pipeline.schedule=circular", *FOUR_STAGES_CHUNKED),
    # The recipe as it is (4 micro-batches, two layers a stage): tests/test_predict.py compiles the same program.
    ("pp_fsdp_tp", "gpipe"): SCHEDULES["gpipe"],
    ("pp_fsdp_tp", "1f1b"): (*SCHEDULES["1f1b"], *M_IS_P),
    ("pp_fsdp_tp", "zero_bubble"): (*SCHEDULES["zero_bubble"], *M_IS_P),
}
# (recipe, schedule, figure) -> why analytic / compiled is still outside [0.9, 1.1] (measured for h100x8). Empty since
# the running tick's working set counts the running layer's whole set rebuilt and its largest split-K partial sums,
# and the 1F1B family's gradients at the peak are the sums its tick loop carries (README, "The analytic model against
# the compiled pipeline").
NOT_YET_MODELLED: dict[tuple[str, str, str], str] = {}
# pp_fsdp_tp's bytes are held per collective by tests/test_predict.py (within 5%, gpipe), so its cases here are
# compiled for the peak only.
BYTES_RECIPES = ("pp",)


def cases(figure: str, recipes=("pp", "pp_fsdp_tp")) -> list:
    """Every case of `recipes`, as a strict xfail where `figure` is not yet modelled for it."""
    out = []
    for recipe, schedule in COMPILED:
        if recipe not in recipes:
            continue
        reason = NOT_YET_MODELLED.get((recipe, schedule, figure))
        marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
        out.append(pytest.param((recipe, schedule), marks=marks, id=f"{recipe}-{schedule}"))
    return out


def _layout(schedule: str, *overrides: str):
    from shardkit.layout import build_layout

    return build_layout(load_base("recipes/pp.toml", (*SCHEDULES[schedule], *overrides)))


@XLA_BUFFERS
def test_tick_buffers_hold_the_schedules_stage_inputs():
    """p=4, m=8: 1f1b's buffer holds p stage inputs, zero_bubble's 2p - 1 (kept until W); the region's edges are the
    whole batch and its gradient; the loss's logits are one micro-batch's, not the batch's as under gpipe."""
    from shardkit.analysis.predicted.estimate import memory_estimate
    from shardkit.analysis.predicted.pipeline_memory import tick_schedule_memory_terms
    from shardkit.pipeline import microbatch_activation_bytes

    one_f_one_b, zero_bubble = _layout("1f1b"), _layout("zero_bubble")
    stage_input = microbatch_activation_bytes(one_f_one_b)
    terms = tick_schedule_memory_terms(one_f_one_b)
    assert terms["stage_inputs"] == 4 * stage_input
    assert terms["region_edges"] == 4 * 8 * stage_input
    assert tick_schedule_memory_terms(zero_bubble)["stage_inputs"] == 7 * stage_input
    gpipe = memory_estimate(_layout("gpipe"))
    assert memory_estimate(one_f_one_b).logits < gpipe.logits / 4


@XLA_BUFFERS
def test_chunked_terms_hold_one_copy_of_the_stage_and_the_running_chunk():
    """interleaved_1f1b, v=2: the re-layout into chunk order is the region's one copy of the stage (no term of its
    own), and the running tick's chunk, picked by a dynamic index, is a copy of half of it; one chunk (1f1b) is read
    in place."""
    from shardkit.analysis.predicted.pipeline_memory import tick_schedule_memory_terms

    interleaved, one_f_one_b = _layout("interleaved_1f1b"), _layout("1f1b", "model.layers=8")
    terms = tick_schedule_memory_terms(interleaved)
    assert terms["stage_weights"] == tick_schedule_memory_terms(one_f_one_b)["stage_weights"] > 0
    assert terms["chunk_weights"] == terms["stage_weights"] / 2
    assert tick_schedule_memory_terms(one_f_one_b)["chunk_weights"] == 0
    assert "chunk_relayout" not in terms


@XLA_BUFFERS
def test_a_per_step_fsdp_gather_keeps_the_tick_loops_copy_of_the_stage():
    """pp_fsdp_tp under 1f1b: the stage's layers gathered over `fsdp` once per step (`gathered_params`) and the tick
    loop's own copy in its layout (`stage_weights`), both held through the ticks; the same size as the gradient sums."""
    from shardkit.analysis.predicted.comm_terms import pipeline_stage_gather_bytes
    from shardkit.analysis.predicted.pipeline_memory import tick_schedule_memory_terms
    from shardkit.layout import build_layout

    layout = build_layout(load_base("recipes/pp_fsdp_tp.toml", SCHEDULES["1f1b"]))
    terms = tick_schedule_memory_terms(layout)
    assert pipeline_stage_gather_bytes(layout, 4) > 0
    assert terms["stage_weights"] == terms["stage_gradient_sums"] > 0


@XLA_BUFFERS
def test_a_lone_action_keeps_its_tick_switch_a_conditional():
    """A tick where every stage takes one action (interleaved_1f1b's all-forward and all-backward ticks) still picks
    between two branches, IDLE onto idle, so that neither jax.lax.switch nor XLA reduces it to straight-line code
    whose chunk scans' buffers XLA:GPU would make all at once (`one_f_one_b.tick_switch`)."""
    from shardkit.pipeline.one_f_one_b import tick_switch
    from shardkit.pipeline.program import Action

    names, index = tick_switch((Action.BACKWARD,))
    assert names == ["backward", "idle"]
    assert index[Action.BACKWARD] == 0 and index[Action.IDLE] == 1
    assert tick_switch((Action.IDLE,))[0] == ["idle"]
    names, index = tick_switch((Action.IDLE, Action.FORWARD, Action.BACKWARD))
    assert [names[i] for i in index[[Action.IDLE, Action.FORWARD, Action.BACKWARD]]] == ["idle", "forward", "backward"]


@XLA_BUFFERS
def test_loop_buffers_grow_with_microbatches_only_by_the_ticks_inputs_and_the_batch_edges():
    """gpipe, two layers per stage, one sequence per replica's micro-batch at m = 4 and 8: the inlined ticks' buffers
    (4 of the 5 single-tick runs) and the running tick's chunk are one micro-batch's; what grows with m is the ticks'
    saved inputs (m + p - 1), the batch's gradient at the region's edge and the whole batch's logits' gradient. A
    one-layer chunk has no scan over its layers, so its inlined ticks hold only their layer's gradient."""
    from shardkit.analysis.predicted.pipeline_memory import chunk_saved_activation_bytes, loop_schedule_memory_terms
    from shardkit.pipeline import microbatch_activation_bytes

    def layout(m: int, layers: int = 8):
        from shardkit.layout import build_layout

        return build_layout(load_base("recipes/pp.toml", ("pipeline.schedule=gpipe", f"model.layers={layers}",
                                                          f"pipeline.microbatches={m}", f"train.global_batch={2 * m}")))

    four, eight = layout(4), layout(8)
    stage_input = microbatch_activation_bytes(four)
    terms_four, terms_eight = loop_schedule_memory_terms(four), loop_schedule_memory_terms(eight)
    chunk_gradient = terms_four["inlined_tick_buffers"] / 4 - chunk_saved_activation_bytes(four)
    assert chunk_gradient > 0
    for name in ("inlined_tick_buffers", "microbatch_activations"):
        assert terms_four[name] == terms_eight[name]
    assert terms_four["tick_inputs"] == (4 + 3) * stage_input
    assert terms_eight["tick_inputs"] - terms_four["tick_inputs"] == 4 * stage_input
    assert terms_eight["region_edge_gradient"] == 2 * terms_four["region_edge_gradient"] == 8 * stage_input
    assert terms_eight["region_output_gradient"] == terms_eight["region_edge_gradient"]
    assert loop_schedule_memory_terms(layout(4, layers=4))["inlined_tick_buffers"] == 4 * chunk_gradient / 2
    # The run of two ticks holds 4 chunk gradients at its backward, fewer than the single-tick runs' phase.
    assert terms_four["looped_run_gradients"] == terms_eight["looped_run_gradients"] == 0


@XLA_BUFFERS
def test_a_long_tick_run_holds_the_later_runs_gradients_and_its_running_ticks_own():
    """pp_fsdp_tp under gpipe (p=2, m=4): ticks 0-3 send alike (one scan of 4 ticks), tick 4 is a run of its own.
    The long run's backward, after the last tick's, holds that tick's chunk gradient and the running tick's own beside
    the run's sum: two chunk gradients (the stage's layers gathered over `fsdp`, compute dtype), where the one single
    run holds nothing beside its own (`inlined_tick_buffers` 0)."""
    from shardkit.analysis.predicted.memory_terms import replica_elements_by_role
    from shardkit.analysis.predicted.pipeline_memory import loop_schedule_memory_terms
    from shardkit.analysis.predicted.xla_buffers import looped_run_gradients_held
    from shardkit.layout import build_layout
    from shardkit.pipeline.schedule import tick_runs

    layout = build_layout(load_base("recipes/pp_fsdp_tp.toml", SCHEDULES["gpipe"]))
    assert [(first, count) for first, count, _ in tick_runs(layout.pipeline)] == [(0, 4), (4, 1)]
    assert looped_run_gradients_held(layout.pipeline) == 2
    terms = loop_schedule_memory_terms(layout)
    assert terms["inlined_tick_buffers"] == 0
    assert terms["looped_run_gradients"] == 2 * replica_elements_by_role(layout)["layers"] * 4 > 0


@XLA_BUFFERS
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for --target's devices")
def test_xla_attention_in_a_chunk_scan_holds_the_hoisted_causal_mask():
    """pp_fsdp_tp (fp32, so XLA's attention; two layers a chunk) on h100x8, at one micro-batch's score shape (2
    sequences x 4 heads a device x 64 x 64): under gpipe the recompute scan's causal mask (one byte an element) and
    fp32 fill value beside the transposed scan's mask; under the 1F1B family the transposed scan's mask alone (the
    recompute's pair dies before it). Nothing where no scan over layers runs XLA's attention: one layer a chunk,
    cuDNN's fused kernel (bf16), or XLA:CPU (not read there)."""
    from shardkit.analysis.predicted.pipeline_memory import loop_schedule_memory_terms, tick_schedule_memory_terms
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.layout import build_layout

    def terms(recipe: str, schedule: str, *overrides: str, on_gpu: bool = True) -> dict:
        devices = target_devices(parse_target("h100x8")) if on_gpu else None
        layout = build_layout(load_base(recipe, (*SCHEDULES[schedule], *overrides)), devices)
        return (tick_schedule_memory_terms if layout.pipeline.one_f_one_b else loop_schedule_memory_terms)(layout)

    scores = 2 * 4 * 64 * 64
    assert terms("recipes/pp_fsdp_tp.toml", "gpipe")["causal_mask"] == scores * (4 + 1 + 1)
    for schedule in ("1f1b", "zero_bubble"):
        assert terms("recipes/pp_fsdp_tp.toml", schedule)["causal_mask"] == scores * 1
    assert terms("recipes/pp_fsdp_tp.toml", "gpipe", "precision.policy=bf16")["causal_mask"] == 0
    assert terms("recipes/pp_fsdp_tp.toml", "1f1b", "precision.policy=bf16")["causal_mask"] == 0
    assert terms("recipes/pp_fsdp_tp.toml", "gpipe", on_gpu=False)["causal_mask"] == 0
    assert terms("recipes/pp.toml", "gpipe")["causal_mask"] == 0  # as shipped: one layer a stage


@XLA_BUFFERS
def test_circular_holds_one_copy_of_the_stage_in_chunk_order():
    """circular, v=2: the re-layout into chunk order is a copy of the stage's stored layers, held through the step;
    gpipe reads its stage in place."""
    from shardkit.analysis.predicted.memory_terms import replica_elements_by_role
    from shardkit.analysis.predicted.pipeline_memory import loop_schedule_memory_terms

    circular, gpipe = _layout("circular"), _layout("gpipe", "model.layers=8")
    stage = replica_elements_by_role(circular)["layers"] * 4  # recipes/pp.toml: fp32 parameters, no FSDP
    assert loop_schedule_memory_terms(circular)["chunk_relayout_copy"] == stage > 0
    assert loop_schedule_memory_terms(gpipe)["chunk_relayout_copy"] == 0


@XLA_BUFFERS
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for --target's devices")
def test_the_running_ticks_working_set_is_its_layer_rebuilt_and_its_largest_split_k_partial_sums():
    """pp_fsdp_tp (two layers a stage, a scan over them): the running layer's whole set on one micro-batch (2 x 64
    tokens), whatever `train.remat` says, and on XLA:GPU the largest split-K partial sums among its GEMMs: the fused
    q/k/v projection's, 128 tokens x 128 outputs over K = 64 cut in 4 (shardkit.analysis.predicted.split_k), 256 KiB.
    With one layer a chunk (recipes/pp.toml as shipped) the 1F1B family's layer tensors are the saved activations: only
    the backward's own (`recompute_bytes`) is added; GPipe's rematerialised tick holds the whole set there too."""
    from shardkit.analysis.predicted.memory_terms import layer_activation_items, microbatch_layout, recompute_bytes
    from shardkit.analysis.predicted.pipeline_memory import tick_recompute_bytes
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.analysis.predicted.xla_buffers import layer_split_k_bytes
    from shardkit.layout import build_layout

    recipe = load_base("recipes/pp_fsdp_tp.toml", SCHEDULES["1f1b"])
    on_gpu, on_cpu = build_layout(recipe, target_devices(parse_target("h100x8"))), build_layout(recipe)
    rebuilt = sum(layer_activation_items(on_cpu.config, 2, 64, 2, 4, "none").values())
    assert tick_recompute_bytes(on_cpu) == rebuilt > recompute_bytes(microbatch_layout(on_cpu), 4)
    assert layer_split_k_bytes(microbatch_layout(on_gpu), 4) == 4 * 128 * 128 * 4
    assert tick_recompute_bytes(on_gpu) == rebuilt + 4 * 128 * 128 * 4
    shipped = build_layout(load_base("recipes/pp.toml", SCHEDULES["1f1b"]))
    assert tick_recompute_bytes(shipped) == recompute_bytes(microbatch_layout(shipped), 4)
    gpipe = build_layout(load_base("recipes/pp.toml", SCHEDULES["gpipe"]))  # a rematerialised tick: the whole set
    assert tick_recompute_bytes(gpipe) == sum(layer_activation_items(gpipe.config, 1, 64, 1, 4, "none").values())


@XLA_BUFFERS
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for --target's devices")
def test_gpipes_loss_region_holds_the_combined_sums_buffer_to_the_steps_end():
    """pp_fsdp_tp under gpipe on h100x8: the replica batch's hidden-state gradient (8 x 64 x 64) and the head's
    gradient shard (64 x 128 / 2), summed over `pipeline` in one combined all-reduce whose f32[36864] buffer lives to
    the update; nothing under XLA:CPU, nor without the loss region (recipes/pp.toml)."""
    from shardkit.analysis.predicted.pipeline_memory import loop_schedule_memory_terms
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.layout import build_layout

    recipe = load_base("recipes/pp_fsdp_tp.toml", SCHEDULES["gpipe"])
    on_gpu = build_layout(recipe, target_devices(parse_target("h100x8")))
    assert loop_schedule_memory_terms(on_gpu)["loss_region_combined_sums"] == (8 * 64 * 64 + 4096) * 4
    assert loop_schedule_memory_terms(build_layout(recipe))["loss_region_combined_sums"] == 0
    pp = build_layout(load_base("recipes/pp.toml", SCHEDULES["gpipe"]), target_devices(parse_target("h100x8")))
    assert loop_schedule_memory_terms(pp)["loss_region_combined_sums"] == 0


@XLA_BUFFERS
def test_the_1f1b_familys_gradients_at_its_peak_are_the_sums_its_loop_carries():
    """recipes/pp.toml under 1f1b: inside the ticks the step's gradients do not exist yet; the loop carries the
    layers' sums (`stage_gradient_sums`) and the loss ticks' head and final-norm sums (64 x 256 + 64 fp32 values,
    replicated over `data`): `MemoryEstimate.gradients` is those, not the step's whole gradients."""
    from shardkit.analysis.predicted.estimate import memory_estimate
    from shardkit.analysis.predicted.memory_terms import gradient_bytes
    from shardkit.analysis.predicted.pipeline_memory import tick_loss_gradient_bytes

    layout = _layout("1f1b")
    assert tick_loss_gradient_bytes(layout) == (64 * 256 + 64) * 4
    assert memory_estimate(layout).gradients == tick_loss_gradient_bytes(layout) < gradient_bytes(layout, 4)


@XLA_BUFFERS
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for --target's devices")
def test_gpipe_counts_the_running_ticks_backward_beside_the_logits_it_holds():
    """Where XLA:GPU holds the whole batch's logits and their gradient through the region's backward, the running
    tick's backward works beside them: its recompute is a pipeline term, not the smaller side of `max(logits,
    recompute)`. On XLA:CPU, which holds no logits' gradient there, the two stay alternatives."""
    from shardkit.analysis.predicted.estimate import memory_estimate
    from shardkit.analysis.predicted.pipeline_memory import loop_schedule_memory_terms, tick_recompute_bytes
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.layout import build_layout

    recipe = load_base("recipes/pp.toml", SCHEDULES["gpipe"])
    on_gpu, on_cpu = build_layout(recipe, target_devices(parse_target("h100x8"))), build_layout(recipe)
    gpu_terms, cpu_terms = loop_schedule_memory_terms(on_gpu), loop_schedule_memory_terms(on_cpu)
    assert gpu_terms["logits_gradient"] > 0 and cpu_terms["logits_gradient"] == 0
    assert gpu_terms["tick_backward_beside_logits"] == tick_recompute_bytes(on_gpu) > 0
    assert memory_estimate(on_gpu).recompute == 0
    assert cpu_terms["tick_backward_beside_logits"] == 0
    assert memory_estimate(on_cpu).recompute == tick_recompute_bytes(on_cpu) > 0


@XLA_BUFFERS
def test_suggest_tries_and_prices_every_schedule_by_the_analytic_model():
    from shardkit.analysis.predicted.estimate import memory_estimate
    from shardkit.analysis.search.candidates import pipeline_choices
    from shardkit.analysis.search.planned import peak_bytes

    layout = _layout("interleaved_1f1b")  # 8 layers: two chunks per stage fit, so every schedule is a choice
    choices = pipeline_choices(dict(layout.mesh.shape), layout.config, layout.recipe)
    assert {schedule for _, schedule, _ in choices} == set(SCHEDULES)
    for schedule in SCHEDULES:
        scheduled = _layout(schedule)
        assert peak_bytes(scheduled) == memory_estimate(scheduled).total
    # Two layers per stage: GPipe's inlined ticks hold a chunk's activations and gradient each (compiled for h100x8:
    # 1f1b 6.0 MiB, gpipe 15.4 at m = 8; README).
    deeper = {schedule: _layout(schedule, "model.layers=8") for schedule in ("1f1b", "gpipe")}
    assert peak_bytes(deeper["1f1b"]) < peak_bytes(deeper["gpipe"]) / 2


@XLA_BUFFERS
def test_the_chunk_relayout_costs_one_stage_of_layers_per_device_however_many_replicas():
    """The re-layout permute's bytes sum its pairs, one per pipeline rank of every replica (as the compiled op is
    counted); each device sends one stage's layers, so its time does not grow with the data degree."""
    import jax

    from shardkit.analysis.predicted.comm_terms import chunk_relayout_items
    from shardkit.analysis.predicted.step_model import collective_seconds
    from shardkit.layout import build_layout

    target = parse_target("h100x8")
    seconds = []
    for data, devices in ((1, jax.devices()[:4]), (2, jax.devices())):
        layout = build_layout(load_base("recipes/pp.toml", (*SCHEDULES["interleaved_1f1b"], f"mesh.data={data}")),
                              devices)
        permute = next(item for item in chunk_relayout_items(layout) if item.kind == "collective-permute")
        seconds.append(collective_seconds(permute, dict(layout.mesh.shape), target)[1])
    assert seconds[1] == pytest.approx(seconds[0])


@XLA_BUFFERS
def test_the_chunk_relayout_moves_the_stored_stack_and_needs_a_permute_only_where_v_is_not_a_multiple_of_p():
    """All-to-all: the stack as stored, each way (under FSDP each device's shard). At v = p (pp_fsdp_tp, p = 2,
    repeats 2) each stage's contiguous block is whole chunks of one repeat and the all-to-all alone re-lays it; at
    p = 4, v = 2 (recipes/pp.toml) a permute over every device follows, tensor ranks included (h100x8: 6.27 MiB of
    permutes compiled at tensor 2, data 1, the stage boundaries' 1.75 MiB among them)."""
    from shardkit.analysis.predicted.comm_terms import chunk_relayout_items
    from shardkit.analysis.predicted.memory_terms import stored_layer_bytes
    from shardkit.layout import build_layout

    fsdp_tp = build_layout(load_base("recipes/pp_fsdp_tp.toml", ("pipeline.schedule=interleaved_1f1b",
                                                                  "pipeline.repeats=2")))
    (all_to_all,) = chunk_relayout_items(fsdp_tp)
    assert all_to_all.kind == "all-to-all" and all_to_all.bytes == 2 * stored_layer_bytes(fsdp_tp)
    tensor = build_layout(load_base("recipes/pp.toml", (*SCHEDULES["interleaved_1f1b"], "mesh.tensor=2",
                                                        "mesh.data=1")))
    permute = next(item for item in chunk_relayout_items(tensor) if item.kind == "collective-permute")
    assert permute.group_size == 8 and permute.bytes == 2 * stored_layer_bytes(tensor) * 8


@pytest.fixture(scope="module")
def comparison(request):
    """`plan --target h100x8`'s analytic-vs-compiled comparison of one (recipe, schedule), compiled once."""
    import jax

    from shardkit.analysis.planning.plan import analytic_vs_compiled, compile_layout
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.layout import build_layout

    assert len(jax.devices()) == 8  # the suite's 8 devices start before `--target` would set up one
    recipe, schedule = request.param
    layout = build_layout(load_base(f"recipes/{recipe}.toml", COMPILED[recipe, schedule]),
                          target_devices(parse_target("h100x8")))
    return analytic_vs_compiled(layout, compile_layout(layout))


@XLA_BUFFERS
@pytest.mark.parametrize("comparison", cases("bytes", BYTES_RECIPES), indirect=True)
@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
def test_analytic_bytes_per_step_within_10_percent_of_compiled(comparison):
    rows = comparison["communication"]
    analytic, compiled = sum(row["analytic"] for row in rows), sum(row["compiled"] for row in rows)
    assert LOW <= analytic / compiled <= HIGH, rows


@XLA_BUFFERS
@pytest.mark.parametrize("comparison", cases("peak"), indirect=True)
@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
def test_analytic_peak_within_10_percent_of_compiled(comparison):
    peak = next(row for row in comparison["memory"] if row["what"] == "peak")
    assert LOW <= peak["analytic"] / peak["compiled"] <= HIGH, comparison["memory"]


# ---- the tick switches' exact bytes per stage: pp_fsdp_tp for h100x8 ----------------------------------------------
# case -> the recipe overrides it is compiled with: each at m = p = 2 (`M_IS_P`; 1f1b's and zero_bubble's are the peak
# cases' programs); interleaved_1f1b with two chunks a stage (one layer each), whose schedule at m = p has a tick where
# every stage idles (no conditional in the compiled program: `tick_branches.attribute_ticks`); FSDP gathering per use
# (its gathers and reduce-scatters in the tick switch's branches) for each.
PER_USE = "pipeline.fsdp_gather=per_use"
TICK_CASES = {"1f1b": COMPILED["pp_fsdp_tp", "1f1b"], "zero_bubble": COMPILED["pp_fsdp_tp", "zero_bubble"],
              "interleaved_1f1b": ("pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", *M_IS_P),
              "1f1b-per_use": (*COMPILED["pp_fsdp_tp", "1f1b"], PER_USE),
              "zero_bubble-per_use": (*COMPILED["pp_fsdp_tp", "zero_bubble"], PER_USE),
              "interleaved_1f1b-per_use": ("pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", *M_IS_P,
                                           PER_USE)}
FAMILIES = ("reduction", "all-gather", "all-to-all", "collective-permute")
# Per use the head is gathered, not split by vocabulary, and one chunk a stage needs no re-layout: no all-to-all is
# compiled (nor modelled) to compare.
WITHOUT_ALL_TO_ALL = ("1f1b-per_use", "zero_bubble-per_use")
CASE_FAMILIES = {case: tuple(f for f in FAMILIES if not (f == "all-to-all" and case in WITHOUT_ALL_TO_ALL))
                 for case in TICK_CASES}
# (case, stage, family) -> why analytic / compiled is outside [0.9, 1.1] (h100x8, measured with this test). Empty
# since the chunk re-layout moves the stored (fsdp-sharded) stack and, at v = p, by one all-to-all alone
# (comm_terms.chunk_relayout_items).
NOT_YET_MODELLED_PER_STAGE: dict[tuple[str, int, str], str] = {}


@functools.cache
def _exact(case: str):
    """(per stage, the exact compiled bytes per family; per stage, tick_stage_communication's family -> bytes) of
    pp_fsdp_tp under `case`'s overrides, compiled once per case for all its families and stages."""
    import jax

    from shardkit.analysis.compiled.collective_kinds import collective_family
    from shardkit.analysis.planning.plan import compile_layout
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.analysis.predicted.tick_bytes import tick_stage_communication
    from shardkit.analysis.search.suggest import load_base
    from shardkit.layout import build_layout
    from shardkit.pipeline.program import tick_program

    assert len(jax.devices()) == 8
    layout = build_layout(load_base("recipes/pp_fsdp_tp.toml", TICK_CASES[case]),
                          target_devices(parse_target("h100x8")))
    module = parse_hlo(compile_layout(layout).as_text())
    collectives = collectives_from_module(module, dict(layout.mesh.shape))
    program = tick_program(layout.pipeline)
    stages = exact_tick_bytes(module, collectives, program)
    assert stages is not None, "the tick switches of the compiled step were not attributed"
    assert branch_name_bytes(collectives, attribute_ticks(module, program)) is not None
    return [by_kind(stage, collective_family) for stage in stages], tick_stage_communication(layout)


def _tick_cases() -> list:
    out = []
    for case, families in CASE_FAMILIES.items():
        for stage in (0, 1):
            for family in families:
                reason = NOT_YET_MODELLED_PER_STAGE.get((case, stage, family))
                marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                out.append(pytest.param(case, stage, family, marks=marks, id=f"{case}-stage{stage}-{family}"))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
@pytest.mark.parametrize("case, stage, family", _tick_cases())
def test_stage_model_within_10_percent_of_the_exact_compiled_bytes(case, stage, family):
    stages, analytic = _exact(case)
    compiled = stages[stage].get(family, 0.0)
    assert compiled > 0 and LOW <= analytic[stage].get(family, 0.0) / compiled <= HIGH, (analytic, stages)
