"""The analytic model of the design page: memory per device, communication per step, FLOPs and MFU.

Everything here is arithmetic on the layout (shapes, specs, mesh sizes, recipe): nothing is compiled or allocated,
so it answers "what will each device hold and send" for any model size in milliseconds. `plan` prints it beside
XLA's compiled figures (`shardkit.analysis.hlo`).

Conventions: `bytes` of a collective is the full buffer it reduces or gathers (as in `shardkit.analysis.hlo`); memory is
per device; FLOPs count a multiply-add as two.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from shardkit.analysis.hlo import RING_FACTORS
from shardkit.analysis.split_k import split_k_partial_sum_bytes
from shardkit.layout import device_shape
from shardkit.loss import DEFAULT_CHUNK_ROWS, chunk_count
from shardkit.microbatch import replica_axes
from shardkit.pipeline import bubble_fraction, collective_permute_bytes, manual_data_axes, microbatch_activation_bytes
from shardkit.pipeline.schedule import tick_runs

# Dense bf16 peak FLOP/s by device kind (published specifications, without sparsity).
ADAM_MOMENTS = 2  # AdamW keeps two fp32 moments per parameter
GPU_PLATFORMS = ("gpu", "cuda", "rocm")  # what XLA:GPU's devices (real or a --target's) call their platform


# The dimensions the analytic model's transformer formulas read (models/llama.py's): a model whose config lacks any of
# them (a user's own architecture) is counted by its parameters alone, with no attention or per-layer terms.
TRANSFORMER_FIELDS = ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")


def is_transformer(config) -> bool:
    """Whether a model config has every dimension the analytic transformer formulas need (`TRANSFORMER_FIELDS`)."""
    return all(hasattr(config, name) for name in TRANSFORMER_FIELDS)


def training_flops_per_token(config: Any, parameters: int, seq_len: int) -> float:
    """6 x parameters (forward 2, backward 4) plus causal attention scores and values.

    The attention term is 12 * layers * (heads * head_dim) * seq_len: it counts the full square of the score matrix
    (as the PaLM and Megatron MFU formulas do), not the causal half. The embedding lookup is counted in `parameters`
    as if it were a matmul, which slightly overstates the FLOPs for untied embeddings: the convention MFU papers use.
    """
    attention = 0.0
    if is_transformer(config):
        attention = 12.0 * config.layers * config.heads * config.head_dim * seq_len
    return 6.0 * parameters + attention


def mfu(flops_per_step: float, step_seconds: float, devices: int, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    return flops_per_step / step_seconds / (devices * peak)


# ---- memory ---------------------------------------------------------------------------------------------------------
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
    specs = layout.specs(getattr(layout.rules, table_name), table_name)
    sizes = dict(layout.mesh.shape)
    shards = jax.tree.map(lambda leaf, spec: math.prod(device_shape(leaf.shape, spec, sizes)),
                          layout.abstract_params, specs)
    return float(sum(jax.tree.leaves(shards))) * itemsize


def memory_estimate(layout) -> MemoryEstimate:
    """Per-device memory of one training step under the layout's precision policy, ZeRO stage and remat policy.

    Parameters are held in the policy's parameter dtype; the fp32 master copy (when kept) and AdamW's two fp32
    moments are laid out by the optimizer rules (ZeRO-1/2 shard them over `data`); fp32 gradients by the gradient
    rules (ZeRO-2 shards them). Under FSDP one layer's parameters are gathered at a time (in the compute dtype), and
    the whole of the non-layer parameters (embedding, head). With `train.fsdp_sync = "per_step"` and accumulation,
    all parameters are gathered once for the step (in the parameter dtype) and the gradients accumulate unreduced:
    both are a replica's whole parameters (divided by tensor/pipeline only), the gradients twice (sum + micro-batch).
    """

    policy = layout.policy
    param_size = np.dtype(policy.param_dtype).itemsize
    compute_size = np.dtype(policy.compute_dtype).itemsize
    params = sharded_bytes(layout, "params", param_size)
    master = sharded_bytes(layout, "optimizer", 4) if policy.master_weights else 0.0
    params += fp8_state_bytes(layout) if policy.fp8 else 0.0
    optimizer = ADAM_MOMENTS * sharded_bytes(layout, "optimizer", 4)
    gradients = gradient_bytes(layout, compute_size)
    gathered = _gathered_param_bytes(layout, compute_size) + pipeline_stage_gather_bytes(layout, compute_size)
    if fsdp_syncs_per_step(layout):  # ZeRO-2-like during the step
        gradients = 2 * replica_param_bytes(layout, 4)
        gathered = replica_param_bytes(layout, param_size)
    memory = MemoryEstimate(
        params=params, master=master, optimizer=optimizer, gradients=gradients,
        gathered_params=gathered,
        activations=activation_bytes(layout, compute_size),
        logits=loss_phase_bytes(layout, compute_size),
        recompute=recompute_bytes(layout, compute_size),
    )
    if layout.pipeline.one_f_one_b:
        return tick_schedule_memory(layout, memory)
    return loop_schedule_memory(layout, memory) if layout.pipeline.enabled else memory


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
    """Parameter elements per device once the data-parallel axes (`data`, `fsdp`) are taken out of every spec."""
    rules = layout.rules.without_axes(("data", "fsdp"))
    return sharded_bytes(dataclasses.replace(layout, rules=rules), "params", 1)


def replica_elements_by_role(layout) -> dict[str, float]:
    """`replica_param_elements` split by how XLA moves each parameter under FSDP: `layers` (the scanned stack,
    gathered per layer in each pass), `lookup` (an untied embedding table with its rows split by no replica axis:
    read by row, never gathered), `outside` (the rest: final norm, output head; gathered once for both passes)."""
    rules = layout.rules.without_axes(("data", "fsdp"))
    specs = layout.specs(rules.params, "params")
    sizes = dict(layout.mesh.shape)
    # Looked up by row when untied and its rows are whole on every device (vocabulary sharded by no axis), unless the
    # tokens are split over more than the data-parallel axes: split over `sequence` or `expert` too, XLA:GPU gathers
    # the table with the head and reduces its gradient with theirs (recipes/cp.toml, moe_ep_fsdp.toml; h100x8).
    sizes = layout.mesh.shape
    token_axes = layout.rules.activations.get("batch", ()) + layout.rules.activations.get("sequence", ())
    by_row = (not getattr(layout.config, "tie_embeddings", True)
              and all(sizes[axis] == 1 for axis in layout.rules.params.get("vocab", ()))
              and all(sizes[axis] == 1 for axis in token_axes if axis not in ("data", "fsdp")))
    out = {"layers": 0.0, "lookup": 0.0, "outside": 0.0}
    for leaf, spec, logical in zip(jax.tree.leaves(layout.abstract_params), jax.tree.leaves(specs),
                                   jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple))):
        role = "layers" if logical and logical[0] == "layers" else (
            "lookup" if tuple(logical) == ("vocab", "embed") and by_row else "outside")
        out[role] += math.prod(device_shape(leaf.shape, spec, sizes))
    return out


def fsdp_syncs_per_step(layout) -> bool:
    """Whether FSDP gathers and reduces once per step around the micro-batch loop (`train.fsdp_sync`, in effect)."""
    return "fsdp" in replica_axes(layout)


def _gathered_param_bytes(layout, itemsize: float) -> float:
    """FSDP: the largest layer's full parameters plus the non-layer ones, gathered once at a time."""
    fsdp = layout.mesh.shape["fsdp"]
    if fsdp == 1:
        return 0.0
    tensor = layout.mesh.shape["tensor"] * layout.mesh.shape["pipeline"]
    per_layer = outside = 0.0
    for leaf, logical in zip(jax.tree.leaves(layout.abstract_params),
                             jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple))):
        if logical and logical[0] == "layers":
            per_layer += math.prod(leaf.shape[1:])
        else:
            outside += math.prod(leaf.shape)
    return (per_layer + outside) * itemsize / tensor


def local_batch(layout) -> tuple[int, int]:
    """(rows, sequence length) of one micro-batch on one device."""
    train, shape = layout.recipe.train, layout.mesh.shape
    rows = train.global_batch // train.grad_accum
    rows //= math.prod(shape[axis] for axis in layout.rules.activations.get("batch", ()) if axis in shape)
    seq = train.seq_len // math.prod(
        shape[axis] for axis in layout.rules.activations.get("sequence", ()) if axis in shape
    )
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


def _layer_geometry(layout) -> tuple[int, int, int, int, int]:
    """(rows, sequence, tensor degree, residual-stream divisor, layers) of one device's micro-batch."""
    b, s = local_batch(layout)
    t = layout.mesh.shape["tensor"]
    return b, s, t, (t if sequence_parallel(layout) else 1), layout.config.layers // layout.mesh.shape["pipeline"]


def activation_bytes(layout, compute_size: float) -> float:
    """All layers' saved activations on one device (what lives until each layer's backward)."""
    b, s, t, sp, layers = _layer_geometry(layout)
    items = layer_activation_items(layout.config, b, s, t, compute_size, layout.recipe.train.remat, sp,
                                   attention_is_fused(layout))
    if hasattr(layout.config, "experts"):
        items = moe_layer_items(layout, items, compute_size)
    return sum(items.values()) * layers


def recompute_bytes(layout, compute_size: float) -> float:
    """One layer's backward working set (never at once with the loss's logits): under remat the layer's whole set,
    rebuilt; without remat the fp32 gradient of the plain attention's scores (nothing for a fused kernel)."""
    b, s, t, sp, _ = _layer_geometry(layout)
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
    from shardkit.pipeline import gpipe

    if not layout.capabilities.lean_loss:
        return None
    train = layout.recipe.train
    stage_rows = gpipe.loss_stage_rows(layout)
    if stage_rows is not None:
        return stage_rows * train.seq_len // chunk_count(stage_rows, train.seq_len, gpipe.LOSS_CHUNK_ROWS)
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
    one_chunk_on_gpu = rows >= b * s and layout.mesh.devices.flat[0].platform in GPU_PLATFORMS
    per_element = compute_size if one_chunk_on_gpu else compute_size + 4
    return hidden + rows * vocab * per_element / t + b * s * 4


# ---- communication --------------------------------------------------------------------------------------------------
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


def communication_estimate(layout) -> list[CommItem]:
    """Collectives per training step by layout (DP, ZeRO-1/2, FSDP, TP, SP, PP), per device, full-buffer bytes.

    - data: one fp32 gradient all-reduce per step (accumulation does not repeat it); ZeRO-1/2 replace it by a
      reduce-scatter of the gradients and an all-gather of the updated parameters (same volume).
    - fsdp: parameters all-gathered in the forward and again in the backward pass, gradients reduce-scattered.
      Under gradient accumulation the gathers repeat per micro-batch, unless `train.fsdp_sync = "per_step"`: then
      one all-gather of the parameters (parameter dtype) before the micro-batch loop serves both passes.
    - tensor: per layer two all-reduces of the micro-batch's b*s*h activations forward, two backward, per
      micro-batch; with a `residual_sequence` activation rule on `tensor` (Megatron-SP, recipes/tp_sp.toml) each
      becomes an all-gather + reduce-scatter pair of the same volume.
    - pipeline: each micro-batch's b*s*h activation crosses each stage boundary forward and its gradient back:
      `shardkit.pipeline.collective_permute_bytes`, per pipeline group, summed over the boundaries.
    - sequence (context parallelism): `context_parallel_items`, and the gradients reduced over `sequence` too (the
      parameters are replicas over it).
    """

    shape = dict(layout.mesh.shape)
    policy = layout.policy
    accum = layout.recipe.train.grad_accum
    compute_size = np.dtype(policy.compute_dtype).itemsize
    param_size = np.dtype(policy.param_dtype).itemsize
    # What one data-parallel replica holds of the parameters, per device: each parameter's own spec without the
    # replica axes (a pipeline stage holds its layers but the embedding and head whole; tensor splits what it shards).
    elements = replica_param_elements(layout)
    items: list[CommItem] = []
    data, fsdp, context = shape["data"], shape["fsdp"], shape["sequence"]
    zero = layout.recipe.rules.zero
    replicas = data * fsdp
    if replicas * context > 1:
        # Reduced in the policy's gradient-reduction dtype (`Policy.grad_reduce_dtype`): the model differentiates
        # the parameters after their cast to the compute dtype, so XLA reduces the cotangents before casting back.
        # With the gradients sharded (FSDP, ZeRO-2) an untied table's row gradients go by all-to-all instead.
        roles = replica_elements_by_role(layout)
        per_layer_fsdp = fsdp > 1 and not fsdp_syncs_per_step(layout)  # `per_step` reduces everything at once
        lookup = roles["lookup"] if per_layer_fsdp or (fsdp == 1 and zero >= 2) else 0.0
        # Under FSDP the parameters outside the layer stack (the head, from the fp32 logits; the final norm) have
        # fp32 gradients, all-reduced over `fsdp` (8b preset, bf16, h100x8).
        outside = roles["outside"] if per_layer_fsdp else 0.0
        grad_bytes = (elements - lookup - outside) * np.dtype(policy.grad_reduce_dtype).itemsize
        items.extend(_gradient_items(grad_bytes, data, fsdp, zero))
        if context > 1:  # the parameters are replicas over `sequence` too: their fsdp shard is reduced over it
            items.append(CommItem("gradients", "all-reduce", ("sequence",), grad_bytes / fsdp, context))
        if outside:
            # over `sequence` in the same all-reduce when the sequence is cut (recipes/cp.toml, h100x8)
            axes = ("fsdp", "sequence") if context > 1 else ("fsdp",)
            items.append(CommItem("gradients", "all-reduce", axes, outside * 4, fsdp * context))
        if lookup and fsdp == 1:
            rows, seq = local_batch(layout)
            items.append(CommItem("embedding row gradients (ZeRO-2)", "all-to-all", ("data",),
                                  rows * seq * layout.config.embed * compute_size * accum, data))
    if data > 1 and zero >= 1:
        items.append(CommItem("updated parameters (ZeRO)", "all-gather", ("data",), elements * param_size, data))
    if fsdp_syncs_per_step(layout):
        items.append(CommItem("parameters, once per step", "all-gather", ("fsdp",), elements * param_size, fsdp))
    elif fsdp > 1:
        items.extend(_fsdp_items(layout, compute_size, param_size, accum))
    items.extend(_tensor_items(layout, shape, compute_size, accum))
    items.extend(context_parallel_items(layout))
    items.extend(_pipeline_items(layout, shape, compute_size, accum))
    if layout.pipeline.one_f_one_b:
        items = tick_schedule_gradient_items(layout, items)
    elif loop_loss_stage_rows(layout) is not None:
        items = loop_loss_region_items(layout, items)
    if shape.get("expert", 1) > 1:
        items = expert_parallel_items(layout, items)
    return items


def _fsdp_items(layout, compute_size: int, param_size: int, accum: int) -> list[CommItem]:
    """FSDP's parameter traffic per step as XLA:GPU compiles it (h100x8, tiny and 8b presets): the layer stack is
    gathered layer by layer in each pass (after its cast to the compute dtype, inside the layer loop), but for the
    expert weights of an expert-parallel region (forward only); the parameters outside it (final norm, output head,
    an embedding not looked up by row) are gathered once, in the parameter dtype (the gather lands before their
    cast, outside any loop), and the forward's copy serves the backward; an untied embedding table looked up by row
    (`replica_elements_by_role`) is never gathered: the looked-up rows of the local tokens are exchanged by an
    all-to-all forward, and their gradients by another backward."""
    fsdp = layout.mesh.shape["fsdp"]
    roles = replica_elements_by_role(layout)
    rows, seq = local_batch(layout)
    layers = roles["layers"] * compute_size * accum
    outside = roles["outside"] * param_size * accum
    # A pipeline gathering each stage once per step (pipeline.fsdp_gather = "per_step") gathers its layers only once.
    once = pipeline_stack_elements_gathered_once(layout) * compute_size * accum
    # Expert weights enter the expert-parallel region gathered (`shardkit.moe.expert_parallel`): the region keeps
    # its inputs for its backward, so they are gathered in the forward only.
    kept = expert_elements_per_device(layout) * compute_size * accum if layout.mesh.shape["expert"] > 1 else 0.0
    items = [CommItem("parameters, forward", "all-gather", ("fsdp",), layers + outside, fsdp),
             CommItem("parameters, backward", "all-gather", ("fsdp",), layers - once - kept, fsdp)]
    if roles["lookup"]:
        rows_bytes = 2 * rows * seq * layout.config.embed * compute_size * accum
        items.append(CommItem("embedding rows (lookup, its gradient)", "all-to-all", ("fsdp",), rows_bytes, fsdp))
    return items


def _gradient_items(grad_bytes: float, data: int, fsdp: int, zero: int) -> list[CommItem]:
    """The gradient reduction as XLA:GPU compiles it (h100:2x4, data=2 x fsdp=4): over `fsdp` a reduce-scatter of
    the replica's gradients, then over `data` an all-reduce of the fsdp shard (ZeRO: a reduce-scatter); without
    `fsdp`, one all-reduce (ZeRO: reduce-scatter) over `data`."""
    items = []
    if fsdp > 1:
        items.append(CommItem("gradients", "reduce-scatter", ("fsdp",), grad_bytes, fsdp))
    if data > 1:
        kind = "reduce-scatter" if zero >= 1 else "all-reduce"
        items.append(CommItem("gradients", kind, ("data",), grad_bytes / fsdp, data))
    return items


def _tensor_items(layout, shape, compute_size, accum) -> list[CommItem]:
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
    device included, as the compiled pairs count them). The `ring` variant moves the same K/V hop by hop; it is
    priced as the gather here, not compiled."""
    shape, config, train = layout.mesh.shape, layout.config, layout.recipe.train
    cp = shape["sequence"]
    if cp == 1 or not is_transformer(config):
        return []
    c = np.dtype(layout.policy.compute_dtype).itemsize
    rows = train.global_batch // (shape["data"] * shape["fsdp"])
    tokens = rows * train.seq_len / shape["tensor"]  # the heads divided over `tensor`
    kv = 2 * tokens * config.kv_heads * config.head_dim
    queries = tokens * config.heads * config.head_dim
    layers = config.layers // shape["pipeline"]
    forwards = 2 if train.remat == "full" else 1
    return [CommItem("K/V (context parallel)", "all-gather", ("sequence",), 2 * layers * kv * c, cp),
            CommItem("dK/dV (context parallel)", "reduce-scatter", ("sequence",), layers * kv * 4, cp),
            CommItem("queries and output to zigzag order and back (causal context parallel)", "collective-permute",
                     ("sequence",), 2 * (forwards + 1) * layers * queries * c, cp)]


def _pipeline_items(layout, shape, compute_size, accum) -> list[CommItem]:
    """Stage-boundary sends, in `shardkit.pipeline.collective_permute_bytes`'s terms: per pipeline group, summed over
    its source-target pairs (as `shardkit.analysis.hlo` counts a compiled collective-permute)."""
    config = layout.pipeline
    if not config.enabled:
        return []
    total = collective_permute_bytes(config, microbatch_activation_bytes(layout)) * accum
    items = [CommItem("stage boundaries (forward + backward)", "collective-permute", ("pipeline",), total,
                      config.stages)]
    train = layout.recipe.train
    rows = train.global_batch // (shape["data"] * shape["fsdp"])
    batch_bytes = rows * train.seq_len * layout.config.embed * compute_size
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
    stored stack). The permute's group is those pairs: `bytes` sums them (as `shardkit.analysis.hlo` counts it), and
    each device sends its stored stack (`shardkit.analysis.nccl.stream_seconds` divides by the group)."""
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
    sizes = dict(layout.mesh.shape)
    total = 0.0
    for leaf, logical, spec in zip(jax.tree.leaves(layout.abstract_params),
                                   jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple)),
                                   jax.tree.leaves(layout.specs(rules.params), is_leaf=_is_spec)):
        if logical and logical[0] == "layers":
            total += math.prod(device_shape(leaf.shape, spec, sizes))
    return total


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


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


# ---- the tick executor's memory (1f1b, interleaved_1f1b, zero_bubble: shardkit/pipeline/one_f_one_b.py) ---------
REGION_EDGE_INPUTS_PER_MICROBATCH = 4  # the embedded batch in, its gradient out, each with a copy at the region's edge


def microbatch_layout(layout):
    """The layout with one pipeline micro-batch as its whole batch: what one tick of the executor computes on."""
    train = layout.recipe.train
    rows = train.global_batch // train.grad_accum // layout.pipeline.microbatches
    recipe = dataclasses.replace(layout.recipe, train=dataclasses.replace(train, global_batch=rows, grad_accum=1))
    return dataclasses.replace(layout, recipe=recipe)


def tick_schedule_memory_terms(layout) -> dict[str, float]:
    """The tick executor's transient buffers per device, by name (the compiled program is one SPMD program, so every
    stage allocates the largest stage's buffers). With A one micro-batch's stage input (b x S x D, compute dtype):

    - `stage_inputs`: A x `TickProgram.slots`, the inputs waiting for their last backward (1f1b: p, the first
      stage's p - d + 1 at d = 1 counted from 1; zero_bubble: 2p - 1, kept until W; interleaved_1f1b: the v chunks'
      inputs in flight, 10 at p=4, m=8, v=2);
    - `received_gradients`: A x `TickProgram.grad_slots`;
    - `region_edges`: REGION_EDGE_INPUTS_PER_MICROBATCH x m x A, the whole embedded batch and its gradient at the
      region's edge (the embedding runs outside it);
    - `stage_weights`: the stage's layers as the region's per-replica copy in the compute dtype (one_f_one_b.py: the
      parameters enter as per-replica copies); under a per-step FSDP gather, the tick loop's copy of the gathered
      stage in its own layout (a transpose of the gather's output), held through the ticks beside the gather's output
      (`gathered_params`), which lives to the step's end (h100x8, recipes/pp_fsdp_tp.toml under 1f1b and
      zero_bubble, read from XLA's buffer assignment: 289 KiB each, both live at the peak);
    - `stage_gradient_sums`: the stage's layer gradients accumulated through the ticks (compute dtype), besides the
      step's gradients the region returns;
    - `chunk_weights`: chunked schedules only: the running tick's chunk, 1/v of the stage, which its tick picks from
      the stage's chunks by a dynamic index, a copy XLA makes for the chunk's scan (compute dtype; with one chunk the
      stage is read in place);
    - `causal_mask`: the causal mask hoisted out of the chunk's transposed scan over layers under XLA's attention,
      at one micro-batch's score shape (`tick_schedule_causal_mask_bytes`);
    - `microbatch_activations`: one chunk's layers' saved activations for one micro-batch (the backward recomputes
      the stage from its stored input, one micro-batch at a time), as the chunk's scan keeps them
      (`chunk_saved_activation_bytes`).
    The loss's logits and the backward's recompute are one micro-batch's as well, on the last stage only
    (`tick_schedule_memory`). The chunked schedules' re-layout into chunk order (`chunk_relayout_items`: chunk r of
    stage d holds layers r*p + d) holds nothing beside these: its output is the region's copy of the stage
    (`stage_weights`; under a per-step FSDP gather the shard the gather reads before the first tick) and the
    gradients it moves back after the last tick are the step's gradients (`MemoryEstimate.gradients`). (h100x8,
    recipes/pp.toml, interleaved_1f1b at 16 layers: at the peak the permute's output, 1154 KiB, is the one copy of
    the stage, beside the picked chunk's 577 KiB.)
    """
    from shardkit.pipeline.program import tick_program

    config = layout.pipeline
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    program = tick_program(config)
    stage_input = microbatch_activation_bytes(layout)
    stage_layers = replica_elements_by_role(layout)["layers"]
    return {
        "stage_inputs": program.slots * stage_input,
        "received_gradients": program.grad_slots * stage_input,
        "region_edges": REGION_EDGE_INPUTS_PER_MICROBATCH * config.microbatches * stage_input,
        "stage_weights": stage_layers * compute_size,
        "stage_gradient_sums": stage_layers * compute_size,
        "chunk_weights": stage_layers * compute_size / config.chunks if config.chunks > 1 else 0.0,
        "causal_mask": tick_schedule_causal_mask_bytes(layout),
        "microbatch_activations": chunk_saved_activation_bytes(layout),
    }


def tick_schedule_memory(layout, memory: MemoryEstimate) -> MemoryEstimate:
    """`memory` with the tick executor's activations: its buffers (`tick_schedule_memory_terms`) instead of every
    micro-batch's saved activations, and the loss and recompute of one micro-batch (the head runs on the last stage,
    per micro-batch) instead of the whole batch's. The gradients at the peak, inside the ticks, are the sums the tick
    loop carries (`stage_gradient_sums`, and the loss's `tick_loss_gradient_bytes`): the step's gradients are made
    from them after the last tick."""
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    terms = tick_schedule_memory_terms(layout)
    micro = microbatch_layout(layout)
    return dataclasses.replace(
        memory, gradients=tick_loss_gradient_bytes(layout), activations=terms.pop("microbatch_activations"),
        pipeline=sum(terms.values()), logits=loss_phase_bytes(micro, compute_size),
        recompute=tick_recompute_bytes(layout))


def tick_loss_gradient_bytes(layout) -> float:
    """The head's and final norm's gradients the 1F1B family's loss ticks sum through the loop, at the gradient
    rules' split in the compute dtype; an untied embedding's gradient is made after the region, from its input's.
    (h100x8, recipes/pp.toml under zero_bubble at 8 layers: the tick loop's conditional carries the head's f32[64,256]
    and the final norm's f32[64] sums beside the layers'.)"""
    untied = not getattr(layout.config, "tie_embeddings", True)

    def summed_in_the_loop(logical: tuple) -> bool:
        return not (logical and logical[0] == "layers") and not (logical == ("vocab", "embed") and untied)

    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    return device_elements(layout, "gradients", summed_in_the_loop) * compute_size


def chunk_saved_activation_bytes(layout) -> float:
    """One micro-batch's saved activations for one chunk of a stage's layers, as the chunk's scan keeps them for its
    backward: `activation_bytes` on one micro-batch, and on XLA:GPU without remat, for a chunk of more than one layer
    (a scan over them), also what `_unremat_layer_items` and `_unremat_mlp_items` list for a fused kernel (each norm's
    normalised fp32 value, three more MLP-width tensors for SwiGLU's backward): the compiled scan's residual stacks
    hold them with XLA's attention too (h100x8, recipes/pp.toml with 2 layers per chunk: 1691 KiB per stack, 1664
    counted; pp_fsdp_tp: 2033, 1857 counted). A one-layer chunk has no scan over its layers."""
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    micro = microbatch_layout(layout)
    chunks = layout.pipeline.chunks
    saved = activation_bytes(micro, compute_size) / chunks
    if not plain_attention_in_chunk_scan(layout):
        return saved
    b, s, t, sp, layers = _layer_geometry(micro)
    residual, mlp = b * s * layout.config.embed / sp, b * s * layout.config.mlp * compute_size / t
    return saved + (2 * residual * 4 + 3 * mlp) * layers / chunks


def plain_attention_in_chunk_scan(layout) -> bool:
    """Whether a pipeline chunk's layers run as a scan (more than one layer a chunk) on XLA:GPU, without remat and
    with XLA's own attention (not a fused kernel): the programs whose scan keeps the residual stacks and the hoisted
    causal mask that `chunk_saved_activation_bytes` and `hoisted_causal_mask_elements` count."""
    _, _, _, _, layers = _layer_geometry(layout)
    scanned = layers // layout.pipeline.chunks > 1 and layout.mesh.devices.flat[0].platform in GPU_PLATFORMS
    plain = layout.recipe.train.remat == "none" and not attention_is_fused(layout) and is_transformer(layout.config)
    return scanned and plain


def hoisted_causal_mask_elements(layout) -> float:
    """Elements of one micro-batch's attention scores (b x heads/t x s x s), the shape XLA broadcasts the causal mask
    and its fill value to where a chunk's scan over layers runs XLA's attention (`plain_attention_in_chunk_scan`),
    else 0.

    Why: `jax.nn.dot_product_attention(is_causal=True)` builds the mask from constants alone, so it is invariant in
    the scan over layers, and the scan's linearization hoists it (pred) and the fill value `where` broadcasts to its
    shape (fp32) out of the loop, one pair for each scan that runs the layers' forward, one mask for the transposed
    scan. shardkit/attention/blocks.py ties its own masks to the queries to avoid this; the plain path does not. Which
    of them are live at the peak differs by schedule family (`tick_schedule_causal_mask_bytes`,
    `loop_schedule_causal_mask_bytes`)."""
    if not plain_attention_in_chunk_scan(layout):
        return 0.0
    b, s, t, _, _ = _layer_geometry(microbatch_layout(layout))
    return score_elements(layout.config, b, s, t)


def tick_schedule_causal_mask_bytes(layout) -> float:
    """The 1F1B family's hoisted causal mask live at its peak: the transposed layer scan's pred mask alone (1 B an
    element, `hoisted_causal_mask_elements`). The backward tick's recompute scan (jvp) holds its own mask and fp32
    fill, but they die when that scan ends, before the transposed scan starts, where the peak is. h100x8,
    recipes/pp_fsdp_tp.toml under 1f1b and zero_bubble: pred[2,2,2,64,64] (32 KiB, the transposed scan's operand, e.g.
    1f1b's loop_broadcast_fusion.64) live at the peak; the recompute's f32 fill (loop_broadcast_fusion.83) is not;
    the f32[2,2,2,64,64] live there is a multiply inside the scan's body (loop_multiply_fusion.5), no fill value;
    recipes/pp.toml's 1f1b at 8 layers: pred[2,1,4,64,64] (32 KiB) alone, likewise; interleaved_1f1b at 16 layers,
    m = 4 (one sequence a replica): pred[2,1,4,64,64] alone (loop_broadcast_fusion.215)."""
    return hoisted_causal_mask_elements(layout) * 1


def loop_schedule_causal_mask_bytes(layout) -> float:
    """The loop schedules' hoisted causal mask live at their peak: the recompute scan's pred mask and fp32 fill value,
    still live in the backward tick's transposed layer scan, beside that scan's own pred mask (4 + 1 + 1 B an element,
    `hoisted_causal_mask_elements`). h100x8, recipes/pp_fsdp_tp.toml under gpipe: f32[2,2,2,64,64] and
    pred[2,2,2,64,64] (loop_broadcast_fusion.18 and .1, operands of the rematted_computation's while) and the
    transposed scan's pred[2,2,2,64,64] (loop_broadcast_fusion), 192 KiB, all live at the peak; recipes/pp.toml's
    gpipe at 8 layers: f32[2,1,4,64,64] and pred[2,1,4,64,64] (loop_broadcast_fusion.44 and .18, held from the
    forward's first tick) and the transposed scan's pred (.19), live at its peak; circular at 16 layers, m = 4 (one
    sequence a replica): the same three, f32 and pred [2,1,4,64,64] (loop_broadcast_fusion.45 and .18) and the
    transposed scan's pred (.19), live at its peak."""
    return hoisted_causal_mask_elements(layout) * (4 + 1 + 1)


# ---- the loop schedules' memory (gpipe, circular: shardkit/pipeline/gpipe.py) ----------------------------------------
def inlined_ticks_held(config) -> int:
    """The single-tick runs (`tick_runs`) whose backward buffers are live beside the running tick's: a run of one
    tick is a scan of length one, which XLA inlines. With chunks of two layers or more, the zeros its chunk's scan
    starts from (the residual stacks and the weight-gradient carry) are made for all of them at the backward's start
    (one fusion; h100x8, gpipe at 8 layers, m = 4 and 8, and circular at 16 layers: 4 of 5 and 6 of 7 runs held), all
    but the one that runs first; with one layer a chunk, each run's layer gradient is kept from its backward until the
    step sums them after the last (gpipe as shipped: 4 of 5 at the last run's backward)."""
    return max(sum(1 for _, count, _ in tick_runs(config) if count == 1) - 1, 0)


def looped_run_gradients_held(config) -> int:
    """Chunk gradients live during the backward of a run of several ticks (a scan over ticks), at the largest such
    run: the runs after it in forward order have run their backward first and each holds its gradient until the step
    sums them, and the running tick's chunk makes its own gradient beside the run's sum (the tick scan's carry, which
    the step's gradients count). 0 without a run of several ticks. h100x8, recipes/pp_fsdp_tp.toml under gpipe (runs
    of 4 ticks and 1): the inlined last tick's gradient and the running tick's, 289 KiB each, beside the loop's sum."""
    runs = tick_runs(config)
    return max((len(runs) - index for index, (_, count, _) in enumerate(runs) if count > 1), default=0)


def loop_schedule_memory_terms(layout) -> dict[str, float]:
    """GPipe's and circular's transient buffers per device by name, as their compiled loop holds them
    (shardkit/pipeline/gpipe.py: a scan over ticks, each tick's chunk rematerialised; the loss outside the region on
    the whole batch). With A one micro-batch's stage input (b x S x D, compute dtype), T = m*v + p - 1 ticks:

    - `tick_inputs`: T x A, each tick's chunk input, what the tick's checkpoint saves for its backward;
    - `region_edge_gradient`: m x A, the whole batch's gradient at the region's edge;
    - `inlined_tick_buffers`: for every single-tick run but one (`inlined_ticks_held`), its chunk's layers' gradient,
      and with chunks of more than one layer (a scan over the chunk's layers, whose zeros XLA allocates at the
      backward's start) the chunk's saved activations on one micro-batch too; a one-layer chunk has no scan, and its
      run's gradient is made by its backward and kept until the step sums them;
    - `looped_run_gradients`: where a run of several ticks' backward holds more chunk gradients
      (`looped_run_gradients_held`) than the single-tick runs' phase holds buffers (`inlined_tick_buffers`), the
      difference: the two phases never overlap, so the larger one counts;
    - `region_output_gradient`: m x A, the gradient of the region's outputs (the whole batch's), which the backward's
      ticks read one micro-batch at a time: held through the region's backward beside the input gradient it builds
      (h100x8: recipes/pp_fsdp_tp.toml under gpipe, the split cotangent the tick loop reads, 128 KiB; recipes/pp.toml
      as shipped, the final norm's input gradient, 128 KiB, live until after the region's backward);
    - `loss_region_combined_sums`: under GPipe's loss region on XLA:GPU, the combined all-reduce buffer of the
      hidden state's and the head's gradient sums, held to the step's end (`loss_region_combined_sum_bytes`);
    - `logits_gradient`: the whole batch's logits' gradient (compute dtype, vocab split over `tensor`), held with the
      logits (`loss_phase_bytes`) through the region's backward on XLA:GPU, whose schedule computes the head's weight
      gradient after it; 0 where the loss's own count already holds an fp32 gradient;
    - `chunk_relayout_copy`: circular only: the stage's layers in chunk order, the re-layout's output
      (`chunk_relayout_items`), a copy of the stored stack made at the step's start and read by every tick (h100x8,
      recipes/pp.toml under circular at 8 and 16 layers: the collective-permute's output, 577 and 1154 KiB, live
      through the whole step);
    - `tick_backward_beside_logits`: where the logits' gradient is held (above), the running tick's backward working
      set (`recompute_bytes` of one micro-batch), which then runs beside the loss's buffers rather than after them
      (`MemoryEstimate` otherwise counts the larger of the two); h100x8, recipes/pp.toml as shipped: the attention
      scores' fp32 gradient live beside the logits at the peak;
    - `causal_mask`: the causal masks and fill value hoisted out of the chunk's scans over layers under XLA's
      attention, at one micro-batch's score shape (`loop_schedule_causal_mask_bytes`);
    - `microbatch_activations`: the running tick's backward, one micro-batch's chunk (`chunk_saved_activation_bytes`).

    Only the first two and the loss grow with m; the rest is one micro-batch's (h100x8, recipes/pp.toml at 8 layers,
    m = 4 and 8: 0.94 of XLA's peak; at m = 8, 0.94 of the live bytes at the peak with the arguments too, 15.96 MiB
    counting the loops' carried values, XLA's heap 0.02 MiB above them). No term counts XLA:GPU's split-K partial
    sums (fp32, one per piece of K): the head's input gradient's, held through the region's backward (512 KiB at
    recipes/pp.toml's sizes), and the running tick's small GEMMs' (384 KiB at one 64-token sequence a micro-batch);
    recipes/pp.toml as shipped: 0.94 of XLA's peak, 0.95 of the live bytes with the arguments (5.28 MiB).
    """
    config = layout.pipeline
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    stage_input = microbatch_activation_bytes(layout)
    chunk = chunk_saved_activation_bytes(layout)
    layers_per_chunk = getattr(layout.config, "layers", 0) // (config.stages * config.chunks)
    chunk_gradient = replica_elements_by_role(layout)["layers"] * compute_size / config.chunks
    scanned_chunk = chunk if layers_per_chunk > 1 else 0.0
    logits_gradient = held_logits_gradient_bytes(layout, compute_size)
    inlined = inlined_ticks_held(config) * (scanned_chunk + chunk_gradient)
    return {
        "tick_inputs": config.forward_ticks * stage_input,
        "region_edge_gradient": config.microbatches * stage_input,
        "region_output_gradient": config.microbatches * stage_input,
        "loss_region_combined_sums": loss_region_combined_sum_bytes(layout),
        "inlined_tick_buffers": inlined,
        "looped_run_gradients": max(looped_run_gradients_held(config) * chunk_gradient - inlined, 0.0),
        "chunk_relayout_copy": stored_layer_bytes(layout) if config.chunks > 1 else 0.0,
        "logits_gradient": logits_gradient,
        "tick_backward_beside_logits": tick_recompute_bytes(layout) if logits_gradient else 0.0,
        "causal_mask": loop_schedule_causal_mask_bytes(layout),
        "microbatch_activations": chunk,
    }


def loss_region_combined_sum_bytes(layout) -> float:
    """GPipe's and circular's loss region on XLA:GPU: the whole replica batch's hidden-state gradient and the head's
    gradient shard, both summed over `pipeline` as the region's backward ends (the transposes of its first casts,
    `gpipe._stage_rows_loss`), which XLA's all-reduce combiner makes one all-reduce of one concatenated buffer. The
    tick loop reads its slice of the hidden part (`region_output_gradient`); the buffer itself lives until the
    optimizer reads the head's part at the step's end (compute dtype). h100x8, recipes/pp_fsdp_tp.toml: gpipe
    f32[36864] = 8 x 64 x 64 + 4096 (144 KiB, live from the loss region's backward to the update), the same under
    circular; at embed 512, seq 512 bf16[3145728] (6 MiB) and f32 (12 MiB). 0 without the loss region."""
    rows = loop_loss_stage_rows(layout)
    if rows is None or layout.mesh.devices.flat[0].platform not in GPU_PLATFORMS:
        return 0.0
    train, shape = layout.recipe.train, layout.mesh.shape
    replica_rows = train.global_batch // train.grad_accum // (shape["data"] * shape["fsdp"])
    hidden = replica_rows * train.seq_len * layout.config.embed
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    return (hidden + split_head_elements(layout) / shape["fsdp"]) * compute_size


def stored_layer_bytes(layout) -> float:
    """Bytes per device of the layer stack as the parameters are stored (their own rules, every axis)."""
    elements = device_elements(layout, "params", lambda logical: bool(logical) and logical[0] == "layers")
    return elements * np.dtype(layout.policy.param_dtype).itemsize


def device_elements(layout, table: str, keep) -> float:
    """Elements per device of the parameters whose logical axes `keep` accepts (a tuple of names), laid out by the
    rule table `table` ("params", "gradients", ...) on every mesh axis."""
    specs = layout.specs(getattr(layout.rules, table), table)
    sizes = dict(layout.mesh.shape)
    logicals = jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple))
    return float(sum(math.prod(device_shape(leaf.shape, spec, sizes))
                     for leaf, spec, logical in zip(jax.tree.leaves(layout.abstract_params), jax.tree.leaves(specs),
                                                    logicals)
                     if keep(tuple(logical))))


def held_logits_gradient_bytes(layout, compute_size: float) -> float:
    """The whole batch's logits' gradient where `loss_phase_bytes` counts only the logits (one chunk on XLA:GPU); 0
    under GPipe's loss region, whose chunks (fewer rows than the device's batch) run one at a time."""
    if not is_transformer(layout.config):
        return 0.0
    b, s = local_batch(layout)
    rows = loss_chunk_rows(layout)
    if rows is None or rows < b * s or layout.mesh.devices.flat[0].platform not in GPU_PLATFORMS:
        return 0.0
    return b * s * layout.vocab * compute_size / layout.mesh.shape["tensor"]


def loop_schedule_memory(layout, memory: MemoryEstimate) -> MemoryEstimate:
    """`memory` with GPipe's or circular's activations: their loop's buffers (`loop_schedule_memory_terms`) instead
    of every micro-batch's saved activations, and one micro-batch's layer recompute; the loss stays the whole
    batch's (it runs after the region)."""
    terms = loop_schedule_memory_terms(layout)
    recompute = 0.0 if terms["tick_backward_beside_logits"] else tick_recompute_bytes(layout)
    return dataclasses.replace(memory, activations=terms.pop("microbatch_activations"), pipeline=sum(terms.values()),
                               recompute=recompute)


def tick_recompute_bytes(layout) -> float:
    """One tick's backward working set: the running layer's whole set on one micro-batch, rebuilt whatever
    `train.remat` says (the executor recomputes every tick's chunk in its backward, so the running layer makes its
    forward's tensors before the chunk's scan stores them), and on XLA:GPU the largest split-K partial sums among the
    layer's GEMMs (`layer_split_k_bytes`). h100x8, recipes/pp_fsdp_tp.toml (two layers a stage, fp32, XLA's
    attention), the running layer's own values live at the peak: gpipe 930 KiB (the recompute's fused q/k/v and down
    projections' partial sums, 256 KiB each, beside its gate/up output and probabilities), 1f1b and zero_bubble 817
    KiB (three score-sized fp32 tensors of the attention's backward beside the output projection's 128 KiB of partial
    sums); 929 KiB counted. bf16 with cuDNN: 683 / 592 / 592 KiB, 659 counted; at embed 512, seq 512: 41.5 MiB. Under
    the 1F1B family with one layer a chunk only the backward's own tensors (`recompute_bytes`) are added to the partial
    sums: the chunk's tensors are its saved activations, and the peak is in its backward (recipes/pp.toml's 1f1b as
    shipped, 0.98 of XLA's peak; 1.12 with the whole set). GPipe's and circular's rematerialised tick holds the
    recomputed layer's whole set there too (pp_fsdp_tp under circular, one layer a chunk: about 1.2 MiB of the running
    layer's values live at the peak, three split-K partial sums among them). Where XLA keeps several GEMMs' partial sums
    live at once the term is short (README, "The running tick's working set")."""
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    micro = microbatch_layout(layout)
    b, s, t, sp, layers = _layer_geometry(micro)
    if layers // layout.pipeline.chunks > 1 or not layout.pipeline.one_f_one_b:
        working = sum(layer_activation_items(layout.config, b, s, t, compute_size, "none", sp,
                                             attention_is_fused(layout)).values())
    else:  # the 1F1B family, one layer a chunk: its tensors are the saved activations (`microbatch_activations`)
        working = recompute_bytes(micro, compute_size)
    on_gpu = layout.mesh.devices.flat[0].platform in GPU_PLATFORMS
    return working + (layer_split_k_bytes(micro, compute_size) if on_gpu else 0.0)


def layer_gemms(layout) -> list[tuple[int, int, int]]:
    """One decoder layer's GEMMs on one device as (m, n, k), its forward's (q/k/v and gate/up each one dot, as XLA
    fuses them), its input gradients' and its weight gradients' (k = the tokens); none for other models. Under
    Megatron-SP the GEMMs take the sequence gathered over `tensor`, so every one sees the micro-batch's b x s tokens."""
    if not is_transformer(layout.config):
        return []
    b, s, t, _, _ = _layer_geometry(layout)
    config = layout.config
    tokens, d, f = b * s, config.embed, config.mlp // t
    q, kv = config.heads * config.head_dim // t, config.kv_heads * config.head_dim // t
    forward = [(tokens, q + 2 * kv, d), (tokens, d, q), (tokens, 2 * f, d), (tokens, d, f)]
    inputs = [(tokens, d, q), (tokens, d, kv), (tokens, q, d), (tokens, d, f), (tokens, f, d)]
    weights = [(d, q, tokens), (d, kv, tokens), (q, d, tokens), (d, f, tokens), (f, d, tokens)]
    return forward + inputs + weights


def layer_split_k_bytes(layout, compute_size: float) -> float:
    """The largest fp32 partial sums XLA:GPU's split-K rewrite gives one of the layer's GEMMs (`layer_gemms`,
    `shardkit.analysis.split_k`): the buffer a split GEMM writes before its reduce, live beside the layer's tensors."""
    return float(max((split_k_partial_sum_bytes(m, n, k, int(compute_size)) for m, n, k in layer_gemms(layout)),
                     default=0))


def tick_schedule_gradient_items(layout, items: list[CommItem]) -> list[CommItem]:
    """The 1F1B family's gradient reductions over `data` (h100x8, recipes/pp.toml): the head and final norm, whose
    gradients only the last stage computes inside the region, are summed over data and pipeline at once; the rest
    (the stage's layers; the embedding, differentiated after the region) over data alone."""
    data, fsdp = layout.mesh.shape["data"], layout.mesh.shape["fsdp"]
    if fsdp > 1 and "fsdp" in manual_data_axes(layout):
        # The region reduces the head's gradients onto their fsdp shard and sums the shard over `pipeline` (h100x8,
        # recipes/pp_fsdp_tp.toml, 1f1b and zero_bubble: 16.12 KiB).
        shard = head_elements(layout) / fsdp * np.dtype(layout.policy.grad_reduce_dtype).itemsize
        axes = ("pipeline", "data") if data > 1 else ("pipeline",)
        items = _split_head_items(layout, items)
        return [*items, CommItem("gradients (head, final norm; fsdp shard)", "all-reduce", axes, shard,
                                 layout.mesh.shape["pipeline"] * data)]
    if data == 1 or fsdp > 1:
        return items
    outside = replica_elements_by_role(layout)["outside"] * np.dtype(layout.policy.grad_reduce_dtype).itemsize
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
    of its gradient back replace them (h100x8, recipes/pp_fsdp_tp.toml, 1f1b: 32 KiB). The loss's gather of the rows
    and reduction of their gradient run inside the tick switch's loss branch, which the compiled counts leave out
    like the layers' tensor all-reduces there: not counted here either."""
    split = split_head_elements(layout)
    if not split:
        return items
    param_size = np.dtype(layout.policy.param_dtype).itemsize
    # The parameters outside the stack have their fp32 gradients all-reduced over `fsdp` where FSDP works per layer
    # (`communication_estimate`), else they are in the reduce-scatter of the gradients.
    fp32_outside = any(i.what == "gradients" and i.kind == "all-reduce" and i.axes[0] == "fsdp" for i in items)
    reduce_size = np.dtype(layout.policy.grad_reduce_dtype).itemsize
    reduced = ("all-reduce", 4) if fp32_outside else ("reduce-scatter", reduce_size)
    out = []
    for item in items:
        if item.what == "parameters, forward" and item.axes == ("fsdp",):
            item = dataclasses.replace(item, bytes=item.bytes - split * param_size)
        elif item.what == "gradients" and item.kind == reduced[0] and item.axes[0] == "fsdp":
            item = dataclasses.replace(item, bytes=item.bytes - split * reduced[1])
        out.append(item)
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    fsdp = layout.mesh.shape["fsdp"]
    return [*out, CommItem("head split by vocabulary, its gradient back", "all-to-all", ("fsdp",),
                           2 * split / fsdp * compute_size, fsdp)]


def loop_loss_stage_rows(layout) -> int | None:
    """The sequences a device's loss takes in GPipe's and circular's loss region (`gpipe.loss_stage_rows`), None
    where the loss runs in the automatic layout."""
    from shardkit.pipeline import gpipe

    return gpipe.loss_stage_rows(layout)


def loop_loss_region_items(layout, items: list[CommItem]) -> list[CommItem]:
    """GPipe's and circular's loss region (`shardkit.pipeline.gpipe.cross_entropy_for`), as compiled for h100x8
    (recipes/pp_fsdp_tp.toml: every row within 0.1%): the head split over `fsdp` by vocabulary (`_split_head_items`),
    and per step, over all of a device's chunks, with T its stage's token rows (1/p of its replica's) and f = fsdp:
    the rows and targets all-gathered over `fsdp` (f x T rows), the hidden state's gradient reduce-scattered back,
    the loss's three per-row statistics (max and sum over `fsdp` and the vocabulary's other axes, the target's logit
    over `fsdp`), and over `pipeline` the replica's hidden-state gradient (the slice's transpose) and the head
    gradient's fsdp shard."""
    shape, train = layout.mesh.shape, layout.recipe.train
    compute_size = np.dtype(layout.policy.compute_dtype).itemsize
    fsdp, p, embed = shape["fsdp"], layout.pipeline.stages, layout.config.embed
    gathered_rows = fsdp * loop_loss_stage_rows(layout) * train.seq_len
    statistic = gathered_rows * 4  # one fp32 value a row
    vocab_axes = tuple(a for a in layout.rules.activations.get("vocab", ()) if shape.get(a, 1) > 1)
    head_shard = (split_head_elements(layout) or head_elements(layout)) / fsdp * compute_size
    return [*_split_head_items(layout, items),
            CommItem("loss rows and targets", "all-gather", ("fsdp",), gathered_rows * (embed * compute_size + 4),
                     fsdp),
            CommItem("loss rows' gradient", "reduce-scatter", ("fsdp",), gathered_rows * embed * compute_size, fsdp),
            CommItem("loss statistics (max, sum)", "all-reduce", ("fsdp", *vocab_axes), 2 * statistic,
                     fsdp * math.prod(shape[a] for a in vocab_axes)),
            CommItem("loss statistics (target logit)", "all-reduce", ("fsdp",), statistic, fsdp),
            CommItem("loss rows' gradient over the stages, head gradient's shard", "all-reduce", ("pipeline",),
                     gathered_rows // fsdp * p * embed * compute_size + head_shard, p)]


def split_head_elements(layout) -> float:
    """Elements per data-parallel replica (whole over `fsdp`) of the head parameters the 1F1B region (and GPipe's
    loss region) splits over `fsdp` by vocabulary (`shardkit.pipeline.head_split.splits`); 0 where it gathers them."""
    from shardkit.pipeline import head_split, pipeline_region

    if not layout.pipeline.one_f_one_b and loop_loss_stage_rows(layout) is None:
        return 0.0
    region = pipeline_region(layout)
    rules = layout.rules.without_axes(("data", "fsdp"))
    sizes = dict(layout.mesh.shape)
    untied = not getattr(layout.config, "tie_embeddings", True)  # an untied table is the embedding's, not the head's
    total = 0.0
    for leaf, spec, logical in zip(jax.tree.leaves(layout.abstract_params),
                                   jax.tree.leaves(layout.specs(rules.params, "params"), is_leaf=_is_spec),
                                   jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple))):
        head = logical and logical[0] != "layers" and not (untied and tuple(logical) == ("vocab", "embed"))
        if head and head_split.splits(layout, region, logical):
            total += math.prod(device_shape(leaf.shape, spec, sizes))
    return total


def head_elements(layout) -> float:
    """Elements per data-parallel replica of the parameters the tick executor's last stage reads besides its layers
    (final norm, output head): those outside the layer stack but an untied embedding table, which is differentiated
    after the region."""
    rules = layout.rules.without_axes(("data", "fsdp"))
    sizes = dict(layout.mesh.shape)
    untied = not getattr(layout.config, "tie_embeddings", True)
    total = 0.0
    for leaf, spec, logical in zip(jax.tree.leaves(layout.abstract_params),
                                   jax.tree.leaves(layout.specs(rules.params, "params"), is_leaf=_is_spec),
                                   jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple))):
        if not (logical and logical[0] == "layers") and not (untied and tuple(logical) == ("vocab", "embed")):
            total += math.prod(device_shape(leaf.shape, spec, sizes))
    return total


# ---- FLOPs -----------------------------------------------------------------------------------------------------------
def flops_per_step(layout) -> float:
    """Model training FLOPs of one step over all devices (see `training_flops_per_token`; a mixture of experts
    counts its active parameters, `active_parameters`)."""
    parameters = active_parameters(layout)
    train = layout.recipe.train
    return training_flops_per_token(layout.config, parameters, train.seq_len) * train.global_batch * train.seq_len


def estimate(layout) -> dict[str, Any]:
    """The whole analytic model as JSON: memory per device, communication per step and FLOPs."""
    memory = memory_estimate(layout)
    comm = communication_estimate(layout)
    return {
        "memory": memory.to_json(),
        "communication": [
            {**dataclasses.asdict(item), "axes": list(item.axes), "wire_bytes": item.wire_bytes} for item in comm
        ],
        "flops_per_step": flops_per_step(layout),
        "flops_per_device_per_step": flops_per_step(layout) / layout.mesh.size,
        "pipeline_bubble": pipeline_bubble_fraction(layout),
        "pipeline_memory_terms": tick_schedule_memory_terms(layout) if layout.pipeline.one_f_one_b else None,
    }


# ---- mixture of experts (models/moe.py, shardkit/moe.py) ------------------------------------------------------------
def expert_parameter_elements(layout) -> float:
    """Elements of the parameters on the logical `experts` axis (0 for a dense model)."""
    leaves = zip(jax.tree.leaves(layout.abstract_params),
                 jax.tree.leaves(layout.logical, is_leaf=lambda x: isinstance(x, tuple)))
    return float(sum(math.prod(leaf.shape) for leaf, logical in leaves if "experts" in logical))


def active_parameters(layout) -> float:
    """Parameters one token uses: all of a dense model's; a mixture of experts counts top_k of its `experts`
    experts (the MFU convention: model FLOPs of the routed tokens, not of the padded slots)."""
    total = float(sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(layout.abstract_params)))
    config = layout.config
    if not hasattr(config, "experts"):
        return total
    experts = expert_parameter_elements(layout)
    return total - experts + experts * config.top_k / config.experts


def moe_layer_items(layout, items: dict[str, float], compute_size: float) -> dict[str, float]:
    """One layer group's saved activations with the MLP routed: per MoE layer the dense SwiGLU items (gate, up,
    hidden, and their fused-kernel extras) become top_k times as many token rows, or under expert parallelism the
    received slots (rows x experts x slots, the dispatch buffer) and the dispatched and returned buffers themselves;
    plus the router's fp32 logits and scores. A group of `moe_every` layers keeps moe_every - 1 dense layers' items
    besides; the total is per layer, so the group's is divided by moe_every."""
    from shardkit.moe import Routing

    config, train = layout.config, layout.recipe.train
    b, s, t, _, _ = _layer_geometry(layout)
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
    grad_size = np.dtype(layout.policy.grad_reduce_dtype).itemsize
    fsdp = shape["fsdp"]
    if fsdp > 1 and not fsdp_syncs_per_step(layout):
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


def _over_expert_too(item: CommItem, ranks: int) -> CommItem:
    """A gradient all-reduce of parameters outside the layers, widened to `expert` (their replicas over it)."""
    return dataclasses.replace(item, axes=item.axes + ("expert",), group_size=item.group_size * ranks)
