"""How other frameworks run a pipeline, for pricing their published runs as they ran them: which stage sends
block or overlap, where the output head runs, which of shardkit's own region-edge collectives they do not have.
Each instance cites the framework's code or paper it is read from.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from shardkit.analysis.predicted.comm_terms import CommItem
from shardkit.analysis.predicted.steptime import CommTime


@dataclasses.dataclass(frozen=True)
class Framework:
    """How the framework running a layout executes it, where frameworks differ in what the step time sees.

    `step_time` prices a layout as shardkit compiles it (`SHARDKIT`, the default); a published run made with another
    framework is priced as that framework runs the same layout (`MEGATRON_SC21`, `LLAMA3`), each field set from the
    framework's code or paper (the sources are beside each instance).

    Attributes:
        name: the framework, as the docs name it.
        async_sends: pipeline stage sends run on their own stream beside the next chunk's compute, so only the
            pipeline's fill and drain wait for them (`async_send_exposure`); otherwise every send is waited for.
        split_sends: each tensor-parallel rank sends 1/t of the boundary activation across hosts (Megatron's
            scatter/gather, or a sequence-parallel residual stream); otherwise each sends all of it.
        head_in_a_layer_slot: the output head and loss take one layer's place on the last stage (the embedding one
            on the first), so the stages that set the pace run layers only; otherwise a stage runs its layers and the
            head (shardkit's SPMD region runs it on every stage; Megatron's last stage runs it on top of its layers).
        region_collectives: shardkit's own pipeline-edge collectives exist: the embedded batch's gradient summed
            over `pipeline` and the chunked schedules' re-layout of the layer stack (`estimate.pipeline_items`).
        attention_as_gemms: attention runs as batched GEMMs around a fused softmax and dropout
            (`kernels.gemm_attention_seconds`) instead of the layout's own kernel choice.
        tick_stages: the 1F1B family runs as shardkit's tick executor (shardkit/pipeline/one_f_one_b.py): a backward
            tick re-runs its chunk's forward, the loss runs on the last stage, so each stage moves its own actions'
            bytes (`shardkit.analysis.predicted.tick_bytes`) and the busiest stage's are the step's; otherwise every
            stage moves the per-device figure of `estimate.communication_estimate`.
    """

    name: str
    async_sends: bool = False
    split_sends: bool = False
    head_in_a_layer_slot: bool = False
    region_collectives: bool = True
    attention_as_gemms: bool = False
    tick_stages: bool = False


SHARDKIT = Framework("shardkit", tick_stages=True)


# Megatron-LM as run for Narayanan et al. 2021 (SC21, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM"): the interleaved schedule with the scatter/gather optimization (their section 4.1: each tensor
# rank sends 1/t of the activation, then an NVLink all-gather). Its sends block: megatron/p2p_communication.py's
# `_communicate` waits on every `batch_isend_irecv` request, then `torch.cuda.synchronize()` "to protect against race
# condition when using batch_isend_irecv()". Each virtual stage is built in place (`get_model`, one model chunk per
# virtual rank): no re-layout; the head runs on the last stage after its layers, with no layer taken off. Attention
# (megatron/model/transformer.py, ParallelAttention): `torch.baddbmm` for the scores, `scale_mask_softmax` (fused),
# `attention_dropout`, `torch.bmm` with V; no flash kernel then.
MEGATRON_SC21 = Framework("Megatron-LM (SC21)", split_sends=True, region_collectives=False, attention_as_gemms=True)


# Meta's Llama 3 405B training (The Llama 3 Herd of Models, arXiv 2407.21783v3, section 3.3.2): "we adopt
# asynchronous point-to-point communication in PP"; tensor parallelism with sequence parallelism (Korthikanti et
# al. cited), so a boundary activation is cut over the tensor ranks; "we reduce one Transformer layer each from the
# first and the last stages ... the first model chunk on the first stage has only the embedding, and the last model
# chunk on the last stage has only output projection and loss calculation".
LLAMA3 = Framework("Meta Llama 3", async_sends=True, split_sends=True, head_in_a_layer_slot=True,
                   region_collectives=False)


STAGE_SENDS = "stage boundaries (forward + backward)"  # `estimate.pipeline_items`' name for the sends


# shardkit's region-edge collectives, as `estimate.pipeline_items` names them: the tick executor's sum of the
# embedded batch's gradient, GPipe/circular's hand-out of the outputs, and the chunked schedules' re-layout.
REGION_COLLECTIVES = ("embedded batch's gradient", "outputs to every stage, input gradient back",
                      "layers into chunk order, gradients back")


def framework_comm(items: Sequence[CommItem], layout, framework: Framework) -> list[CommItem]:
    """The collectives of `items` that `framework` runs: shardkit's region-edge ones dropped where the framework has
    none, stage sends cut over the tensor ranks where it splits them."""
    if not layout.pipeline.enabled:
        return list(items)
    out = []
    for item in items:
        if item.what in REGION_COLLECTIVES and not framework.region_collectives:
            continue
        if item.what == STAGE_SENDS and framework.split_sends:
            item = dataclasses.replace(item, bytes=item.bytes / layout.mesh.shape["tensor"])
        out.append(item)
    return out


def sends_per_device(layout) -> float:
    """Stage sends one device makes per step: each micro-batch crosses v*p - 1 boundaries forward and as many
    backward (`shardkit.pipeline.collective_permute_bytes`), shared by the p devices of the pipeline."""
    config = layout.pipeline
    transfers = 2 * config.microbatches * (config.repeats * config.stages - 1)
    return transfers * layout.recipe.train.grad_accum / config.stages


def async_send_exposure(layout, sends: CommTime, compute: float) -> float:
    """What asynchronous stage sends leave exposed: in the steady state a send runs beside the next chunk's compute,
    so only the fill and the drain wait for theirs (a micro-batch's activation crosses p - 1 hosts on its way to the
    last stage before it has work, and its gradient p - 1 on the way back: 2(p - 1) sends on the critical path);
    plus whatever the sends need beyond the step's compute (one link per device, on its own stream)."""
    one_send = sends.seconds / sends_per_device(layout)
    critical = 2 * (layout.pipeline.stages - 1) * one_send
    return min(sends.seconds, critical + max(0.0, sends.seconds - compute))
