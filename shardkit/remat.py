"""Activation recomputation policies, applied to each layer of a stacked model.

    none       keep every activation of the layer for the backward pass.
    full       keep only the layer's input; recompute the rest in the backward pass.
    selective  keep the matmul outputs the models name (`checkpoint_name`), recompute elementwise work and softmax:
               the cheap-to-recompute, expensive-to-store part (Korthikanti et al. 2022).
    offload    like selective, but the kept tensors go to pinned host memory (needs a GPU or TPU backend).
"""

from __future__ import annotations

from typing import Callable

import jax

from shardkit.errors import ShardkitError

# The names the reference models give their matmul outputs.
SAVED_NAMES = ("query_proj", "key_proj", "value_proj", "attention_out", "mlp_gate", "mlp_up")


def remat_wrapper(policy: str, platform: str) -> Callable[[Callable], Callable] | None:
    """A function that wraps one layer's function in the policy, or None for `none`."""
    if policy == "none":
        return None
    if policy == "full":
        checkpoint_policy = jax.checkpoint_policies.nothing_saveable
    elif policy == "selective":
        checkpoint_policy = jax.checkpoint_policies.save_only_these_names(*SAVED_NAMES)
    elif policy == "offload":
        if platform == "cpu":
            raise ShardkitError("train.remat", "'offload' needs a GPU or TPU backend with pinned host memory; "
                                "this run is on the CPU: use 'selective' or 'full'")
        checkpoint_policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(SAVED_NAMES),
            offload_src="device", offload_dst="pinned_host",
        )
    else:
        raise ShardkitError("train.remat", f"unknown policy {policy!r}; use none, full, selective or offload")
    return lambda fn: jax.checkpoint(fn, policy=checkpoint_policy, prevent_cse=False)
