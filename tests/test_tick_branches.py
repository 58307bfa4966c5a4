"""The 1F1B family's tick switches attributed in the compiled program (shardkit/analysis/compiled/tick_branches.py), and
the per-stage model of the collective bytes they give (shardkit/analysis/predicted/tick_bytes.py).

These tests read hand-written HLO whose answer is known by construction, and the per-stage model's structure (counts
from the tick program, no compile). The per-stage model against the exact bytes of pp_fsdp_tp's compiled h100x8 step
is in tests/test_pipeline_estimate.py, beside the peak comparisons that compile the same programs: one test process
compiles each of them once (tests/compile_only_memo.py).
"""
from __future__ import annotations

import numpy as np
import pytest

from shardkit.analysis.compiled.hlo import collectives_from_module
from shardkit.analysis.compiled.hlo_parse import parse_hlo
from shardkit.analysis.compiled.tick_branches import attribute_ticks, branch_name_bytes, by_kind, exact_tick_bytes
from shardkit.pipeline.program import Action, TickProgram

LOW, HIGH = 0.9, 1.1
F, B, BL, IDLE = Action.FORWARD, Action.BACKWARD, Action.BACKWARD_LAST, Action.IDLE
# Two stages, five ticks. Sends: a forward pair at tick 0, one backward pair after each later tick, so tick_blocks
# makes ticks 0-2 one block of period 3 (three switches, run once) and ticks 3-4 a scan of two trips of one switch.
# Each branch all-reduces its own size over both devices (f32 elements: 4 bytes each).
FORWARD, BACKWARD, BACKWARD_LAST = 16, 32, 64
ACTIONS = np.array([[F, F, B, B, IDLE], [IDLE, BL, IDLE, BL, BL]], np.int32)
SENDS = ((((0, 1),), ()),) + (((), ((1, 0),)),) * 4
def _branch(name: str, index: int, elements: int, channel: int) -> str:
    """A branch computation that all-reduces `elements` f32 values, its op_name naming branch `index`."""
    metadata = f'metadata={{op_name="jit(step)/shard_map/while/body/closed_call/cond/branch_{index}_fun/dot"}}'
    return f"""
%{name} (a: f32[64]) -> f32[64] {{
  %a = f32[64]{{0}} parameter(0)
  %x = f32[{elements}]{{0}} slice(%a), slice={{[0:{elements}]}}
  %r = f32[{elements}]{{0}} all-reduce(%x), channel_id={channel}, replica_groups={{{{0,1}}}}, to_apply=%add, {metadata}
  ROOT %o = f32[64]{{0}} add(%a, %a)
}}
"""




def _tick_hlo(loop_trips: int = 2, tick1_branches: tuple[int, int] = (0, 1)) -> str:
    """Ticks 0-2 as three conditionals in the entry, ticks 3-4 as one conditional in a loop of `loop_trips` trips.
    `tick1_branches`: the branch indices tick 1's two branches' op_names name (swapped: a misattribution)."""
    first, second = tick1_branches
    computations = [
        _branch("t0_forward", 1, FORWARD, 1),
        _branch("t1_forward", first, FORWARD, 2), _branch("t1_backward_last", second, BACKWARD_LAST, 3),
        _branch("t2_backward", 1, BACKWARD, 4),
        _branch("t3_backward", 1, BACKWARD, 5), _branch("t3_backward_last", 2, BACKWARD_LAST, 6),
    ]
    return "HloModule ticks, num_partitions=2\n" + """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%idle (a: f32[64]) -> f32[64] {
  ROOT %a = f32[64]{0} parameter(0)
}
""" + "".join(computations) + """
%tick_body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[64]{0} get-tuple-element(%p), index=1
  %c3 = f32[64]{0} conditional(%i, %v, %v, %v), branch_computations={%idle, %t3_backward, %t3_backward_last}
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %c3)
}

%tick_cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (s: s32[], v: f32[64]) -> f32[64] {
  %s = s32[] parameter(0)
  %v = f32[64]{0} parameter(1)
  %c0 = f32[64]{0} conditional(%s, %v, %v), branch_computations={%idle, %t0_forward}
  %c1 = f32[64]{0} conditional(%s, %c0, %c0), branch_computations={%t1_forward, %t1_backward_last}
  %c2 = f32[64]{0} conditional(%s, %c1, %c1), branch_computations={%idle, %t2_backward}
  %init = (s32[], f32[64]{0}) tuple(%s, %c2)
  %loop = (s32[], f32[64]{0}) while(%init), condition=%tick_cond, body=%tick_body, backend_config=TRIPS
  ROOT %out = f32[64]{0} get-tuple-element(%loop), index=1
}
""".replace("TRIPS", '{"known_trip_count":{"n":"%d"}}' % loop_trips)


def _program(actions: np.ndarray = ACTIONS, sends=SENDS) -> TickProgram:
    zeros = np.zeros(actions.shape, np.int32)
    return TickProgram(actions, zeros, zeros, zeros.astype(bool), zeros, zeros, zeros - 1, zeros - 1, 1, 1, sends)


def _module(**kwargs):
    module = parse_hlo(_tick_hlo(**kwargs))
    return module, collectives_from_module(module, {"pipeline": 2})


def test_each_tick_is_attributed_its_conditional_and_the_switch_names_of_its_branches():
    module, _ = _module()
    ticks = attribute_ticks(module, _program())
    assert [(t.tick, t.conditional, t.executions, t.branch_names) for t in ticks] == [
        (0, "c0", 1, ("idle", "forward")), (1, "c1", 1, ("forward", "backward_last")),
        (2, "c2", 1, ("idle", "backward")), (3, "c3", 2, ("idle", "backward", "backward_last")),
        (4, "c3", 2, ("idle", "backward", "backward_last")),
    ]


def test_exact_bytes_take_each_stages_branch_per_tick_and_lie_below_the_upper_bound():
    module, collectives = _module()
    stages = exact_tick_bytes(module, collectives, _program())
    # stage 0: F, F, B, B, idle; stage 1: idle, BL, idle, BL, BL (the loop's two trips take different branches)
    assert [by_kind(stage) for stage in stages] == [
        {"all-reduce": 4 * (2 * FORWARD + 2 * BACKWARD)}, {"all-reduce": 4 * 3 * BACKWARD_LAST}]
    # the upper bound: every conditional's costliest branch on every run, the loop's twice
    assert collectives.conditional_bytes("all-reduce") == 4 * (FORWARD + BACKWARD_LAST + BACKWARD + 2 * BACKWARD_LAST)
    assert branch_name_bytes(collectives, attribute_ticks(module, _program())) == {
        "idle": 0, "forward": 4 * FORWARD, "backward_last": 4 * BACKWARD_LAST, "backward": 4 * BACKWARD}


def test_a_tick_where_every_stage_idles_has_no_conditional_and_the_others_keep_theirs():
    """Two ticks, one block: at tick 0 both stages idle, at tick 1 stage 0 runs forward. Tick 0's switch has one
    branch, which compiles as a plain call (no conditional in the HLO), so the one conditional is tick 1's."""
    hlo = "HloModule ticks, num_partitions=2\n" + """
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%idle (a: f32[64]) -> f32[64] {
  ROOT %a = f32[64]{0} parameter(0)
}
""" + _branch("t1_forward", 1, FORWARD, 1) + """
ENTRY %main (s: s32[], v: f32[64]) -> f32[64] {
  %s = s32[] parameter(0)
  %v = f32[64]{0} parameter(1)
  ROOT %c1 = f32[64]{0} conditional(%s, %v, %v), branch_computations={%idle, %t1_forward}
}
"""
    module = parse_hlo(hlo)
    program = _program(np.array([[IDLE, F], [IDLE, IDLE]], np.int32), (((), ()), (((0, 1),), ())))
    ticks = attribute_ticks(module, program)
    assert [(tick.tick, tick.conditional, tick.branch_names) for tick in ticks] == [(1, "c1", ("idle", "forward"))]
    stages = exact_tick_bytes(module, collectives_from_module(module, {"pipeline": 2}), program)
    assert [by_kind(stage) for stage in stages] == [{"all-reduce": 4 * FORWARD}, {}]


@pytest.mark.parametrize("kwargs", [{"loop_trips": 3}, {"tick1_branches": (1, 0)}], ids=["ticks", "op_names"])
def test_a_program_that_does_not_check_out_is_not_attributed(kwargs):
    """One tick too many (the loop's trip count), or branches whose op_names name each other's index: None, and
    callers keep the upper bound."""
    module, collectives = _module(**kwargs)
    assert attribute_ticks(module, _program()) is None
    assert exact_tick_bytes(module, collectives, _program()) is None


# ---- the per-stage model (shardkit.analysis.predicted.tick_bytes), from the tick program alone -----------------------
def _layout(schedule: str, *overrides: str):
    from shardkit.analysis.search.suggest import load_base
    from shardkit.layout import build_layout

    return build_layout(load_base("recipes/pp_fsdp_tp.toml", (f"pipeline.schedule={schedule}", *overrides)))


def _per_microbatch_layer_reductions(layout, stage: int) -> float:
    """The stage's layers' reductions over `tensor` per layer per micro-batch, summed over its actions."""
    from shardkit.analysis.predicted.tick_bytes import action_counts, layer_items
    from shardkit.pipeline import microbatch_activation_bytes

    config = layout.pipeline
    layers = layout.config.layers // (config.stages * config.chunks)
    total = sum(runs * item.bytes for action, runs in action_counts(layout)[stage].items()
                for item in layer_items(layout, action))
    return total / (microbatch_activation_bytes(layout) * layers * config.microbatches * config.chunks)


def _loss_runs(layout, stage: int) -> int:
    """How often the stage's items gather the loss's rows over `fsdp` (once per loss run)."""
    from shardkit.analysis.predicted.tick_bytes import action_counts, action_items

    return sum(runs for action, runs in action_counts(layout)[stage].items()
               for item in action_items(layout, action) if item.what == "loss rows, targets, cotangents")


def test_stage_counts_follow_the_tick_program():
    """1f1b: stage 0 forwards and backwards each micro-batch (4 reductions a layer recomputed + 2 forward: 6), the
    last stage runs the loss m times; zero_bubble: stage 0's B and W each re-run the forward and the input-gradient
    backward (10 a layer), the last stage's B and W each 4 a layer (8) and the loss twice per micro-batch."""
    from shardkit.analysis.predicted.tick_bytes import action_counts
    from shardkit.pipeline.program import Action

    one_f_one_b = _layout("1f1b")
    m = one_f_one_b.pipeline.microbatches
    counts = action_counts(one_f_one_b)
    assert (counts[0][Action.FORWARD], counts[0][Action.BACKWARD], counts[1][Action.BACKWARD_LAST]) == (m, m, m)
    assert [_per_microbatch_layer_reductions(one_f_one_b, stage) for stage in (0, 1)] == [6, 4]
    assert [_loss_runs(one_f_one_b, stage) for stage in (0, 1)] == [0, m]
    zero_bubble = _layout("zero_bubble")
    assert [_per_microbatch_layer_reductions(zero_bubble, stage) for stage in (0, 1)] == [10, 8]
    assert [_loss_runs(zero_bubble, stage) for stage in (0, 1)] == [0, 2 * m]


@pytest.mark.parametrize("remat, extra", [("full", 1), ("selective", 1), ("minimal_with_context", 0)])
def test_remat_that_rebuilds_the_output_projection_reruns_its_reduction_in_every_backward(remat, extra):
    """Under `full` and `selective` the chunk's backward recomputes each layer's attention output projection, whose
    reduction over `tensor` runs again (one a layer); `minimal_with_context` keeps its output. 1f1b: 6 + 1 on stage 0
    (one backward a micro-batch), zero_bubble: 10 + 2 (B and W). As compiled for h100x8: 1f1b and zero_bubble under
    `full` 1.00 of the exact bytes on both stages (`shardkit plan recipes/pp_fsdp_tp.toml --target h100x8 --set
    train.remat=full`); 0.89 and 0.86 before this term."""
    one_f_one_b = _layout("1f1b", f"train.remat={remat}")
    assert [_per_microbatch_layer_reductions(one_f_one_b, stage) for stage in (0, 1)] == [6 + extra, 4 + extra]
    zero_bubble = _layout("zero_bubble", f"train.remat={remat}")
    assert [_per_microbatch_layer_reductions(zero_bubble, stage) for stage in (0, 1)] == [10 + 2 * extra,
                                                                                          8 + 2 * extra]


def test_a_one_layer_chunks_backward_drops_its_recomputed_output_reduction():
    """interleaved_1f1b with v = 2 on two layers a stage: one layer a chunk, so a backward recomputes 2 and pulls
    back 2, less the recomputed output's (3); the last chunk's output feeds the loss and keeps it (4)."""
    from shardkit.analysis.predicted.tick_bytes import layer_items
    from shardkit.pipeline import microbatch_activation_bytes
    from shardkit.pipeline.program import Action

    layout = _layout("interleaved_1f1b", "pipeline.repeats=2")
    a = microbatch_activation_bytes(layout)
    assert [sum(i.bytes for i in layer_items(layout, action)) / a
            for action in (Action.FORWARD, Action.BACKWARD, Action.BACKWARD_LAST)] == [2, 3, 4]


def test_a_whole_heads_loss_drops_the_target_logit_where_the_action_discards_the_loss():
    """Under `pipeline.fsdp_gather=per_use` the head is gathered, not split: its loss reduces the head input's
    gradient and the softmax's statistics over `tensor`, the target logit's only where the loss is kept (zero_bubble's
    W discards it)."""
    from shardkit.analysis.predicted.tick_bytes import loss_items, split_loss_items
    from shardkit.pipeline import microbatch_activation_bytes

    layout = _layout("zero_bubble", "pipeline.fsdp_gather=per_use")
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    tokens = microbatch_activation_bytes(layout) // (layout.config.embed * compute_size)
    kept, discarded = (loss_items(layout, keeps_loss=keep) for keep in (True, False))
    assert [(i.kind, i.axes) for i in kept] == [(i.kind, i.axes) for i in discarded] == [("all-reduce", ("tensor",))]
    assert kept[0].bytes - discarded[0].bytes == tokens * 4
    assert kept[0].bytes == microbatch_activation_bytes(layout) + 3 * tokens * 4
    split = _layout("zero_bubble")  # the split loss: the target logit over `fsdp` too
    assert len(split_loss_items(split, keeps_loss=True)) == len(split_loss_items(split, keeps_loss=False)) + 1


def test_stages_differ_by_their_actions_only_and_families_sum_the_items():
    """What runs outside the switch is the same on every stage: two stages' items differ only by their actions'."""
    from shardkit.analysis.compiled.collective_kinds import collective_family
    from shardkit.analysis.predicted.tick_bytes import step_items, tick_stage_communication, tick_stage_items

    layout = _layout("zero_bubble")
    outside = step_items(layout)
    stages = tick_stage_items(layout)
    assert all(items[:len(outside)] == outside for items in stages)
    for items, families in zip(stages, tick_stage_communication(layout)):
        expected: dict[str, float] = {}
        for item in items:
            expected[collective_family(item.kind)] = expected.get(collective_family(item.kind), 0.0) + item.bytes
        assert families == expected
    # the estimate's reductions over `tensor` all move into the actions but the embedding's rows
    assert [item.what for item in outside if item.axes == ("tensor",)] == ["embedding rows (vocab over tensor)"]


def _fsdp_runs(layout, action) -> tuple[float, float]:
    """(all-gathered, reduce-scattered) bytes over `fsdp` of one run of `action` (`fsdp_action_items`)."""
    from shardkit.analysis.predicted.tick_bytes import fsdp_action_items

    items = fsdp_action_items(layout, action)
    return tuple(sum(i.bytes for i in items if i.kind == kind and i.axes == ("fsdp",))
                 for kind in ("all-gather", "reduce-scatter"))


def test_fsdp_per_use_runs_in_the_actions_that_use_each_weight():
    """Under `pipeline.fsdp_gather=per_use` a forward gathers its chunk (C), every action that differentiates it
    gathers it twice (the recomputed forward and the transposed scan), those that make its weight gradients
    reduce-scatter it; the loss actions gather the head and final norm (H) with the norm's scale (S) once more, those
    that make the head's gradient reduce-scatter H. pp_fsdp_tp: two layers a stage of 144.5 KiB a device (plan's
    table, 147,968 bytes) whole over fsdp = 2; head 16 KiB and final norm 128 B a device."""
    from shardkit.pipeline.program import Action

    layout = _layout("zero_bubble", "pipeline.fsdp_gather=per_use")
    c, h, s = 2 * 147_968, 2 * (16_384 + 128), 2 * 128
    assert {action: _fsdp_runs(layout, action) for action in Action} == {
        Action.IDLE: (0, 0), Action.FORWARD: (c, 0),
        Action.BACKWARD: (2 * c, c), Action.BACKWARD_LAST: (2 * c + h + s, c + h),
        Action.INPUT_GRAD: (2 * c, 0), Action.INPUT_GRAD_LAST: (2 * c + h + s, h),
        Action.WEIGHT_GRAD: (2 * c, c), Action.WEIGHT_GRAD_LAST: (2 * c + h + s, c)}
    # gathering once per step (the default), the region runs none of them in the branches
    assert all(_fsdp_runs(_layout("zero_bubble"), action) == (0, 0) for action in Action)


def test_fsdp_per_use_leaves_only_the_embedding_and_the_head_gradients_sum_outside_the_switch():
    """Outside the switch: the embedding table (16 KiB a device, whole over fsdp = 2) gathered and its gradient
    reduce-scattered, the head's and final norm's gradient shard summed over `pipeline`; no all-to-all (the head is
    gathered, not split by vocabulary). 1f1b's stages: 4 forwards and 4 backwards (12 C), 4 backward_lasts."""
    from shardkit.analysis.predicted.tick_bytes import step_items, tick_stage_items

    layout = _layout("1f1b", "pipeline.fsdp_gather=per_use")
    e, h = 2 * 16_384, 2 * (16_384 + 128)
    assert sorted((i.kind, i.axes, i.bytes) for i in step_items(layout) if "fsdp" in i.axes) == [
        ("all-gather", ("fsdp",), e), ("reduce-scatter", ("fsdp",), e)]
    assert [i.bytes for i in step_items(layout) if i.what.startswith("gradients (head")] == [h / 2]
    c, s = 2 * 147_968, 2 * 128
    gathered = [sum(i.bytes for i in items if i.kind == "all-gather") for items in tick_stage_items(layout)]
    assert gathered == [e + 12 * c, e + 4 * (2 * c + h + s)]
    assert not any(i.kind == "all-to-all" for items in tick_stage_items(layout) for i in items)


def test_gpipe_is_not_modelled_per_stage():
    from shardkit.analysis.predicted.tick_bytes import tick_stage_communication

    with pytest.raises(ValueError, match="1F1B family"):
        tick_stage_communication(_layout("gpipe"))
