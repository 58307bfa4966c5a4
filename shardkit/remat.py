"""Activation recomputation policies, applied to each layer of a stacked model.

    none       keep every activation of the layer for the backward pass.
    full       keep only the layer's input; recompute the rest in the backward pass.
    selective  keep the matmul outputs the models name (`checkpoint_name`), recompute elementwise work and softmax:
               the cheap-to-recompute, expensive-to-store part (Korthikanti et al. 2022). Under cuDNN's fused
               attention the kernel's softmax statistics are not kept, so the backward reruns the attention forward.
    minimal_with_context
               MaxText's policy of that name, fitted to the fused kernel: keep the q/k/v projections, the attention
               output with the kernel's fp32 log-sum-exp, the output projection and the MLP's input matmuls, so the
               backward reruns no attention kernel and no large matmul, only norms, rotary and activations.
    offload    like selective, but the kept tensors go to pinned host memory (needs a GPU or TPU backend).

Why two ways to match. A value is kept either by name (the models wrap matmul outputs in `checkpoint_name`) or by
the primitive that makes it. cuDNN's fused attention is one opaque custom call whose residuals (its output and its
softmax log-sum-exp) are made inside `jax.nn.dot_product_attention`: no `checkpoint_name` reaches them, and naming
the output after the call would keep the output alone, so the backward would rerun the kernel for its statistics.
`minimal_with_context` therefore also keeps the outputs of JAX's cuDNN forward primitive (`CUDNN_FORWARD`). On XLA's
attention (CPU, fp32) the same policy keeps the named attention output; the softmax is recomputed there in any case.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from shardkit.attention.blocks import REGION_NAMES
from shardkit.errors import ShardkitError
from shardkit.recipe import REMAT_POLICIES

# The names the reference models give their matmul outputs.
SAVED_NAMES = ("query_proj", "key_proj", "value_proj", "attention_out", "mlp_gate", "mlp_up")
# minimal_with_context: MaxText's `minimal` set (projections in and out of attention, the MLP's input matmuls) plus
# the attention output ("context" in MaxText).
MINIMAL_WITH_CONTEXT_NAMES = SAVED_NAMES + ("out_proj",)
# JAX's primitives for the forward of cuDNN's fused attention (jax._src.cudnn.fused_attention_stablehlo): outputs
# (attention output, fp32 softmax statistics) when differentiated.
CUDNN_FORWARD = ("dot_product_attention_fwd", "dot_product_attention_fwd_wrapper")


def minimal_with_context_policy(fused_attention: bool, pipelined: bool = False) -> Callable:
    """The `jax.checkpoint` policy of `minimal_with_context`.

    With `fused_attention` (the step runs cuDNN's kernel) the kernel's forward outputs are kept by primitive and the
    named `attention_out`, the same values reshaped, is not kept again: it would be a second copy of the output.
    `pipelined`: the kernel runs in a nested region (a pipeline stage's, or packed documents' on any layout:
    shardkit.attention.blocks.REGION_NAMES), whose outputs are kept by name instead.
    """
    names = [name for name in MINIMAL_WITH_CONTEXT_NAMES if not (fused_attention and name == "attention_out")]
    by_name = jax.checkpoint_policies.save_only_these_names(*names, *REGION_NAMES)
    primitives = () if pipelined else CUDNN_FORWARD

    def policy(prim, *avals, **params) -> bool:
        return prim.name in primitives or by_name(prim, *avals, **params)

    return policy


def check_remat(policy: str, platform: str) -> None:
    """Raise a ShardkitError naming `train.remat` when `policy` is unknown or cannot run on `platform`."""
    if policy not in REMAT_POLICIES:
        raise ShardkitError("train.remat", f"unknown policy {policy!r}; use none, full, selective, "
                            "minimal_with_context or offload")
    if policy == "offload" and platform == "cpu":
        raise ShardkitError("train.remat", "'offload' needs a GPU or TPU backend with pinned host memory; "
                            "this run is on the CPU: use 'selective' or 'full'")


def remat_wrapper(policy: str, platform: str, fused_attention: bool = False,
                  pipelined: bool = False) -> Callable[[Callable], Callable] | None:
    """A function that wraps one layer's function in the policy, or None for `none`.

    `fused_attention`: whether attention runs on cuDNN's fused kernel (it changes what `minimal_with_context` keeps);
    `pipelined`: whether the layers run in a pipeline's stages (`minimal_with_context_policy`).
    """
    check_remat(policy, platform)
    if policy == "none":
        return None
    if policy == "full":
        checkpoint_policy = jax.checkpoint_policies.nothing_saveable
    elif policy == "selective":
        checkpoint_policy = jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES)
    elif policy == "minimal_with_context":
        checkpoint_policy = minimal_with_context_policy(fused_attention, pipelined)
    else:  # offload
        checkpoint_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device", offload_dst="pinned_host",
        )
    return lambda fn: jax.checkpoint(fn, policy=checkpoint_policy, prevent_cse=False)
