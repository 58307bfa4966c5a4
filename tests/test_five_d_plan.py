"""`plan`'s analytic model for context and expert parallelism inside a pipeline (shardkit/analysis/predicted/
region_terms.py), against XLA:GPU's compiled program (h100x8 and h100:2x8, compiled deviceless on this CPU), and
`suggest` searching the expert axis with the others.

Each compiled case is compiled once (a module-scoped fixture) and read by all of its tests.
"""

from __future__ import annotations

import pytest

from shardkit.analysis.predicted.region_terms import ZIGZAG_ITEM as ZIGZAG
from shardkit.analysis.predicted.targets import cuda_plugin_available, parse_target
from shardkit.analysis.predicted.xla_buffers import SKIP_REASON, matches_jax
from shardkit.analysis.search.suggest import load_base
from tests.helpers import HIGH, LOW

NEEDS_PLUGIN = pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin for --target")
# The 8b preset cut to 4 layers on 16 GPUs: pipeline 2 x context 2 x fsdp 2 x tensor 2, 8k tokens a sequence, FSDP
# gathered once per step (the default), so GPipe's loss region runs, manual over `sequence`.
FIVE_D_8B = ("model.preset=8b", "model.layers=4", "precision.policy=bf16", "mesh.pipeline=2", "mesh.sequence=2",
             "mesh.fsdp=2", "mesh.tensor=2", "train.seq_len=8192", "train.global_batch=4", "pipeline.microbatches=2")


def _layout(recipe: str, *overrides: str, target: str | None = None):
    from shardkit.analysis.predicted.targets import target_devices
    from shardkit.layout import build_layout

    devices = target_devices(parse_target(target)) if target else None
    return build_layout(load_base(recipe, overrides), devices)


def test_a_stage_input_is_split_over_the_context_and_expert_ranks():
    """recipes/pp_cp.toml (16 x 64 tokens, m=4, fsdp 2, context 2) and pp_moe_ep.toml (m=2, fsdp 2, expert 2): one
    micro-batch's stage input is its rows over data x fsdp x expert, its tokens over the context ranks."""
    from shardkit.pipeline import microbatch_activation_bytes

    assert microbatch_activation_bytes(_layout("recipes/pp_cp.toml")) == 2 * 32 * 64 * 4
    assert microbatch_activation_bytes(_layout("recipes/pp_moe_ep.toml")) == 2 * 64 * 64 * 4


def test_loop_schedules_run_every_tick_and_recompute_the_forward():
    """gpipe p=2, m=4: T = 5 ticks for 4 micro-batches; the 1F1B family's idle ticks run nothing; the expert
    all-to-alls gain the tick's recompute (6 buffers a layer pass, not 4); the stage's weight gradients are summed
    over the context ranks once per tick, not once per step."""
    from shardkit.analysis.predicted.estimate import communication_estimate
    from shardkit.analysis.predicted.memory_terms import replica_elements_by_role
    from shardkit.analysis.predicted.region_terms import layer_pass_ratio
    from shardkit.moe import all_to_all_bytes

    cp = _layout("recipes/pp_cp.toml")
    assert layer_pass_ratio(cp) == 5 / 4
    assert layer_pass_ratio(_layout("recipes/pp.toml", "pipeline.schedule=1f1b")) == 1
    items = {item.what: item for item in communication_estimate(cp)}
    per_tick = items["stage gradients over the context ranks, per tick"]
    assert per_tick.bytes == 5 * replica_elements_by_role(cp)["layers"] * 4 and per_tick.axes == ("sequence",)
    assert not any(item.axes == ("sequence",) and item.what == "gradients" for item in items.values())
    ep = _layout("recipes/pp_moe_ep.toml")  # m=2, T=3
    tokens = {item.what: item for item in communication_estimate(ep)}
    dispatch = tokens["tokens to experts and back (dispatch, combine; forward, backward)"]
    assert dispatch.bytes == all_to_all_bytes(ep) * 3 / 2 * 6 / 4


@NEEDS_PLUGIN
def test_loss_region_holds_no_logits_gradient_into_the_layer_regions_backward():
    """pp_moe_ep on h100x8: GPipe's loss region takes whole rows over the expert ranks, as many token rows as the
    device's batch (4 x 64), and its backward still reads the logits' gradient before the layer region's: neither
    the logits' gradient nor a tick's backward beside the loss is counted (the compiled peak, in the last tick's
    backward, holds no logits)."""
    from shardkit.analysis.predicted.memory_terms import local_batch, loss_chunk_rows
    from shardkit.analysis.predicted.pipeline_memory import loop_schedule_memory_terms

    ep = _layout("recipes/pp_moe_ep.toml", target="h100x8")
    b, s = local_batch(ep)
    assert loss_chunk_rows(ep) == b * s
    terms = loop_schedule_memory_terms(ep)
    assert terms["logits_gradient"] == terms["tick_backward_beside_logits"] == 0
    assert terms["loss_region_combined_sums"] > 0


def test_suggest_searches_the_expert_axis_for_moe_models_only():
    from shardkit.analysis.search.candidates import AXIS_OPTIONS

    target = parse_target("h100x8")
    moe, dense = _layout("recipes/pp_moe_ep.toml"), _layout("recipes/pp_cp.toml")
    assert AXIS_OPTIONS["expert"](moe.config, moe.recipe, target) == [1, 2, 4, 8]
    assert AXIS_OPTIONS["expert"](dense.config, dense.recipe, target) == [1]


@pytest.fixture(scope="module")
def compiled_case(request):
    """(layout, compiled program, plan's analytic-vs-compiled comparison) of one case, compiled once."""
    from shardkit.analysis.planning.plan import analytic_vs_compiled, compile_layout

    recipe, target, overrides = request.param
    layout = _layout(recipe, *overrides, target=target)
    compiled = compile_layout(layout)
    return layout, compiled, analytic_vs_compiled(layout, compiled)


PIPELINED = [pytest.param((f"recipes/{name}.toml", "h100x8", ()), id=name) for name in ("pp_cp", "pp_moe_ep")]


@pytest.mark.slow
@pytest.mark.skipif(not matches_jax(), reason=SKIP_REASON)
@NEEDS_PLUGIN
@pytest.mark.parametrize("compiled_case", PIPELINED, indirect=True)
def test_pipelined_context_and_experts_bytes_per_step_within_10_percent(compiled_case):
    rows = compiled_case[2]["communication"]
    analytic, compiled = sum(row["analytic"] for row in rows), sum(row["compiled"] for row in rows)
    assert LOW <= analytic / compiled <= HIGH, rows


@pytest.mark.slow
@pytest.mark.skipif(not matches_jax(), reason=SKIP_REASON)
@NEEDS_PLUGIN
@pytest.mark.parametrize("compiled_case", PIPELINED, indirect=True)
def test_pipelined_context_and_experts_peak_within_10_percent(compiled_case):
    peak = next(row for row in compiled_case[2]["memory"] if row["what"] == "peak")
    assert LOW <= peak["analytic"] / peak["compiled"] <= HIGH, compiled_case[2]["memory"]


FIVE_D_CASE = pytest.mark.parametrize("compiled_case", [("recipes/pp_cp.toml", "h100:2x8", FIVE_D_8B)], indirect=True,
                                      ids=["8b-4layers-pp2-cp2-fsdp2-tp2"])


@pytest.mark.slow
@pytest.mark.skipif(not matches_jax(), reason=SKIP_REASON)
@NEEDS_PLUGIN
@FIVE_D_CASE
def test_8b_pipeline_context_fsdp_tensor_holds_cudnn_attention_and_fits(compiled_case):
    """The 8b preset cut to 4 layers on h100:2x8: cuDNN's fused attention in the program, the compiled peak within
    an H100's usable memory."""
    from shardkit.analysis.predicted.targets import usable_bytes

    _, compiled, comparison = compiled_case
    assert "__cudnn$fmha" in compiled.as_text()
    peak = next(row for row in comparison["memory"] if row["what"] == "peak")
    assert peak["compiled"] <= usable_bytes(parse_target("h100:2x8").gpu, 0.9)


@pytest.mark.slow
@pytest.mark.skipif(not matches_jax(), reason=SKIP_REASON)
@NEEDS_PLUGIN
@FIVE_D_CASE
def test_8b_pipeline_context_fsdp_tensor_analytic_peak_within_10_percent(compiled_case):
    _, _, comparison = compiled_case
    peak = next(row for row in comparison["memory"] if row["what"] == "peak")
    assert LOW <= peak["analytic"] / peak["compiled"] <= HIGH, comparison["memory"]


LLAMA3_70B = ("model.preset=8b", "model.layers=80", "model.embed=8192", "model.heads=64", "model.kv_heads=8",
              "model.head_dim=128", "model.mlp=28672", "precision.policy=bf16")
# DeepSeekMoE 16B's shapes (many small experts, top 6 of 64), capacity routing.
MANY_EXPERTS = ("model.name=moe", "model.preset=moe-tiny", "model.layers=28", "model.embed=2048", "model.heads=16",
                "model.kv_heads=16", "model.head_dim=128", "model.mlp=1408", "model.experts=64", "model.top_k=6",
                "model.vocab=102400", "model.routing=capacity", "precision.policy=bf16")


def _ranked_with_pipeline_and(recipe: str, target_text: str, axis: str, overrides: tuple[str, ...]):
    from shardkit.analysis.predicted.targets import usable_bytes
    from shardkit.analysis.search.suggest import rank_layouts

    target = parse_target(target_text)
    usable = usable_bytes(target.gpu, 0.9)
    ranked, _ = rank_layouts(load_base(recipe, overrides), target, usable)
    both = [r for r in ranked if r.candidate.sizes["pipeline"] > 1 and r.candidate.sizes[axis] > 1]
    assert both and all(r.memory <= usable for r in both)
    return ranked[0], both


def _exposed(ranked, what: str) -> float:
    return sum(c.exposed for c in ranked.best_time.comm if c.item.what == what)


def test_suggest_prices_pipeline_x_context_for_long_context_and_names_what_it_loses():
    """Llama 3 70B's shapes at 128k tokens a sequence, 4 sequences, on 64 H100s: pipeline x context layouts are
    searched and fit. Context parallelism over all 64 ranks (its ranks FSDP ranks too) wins; the best pipeline x
    context layout loses by its bubble (4 micro-batches, all the batch allows), its stage gradients summed over the
    context ranks once per tick, and its per-layer zigzag reorders: without those it would be within 5% of the
    winner."""
    winner, (pp_cp, *_) = _ranked_with_pipeline_and("recipes/single.toml", "h100:8x8", "sequence",
                                                    (*LLAMA3_70B, "train.global_batch=4", "train.seq_len=131072"))
    assert winner.candidate.sizes["pipeline"] == 1 and winner.candidate.sizes["sequence"] > 1
    lost = (pp_cp.best_time.bubble + _exposed(pp_cp, "stage gradients over the context ranks, per tick")
            + _exposed(pp_cp, ZIGZAG))
    assert lost > 0.5 * (pp_cp.best_time.total - winner.best_time.total)
    assert pp_cp.best_time.total - lost <= 1.05 * winner.best_time.total


def test_suggest_prices_pipeline_x_experts_with_the_ticks_all_to_alls():
    """DeepSeekMoE 16B's shapes on 8 H100s: pipeline x expert layouts are searched under both kinds of schedule and
    fit, their experts' all-to-alls priced as the schedules run them: under gpipe and circular every tick, the
    forward again in the backward; under the 1F1B family once per micro-batch."""
    from shardkit.analysis.predicted.region_terms import EXPERT_ALL_TO_ALL, layer_pass_ratio
    from shardkit.moe import all_to_all_bytes

    _, pp_ep = _ranked_with_pipeline_and("recipes/moe_ep.toml", "h100x8", "expert",
                                         (*MANY_EXPERTS, "train.global_batch=16", "train.seq_len=4096"))
    ticked = [r for r in pp_ep if r.layout.pipeline.one_f_one_b]
    looped = [r for r in pp_ep if not r.layout.pipeline.one_f_one_b]
    assert ticked and looped
    for ranked in (ticked[0], looped[0]):
        layout = ranked.layout
        (dispatch,) = [c.item for c in ranked.best_time.comm if c.item.what == EXPERT_ALL_TO_ALL]
        passes = 1.0 if layout.recipe.train.remat != "none" else 6 / 4
        assert dispatch.bytes == pytest.approx(all_to_all_bytes(layout) * layer_pass_ratio(layout) * passes)
    assert layer_pass_ratio(ticked[0].layout) == 1 and layer_pass_ratio(looped[0].layout) > 1
