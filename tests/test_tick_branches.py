"""The 1F1B family's tick switches attributed in the compiled program (shardkit/analysis/tick_branches.py), and the
exact collective bytes per stage they give, against the analytic model.

The fast tests read hand-written HLO whose answer is known by construction. The slow ones compile pp_fsdp_tp for
h100x8 on this CPU (once per schedule, a module-scoped fixture) and hold analytic / compiled within [0.9, 1.1] per
collective family (plan's matching: all-reduce and reduce-scatter are one family) and per stage, the cases the model
does not count yet as strict xfails naming what it misses, so that a fix shows up as an unexpected pass.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from shardkit.analysis.hlo import collectives_from_module, parse_hlo
from shardkit.analysis.targets import cuda_plugin_available, parse_target
from shardkit.analysis.tick_branches import attribute_ticks, branch_name_bytes, by_kind, exact_tick_bytes
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


def _program() -> TickProgram:
    zeros = np.zeros(ACTIONS.shape, np.int32)
    return TickProgram(ACTIONS, zeros, zeros, zeros.astype(bool), zeros, zeros, zeros - 1, zeros - 1, 1, 1, SENDS)


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


@pytest.mark.parametrize("kwargs", [{"loop_trips": 3}, {"tick1_branches": (1, 0)}], ids=["ticks", "op_names"])
def test_a_program_that_does_not_check_out_is_not_attributed(kwargs):
    """One tick too many (the loop's trip count), or branches whose op_names name each other's index: None, and
    callers keep the upper bound."""
    module, collectives = _module(**kwargs)
    assert attribute_ticks(module, _program()) is None
    assert exact_tick_bytes(module, collectives, _program()) is None


# ---- compiled: pp_fsdp_tp for h100x8 --------------------------------------------------------------------------------
SCHEDULES = ("1f1b", "zero_bubble")
FAMILIES = ("reduction", "all-gather", "all-to-all", "collective-permute")
# (schedule, stage, family) -> why analytic / compiled is outside [0.9, 1.1] (h100x8, measured with this test).
# Per micro-batch, a = b*s*h = 32 KiB (fp32) and two layers a stage; the model counts 4 all-reduces a layer (Megatron's
# two forward, two backward) and the head's loss terms (the vocabulary over `tensor`) on every device.
RECOMPUTE = ("the backward tick re-runs the stage's forward (the executor keeps only the stage input): its 2 "
             "all-reduces a layer over tensor again, 4 x 2 x 2 x 32 KiB = 512 KiB a step the model does not count")
LOSS_ROWS = ("backward_last runs the loss with the head split by vocabulary over fsdp: per micro-batch the rows and "
             "targets all-gathered over fsdp (65 KiB) and their gradient reduce-scattered back (64 KiB), the loss "
             "statistics over fsdp and fsdp+tensor (3 KiB), and 65 KiB over tensor (one combined all-reduce, the model "
             "33.5 KiB); the model counts these for GPipe's loss region (loop_loss_region_items), not for the 1F1B "
             "family")
ZERO_BUBBLE = ("input_grad and weight_grad each re-run the stage's forward and its input-gradient backward: 4 "
               "all-reduces a layer each beside forward's 2, 10 a layer per micro-batch where the model counts 4")
NOT_YET_MODELLED: dict[tuple[str, int, str], str] = {
    ("1f1b", 0, "reduction"): f"0.82 (1.71 / 2.08 MiB): {RECOMPUTE}; the head's loss terms (134 KiB of the model's "
                              "262 KiB over tensor) run on the last stage only",
    ("1f1b", 1, "reduction"): f"0.82 (1.71 / 2.10 MiB): {LOSS_ROWS}",
    ("1f1b", 1, "all-gather"): f"0.55 (321 / 581 KiB): {LOSS_ROWS}",
    ("zero_bubble", 0, "reduction"): f"0.56 (1.71 / 3.08 MiB): {ZERO_BUBBLE} (2.5 MiB against 1 MiB)",
    ("zero_bubble", 1, "reduction"): f"0.47 (1.71 / 3.60 MiB): input_grad_last and weight_grad_last each run the "
                                     f"stage's layers forward and back (8 all-reduces a layer per micro-batch against "
                                     f"4) and the loss: {LOSS_ROWS}, twice",
    ("zero_bubble", 1, "all-gather"): f"0.38 (321 / 841 KiB): {LOSS_ROWS}, in both input_grad_last and "
                                      "weight_grad_last",
}


@functools.cache
def _exact(schedule: str):
    """(per stage, the exact compiled bytes per family; analytic family -> bytes) of pp_fsdp_tp under `schedule`,
    compiled once per schedule for all its cases."""
    import jax

    from shardkit.analysis.estimate import communication_estimate
    from shardkit.analysis.plan import collective_family, compile_layout
    from shardkit.analysis.suggest import load_base
    from shardkit.analysis.targets import target_devices
    from shardkit.layout import build_layout
    from shardkit.pipeline.program import tick_program

    assert len(jax.devices()) == 8
    layout = build_layout(load_base("recipes/pp_fsdp_tp.toml", (f"pipeline.schedule={schedule}",)),
                          target_devices(parse_target("h100x8")))
    module = parse_hlo(compile_layout(layout).as_text())
    collectives = collectives_from_module(module, dict(layout.mesh.shape))
    program = tick_program(layout.pipeline)
    analytic: dict[str, float] = {}
    for item in communication_estimate(layout):
        analytic[collective_family(item.kind)] = analytic.get(collective_family(item.kind), 0.0) + item.bytes
    stages = exact_tick_bytes(module, collectives, program)
    assert stages is not None, "the tick switches of the compiled step were not attributed"
    assert branch_name_bytes(collectives, attribute_ticks(module, program)) is not None
    return [by_kind(stage, collective_family) for stage in stages], analytic


def _cases() -> list:
    out = []
    for schedule in SCHEDULES:
        for stage in (0, 1):
            for family in FAMILIES:
                reason = NOT_YET_MODELLED.get((schedule, stage, family))
                marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                out.append(pytest.param(schedule, stage, family, marks=marks, id=f"{schedule}-stage{stage}-{family}"))
    return out


@pytest.mark.slow
@pytest.mark.skipif(not cuda_plugin_available(), reason="needs the jax[cuda12] plugin to compile for --target")
@pytest.mark.parametrize("schedule, stage, family", _cases())
def test_analytic_bytes_within_10_percent_of_the_exact_compiled_bytes(schedule, stage, family):
    stages, analytic = _exact(schedule)
    compiled = stages[stage].get(family, 0.0)
    assert compiled > 0 and LOW <= analytic.get(family, 0.0) / compiled <= HIGH, (analytic, stages)
