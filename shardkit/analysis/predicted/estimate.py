"""The analytic model of the design page: memory per device, communication per step, FLOPs and MFU.

Everything here is arithmetic on the layout (shapes, specs, mesh sizes, recipe): nothing is compiled or allocated,
so it answers "what will each device hold and send" for any model size in milliseconds. `plan` prints it beside
XLA's compiled figures (`shardkit.analysis.compiled.hlo`), which lead wherever there are some: they are exact.

This module combines the terms: `memory_terms` (parameters, optimizer state, gradients, activations, the loss),
`comm_terms` (collectives by kind of parallelism), `pipeline_memory` (the schedules' buffers), `xla_buffers` (the
terms read from one XLA version's buffer assignment) and `flops`.

Conventions: `bytes` of a collective is the full buffer it reduces or gathers (as in `shardkit.analysis.compiled.hlo`);
memory is per device; FLOPs count a multiply-add as two.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from shardkit.analysis.predicted.comm_terms import (
    CommItem,
    context_parallel_items,
    expert_parallel_items,
    fsdp_items,
    gradient_items,
    loop_loss_region_items,
    pipeline_bubble_fraction,
    pipeline_items,
    pipeline_stage_gather_bytes,
    tensor_items,
    tick_schedule_gradient_items,
)
from shardkit.analysis.predicted.flops import flops_per_step
from shardkit.analysis.predicted.memory_terms import (
    ADAM_MOMENTS,
    MemoryEstimate,
    activation_bytes,
    fp8_state_bytes,
    fsdp_group,
    fsdp_syncs_per_step,
    gathered_param_bytes,
    gradient_bytes,
    local_batch,
    loss_phase_bytes,
    recompute_bytes,
    replica_elements_by_role,
    replica_param_bytes,
    replica_param_elements,
    sharded_bytes,
)
from shardkit.analysis.predicted.pipeline_memory import (
    loop_schedule_memory,
    tick_schedule_memory,
    tick_schedule_memory_terms,
)
from shardkit.analysis.predicted.region_terms import pipelined_region_items
from shardkit.pipeline import gpipe


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
    param_size = policy.param_size
    compute_size = policy.compute_size
    params = sharded_bytes(layout, "params", param_size)
    master = sharded_bytes(layout, "optimizer", 4) if policy.master_weights else 0.0
    params += fp8_state_bytes(layout) if policy.fp8 else 0.0
    optimizer = ADAM_MOMENTS * sharded_bytes(layout, "optimizer", 4)
    gradients = gradient_bytes(layout, compute_size)
    gathered = gathered_param_bytes(layout, compute_size) + pipeline_stage_gather_bytes(layout, compute_size)
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
    - sequence (context parallelism): `context_parallel_items`; the context ranks are FSDP ranks (`fsdp_group`),
      so the parameters are gathered and their gradients reduce-scattered over `fsdp` x `sequence`, unless the rules
      keep them replicas over `sequence` (then their fsdp shard is all-reduced over it).
    """

    shape = dict(layout.mesh.shape)
    policy = layout.policy
    accum = layout.recipe.train.grad_accum
    compute_size = policy.compute_size
    param_size = policy.param_size
    # What one data-parallel replica holds of the parameters, per device: each parameter's own spec without the
    # replica axes (a pipeline stage holds its layers but the embedding and head whole; tensor splits what it shards).
    elements = replica_param_elements(layout)
    items: list[CommItem] = []
    data, context = shape["data"], shape["sequence"]
    group = fsdp_group(layout)  # the FSDP ranks: `fsdp`, and the context and expert ranks the rules add to them
    fsdp = math.prod(shape[axis] for axis in group)
    zero = layout.recipe.rules.zero
    replicas = data * fsdp
    # An fsdp axis that splits no parameter (the model names nothing the rules map to it) gathers nothing: its
    # devices are data-parallel replicas, their gradients all-reduced.
    fsdp_split = fsdp > 1 and any(layout.splits(axis) for axis in group)
    if replicas * context > 1:
        # Reduced in the policy's gradient-reduction dtype (`Policy.grad_reduce_dtype`): the model differentiates
        # the parameters after their cast to the compute dtype, so XLA reduces the cotangents before casting back.
        # With the gradients sharded (FSDP, ZeRO-2) an untied table's row gradients go by all-to-all instead.
        roles = replica_elements_by_role(layout)
        per_layer_fsdp = fsdp_split and not fsdp_syncs_per_step(layout)  # `per_step` reduces everything at once
        lookup = roles["lookup"] if per_layer_fsdp or (fsdp == 1 and zero >= 2) else 0.0
        # Under FSDP the parameters outside the layer stack (the head, from the fp32 logits; the final norm) have
        # fp32 gradients, all-reduced over `fsdp` (8b preset, bf16, h100x8).
        outside = roles["outside"] if per_layer_fsdp else 0.0
        grad_bytes = (elements - lookup - outside) * policy.grad_reduce_size
        if fsdp > 1 and not fsdp_split:
            items.append(CommItem("gradients", "all-reduce", (("data",) if data > 1 else ()) + group, grad_bytes,
                                  replicas))
        else:
            items.extend(gradient_items(grad_bytes, data, fsdp, zero, group))
        replica_context = context > 1 and "sequence" not in group
        if replica_context:  # the parameters are replicas over `sequence`: their fsdp shard is reduced over it
            items.append(CommItem("gradients", "all-reduce", ("sequence",), grad_bytes / fsdp, context))
        if outside:
            # over `sequence` in the same all-reduce when the sequence is cut (recipes/cp.toml, h100x8)
            axes = group + ("sequence",) if replica_context else group
            items.append(CommItem("gradients", "all-reduce", axes, outside * 4,
                                  fsdp * (context if replica_context else 1)))
        if lookup and fsdp == 1:
            rows, seq = local_batch(layout)
            items.append(CommItem("embedding row gradients (ZeRO-2)", "all-to-all", ("data",),
                                  rows * seq * layout.config.embed * compute_size * accum, data))
    if data > 1 and zero >= 1:
        items.append(CommItem("updated parameters (ZeRO)", "all-gather", ("data",), elements * param_size, data))
    if fsdp_syncs_per_step(layout):
        items.append(CommItem("parameters, once per step", "all-gather", ("fsdp",), elements * param_size, fsdp))
    elif fsdp_split:
        items.extend(fsdp_items(layout, compute_size, param_size, accum, group))
    if shape["tensor"] == 1 or layout.splits("tensor"):  # a tensor axis that splits no weight repeats the compute
        items.extend(tensor_items(layout, shape, compute_size, accum))
    items.extend(context_parallel_items(layout))
    items.extend(pipeline_items(layout, shape, compute_size, accum))
    if layout.pipeline.one_f_one_b:
        items = tick_schedule_gradient_items(layout, items)
    elif gpipe.loss_stage_rows(layout) is not None:
        items = loop_loss_region_items(layout, items)
    if shape.get("expert", 1) > 1:
        items = expert_parallel_items(layout, items)
    return pipelined_region_items(layout, items)


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
