"""The analytic model's memory terms per device: parameters and optimizer state by rule table, gradients, one
layer's saved activations by remat policy, the loss's logits, a mixture of experts' routed buffers.

Everything here is arithmetic on the layout (shapes, specs, mesh sizes, recipe). `shardkit.analysis.predicted.estimate`
combines these terms into `memory_estimate`; the pipeline schedules' own buffers are in
`shardkit.analysis.predicted.pipeline_memory`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from shardkit.analysis.predicted.flops import expert_parameter_elements, is_transformer
from shardkit.loss import DEFAULT_CHUNK_ROWS, chunk_count
from shardkit.microbatch import replica_axes
from shardkit.pipeline import gpipe
from shardkit.platforms import on_gpu
from shardkit.rules import (
    SHARED_FSDP_AXES,
    table_without_axes,
    table_without_shared_fsdp_ranks,
    without_shared_fsdp_ranks,
)

# Dense bf16 peak FLOP/s by device kind (published specifications, without sparsity).
ADAM_MOMENTS = 2  # AdamW keeps two fp32 moments per parameter


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes by item. `state` persists between steps; `transient` lives only inside the step.

    The step's transient peak is what stays alive through the backward pass (gradients, gathered parameters, every
    layer's saved activations) plus the larger of two phases that never overlap: the loss (`logits`: the head's
    output and its gradient) and one layer's recomputation under remat (`recompute`).
    """

    params: float
    master: float
    optimizer: float
    gradients: float
    gathered_params: float
    activations: float
    logits: float
    recompute: float = 0.0
    pipeline: float = 0.0  # a pipeline's own buffers (`tick_schedule_memory_terms`, `loop_schedule_memory_terms`)

    @property
    def state(self) -> float:
        return self.params + self.master + self.optimizer

    @property
    def transient(self) -> float:
        return (self.gradients + self.gathered_params + self.activations + self.pipeline
                + max(self.logits, self.recompute))

    @property
    def total(self) -> float:
        return self.state + self.transient

    def to_json(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "state": self.state, "transient": self.transient, "total": self.total}


def sharded_bytes(layout, table_name: str, itemsize: float) -> float:
    """Bytes per device of one copy of the parameters laid out by a rule table, at `itemsize` bytes per element."""
    return float(sum(layout.shard_elements(getattr(layout.rules, table_name), table_name))) * itemsize


def fp8_state_bytes(layout) -> float:
    """The fp8 policy's scaling state on one device (counted with the parameters): per layer of its pipeline stage and
    per matmul site, three fp32 scales and three amax histories (shardkit.precision.fp8_site_state); Llama's 7 sites."""
    from shardkit.precision import AMAX_HISTORY, FP8_HISTORIES, FP8_SCALES

    layers = getattr(layout.config, "layers", 0) // layout.mesh.shape["pipeline"]
    return float(layers * 7 * (len(FP8_SCALES) + len(FP8_HISTORIES) * AMAX_HISTORY) * 4)


def gradient_bytes(layout, compute_size: float) -> float:
    """The step's gradients: in the compute dtype, since the model differentiates the parameters after their cast
    (XLA fuses the cast to fp32 into the norm and the update; compiled on h100x1 under bf16); under accumulation
    the fp32 running sum besides one micro-batch's gradients."""
    gradients = sharded_bytes(layout, "gradients", compute_size)
    if layout.recipe.train.grad_accum > 1:
        gradients += sharded_bytes(layout, "gradients", 4)
    return gradients


def replica_param_bytes(layout, itemsize: float) -> float:
    """Bytes per device of one accumulating replica's parameters: the parameter specs without the replica axes
    (`shardkit.microbatch.replica_axes`), i.e. what per-step FSDP sync gathers, and its unreduced gradient buffer's
    size."""
    rules = layout.rules.without_axes(replica_axes(layout))
    return sharded_bytes(dataclasses.replace(layout, rules=rules), "params", itemsize)


def replica_param_elements(layout) -> float:
    """Parameter elements per device once the data-parallel axes (`data`, `fsdp`, and the context and expert ranks
    where they shard a parameter as FSDP ranks: `data_parallel_rules`) are taken out of every spec."""
    return sharded_bytes(dataclasses.replace(layout, rules=data_parallel_rules(layout)), "params", 1)


def data_parallel_rules(layout):
    """The layout's rules without `data` and `fsdp`, and without the SHARED_FSDP_AXES that a parameter rule lists
    after another axis (the context and expert ranks as extra FSDP ranks, shardkit.rules)."""
    return without_shared_fsdp_ranks(layout.rules).without_axes(("data", "fsdp"))


def fsdp_group(layout) -> tuple[str, ...]:
    """The mesh axes (of more than one device) whose ranks shard the parameters as FSDP does: `fsdp`, and the context
    and expert ranks where the rules make them FSDP ranks too (on the `embed` rule)."""
    shape = layout.mesh.shape
    embed = layout.rules.params.get("embed", ())
    shared = tuple(axis for axis in embed if axis in SHARED_FSDP_AXES and shape[axis] > 1)
    return (("fsdp",) if shape["fsdp"] > 1 else ()) + shared


def replica_elements_by_role(layout) -> dict[str, float]:
    """`replica_param_elements` split by how XLA moves each parameter under FSDP: `layers` (the scanned stack,
    gathered per layer in each pass), `lookup` (an untied embedding table with its rows split by no replica axis:
    read by row, never gathered), `outside` (the rest: final norm, output head; gathered once for both passes)."""
    params = table_without_axes(table_without_shared_fsdp_ranks(layout.rules.params), ("data", "fsdp"))
    elements = layout.shard_elements(params, "params")  # `data_parallel_rules(layout).params`
    # Looked up by row when untied and its rows are whole on every device (vocabulary sharded by no axis), unless the
    # tokens are split over more than the data-parallel axes: split over `sequence` or `expert` too, XLA:GPU gathers
    # the table with the head and reduces its gradient with theirs (recipes/cp.toml, moe_ep_fsdp.toml; h100x8).
    sizes = layout.mesh.shape
    # The expert ranks as FSDP ranks of the table are data-parallel ranks here (moe_ep*.toml, h100x8: rows by
    # all-to-all over them).
    token_axes = layout.rules.activations.get("batch", ()) + layout.rules.activations.get("sequence", ())
    data_parallel = ("data", "fsdp") + (("expert",) if "expert" in fsdp_group(layout) else ())
    by_row = (not getattr(layout.config, "tie_embeddings", True)
              and all(sizes[axis] == 1 for axis in layout.rules.params.get("vocab", ()))
              and all(sizes[axis] == 1 for axis in token_axes if axis not in data_parallel))
    out = {"layers": 0.0, "lookup": 0.0, "outside": 0.0}
    for count, logical in zip(elements, layout.logical_leaves(), strict=True):
        role = "layers" if logical and logical[0] == "layers" else (
            "lookup" if tuple(logical) == ("vocab", "embed") and by_row else "outside")
        out[role] += count
    return out


def fsdp_syncs_per_step(layout) -> bool:
    """Whether FSDP gathers and reduces once per step around the micro-batch loop (`train.fsdp_sync`, in effect)."""
    return "fsdp" in replica_axes(layout)


def gathered_param_bytes(layout, itemsize: float) -> float:
    """FSDP: the largest layer's full parameters plus the non-layer ones, gathered once at a time."""
    if not fsdp_group(layout):
        return 0.0
    tensor = layout.mesh.shape["tensor"] * layout.mesh.shape["pipeline"]
    per_layer = outside = 0.0
    for leaf, logical in zip(layout.parameter_leaves(), layout.logical_leaves()):
        if logical and logical[0] == "layers":
            per_layer += math.prod(leaf.shape[1:])
        else:
            outside += math.prod(leaf.shape)
    return (per_layer + outside) * itemsize / tensor


def local_batch(layout) -> tuple[int, int]:
    """(rows, sequence length) of one micro-batch on one device."""
    train, shape = layout.recipe.train, layout.mesh.shape
    rows, seq = train.global_batch // train.grad_accum, train.seq_len
    for axis in layout.rules.activations.get("batch", ()):
        rows //= shape.get(axis, 1)  # one axis at a time: the same floor as dividing by their product
    for axis in layout.rules.activations.get("sequence", ()):
        seq //= shape.get(axis, 1)
    return rows, seq


def layer_activation_items(config: Any, b: int, s: int, t: int, compute_size: float, remat: str,
                           sp: int = 1, fused: bool = False) -> dict[str, float]:
    """Bytes one device keeps for the backward pass of one decoder layer, by tensor (Korthikanti et al. 2022, adapted).

    The Llama block here: RMSNorm (computed in fp32, keeping its fp32 input and the inverse RMS), q/k/v projections
    with grouped-query heads, rotary, softmax in fp32, output projection, RMSNorm, SwiGLU. `t` is the tensor-parallel
    degree dividing heads and mlp; `sp` divides the residual stream (layer input, norm inputs, statistics and
    outputs): `t` under Megatron-SP (Korthikanti's /t on the parts plain TP replicates), else 1. The presets are
    shardkit.remat's: `full` keeps only the layer input; `selective` the named matmul outputs (q, k, v, attention
    output, gate, up) and the layer input, recomputing norms, softmax and SwiGLU products; `minimal_with_context`
    those plus the output projection (`out_proj`) and, under a fused kernel, the kernel's fp32 statistics. `fused`: a
    flash attention kernel (cuDNN) keeps no s x s scores (`attention_items`).
    """
    if not is_transformer(config):
        return _mlp_layer_items(config, b, s, t, compute_size, remat, sp)
    c = compute_size
    residual = b * s * config.embed / sp  # elements of one residual-stream tensor on this device
    if remat in ("full", "offload"):
        return {"layer_input": residual * c}
    attention = attention_items(config, b, s, t, c, remat, fused)
    f = b * s * config.mlp * c / t
    if remat == "selective":
        return {"layer_input": residual * c, **attention, "gate": f, "up": f}
    if remat == "minimal_with_context":
        return {"layer_input": residual * c, **attention, "out_proj": residual * c, "gate": f, "up": f}
    return {**_unremat_layer_items(residual, b * s / sp, c, fused), **attention, **_unremat_mlp_items(f, fused)}


def _unremat_layer_items(residual: float, tokens: float, c: float, fused: bool) -> dict[str, float]:
    """Without remat: both RMSNorms' fp32 inputs, inverse RMS (fp32, one a token) and outputs; XLA:GPU (where the
    kernel is fused) also keeps each norm's normalised fp32 value, for the scale's gradient (compiled on h100x1)."""
    items = {"attn_norm_input_fp32": residual * 4, "attn_norm_rms": tokens * 4, "attn_norm_out": residual * c,
             "mlp_norm_input_fp32": residual * 4, "mlp_norm_rms": tokens * 4, "mlp_norm_out": residual * c}
    return {**items, "attn_norm_normed_fp32": residual * 4, "mlp_norm_normed_fp32": residual * 4} if fused else items


def _unremat_mlp_items(f: float, fused: bool) -> dict[str, float]:
    """Without remat: SwiGLU's gate, up and product; XLA:GPU (where the kernel is fused) keeps three more tensors of
    the MLP's width for SwiGLU's backward, among them sigmoid(gate) and silu(gate) (compiled on h100x1)."""
    items = {"gate": f, "up": f, "hidden": f}
    return {**items, "sigmoid_gate": f, "silu_gate": f, "swiglu_other": f} if fused else items


def attention_items(config: Any, b: int, s: int, t: int, c: float, remat: str, fused: bool) -> dict[str, float]:
    """One layer's saved attention tensors: projections (rotated where rotary applies) and output, plus the scores
    (plain) or the fused kernel's fp32 log-sum-exp per head and query (no s x s term). `selective` does not keep the
    log-sum-exp: the backward reruns the kernel's forward (shardkit.remat). The compiled step for h100x1 keeps
    exactly these four tensors (two of q's size, two of k's) besides the statistics, under every preset."""
    q = b * s * config.heads * config.head_dim * c / t
    kv = b * s * config.kv_heads * config.head_dim * c / t
    items = {"q": q, "k": kv, "v": kv, "attention_out": q}
    if fused:
        return items if remat == "selective" else {**items, "softmax_lse_fp32": b * config.heads * s * 4 / t}
    if remat in ("selective", "minimal_with_context"):
        return items
    # XLA keeps the fp32 scores before the softmax as well as the probabilities (compiled on XLA:CPU and h100x1).
    probs = score_elements(config, b, s, t)
    return {**items, "scores_fp32": probs * 4, "softmax_probs_fp32": probs * 4,
            "probs_compute": probs * c if c != 4 else 0.0}


def score_elements(config: Any, b: int, s: int, t: int) -> float:
    """Elements of one layer's attention score matrix on one device (plain attention only)."""
    return b * config.heads * s * s / t


def _mlp_layer_items(config: Any, b: int, s: int, t: int, c: float, remat: str, sp: int = 1) -> dict[str, float]:
    if remat != "none":
        return {"layer_input": b * s * config.embed * c / sp}
    return {"layer_input": b * s * config.embed * c / sp, "pre_gelu": b * s * config.mlp * c / t,
            "hidden": b * s * config.mlp * c / t}


def sequence_parallel(layout) -> bool:
    """Megatron-SP: the residual stream's sequence (`residual_sequence`, shardkit.rules) is cut over `tensor`."""
    return layout.mesh.shape["tensor"] > 1 and "tensor" in layout.rules.activations.get("residual_sequence", ())


def attention_is_fused(layout) -> bool:
    """Whether the step's attention runs on cuDNN's fused kernel: the layout's own choice (`Layout.attention`), for
    plain, pipelined and context-parallel attention alike; never for models without attention heads."""
    return is_transformer(layout.config) and layout.attention.choice.fused


def layer_geometry(layout) -> tuple[int, int, int, int, int]:
    """(rows, sequence, tensor degree, residual-stream divisor, layers) of one device's micro-batch."""
    b, s = local_batch(layout)
    t = layout.mesh.shape["tensor"]
    return b, s, t, (t if sequence_parallel(layout) else 1), layout.config.layers // layout.mesh.shape["pipeline"]


def activation_bytes(layout, compute_size: float, fused: bool | None = None) -> float:
    """All layers' saved activations on one device (what lives until each layer's backward). `fused`:
    `attention_is_fused(layout)` where the caller has it (a micro-batch's layout shares its layout's kernel)."""
    b, s, t, sp, layers = layer_geometry(layout)
    items = layer_activation_items(layout.config, b, s, t, compute_size, layout.recipe.train.remat, sp,
                                   attention_is_fused(layout) if fused is None else fused)
    if hasattr(layout.config, "experts"):
        items = moe_layer_items(layout, items, compute_size)
    return sum(items.values()) * layers


def recompute_bytes(layout, compute_size: float) -> float:
    """One layer's backward working set (never at once with the loss's logits): under remat the layer's whole set,
    rebuilt; without remat the fp32 gradient of the plain attention's scores (nothing for a fused kernel)."""
    b, s, t, sp, _ = layer_geometry(layout)
    fused = attention_is_fused(layout)
    if layout.recipe.train.remat != "none":
        return sum(layer_activation_items(layout.config, b, s, t, compute_size, "none", sp, fused).values())
    if fused or not is_transformer(layout.config):
        return 0.0
    return score_elements(layout.config, b, s, t) * 4


def loss_chunk_rows(layout) -> int | None:
    """Token rows one device turns into logits at a time in the lean loss (`shardkit.loss`: its own chunking; under
    GPipe and circular with the per-step FSDP gather, its loss region's: 1/p of the replica's rows in chunks of
    `gpipe.LOSS_CHUNK_ROWS`, one live at a time; split by vocabulary, f times the rows of a f-th of the vocabulary,
    the same size), or None for models without the `final_hidden` / `head_weight` split, which take the plain loss's
    full logits."""

    if not layout.capabilities.lean_loss:
        return None
    train = layout.recipe.train
    stage_rows = gpipe.loss_stage_rows(layout)
    if stage_rows is not None:
        positions = train.seq_len // gpipe.loss_context_ranks(layout)
        return stage_rows * positions // chunk_count(stage_rows, positions, gpipe.LOSS_CHUNK_ROWS)
    b, s = local_batch(layout)
    micro = train.global_batch // train.grad_accum
    chunks = chunk_count(micro, train.seq_len, DEFAULT_CHUNK_ROWS, micro // b, train.seq_len // s)
    return math.ceil(b * s / chunks)


def loss_phase_bytes(layout, compute_size: float) -> float:
    """The loss's peak: the final norm's fp32 input, and logits in the compute dtype with their fp32 softmax
    gradient (vocab split over `tensor`): for the whole micro-batch (plain loss), or for one chunk of rows of the
    lean loss, which also keeps one fp32 log-sum-exp per token. A lean loss of one chunk has no loop, and XLA:GPU
    fuses the fp32 gradient into the head's matmuls: only the compute-dtype logits are held (compiled on h100x1,
    1b widths, 2048 and 4096 rows: within 4%; with the loop, 8192 rows in 2 chunks, the fp32 gradient is held too)."""
    b, s = local_batch(layout)
    t, vocab = layout.mesh.shape["tensor"], layout.vocab
    hidden = b * s * layout.config.embed * 4
    rows = loss_chunk_rows(layout)
    if rows is None:
        return hidden + b * s * vocab * (compute_size + 4) / t
    one_chunk_on_gpu = rows >= b * s and on_gpu(layout.mesh)
    per_element = compute_size if one_chunk_on_gpu else compute_size + 4
    return hidden + rows * vocab * per_element / t + b * s * 4


def is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def microbatch_layout(layout):
    """The layout with one pipeline micro-batch as its whole batch: what one tick of the executor computes on."""
    train = layout.recipe.train
    rows = train.global_batch // train.grad_accum // layout.pipeline.microbatches
    recipe = dataclasses.replace(layout.recipe, train=dataclasses.replace(train, global_batch=rows, grad_accum=1))
    return dataclasses.replace(layout, recipe=recipe)


def stored_layer_bytes(layout) -> float:
    """Bytes per device of the layer stack as the parameters are stored (their own rules, every axis)."""
    elements = device_elements(layout, "params", lambda logical: bool(logical) and logical[0] == "layers")
    return elements * layout.policy.param_size


def device_elements(layout, table: str, keep) -> float:
    """Elements per device of the parameters whose logical axes `keep` accepts (a tuple of names), laid out by the
    rule table `table` ("params", "gradients", ...) on every mesh axis."""
    elements = layout.shard_elements(getattr(layout.rules, table), table)
    return float(sum(count for count, logical in zip(elements, layout.logical_leaves()) if keep(tuple(logical))))


def head_elements(layout) -> float:
    """Elements per data-parallel replica of the parameters the tick executor's last stage reads besides its layers
    (final norm, output head): those outside the layer stack but an untied embedding table, which is differentiated
    after the region."""
    rules = data_parallel_rules(layout)
    untied = not getattr(layout.config, "tie_embeddings", True)
    total = 0.0
    for elements, logical in zip(layout.shard_elements(rules.params, "params"), layout.logical_leaves()):
        if not (logical and logical[0] == "layers") and not (untied and tuple(logical) == ("vocab", "embed")):
            total += elements
    return total


def moe_layer_items(layout, items: dict[str, float], compute_size: float) -> dict[str, float]:
    """One layer group's saved activations with the MLP routed: per MoE layer the dense SwiGLU items (gate, up,
    hidden, and their fused-kernel extras) become top_k times as many token rows, or under expert parallelism the
    received slots (rows x experts x slots, the dispatch buffer) and the dispatched and returned buffers themselves;
    plus the router's fp32 logits and scores. A group of `moe_every` layers keeps moe_every - 1 dense layers' items
    besides; the total is per layer, so the group's is divided by moe_every."""
    from shardkit.moe import Routing

    config, train = layout.config, layout.recipe.train
    b, s, t, _, _ = layer_geometry(layout)
    mlp_names = ("gate", "up", "hidden", "sigmoid_gate", "silu_gate", "swiglu_other")
    mlp = {name: value for name, value in items.items() if name in mlp_names}
    rest = {name: value for name, value in items.items() if name not in mlp_names}
    if layout.mesh.shape.get("expert", 1) > 1:
        slots = Routing(config.routing, config.capacity(train.seq_len)).slots(train.seq_len)
        rows = b * config.experts * slots  # received rows equal the rows dispatched (all-to-all keeps the size)
        buffers = {"dispatch_buffer": 2 * rows * config.embed * compute_size}
    else:
        rows, buffers = b * s * config.top_k, {}
    moe = {f"expert_{name}": value * rows / (b * s) for name, value in mlp.items()}
    router = {"router_logits_fp32": 2 * b * s * config.experts * 4.0}
    if config.shared_expert:
        moe.update({f"shared_{name}": value for name, value in mlp.items()})
    group = {**rest, **moe, **buffers, **router}
    if config.moe_every == 1:
        return group
    dense = {**rest, **mlp}
    weight = (config.moe_every - 1) / config.moe_every
    return {name: group.get(name, 0.0) / config.moe_every + dense.get(name, 0.0) * weight
            for name in set(group) | set(dense)}


def expert_elements_per_device(layout) -> float:
    """Elements of one device's expert weights with `data` and `fsdp` taken out: the experts split over `expert`
    (and their hidden dimension over `tensor`, their layers over `pipeline`)."""
    shape = layout.mesh.shape
    return expert_parameter_elements(layout) / shape["expert"] / shape["tensor"] / shape["pipeline"]
