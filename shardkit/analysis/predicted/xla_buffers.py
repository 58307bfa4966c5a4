"""Terms of the analytic model that follow one XLA version's buffer assignment, not the algorithm: which buffers
XLA:GPU's scheduler and buffer assignment keep live at a pipeline step's peak.

They were read from the optimized HLO and buffer assignment of programs compiled by jax and jaxlib `READ_FROM_JAX`
with the jax[cuda12] plugin of the same version (split-K partial sums of small GEMMs,
`shardkit.analysis.predicted.split_k`; causal masks hoisted out of the layer scan; the zeros of inlined single-tick
runs; the loss region's combined all-reduce buffer; the logits' gradient held through the region's backward). Another
XLA may schedule, hoist and combine differently: these terms then drift, and their tests skip with that reason
(`matches_jax`) instead of being re-fitted silently. The compiled figure (`plan`'s "compiled" column) is exact on any
version.
"""

from __future__ import annotations

import jax

from shardkit.analysis.predicted.comm_terms import split_head_elements
from shardkit.analysis.predicted.flops import is_transformer
from shardkit.analysis.predicted.memory_terms import (
    attention_is_fused,
    layer_geometry,
    local_batch,
    loss_chunk_rows,
    microbatch_layout,
    score_elements,
)
from shardkit.analysis.predicted.split_k import split_k_partial_sum_bytes
from shardkit.pipeline import gpipe
from shardkit.pipeline.schedule import tick_runs
from shardkit.platforms import on_gpu

READ_FROM_JAX = "0.10.2"  # the jax, jaxlib and jax[cuda12] plugin version these terms were read from


def matches_jax() -> bool:
    """Whether the installed jax is the version these terms were read from (`READ_FROM_JAX`)."""
    return jax.__version__ == READ_FROM_JAX


SKIP_REASON = (f"the analytic model's XLA-specific terms (shardkit.analysis.predicted.xla_buffers) were read from jax "
               f"{READ_FROM_JAX}'s buffer assignment; this is jax {jax.__version__}")


def plain_attention_in_chunk_scan(layout) -> bool:
    """Whether a pipeline chunk's layers run as a scan (more than one layer a chunk) on XLA:GPU, without remat and
    with XLA's own attention (not a fused kernel): the programs whose scan keeps the residual stacks and the hoisted
    causal mask that `chunk_saved_activation_bytes` and `hoisted_causal_mask_elements` count."""
    _, _, _, _, layers = layer_geometry(layout)
    scanned = layers // layout.pipeline.chunks > 1 and on_gpu(layout.mesh)
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
    b, s, t, _, _ = layer_geometry(microbatch_layout(layout))
    return score_elements(layout.config, b, s, t)


def tick_schedule_causal_mask_bytes(layout) -> float:
    """The 1F1B family's hoisted causal mask live at its peak: the transposed layer scan's pred mask alone (1 B an
    element, `hoisted_causal_mask_elements`). The backward tick's recompute scan (jvp) holds its own mask and fp32
    fill, but they die when that scan ends, before the transposed scan starts, where the peak is."""
    return hoisted_causal_mask_elements(layout) * 1


def loop_schedule_causal_mask_bytes(layout) -> float:
    """The loop schedules' hoisted causal mask live at their peak: the recompute scan's pred mask and fp32 fill value,
    still live in the backward tick's transposed layer scan, beside that scan's own pred mask (4 + 1 + 1 B an element,
    `hoisted_causal_mask_elements`), for gpipe and circular alike."""
    return hoisted_causal_mask_elements(layout) * (4 + 1 + 1)


def inlined_ticks_held(config) -> int:
    """The single-tick runs (`tick_runs`) whose backward buffers are live beside the running tick's: a run of one
    tick is a scan of length one, which XLA inlines. With chunks of two layers or more, the zeros its chunk's scan
    starts from (the residual stacks and the weight-gradient carry) are made for all of them at the backward's start
    (one fusion), all but the one that runs first; with one layer a chunk, each run's layer gradient is kept from its
    backward until the step sums them after the last."""
    return max(sum(1 for _, count, _ in tick_runs(config) if count == 1) - 1, 0)


def looped_run_gradients_held(config) -> int:
    """Chunk gradients live during the backward of a run of several ticks (a scan over ticks), at the largest such
    run: the runs after it in forward order have run their backward first and each holds its gradient until the step
    sums them, and the running tick's chunk makes its own gradient beside the run's sum (the tick scan's carry, which
    the step's gradients count). 0 without a run of several ticks."""
    runs = tick_runs(config)
    return max((len(runs) - index for index, (_, count, _) in enumerate(runs) if count > 1), default=0)


def loss_region_combined_sum_bytes(layout) -> float:
    """GPipe's and circular's loss region on XLA:GPU: the whole replica batch's hidden-state gradient and the head's
    gradient shard, both summed over `pipeline` as the region's backward ends (the transposes of its first casts,
    `gpipe._stage_rows_loss`), which XLA's all-reduce combiner makes one all-reduce of one concatenated buffer. The
    tick loop reads its slice of the hidden part (`region_output_gradient`); the buffer itself lives until the
    optimizer reads the head's part at the step's end (compute dtype). 0 without the loss region."""
    rows = gpipe.loss_stage_rows(layout)
    if rows is None or not on_gpu(layout.mesh):
        return 0.0
    train, shape = layout.recipe.train, layout.mesh.shape
    replica_rows = train.global_batch // train.grad_accum // (shape["data"] * shape["fsdp"])
    hidden = replica_rows * train.seq_len * layout.config.embed
    compute_size = layout.policy.compute_size
    return (hidden + split_head_elements(layout) / shape["fsdp"]) * compute_size


def held_logits_gradient_bytes(layout, compute_size: float) -> float:
    """The whole batch's logits' gradient where `loss_phase_bytes` counts only the logits (one chunk on XLA:GPU),
    held through the layer region's backward because XLA:GPU schedules the head's weight gradient after it. 0 under
    GPipe's loss region (`gpipe.loss_stage_rows`) whatever its rows: XLA:GPU runs both matmuls that read the logits'
    gradient (the head's gradient and the hidden state's) in the loss region's backward, before the layer region's
    backward, which the hidden state's gradient feeds, so the logits' gradient dies before that starts. The region's
    rows can be as many as the device's batch rows: it takes whole rows over the expert ranks, which split the
    layers' batch."""
    if not is_transformer(layout.config) or gpipe.loss_stage_rows(layout) is not None:
        return 0.0
    b, s = local_batch(layout)
    rows = loss_chunk_rows(layout)
    if rows is None or rows < b * s or not on_gpu(layout.mesh):
        return 0.0
    return b * s * layout.vocab * compute_size / layout.mesh.shape["tensor"]


def layer_gemms(layout) -> list[tuple[int, int, int]]:
    """One decoder layer's GEMMs on one device as (m, n, k), its forward's (q/k/v and gate/up each one dot, as XLA
    fuses them), its input gradients' and its weight gradients' (k = the tokens); none for other models. Under
    Megatron-SP the GEMMs take the sequence gathered over `tensor`, so every one sees the micro-batch's b x s tokens."""
    if not is_transformer(layout.config):
        return []
    b, s, t, _, _ = layer_geometry(layout)
    config = layout.config
    tokens, d, f = b * s, config.embed, config.mlp // t
    q, kv = config.heads * config.head_dim // t, config.kv_heads * config.head_dim // t
    forward = [(tokens, q + 2 * kv, d), (tokens, d, q), (tokens, 2 * f, d), (tokens, d, f)]
    inputs = [(tokens, d, q), (tokens, d, kv), (tokens, q, d), (tokens, d, f), (tokens, f, d)]
    weights = [(d, q, tokens), (d, kv, tokens), (q, d, tokens), (d, f, tokens), (f, d, tokens)]
    return forward + inputs + weights


def layer_split_k_bytes(layout, compute_size: float) -> float:
    """The largest fp32 partial sums XLA:GPU's split-K rewrite gives one of the layer's GEMMs (`layer_gemms`,
    `shardkit.analysis.predicted.split_k`): the buffer a split GEMM writes before its reduce, live beside the layer's
    tensors."""
    return float(max((split_k_partial_sum_bytes(m, n, k, int(compute_size)) for m, n, k in layer_gemms(layout)),
                     default=0))
