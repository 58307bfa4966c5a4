"""Collective bytes per pipeline stage of a 1F1B-family step (1f1b, interleaved_1f1b, zero_bubble): the tick
program's actions times what each action's branch of the tick switch computes.

`communication_estimate` gives one figure per device. Under the tick executor (shardkit/pipeline/one_f_one_b.py)
the stages differ: each tick runs one action per stage in a `lax.switch` branch, the layers' reductions over
`tensor` run inside those branches as often as the stage's actions re-run its layers, and the loss runs on the last
stage only. Here every stage gets

- what runs once per step outside the switch, on every stage (`step_items`): the estimate's items but those that run
  inside the branches (the layers' and the head's reductions over `tensor`; FSDP's traffic of the layers and the
  head where it gathers per use);
- per action of the stage's row of the tick program (`tick_program(layout.pipeline).action`), that action's
  collectives (`action_items`), one run each time the stage takes it.

Which branch runs where is exactly what `shardkit.analysis.compiled.tick_branches` reads from the compiled program, so
tests/test_pipeline_estimate.py holds these figures to its exact per-stage bytes. Nothing here reads a compiled program.

FSDP gathering per use (`pipeline.fsdp_gather = "per_use"`: `fsdp` automatic inside the region) moves FSDP's
traffic of the stage's layers, the head and the final norm into the branches (`fsdp_action_items`); only the
embedding's gather and gradient and the head gradient's sum over `pipeline` stay outside (`per_use_step_items`).
tests/test_pipeline_estimate.py holds it to the compiled bytes per stage.

Not modelled per action (they keep the estimate's per-step figures on every stage): context- and expert-parallel
collectives inside the layers. Modelled but not yet held to a compiled 1F1B program: sequence parallelism's pairs.
"""

from __future__ import annotations

import collections

import numpy as np

from shardkit.analysis.compiled.collective_kinds import collective_family
from shardkit.analysis.predicted.comm_terms import CommItem, split_head_elements, tensor_items
from shardkit.analysis.predicted.estimate import communication_estimate
from shardkit.analysis.predicted.memory_terms import (
    head_elements,
    local_batch,
    replica_elements_by_role,
    sequence_parallel,
)
from shardkit.pipeline import manual_data_axes, microbatch_activation_bytes
from shardkit.pipeline.program import Action, tick_program

FP32 = 4  # the loss's statistics, its cotangent and the token ids (int32) are four bytes an element

# Tensor reductions per layer each action runs (Megatron's f and g: 2 in a forward pass, 2 in its backward), as
# one_f_one_b._StageWork's branches compute them; counted in the compiled branches (h100x8, recipes/pp_fsdp_tp.toml,
# two layers a stage, per run of the branch: forward 4 all-reduces over tensor, backward 8, backward_last 8 besides
# the loss's one, zero_bubble's input_grad 8, weight_grad 8, input_grad_last and weight_grad_last 8 besides the loss's).
LAYER_REDUCTIONS = {
    Action.IDLE: 0,
    Action.FORWARD: 2,
    # The executor keeps only the stage input, so every backward re-runs the chunk's forward under jax.vjp: 2 + 2.
    Action.BACKWARD: 4,
    Action.BACKWARD_LAST: 4,
    # zero_bubble's B differentiates the input only, but its backward crosses every layer's input-gradient
    # reductions, after re-running the forward.
    Action.INPUT_GRAD: 4,
    Action.INPUT_GRAD_LAST: 4,
    # zero_bubble's W re-runs the forward and the backward again: every layer's weights (its norms' scales too) need
    # the gradient of their input, which the next block's reductions over `tensor` sum, so none of them drops out.
    Action.WEIGHT_GRAD: 4,
    Action.WEIGHT_GRAD_LAST: 4,
}
# The backward actions whose recomputed forward's output no gradient reads (the last chunk's feeds the loss). With a
# chunk of one layer no loop is left over the chunk's layers and XLA drops that output's reduction, the recomputed
# forward's last (interleaved_1f1b, v = 2 on pp_fsdp_tp, one layer a chunk: backward 3 all-reduces, backward_last 4
# besides the loss's); a scan over two or more layers runs one body for every layer and keeps it.
DISCARDS_OUTPUT = (Action.BACKWARD, Action.INPUT_GRAD, Action.WEIGHT_GRAD)
# The actions that run the head and the loss (the last chunk's backward, recomputing its forward), and of them those
# that keep the loss's value (W discards it: `sums.add(0.0, ...)`, so XLA drops the target logit's sums).
RUNS_LOSS = (Action.BACKWARD_LAST, Action.INPUT_GRAD_LAST, Action.WEIGHT_GRAD_LAST)
KEEPS_LOSS = (Action.BACKWARD_LAST, Action.INPUT_GRAD_LAST)
# The actions that differentiate the chunk's layers, and the `train.remat` presets under which that backward recomputes
# each layer's forward once more inside the chunk's scan, its attention output projection among what it rebuilds:
# one more reduction a layer (the projection's; the block's last, the layer's output, is read by no gradient there).
# `minimal_with_context` keeps the projection's output and reruns none.
DIFFERENTIATES = (Action.BACKWARD, Action.BACKWARD_LAST, Action.INPUT_GRAD, Action.INPUT_GRAD_LAST,
                  Action.WEIGHT_GRAD, Action.WEIGHT_GRAD_LAST)
REMAT_RERUNS_PROJECTION = ("full", "selective", "offload")
# FSDP per use (`pipeline.fsdp_gather = "per_use"`): the actions that make the chunk's weight gradients, and those that
# make the head's (the loss actions but W, which differentiates the chunk only), each reduce-scattering it over `fsdp`
# onto the shard its sum is kept on.
MAKES_CHUNK_GRADIENT = (Action.BACKWARD, Action.BACKWARD_LAST, Action.WEIGHT_GRAD, Action.WEIGHT_GRAD_LAST)
MAKES_HEAD_GRADIENT = (Action.BACKWARD_LAST, Action.INPUT_GRAD_LAST)
# The estimate's items of FSDP's per-step parameter traffic (`fsdp_items`, `gradient_items`), which per use run
# in the branches instead (the embedding's excepted: `per_use_step_items`).
FSDP_STEP_ITEMS = ("parameters, forward", "parameters, backward", "gradients")


def tick_stage_communication(layout) -> list[dict[str, float]]:
    """Per pipeline stage of a 1F1B-family layout, collective family -> bytes per step per device (full-buffer
    bytes, as `communication_estimate`; families as `collective_family` names them: every
    reduction is "reduction")."""
    out = []
    for items in tick_stage_items(layout):
        families: dict[str, float] = collections.defaultdict(float)
        for item in items:
            families[collective_family(item.kind)] += item.bytes
        out.append(dict(families))
    return out


def tick_stage_items(layout) -> list[list[CommItem]]:
    """Per pipeline stage, its collectives per step per device: `step_items`, then per action the stage takes its
    `action_items` times the number of ticks it takes it (`tick_program`)."""
    if not layout.pipeline.one_f_one_b:
        raise ValueError(f"per-stage communication is modelled for the 1F1B family, not {layout.pipeline.schedule}")
    outside = step_items(layout)
    counts = action_counts(layout)
    per_run = {action: action_items(layout, action) for action in sorted({a for row in counts for a in row})}
    stages = []
    for row in counts:
        items = list(outside)
        for action, runs in sorted(row.items()):
            items.extend(_times(item, runs) for item in per_run[action])
        stages.append(items)
    return stages


def action_counts(layout) -> list[dict[Action, int]]:
    """Per stage, how many ticks of the step it takes each action (IDLE included)."""
    rows = tick_program(layout.pipeline).action.tolist()  # counted as ints: one Action per kind, not per tick
    return [{Action(a): runs for a, runs in collections.Counter(row).items()} for row in rows]


def _times(item: CommItem, runs: int) -> CommItem:
    return CommItem(f"{item.what} x {runs}", item.kind, item.axes, item.bytes * runs, item.group_size)


def step_items(layout) -> list[CommItem]:
    """What every stage runs once per step outside the tick switch: `communication_estimate`'s items (FSDP's
    once-per-step gather and reduce-scatter, the head's all-to-alls, the stage-boundary sends, the sums over
    `pipeline` and `data`) without its reductions over `tensor`, which run inside the switch's branches and are
    counted per action here, but for the embedding's rows summed over `tensor` (vocabulary over `tensor`), which runs
    before the region on the whole local batch (one all-reduce outside the switch).
    Where FSDP gathers per use, its parameter traffic is `per_use_step_items` instead of the estimate's."""
    shape = dict(layout.mesh.shape)
    compute_size = layout.policy.compute_size
    accum = layout.recipe.train.grad_accum
    in_switch = tensor_items(layout, shape, compute_size, accum)
    items = [item for item in communication_estimate(layout) if item not in in_switch]
    if gathers_per_use(layout):
        items = [item for item in items if not _fsdp_step_item(item)] + per_use_step_items(layout)
    if _vocab_over_tensor(layout):
        b, s = local_batch(layout)
        rows = b * s * layout.config.embed * compute_size * accum
        items.append(CommItem("embedding rows (vocab over tensor)", "all-reduce", ("tensor",), rows, shape["tensor"]))
        if sequence_parallel(layout):  # the rows' gradient, cut along the sequence, is gathered back
            items.append(CommItem("embedding rows gradient (vocab over tensor, SP)", "all-gather", ("tensor",), rows,
                                  shape["tensor"]))
    return items


def _vocab_over_tensor(layout) -> bool:
    return layout.mesh.shape["tensor"] > 1 and "tensor" in layout.rules.activations.get("vocab", ())


def gathers_per_use(layout) -> bool:
    """Whether FSDP's gathers and reduce-scatters of the stage's layers and the head run inside the tick switch's
    branches: `fsdp` > 1 and left automatic in the region (`pipeline.fsdp_gather = "per_use"`)."""
    # `pipeline_region(layout).gathers_per_step`, without deriving the region's rules
    return layout.mesh.shape["fsdp"] > 1 and "fsdp" not in manual_data_axes(layout)


def _fsdp_step_item(item: CommItem) -> bool:
    return item.axes == ("fsdp",) and item.what in FSDP_STEP_ITEMS


def per_use_step_items(layout) -> list[CommItem]:
    """FSDP per use, what runs outside the switch: the embedding table (outside the stack and the head, unless looked
    up by row) gathered over `fsdp` before the region in the parameter dtype, its gradient (summed in fp32 by
    one_f_one_b.value_and_grad) reduce-scattered back after it, and the head's and final norm's gradients, kept on
    their fsdp shard through the ticks, summed over `pipeline` (and `data`) once, unconditionally."""
    shape = layout.mesh.shape
    fsdp, data = shape["fsdp"], shape["data"]
    embedding = replica_elements_by_role(layout)["outside"] - head_elements(layout)
    param_size = layout.policy.param_size
    compute_size = layout.policy.compute_size
    accum = layout.recipe.train.grad_accum
    items = []
    if embedding:
        items += [CommItem("embedding (per use)", "all-gather", ("fsdp",), embedding * param_size * accum, fsdp),
                  CommItem("embedding gradient (per use)", "reduce-scatter", ("fsdp",), embedding * FP32 * accum,
                           fsdp)]
    axes = ("pipeline", "data") if data > 1 else ("pipeline",)
    head_shard = head_elements(layout) / fsdp * compute_size * accum
    items.append(CommItem("gradients (head, final norm; fsdp shard)", "all-reduce", axes, head_shard,
                          shape["pipeline"] * data))
    return items


def action_items(layout, action: Action) -> list[CommItem]:
    """The collectives of one run of `action`'s branch on one device: its chunk's layers' reductions over `tensor`
    (`LAYER_REDUCTIONS` per layer, each of one micro-batch's b*s*h activation), for the actions that run the loss,
    `loss_items`, and FSDP's gathers and reduce-scatters where it gathers per use (`fsdp_action_items`)."""
    items = layer_items(layout, action)
    if action in RUNS_LOSS:
        items += loss_items(layout, keeps_loss=action in KEEPS_LOSS)
    return items + fsdp_action_items(layout, action)


def fsdp_action_items(layout, action: Action) -> list[CommItem]:
    """FSDP per use, one run of `action` (compute dtype: the stack and the head are cast before the region), C the
    chunk's layers and H the head and final norm, each one data replica's (whole over `fsdp`):

    - the chunk gathered over `fsdp`, layer by layer in its scan: once by a forward; twice by every action that
      differentiates it, whose recomputed forward gathers it and whose transposed scan gathers each layer again;
    - C reduce-scattered by the actions that make the chunk's weight gradients (`MAKES_CHUNK_GRADIENT`);
    - the loss actions gather H, in one all-gather with the final norm's scale a second time (the transpose's own
      copy: the combined all-gather's operands name the scale's shard twice), and those that make the head's gradient
      (`MAKES_HEAD_GRADIENT`) reduce-scatter H.

    Per run: forward gathers C; backward and weight_grad 2C and reduce-scatter C; input_grad 2C; backward_last
    2C + H + 256 and C + H; input_grad_last 2C + H + 256 and H; weight_grad_last 2C + H + 256 and C. None where the
    region gathers once per step. With one layer a chunk no scan is left and XLA keeps one matrix of the recomputed
    forward's gathers for a backward's pullback, which the 2C here does not subtract."""
    if not gathers_per_use(layout):
        return []
    fsdp = layout.mesh.shape["fsdp"]
    compute_size = layout.policy.compute_size
    chunk = replica_elements_by_role(layout)["layers"] / layout.pipeline.chunks * compute_size
    gathers = (action == Action.FORWARD) + 2 * (action in DIFFERENTIATES)
    items = []
    if gathers:
        items.append(CommItem("chunk's layers (per use)", "all-gather", ("fsdp",), gathers * chunk, fsdp))
    if action in MAKES_CHUNK_GRADIENT:
        items.append(CommItem("chunk's layer gradients (per use)", "reduce-scatter", ("fsdp",), chunk, fsdp))
    if action in RUNS_LOSS:
        head = head_elements(layout) * compute_size
        scale = _final_norm_elements(layout) * compute_size
        items.append(CommItem("head, final norm (per use)", "all-gather", ("fsdp",), head + scale, fsdp))
        if action in MAKES_HEAD_GRADIENT:
            items.append(CommItem("head, final norm gradients (per use)", "reduce-scatter", ("fsdp",), head, fsdp))
    return items


def _final_norm_elements(layout) -> float:
    """Elements per data replica of the head's one-dimensional parameters (the final norm's scale)."""
    rules = layout.rules.without_axes(("data", "fsdp"))
    total = 0.0
    for elements, logical in zip(layout.shard_elements(rules.params, "params"), layout.logical_leaves()):
        if tuple(logical or ()) == ("embed",):
            total += elements
    return total


def layer_items(layout, action: Action) -> list[CommItem]:
    """One run of `action` over its chunk's layers: `LAYER_REDUCTIONS[action]` reductions over `tensor` of one
    micro-batch's activation per layer, less the one `DISCARDS_OUTPUT` drops from a one-layer chunk, plus one a layer
    where remat rebuilds the attention's output projection in the backward (`REMAT_RERUNS_PROJECTION`); under sequence
    parallelism each is an all-gather and reduce-scatter pair of the same volume (as `tensor_items`)."""
    t = layout.mesh.shape["tensor"]
    config = layout.pipeline
    layers = layout.config.layers // (config.stages * config.chunks)
    reductions = LAYER_REDUCTIONS[action] * layers - (layers == 1 and action in DISCARDS_OUTPUT)
    if action in DIFFERENTIATES and layout.recipe.train.remat in REMAT_RERUNS_PROJECTION:
        reductions += layers
    if t == 1 or not reductions:
        return []
    total = reductions * microbatch_activation_bytes(layout)
    if sequence_parallel(layout):
        return [CommItem("chunk's layer activations (SP)", kind, ("tensor",), total, t)
                for kind in ("all-gather", "reduce-scatter")]
    return [CommItem("chunk's layer activations", "all-reduce", ("tensor",), total, t)]


def loss_items(layout, keeps_loss: bool) -> list[CommItem]:
    """One micro-batch's loss on the last stage, forward and backward (`split_loss_items` where the head is split
    over `fsdp` by vocabulary, else `vocab_parallel_loss_items`)."""
    if split_head_elements(layout):
        return split_loss_items(layout, keeps_loss)
    return vocab_parallel_loss_items(layout, keeps_loss)


def split_loss_items(layout, keeps_loss: bool) -> list[CommItem]:
    """The loss with the head split over `fsdp` by vocabulary (`shardkit.pipeline.head_split.cross_entropy_sum`),
    one micro-batch, with T its tokens on a device, f = fsdp, G = f x T the gathered rows. As compiled for h100x8
    (recipes/pp_fsdp_tp.toml, T = 128, D = 64, fp32; per run of backward_last / input_grad_last / weight_grad_last):

    - over `fsdp`, the rows, targets and each rank's loss cotangent all-gathered (one combined all-gather:
      G*D*c + G*4 + f*4 = 66,568 bytes), and the rows' gradient reduce-scattered back (G*D*c = 65,536);
    - the log-sum-exp's max and sum over `fsdp` and the vocabulary's axes (`tensor`: two all-reduces of G*4,
      2,048 bytes);
    - the hidden state's gradient, partial over the vocabulary's blocks, summed over them (one all-reduce of G*D*c
      over `tensor`), with, where the action keeps the loss's value, the target logit summed over `tensor` in the
      same all-reduce (G*4: 66,560 bytes, 65,536 in weight_grad_last) and over `fsdp` (G*4: 1,024 bytes, none in
      weight_grad_last).
    """
    shape = layout.mesh.shape
    fsdp, embed = shape["fsdp"], layout.config.embed
    compute_size = layout.policy.compute_size
    gathered = fsdp * _microbatch_tokens(layout)
    rows = gathered * embed * compute_size
    statistic = gathered * FP32
    vocab_axes = _vocab_axes(layout)
    vocab_group = int(np.prod([shape[a] for a in vocab_axes]))
    items = [CommItem("loss rows, targets, cotangents", "all-gather", ("fsdp",), rows + statistic + fsdp * FP32, fsdp),
             CommItem("loss rows' gradient", "reduce-scatter", ("fsdp",), rows, fsdp),
             CommItem("loss statistics (max, sum)", "all-reduce", ("fsdp", *vocab_axes), 2 * statistic,
                      fsdp * vocab_group)]
    if keeps_loss:
        items.append(CommItem("loss statistics (target logit)", "all-reduce", ("fsdp",), statistic, fsdp))
    if vocab_axes:
        target = statistic if keeps_loss else 0.0
        items.append(CommItem("head input gradient, target logit (vocab blocks)", "all-reduce", vocab_axes,
                              rows + target, vocab_group))
    return items


def vocab_parallel_loss_items(layout, keeps_loss: bool) -> list[CommItem]:
    """The loss with the head whole over `fsdp` and its vocabulary over `tensor`: the inside-the-region part of
    `_vocab_parallel_items`, per micro-batch: the head input's gradient (b*s*h) and the softmax's statistics (max,
    sum, and the target logit where the action keeps the loss) all-reduced over `tensor`; nothing where the
    vocabulary is whole."""
    if not _vocab_over_tensor(layout):
        return []
    tokens = _microbatch_tokens(layout)
    compute_size = layout.policy.compute_size
    statistics = (3 if keeps_loss else 2) * tokens * FP32
    total = tokens * layout.config.embed * compute_size + statistics
    return [CommItem("head input gradient, loss statistics (vocab over tensor)", "all-reduce", ("tensor",), total,
                     layout.mesh.shape["tensor"])]


def _microbatch_tokens(layout) -> int:
    """One micro-batch's tokens on one device (its rows of one data replica, the whole sequence)."""
    compute_size = layout.policy.compute_size
    return microbatch_activation_bytes(layout) // (layout.config.embed * compute_size)


def _vocab_axes(layout) -> tuple[str, ...]:
    """The mesh axes (> 1) the vocabulary's activations are split over inside the region (`tensor` or none)."""
    shape = layout.mesh.shape
    return tuple(a for a in layout.rules.activations.get("vocab", ()) if shape.get(a, 1) > 1 and a != "fsdp")
