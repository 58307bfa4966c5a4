"""The pipeline schedules' transient buffers per device: the tick executor's (1f1b, interleaved_1f1b, zero_bubble:
shardkit/pipeline/one_f_one_b.py) and the loop schedules' (gpipe, circular: shardkit/pipeline/gpipe.py), in place of
every micro-batch's saved activations. Terms that follow one XLA version's buffer assignment rather than the schedule
are in `shardkit.analysis.predicted.xla_buffers`.
"""

from __future__ import annotations

import dataclasses

from shardkit.analysis.predicted.memory_terms import (
    MemoryEstimate,
    activation_bytes,
    attention_is_fused,
    device_elements,
    layer_activation_items,
    layer_geometry,
    loss_phase_bytes,
    microbatch_layout,
    recompute_bytes,
    replica_elements_by_role,
    stored_layer_bytes,
)
from shardkit.analysis.predicted.xla_buffers import (
    held_logits_gradient_bytes,
    inlined_ticks_held,
    layer_split_k_bytes,
    loop_schedule_causal_mask_bytes,
    looped_run_gradients_held,
    loss_region_combined_sum_bytes,
    plain_attention_in_chunk_scan,
    tick_schedule_causal_mask_bytes,
)
from shardkit.pipeline import (
    gpipe,
    microbatch_activation_bytes,
)
from shardkit.platforms import on_gpu

REGION_EDGE_INPUTS_PER_MICROBATCH = 4  # the embedded batch in, its gradient out, each with a copy at the region's edge


def tick_schedule_memory_terms(layout, micro=None) -> dict[str, float]:
    """The tick executor's transient buffers per device, by name (the compiled program is one SPMD program, so every
    stage allocates the largest stage's buffers). With A one micro-batch's stage input (b x S x D, compute dtype):

    - `stage_inputs`: A x `TickProgram.slots`, the inputs waiting for their last backward (1f1b: p, the first
      stage's p - d + 1 at d = 1 counted from 1; zero_bubble: 2p - 1, kept until W; interleaved_1f1b: the v chunks'
      inputs in flight);
    - `received_gradients`: A x `TickProgram.grad_slots`;
    - `region_edges`: REGION_EDGE_INPUTS_PER_MICROBATCH x m x A, the whole embedded batch and its gradient at the
      region's edge (the embedding runs outside it);
    - `stage_weights`: the stage's layers as the region's per-replica copy in the compute dtype (one_f_one_b.py: the
      parameters enter as per-replica copies); under a per-step FSDP gather, the tick loop's copy of the gathered
      stage in its own layout (a transpose of the gather's output), held through the ticks beside the gather's output
      (`gathered_params`), which lives to the step's end;
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
    gradients it moves back after the last tick are the step's gradients (`MemoryEstimate.gradients`). The compiled
    buffers behind each term: bench/results/pipeline_buffers_h100x8_*.md. `micro`: `microbatch_layout(layout)`, where
    the caller has derived it already."""
    from shardkit.pipeline.program import tick_program

    config = layout.pipeline
    compute_size = layout.policy.compute_size
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
        "microbatch_activations": chunk_saved_activation_bytes(layout, micro),
    }


def tick_schedule_memory(layout, memory: MemoryEstimate) -> MemoryEstimate:
    """`memory` with the tick executor's activations: its buffers (`tick_schedule_memory_terms`) instead of every
    micro-batch's saved activations, and the loss and recompute of one micro-batch (the head runs on the last stage,
    per micro-batch) instead of the whole batch's. The gradients at the peak, inside the ticks, are the sums the tick
    loop carries (`stage_gradient_sums`, and the loss's `tick_loss_gradient_bytes`): the step's gradients are made
    from them after the last tick."""
    compute_size = layout.policy.compute_size
    micro = microbatch_layout(layout)
    terms = tick_schedule_memory_terms(layout, micro)
    return dataclasses.replace(
        memory, gradients=tick_loss_gradient_bytes(layout), activations=terms.pop("microbatch_activations"),
        pipeline=sum(terms.values()), logits=loss_phase_bytes(micro, compute_size),
        recompute=tick_recompute_bytes(layout, micro))


def tick_loss_gradient_bytes(layout) -> float:
    """The head's and final norm's gradients the 1F1B family's loss ticks sum through the loop, at the gradient
    rules' split in the compute dtype; an untied embedding's gradient is made after the region, from its input's."""
    untied = not getattr(layout.config, "tie_embeddings", True)

    def summed_in_the_loop(logical: tuple) -> bool:
        return not (logical and logical[0] == "layers") and not (logical == ("vocab", "embed") and untied)

    compute_size = layout.policy.compute_size
    return device_elements(layout, "gradients", summed_in_the_loop) * compute_size


def chunk_saved_activation_bytes(layout, micro=None) -> float:
    """One micro-batch's saved activations for one chunk of a stage's layers, as the chunk's scan keeps them for its
    backward: `activation_bytes` on one micro-batch, and on XLA:GPU without remat, for a chunk of more than one layer
    (a scan over them), also what `_unremat_layer_items` and `_unremat_mlp_items` list for a fused kernel (each norm's
    normalised fp32 value, three more MLP-width tensors for SwiGLU's backward): the compiled scan's residual stacks
    hold them with XLA's attention too. A one-layer chunk has no scan over its layers. `micro`: as
    `tick_schedule_memory_terms` takes it."""
    compute_size = layout.policy.compute_size
    micro = microbatch_layout(layout) if micro is None else micro
    chunks = layout.pipeline.chunks
    saved = activation_bytes(micro, compute_size, attention_is_fused(layout)) / chunks
    if not plain_attention_in_chunk_scan(layout):
        return saved
    b, s, t, sp, layers = layer_geometry(micro)
    residual, mlp = b * s * layout.config.embed / sp, b * s * layout.config.mlp * compute_size / t
    return saved + (2 * residual * 4 + 3 * mlp) * layers / chunks


def loop_schedule_memory_terms(layout, micro=None) -> dict[str, float]:
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
      ticks read one micro-batch at a time: held through the region's backward beside the input gradient it builds;
    - `loss_region_combined_sums`: under GPipe's loss region on XLA:GPU, the combined all-reduce buffer of the
      hidden state's and the head's gradient sums, held to the step's end (`loss_region_combined_sum_bytes`);
    - `logits_gradient`: the whole batch's logits' gradient (compute dtype, vocab split over `tensor`), held with the
      logits (`loss_phase_bytes`) through the region's backward on XLA:GPU, whose schedule computes the head's weight
      gradient after it; 0 where the loss's own count already holds an fp32 gradient, and under GPipe's loss
      region, whose backward reads the logits' gradient before the region's starts (`held_logits_gradient_bytes`);
    - `chunk_relayout_copy`: circular only: the stage's layers in chunk order, the re-layout's output
      (`chunk_relayout_items`), a copy of the stored stack made at the step's start and read by every tick;
    - `tick_backward_beside_logits`: where the logits' gradient is held (above), the running tick's backward working
      set (`recompute_bytes` of one micro-batch), which then runs beside the loss's buffers rather than after them
      (`MemoryEstimate` otherwise counts the larger of the two);
    - `causal_mask`: the causal masks and fill value hoisted out of the chunk's scans over layers under XLA's
      attention, at one micro-batch's score shape (`loop_schedule_causal_mask_bytes`);
    - `microbatch_activations`: the running tick's backward, one micro-batch's chunk (`chunk_saved_activation_bytes`).

    Only the first two and the loss grow with m; the rest is one micro-batch's. No term counts XLA:GPU's split-K
    partial sums outside the running tick (the head's input gradient's, held through the region's backward), so the
    terms fall a little short of the compiled peak: tests/test_pipeline_estimate*.py hold them within [0.9, 1.1], and
    bench/results/pipeline_buffers_h100x8_*.md lists the compiled buffers behind each term. `micro`: as
    `tick_schedule_memory_terms` takes it."""
    config = layout.pipeline
    compute_size = layout.policy.compute_size
    micro = microbatch_layout(layout) if micro is None else micro
    stage_input = microbatch_activation_bytes(layout)
    chunk = chunk_saved_activation_bytes(layout, micro)
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
        "tick_backward_beside_logits": tick_recompute_bytes(layout, micro) if logits_gradient else 0.0,
        "causal_mask": loop_schedule_causal_mask_bytes(layout),
        "microbatch_activations": chunk,
    }


def loop_schedule_memory(layout, memory: MemoryEstimate) -> MemoryEstimate:
    """`memory` with GPipe's or circular's activations: their loop's buffers (`loop_schedule_memory_terms`) instead
    of every micro-batch's saved activations, and one micro-batch's layer recompute; the loss stays the whole
    batch's (it runs after the region). Where the loss and the region's backward never live at once
    (`loss_phase_apart`), the running tick's activations and the backward-only buffers are counted in `recompute`,
    the backward's side of the two phases `MemoryEstimate` takes the larger of."""
    micro = microbatch_layout(layout)
    terms = loop_schedule_memory_terms(layout, micro)
    recompute = 0.0 if terms["tick_backward_beside_logits"] else tick_recompute_bytes(layout, micro)
    running = terms.pop("microbatch_activations")
    if loss_phase_apart(layout, terms):
        backward = running + recompute + sum(terms.pop(name) for name in BACKWARD_ONLY_TERMS)
        return dataclasses.replace(memory, activations=0.0, pipeline=sum(terms.values()), recompute=backward)
    return dataclasses.replace(memory, activations=running, pipeline=sum(terms.values()), recompute=recompute)


# The loop schedules' buffers that exist only inside the region's backward (`loop_schedule_memory_terms`).
BACKWARD_ONLY_TERMS = ("inlined_tick_buffers", "looped_run_gradients", "region_output_gradient", "causal_mask")


def loss_phase_apart(layout, terms: dict[str, float]) -> bool:
    """Whether the loss's buffers and the region's backward never live at once: on XLA:GPU, with the loss after the
    region (no loss region inside it) and nothing of the loss held into the region's backward (no held logits'
    gradient: the lean loss runs its chunks one at a time and is done before the region's backward starts). Then the
    step's transient peak is the larger of the two phases: the loss beside what the region's forward saved (its
    ticks' inputs, the batch at its edge), or the region's backward (the running tick's activations and working set,
    the gradients its runs hold, the gradient of the region's outputs)."""
    return on_gpu(layout.mesh) and gpipe.loss_stage_rows(layout) is None and not terms["logits_gradient"]


def tick_recompute_bytes(layout, micro=None) -> float:
    """One tick's backward working set: the running layer's whole set on one micro-batch, rebuilt whatever
    `train.remat` says (the executor recomputes every tick's chunk in its backward, so the running layer makes its
    forward's tensors before the chunk's scan stores them), and on XLA:GPU the largest split-K partial sums among the
    layer's GEMMs (`layer_split_k_bytes`). Under the 1F1B family with one layer a chunk only the backward's own
    tensors (`recompute_bytes`) are added to the partial sums: the chunk's tensors are its saved activations, and the
    peak is in its backward. GPipe's and circular's rematerialised tick holds the recomputed layer's whole set there
    too. Where XLA keeps several GEMMs' partial sums live at once the term is short. `micro`: as
    `tick_schedule_memory_terms` takes it."""
    compute_size = layout.policy.compute_size
    micro = microbatch_layout(layout) if micro is None else micro
    b, s, t, sp, layers = layer_geometry(micro)
    if layers // layout.pipeline.chunks > 1 or not layout.pipeline.one_f_one_b:
        working = sum(layer_activation_items(layout.config, b, s, t, compute_size, "none", sp,
                                             attention_is_fused(layout)).values())
    else:  # the 1F1B family, one layer a chunk: its tensors are the saved activations (`microbatch_activations`)
        working = recompute_bytes(micro, compute_size)
    return working + (layer_split_k_bytes(micro, compute_size) if on_gpu(layout.mesh) else 0.0)
