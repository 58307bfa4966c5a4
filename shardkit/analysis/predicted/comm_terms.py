"""The analytic model's collectives per step, by kind of parallelism: FSDP's gathers and reductions, data
parallelism's and ZeRO's, tensor and sequence parallelism's, context parallelism's K/V, the pipeline's sends and
re-layouts and its head split, expert parallelism's all-to-alls.

`bytes` of a collective is the full buffer it reduces or gathers (as in `shardkit.analysis.compiled.hlo`), per device.
`shardkit.analysis.predicted.estimate.communication_estimate` combines them.
"""

from __future__ import annotations

import dataclasses
import math

from shardkit.analysis.compiled.collective_kinds import RING_FACTORS
from shardkit.analysis.predicted.flops import is_transformer
from shardkit.analysis.predicted.memory_terms import (
    expert_elements_per_device,
    fsdp_group,
    fsdp_syncs_per_step,
    head_elements,
    local_batch,
    replica_elements_by_role,
    replica_param_elements,
    sequence_parallel,
    stored_layer_bytes,
)
from shardkit.attention.context import balanced_ring
from shardkit.pipeline import (
    bubble_fraction,
    collective_permute_bytes,
    gpipe,
    manual_data_axes,
    microbatch_activation_bytes,
)


@dataclasses.dataclass(frozen=True)
class CommItem:
    """One expected stream of collectives per step: what, of which kind, over which axes, how many full-buffer bytes."""

    what: str
    kind: str
    axes: tuple[str, ...]
    bytes: float
    group_size: int

    @property
    def wire_bytes(self) -> float:
        return self.bytes * RING_FACTORS[self.kind](self.group_size) if self.group_size > 1 else 0.0


def fsdp_items(layout, compute_size: int, param_size: int, accum: int,
               group: tuple[str, ...] = ("fsdp",)) -> list[CommItem]:
    """FSDP's parameter traffic per step as XLA:GPU compiles it (h100x8, tiny and 8b presets): the layer stack is
    gathered layer by layer in each pass (after its cast to the compute dtype, inside the layer loop), but for the
    expert weights of an expert-parallel region (forward only); the parameters outside it (final norm, output head,
    an embedding not looked up by row) are gathered once, in the parameter dtype (the gather lands before their
    cast, outside any loop), and the forward's copy serves the backward; an untied embedding table looked up by row
    (`replica_elements_by_role`) is never gathered: the looked-up rows of the local tokens are exchanged by an
    all-to-all forward, and their gradients by another backward. `group`: the FSDP ranks' mesh axes
    (`shardkit.analysis.predicted.memory_terms.fsdp_group`)."""
    fsdp = math.prod(layout.mesh.shape[axis] for axis in group)
    roles = replica_elements_by_role(layout)
    rows, seq = local_batch(layout)
    layers = roles["layers"] * compute_size * accum
    outside = roles["outside"] * param_size * accum
    # A pipeline gathering each stage once per step (pipeline.fsdp_gather = "per_step") gathers its layers only once.
    once = pipeline_stack_elements_gathered_once(layout) * compute_size * accum
    # Expert weights enter the expert-parallel region gathered (`shardkit.moe.expert_parallel`): the region keeps
    # its inputs for its backward, so they are gathered in the forward only (a stage gathered once counts them above).
    expert_region = layout.mesh.shape["expert"] > 1 and not once
    kept = expert_elements_per_device(layout) * compute_size * accum if expert_region else 0.0
    items = [CommItem("parameters, forward", "all-gather", group, layers + outside, fsdp),
             CommItem("parameters, backward", "all-gather", group, layers - once - kept, fsdp)]
    if roles["lookup"]:
        rows_bytes = 2 * rows * seq * layout.config.embed * compute_size * accum
        items.append(CommItem("embedding rows (lookup, its gradient)", "all-to-all", group, rows_bytes, fsdp))
    return items


def gradient_items(grad_bytes: float, data: int, fsdp: int, zero: int,
                   group: tuple[str, ...] = ("fsdp",)) -> list[CommItem]:
    """The gradient reduction as XLA:GPU compiles it (h100:2x4, data=2 x fsdp=4): over the FSDP ranks (`group`, of
    `fsdp` devices) a reduce-scatter of the replica's gradients, then over `data` an all-reduce of the fsdp shard
    (ZeRO: a reduce-scatter); without FSDP ranks, one all-reduce (ZeRO: reduce-scatter) over `data`."""
    items = []
    if fsdp > 1:
        items.append(CommItem("gradients", "reduce-scatter", group, grad_bytes, fsdp))
    if data > 1:
        kind = "reduce-scatter" if zero >= 1 else "all-reduce"
        items.append(CommItem("gradients", kind, ("data",), grad_bytes / fsdp, data))
    return items


def tensor_items(layout, shape, compute_size, accum) -> list[CommItem]:
    t = shape["tensor"]
    if t == 1:
        return []
    # `local_batch` divides the sequence by the `sequence` rule only; Megatron-SP cuts `residual_sequence` over
    # `tensor`, so b*s*h is the whole sequence's activation, of which each device holds 1/t between blocks.
    b, s = local_batch(layout)
    activation = b * s * layout.config.embed * compute_size
    total = layer_activation_reductions(layout, activation) * accum
    if sequence_parallel(layout):
        items = [CommItem("layer activations (SP)", "all-gather", ("tensor",), total, t),
                 CommItem("layer activations (SP)", "reduce-scatter", ("tensor",), total, t)]
    else:
        items = [CommItem("layer activations", "all-reduce", ("tensor",), total, t)]
    if "tensor" in layout.rules.activations.get("vocab", ()):  # the tensor axis is > 1 here
        items.extend(_vocab_parallel_items(layout, activation * accum, 3 * b * s * 4 * accum, t))
    return items


def layer_activation_reductions(layout, activation: float) -> float:
    """Bytes of the layers' reductions over `tensor` per step (per accumulation step), `activation` being the local
    batch's b*s*h: two per layer forward and two backward (Megatron's f and g), 4 x layers x activation.

    Under the GPipe and circular schedules every stage runs its chunk at every tick, bubble ticks included (one SPMD
    program: a stage idle in the schedule computes on zeros), v*m + p - 1 ticks of L/(p*v) layers on one micro-batch's
    rows, and each tick is rematerialised (shardkit.pipeline.gpipe._apply_chunk): its forward reductions run again in
    the backward, but for the last layer's second one when the chunk is one layer (no loop is left over the chunk's
    layers, and XLA drops the recomputed reduction whose output no gradient reads). As compiled for h100x8
    (recipes/pp_fsdp_tp.toml, 2 x 64 x 64 fp32 rows): gpipe, 2 layers a tick, 20 forward and 40 backward all-reduces;
    circular (v=2), 1 layer a tick, 18 and 27. The 1F1B family runs its layers inside the tick switch's branches (not
    in the compiled totals): the plain count."""
    config = layout.pipeline
    layers = layout.config.layers // layout.mesh.shape["pipeline"]
    if not config.enabled or config.one_f_one_b:
        return 4 * layers * activation
    chunk = layers // config.chunks  # layers a tick runs
    per_tick = 2 * chunk + (2 * chunk - (chunk == 1)) + 2 * chunk  # forward, its recompute, backward
    return config.forward_ticks * per_tick * activation / config.microbatches


def _vocab_parallel_items(layout, activation: float, statistics: float, t: int) -> list[CommItem]:
    """Vocabulary over `tensor` (h100x8, recipes/tp.toml, fsdp_tp.toml, tp_sp.toml): the embedding lookup's partial
    rows are summed over `tensor` (`shardkit.nn.lookup`) and the head's input gradient too, one activation each; the
    loss's softmax sums its fp32 per-token max, sum and target logit (`statistics`). Under sequence parallelism the
    head's input (the final norm's output, cut along the sequence) is all-gathered forward and its gradient
    reduce-scattered back, and the embedding's rows gradient, cut along the sequence, is all-gathered back: one
    more all-gather of the activation each."""
    reduced = CommItem("embedding rows, head input gradient, loss statistics (vocab over tensor)", "all-reduce",
                       ("tensor",), 2 * activation + statistics, t)
    if not sequence_parallel(layout):
        return [reduced]
    return [reduced, CommItem("head input, embedding rows gradient (vocab over tensor, SP)", "all-gather",
                              ("tensor",), 2 * activation, t)]


def context_parallel_items(layout) -> list[CommItem]:
    """Context parallelism's own traffic (`shardkit.attention.ring`, the `allgather` variant as XLA:GPU compiles it
    on h100x8, recipes/cp.toml): per layer the K/V of the whole sequence all-gathered over `sequence` in the forward
    and again in the backward (under `full` remat too: the recomputed forward's gather serves the backward),
    dK/dV reduce-scattered in fp32; and the causal zigzag reorder: the queries into zigzag order and the output
    back, each in the forward (and in remat's recomputed forward under `full`) and their transposes in the
    backward, every one of the 2 x cp chunks of a replica's sequence sent once (the chunks that stay on their
    device included, as the compiled pairs count them), unless the step puts its rows in that order once
    (`shardkit.attention.context.balanced_ring`): then no layer reorders anything. The `ring` variant moves the same
    K/V hop by hop; it is priced as the gather here, not compiled."""

    shape, config, train = layout.mesh.shape, layout.config, layout.recipe.train
    cp = shape["sequence"]
    if cp == 1 or not is_transformer(config):
        return []
    c = layout.policy.compute_size
    rows = train.global_batch // (shape["data"] * shape["fsdp"])
    tokens = rows * train.seq_len / shape["tensor"]  # the heads divided over `tensor`
    kv = 2 * tokens * config.kv_heads * config.head_dim
    queries = tokens * config.heads * config.head_dim
    layers = config.layers // shape["pipeline"]
    forwards = 2 if train.remat == "full" else 1
    items = [CommItem("K/V (context parallel)", "all-gather", ("sequence",), 2 * layers * kv * c, cp),
             CommItem("dK/dV (context parallel)", "reduce-scatter", ("sequence",), layers * kv * 4, cp)]
    if not balanced_ring(layout):
        items.append(CommItem("queries and output to zigzag order and back (causal context parallel)",
                              "collective-permute", ("sequence",), 2 * (forwards + 1) * layers * queries * c, cp))
    return items


def pipeline_items(layout, shape, compute_size, accum) -> list[CommItem]:
    """Stage-boundary sends, in `shardkit.pipeline.collective_permute_bytes`'s terms: per pipeline group, summed over
    its source-target pairs (as `shardkit.analysis.compiled.hlo` counts a compiled collective-permute)."""
    config = layout.pipeline
    if not config.enabled:
        return []
    total = collective_permute_bytes(config, microbatch_activation_bytes(layout)) * accum
    items = [CommItem("stage boundaries (forward + backward)", "collective-permute", ("pipeline",), total,
                      config.stages)]
    train = layout.recipe.train
    rows = train.global_batch // (shape["data"] * shape["fsdp"])
    batch_bytes = rows * train.seq_len * layout.config.embed * compute_size * replica_token_share(layout)
    if config.one_f_one_b:
        # The tick executor's head runs on the last stage: only the embedded batch's gradient, filed by stage 0, is
        # summed over `pipeline` at the region's edge (one batch activation per step).
        items.append(CommItem("embedded batch's gradient", "all-reduce", ("pipeline",), batch_bytes, config.stages))
    else:
        # GPipe/circular hand the last stage's outputs to every rank (the head runs outside the region) with a sum
        # over `pipeline`, and the backward sums the input gradient the same way: two batch activations per step.
        items.append(CommItem("outputs to every stage, input gradient back", "all-reduce", ("pipeline",),
                              2 * batch_bytes, config.stages))
    if config.chunks > 1:
        items.extend(chunk_relayout_items(layout))
    return items


def replica_token_share(layout) -> float:
    """The share of a data replica's tokens (its `data` x `fsdp` rows) one device holds: the batch rule's other axes
    (the expert ranks) split its rows, the sequence rule's (the context ranks) its tokens."""
    shape, activations = layout.mesh.shape, layout.rules.activations
    others = [axis for axis in activations.get("batch", ()) if axis not in ("data", "fsdp")]
    return 1.0 / math.prod(shape.get(axis, 1) for axis in (*others, *activations.get("sequence", ())))


def chunk_relayout_items(layout) -> list[CommItem]:
    """The chunked schedules' re-layout (circular, interleaved_1f1b): chunk r of stage d holds layers r*p + d, not the
    contiguous rows `layers -> pipeline` gives stage d, so XLA exchanges the stacked layers once per step and their
    gradients back, as the parameters are stored (`stored_layer_bytes`: under FSDP each device's shard).

    How XLA's SPMD reshape (L) -> (v, p, L/(p*v)) moves them depends on how the contiguous blocks fall on the chunks
    (compiled for h100x8): where v is a multiple of p, each stage's block is whole chunks of one repeat's row and one
    all-to-all each way re-lays them (pp_fsdp_tp at v = 2 and 4, p = 2; recipes/pp.toml at p = 2, v = 2: the
    all-to-all only, every permute of the program a stage boundary's); otherwise (p = 4, v = 2) a block spans two
    stages' chunks, and the all-to-all is followed by one collective-permute each way whose source-target pairs span
    every device of the mesh (recipes/pp.toml with data 2, with fsdp 2, with tensor 2: 8 pairs, each a device's
    stored stack). The permute's group is those pairs: `bytes` sums them (as `shardkit.analysis.compiled.hlo` counts
    it), and each device sends its stored stack (`shardkit.analysis.predicted.nccl.stream_seconds` divides by the
    group)."""
    config = layout.pipeline
    stored = stored_layer_bytes(layout)
    items = [CommItem("layers into chunk order, gradients back", "all-to-all", ("pipeline",), 2 * stored,
                      config.stages)]
    if config.chunks % config.stages == 0:
        return items
    pairs = int(layout.mesh.devices.size)
    return items + [CommItem("layers into chunk order, gradients back", "collective-permute", ("pipeline",),
                             2 * stored * pairs, pairs)]


def pipeline_stack_elements_gathered_once(layout) -> float:
    """Elements per device of a stage's layers when the pipeline gathers them over `fsdp` once per step
    (`pipeline.fsdp_gather = "per_step"`, shardkit/pipeline/config.py), else 0. Their forward gather serves the
    backward too, so the step's second (backward) gather leaves them out; their gradient is reduce-scattered once, as
    the gradients item already counts."""
    if not layout.pipeline.enabled or "fsdp" not in manual_data_axes(layout):
        return 0.0
    rules = layout.rules.without_axes(("data", "fsdp"))
    total = 0.0
    for elements, logical in zip(layout.shard_elements(rules.params), layout.logical_leaves()):
        if logical and logical[0] == "layers":
            total += elements
    return total


def pipeline_stage_gather_bytes(layout, compute_size: float) -> float:
    """Memory of a per-step FSDP gather inside a pipeline beyond FSDP's one layer at a time: the stage's other layers
    gathered for the whole step, and their gradient accumulated per replica through the ticks (both in the compute
    dtype) until the one reduce-scatter."""
    elements = pipeline_stack_elements_gathered_once(layout)
    if not elements:
        return 0.0
    layers = layout.config.layers // layout.pipeline.stages
    return (2 * elements - elements / layers) * compute_size


def pipeline_bubble_fraction(layout) -> float | None:
    """The schedule's idle share of the step (`shardkit.pipeline.bubble_fraction`), None without a pipeline."""
    return bubble_fraction(layout.pipeline) if layout.pipeline.enabled else None


def tick_schedule_gradient_items(layout, items: list[CommItem]) -> list[CommItem]:
    """The 1F1B family's gradient reductions over `data`: the head and final norm, whose
    gradients only the last stage computes inside the region, are summed over data and pipeline at once; the rest
    (the stage's layers; the embedding, differentiated after the region) over data alone."""
    data, fsdp = layout.mesh.shape["data"], layout.mesh.shape["fsdp"]
    if fsdp > 1 and "fsdp" in manual_data_axes(layout):
        # The region reduces the head's gradients onto their fsdp shard and sums the shard over `pipeline`.
        shard = head_elements(layout) / fsdp * layout.policy.grad_reduce_size
        axes = ("pipeline", "data") if data > 1 else ("pipeline",)
        items = _split_head_items(layout, items)
        return [*items, CommItem("gradients (head, final norm; fsdp shard)", "all-reduce", axes, shard,
                                 layout.mesh.shape["pipeline"] * data)]
    if data == 1 or fsdp > 1:
        return items
    outside = replica_elements_by_role(layout)["outside"] * layout.policy.grad_reduce_size
    out = []
    for item in items:
        if item.what == "gradients" and item.axes == ("data",):
            out.append(dataclasses.replace(item, bytes=item.bytes - outside))
            out.append(CommItem("gradients (head, final norm)", item.kind, ("data", "pipeline"), outside,
                                data * layout.mesh.shape["pipeline"]))
        else:
            out.append(item)
    return out


def _split_head_items(layout, items: list[CommItem]) -> list[CommItem]:
    """The head split over `fsdp` by vocabulary (shardkit/pipeline/head_split.py) is neither gathered nor reduced
    over `fsdp` like the other parameters outside the stack: an all-to-all of its fsdp shard into the region and one
    of its gradient back replace them. The loss's gather of the rows
    and reduction of their gradient run inside the tick switch's loss branch, which the compiled counts leave out
    like the layers' tensor all-reduces there: not counted here either."""
    split = split_head_elements(layout)
    if not split:
        return items
    param_size = layout.policy.param_size
    # The parameters outside the stack have their fp32 gradients all-reduced over `fsdp` where FSDP works per layer
    # (`communication_estimate`), else they are in the reduce-scatter of the gradients.
    fp32_outside = any(i.what == "gradients" and i.kind == "all-reduce" and i.axes[0] == "fsdp" for i in items)
    reduce_size = layout.policy.grad_reduce_size
    reduced = ("all-reduce", 4) if fp32_outside else ("reduce-scatter", reduce_size)
    out = []
    for item in items:
        if item.what == "parameters, forward" and item.axes == ("fsdp",):
            item = dataclasses.replace(item, bytes=item.bytes - split * param_size)
        elif item.what == "gradients" and item.kind == reduced[0] and item.axes[0] == "fsdp":
            item = dataclasses.replace(item, bytes=item.bytes - split * reduced[1])
        out.append(item)
    compute_size = layout.policy.compute_size
    fsdp = layout.mesh.shape["fsdp"]
    return [*out, CommItem("head split by vocabulary, its gradient back", "all-to-all", ("fsdp",),
                           2 * split / fsdp * compute_size, fsdp)]


def loop_loss_region_items(layout, items: list[CommItem]) -> list[CommItem]:
    """GPipe's and circular's loss region (`shardkit.pipeline.gpipe.cross_entropy_for`), as compiled for h100x8
    (recipes/pp_fsdp_tp.toml: every row within 0.1%): the head split over `fsdp` by vocabulary (`_split_head_items`),
    and per step, over all of a device's chunks, with T its stage's token rows (1/p of its replica's) and f = fsdp:
    the rows and targets all-gathered over `fsdp` (f x T rows), the hidden state's gradient reduce-scattered back,
    the loss's three per-row statistics (max and sum over `fsdp` and the vocabulary's other axes, the target's logit
    over `fsdp`), and over `pipeline` the replica's hidden-state gradient (the slice's transpose) and the head
    gradient's fsdp shard (over `sequence` too under context parallelism, whose ranks each take their own positions:
    the rows are f x T / c positions long)."""
    shape, train = layout.mesh.shape, layout.recipe.train
    compute_size = layout.policy.compute_size
    fsdp, p, embed = shape["fsdp"], layout.pipeline.stages, layout.config.embed
    contexts = gpipe.loss_context_ranks(layout)
    whole_rows = fsdp * gpipe.loss_stage_rows(layout) * train.seq_len
    gathered_rows = whole_rows // contexts
    statistic = gathered_rows * 4  # one fp32 value a row
    vocab_axes = tuple(a for a in layout.rules.activations.get("vocab", ()) if shape.get(a, 1) > 1)
    head_shard = (split_head_elements(layout) or head_elements(layout)) / fsdp * compute_size
    share = replica_token_share(layout)
    return [*_split_head_items(layout, items), *_loss_rows_whole_items(layout, gathered_rows),
            CommItem("loss rows and targets", "all-gather", ("fsdp",), gathered_rows * (embed * compute_size + 4),
                     fsdp),
            CommItem("loss rows' gradient", "reduce-scatter", ("fsdp",), gathered_rows * embed * compute_size, fsdp),
            CommItem("loss statistics (max, sum)", "all-reduce", ("fsdp", *vocab_axes), 2 * statistic,
                     fsdp * math.prod(shape[a] for a in vocab_axes)),
            CommItem("loss statistics (target logit)", "all-reduce", ("fsdp",), statistic, fsdp),
            CommItem("loss rows' gradient over the stages", "all-reduce", ("pipeline",),
                     whole_rows // fsdp * p * embed * compute_size * share, p),
            CommItem("head gradient's shard", "all-reduce", ("pipeline", "sequence") if contexts > 1 else ("pipeline",),
                     head_shard, p * contexts)]


def _loss_rows_whole_items(layout, gathered_rows: int) -> list[CommItem]:
    """The loss region takes whole rows of its replica: where the expert ranks split the rows, the stage's rows and
    targets are gathered over them in the forward, and again in the backward (the transpose of their split). Priced at
    the rows the region then gathers over `fsdp` (rows and targets). The context ranks each keep their own positions
    (the region is manual over `sequence`)."""
    shape, activations = layout.mesh.shape, layout.rules.activations
    axes = tuple(axis for axis in (*activations.get("batch", ()), *activations.get("sequence", ()))
                 if axis not in ("data", "fsdp", "sequence") and shape.get(axis, 1) > 1)
    if not axes:
        return []
    rows = gathered_rows * (layout.config.embed * layout.policy.compute_size + 4)
    return [CommItem("loss rows and targets whole over the expert ranks (forward, backward)",
                     "all-gather", axes, 2 * rows, math.prod(shape[axis] for axis in axes))]


def split_head_elements(layout) -> float:
    """Elements per data-parallel replica (whole over `fsdp`) of the head parameters the 1F1B region (and GPipe's
    loss region) splits over `fsdp` by vocabulary (`shardkit.pipeline.head_split.splits`); 0 where it gathers them."""
    from shardkit.pipeline import head_split, pipeline_region

    if not layout.pipeline.one_f_one_b and gpipe.loss_stage_rows(layout) is None:
        return 0.0
    region = pipeline_region(layout)
    rules = layout.rules.without_axes(("data", "fsdp"))
    untied = not getattr(layout.config, "tie_embeddings", True)  # an untied table is the embedding's, not the head's
    total = 0.0
    for elements, logical in zip(layout.shard_elements(rules.params, "params"), layout.logical_leaves()):
        head = logical and logical[0] != "layers" and not (untied and tuple(logical) == ("vocab", "embed"))
        if head and head_split.splits(layout, region, logical):
            total += elements
    return total


def expert_parallel_items(layout, items: list[CommItem]) -> list[CommItem]:
    """Expert parallelism's traffic: the all-to-alls (`shardkit.moe.all_to_all_bytes`), and the gradient reduction
    of the parameters outside the experts over `expert` too, since the batch is also split over it: they are
    replicas over data x fsdp x expert, the experts' only over data x fsdp.

    Under per-layer FSDP as XLA:GPU compiles it (h100x8, recipes/moe_ep_fsdp.toml): every layer's gradients
    (experts' included) reduce-scattered over `fsdp` (the gradients items), then the non-expert layers' fsdp shard
    all-reduced over `expert`, and the parameters outside the layers all-reduced over fsdp x expert at once.
    Without FSDP: one reduction over data x expert of the non-expert gradients, one over data of the experts'."""
    from shardkit.moe import all_to_all_bytes

    shape = dict(layout.mesh.shape)
    ranks = shape["expert"]
    expert_elements = expert_elements_per_device(layout)
    grad_size = layout.policy.grad_reduce_size
    fsdp = shape["fsdp"]
    group = fsdp_group(layout)
    if "expert" in group and not fsdp_syncs_per_step(layout):
        roles = replica_elements_by_role(layout)
        expert_gather = expert_elements * layout.policy.compute_size * layout.recipe.train.grad_accum
        out = _experts_outside_fsdp_group(items, group, expert_elements * grad_size, expert_gather,
                                          roles["lookup"] * grad_size, shape)
    elif fsdp > 1 and not fsdp_syncs_per_step(layout):
        out = [_over_expert_too(item, ranks) if item.what == "gradients" and item.axes[0] == "fsdp"
               and item.kind == "all-reduce" else item for item in items]
        layer_grads = sum(item.bytes for item in items if item.what == "gradients" and item.kind == "reduce-scatter")
        out.append(CommItem("gradients (outside the experts, fsdp shard)", "all-reduce", ("expert",),
                            (layer_grads - expert_elements * grad_size) / fsdp, ranks))
    else:
        out = [item for item in items if item.what != "gradients"]
        other_elements = replica_param_elements(layout) - expert_elements
        replica_axes = tuple(axis for axis in ("data", "fsdp") if shape[axis] > 1)
        kind = "reduce-scatter" if fsdp > 1 or layout.recipe.rules.zero >= 1 else "all-reduce"
        replicas = shape["data"] * fsdp
        out.append(CommItem("gradients (outside the experts)", kind, replica_axes + ("expert",), other_elements * 4,
                            replicas * ranks))
        if replicas > 1:
            out.append(CommItem("gradients (experts)", kind, replica_axes, expert_elements * 4, replicas))
    out.append(CommItem("tokens to experts and back (dispatch, combine; forward, backward)", "all-to-all",
                        ("expert",), all_to_all_bytes(layout), ranks))
    return out


def _experts_outside_fsdp_group(items: list[CommItem], group: tuple[str, ...], expert_bytes: float,
                                expert_gather: float, lookup_bytes: float, shape) -> list[CommItem]:
    """The expert ranks are FSDP ranks of the weights outside the experts, as XLA:GPU compiles recipes/moe_ep.toml and
    moe_ep_fsdp.toml (h100x8): those are gathered and their gradients reduce-scattered over the whole `group`; the
    experts' own weights, split over `expert`, are gathered (forward only: the region keeps them) and their gradients
    reduce-scattered over the group's other axes, and all-reduced whole over `data`. With `data` too, the gradients
    outside the layers, the embedding table's included, are all-reduced over data x group at once."""
    others = tuple(axis for axis in group if axis != "expert")
    others_size, fsdp = math.prod(shape[axis] for axis in others), math.prod(shape[axis] for axis in group)
    data = shape["data"]
    out = []
    for item in items:
        gradients = item.what == "gradients"
        if gradients and item.kind == "reduce-scatter" and item.axes == group:
            out.append(dataclasses.replace(item, bytes=item.bytes - expert_bytes))
            if others:
                out.append(CommItem("gradients (experts)", "reduce-scatter", others, expert_bytes, others_size))
        elif gradients and item.axes == ("data",):
            out.append(dataclasses.replace(item, bytes=item.bytes - expert_bytes / fsdp + expert_bytes / others_size))
        elif gradients and item.kind == "all-reduce" and item.axes == group and data > 1:
            out.append(dataclasses.replace(item, axes=("data",) + group, bytes=item.bytes + lookup_bytes,
                                           group_size=item.group_size * data))
        elif item.what == "parameters, forward" and item.axes == group:
            out.append(dataclasses.replace(item, bytes=item.bytes - expert_gather))
            if others:
                out.append(CommItem("expert weights, forward", "all-gather", others, expert_gather, others_size))
        else:
            out.append(item)
    return out


def _over_expert_too(item: CommItem, ranks: int) -> CommItem:
    """A gradient all-reduce of parameters outside the layers, widened to `expert` (their replicas over it)."""
    return dataclasses.replace(item, axes=item.axes + ("expert",), group_size=item.group_size * ranks)
