"""Attention as a forward pass runs it: plain, fused (cuDNN) or context-parallel, as the resolved layout set it up.

`AttentionSetup` is the attention part of a resolved layout (`shardkit.layout.Layout.attention`): the kernel chosen
once (`shardkit.attention.kernel.choose_kernel`) and the context-parallel mode when the sequence is cut over a mesh
axis. `attend` is what `shardkit.nn.attention` calls, with the mesh and activation rules in force where it runs (a
pipeline stage or a micro-batch replica narrows them).

Dimension letters: B batch, S queries, T keys, K kv heads, G query heads per kv head, E head_dim.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from shardkit.attention.blocks import region_fused_attention
from shardkit.attention.context import context_parallel_attention
from shardkit.attention.kernel import KernelChoice, Platform, choose_kernel
from shardkit.attention.packed import packed_region_attention
from shardkit.attention.reference import attention_mask, reference_attention
from shardkit.rules import Table, resolve_spec

KEYS_LOGICAL = ("batch", "sequence", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class AttentionSetup:
    """How attention runs in one layout. The default (no mesh) is XLA's kernel on whole arrays: plain Flax.

    `choice` was made with the config's head_dim when the config has one; `head_dim_known` False means the queries'
    head size decides at trace time, under the same `mode` and `platform`.
    """

    choice: KernelChoice = dataclasses.field(
        default_factory=lambda: KernelChoice("xla", "no layout: plain XLA attention"))
    mode: str = "xla"
    platform: Platform = dataclasses.field(default_factory=Platform)
    head_dim_known: bool = True
    ring_axis: str | None = None  # the mesh axis the sequence is cut over (None: no context parallelism)
    context_parallel: str = "allgather"  # ring | allgather (train.context)
    packed: bool = False  # rows are packed documents (data.packing): attention takes segment ids
    balanced: bool = False  # the sequence arrives in the load-balanced order (shardkit.attention.context)
    # Attention runs inside a branch of the 1F1B tick switch, which only some pipeline stages take
    # (shardkit/pipeline/one_f_one_b.py): the ring's hops then avoid collective-permutes on CPU (`Plan.tick_branch`).
    tick_branch: bool = False

    @property
    def ring(self) -> bool:
        """Whether attention runs as ring context parallelism (which keeps packed rows on the XLA block kernel)."""
        return self.ring_axis is not None and self.context_parallel == "ring"

    def kernel_for(self, q_BSKGE: jax.Array, causal: bool = True, packed: bool = False) -> str:
        """`cudnn` or `xla` for these queries (with segment ids when `packed`)."""
        if self.head_dim_known and (self.packed or not packed):
            return self.choice.kernel
        return choose_kernel(self.mode, self.platform, q_BSKGE.dtype, q_BSKGE.shape[-1], causal, packed,
                             ring=self.ring).kernel



def keys_spec(k_BTKE: jax.Array, mesh: Mesh | None, activation_rules: Table | None):
    """The keys' PartitionSpec under the activation rules (None without a mesh and rules)."""
    if activation_rules is None or mesh is None:
        return None
    return resolve_spec("attention keys", k_BTKE.shape, KEYS_LOGICAL, activation_rules, dict(mesh.shape), "activations")


def attend(q_BSKGE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, causal: bool, setup: AttentionSetup,
           mesh: Mesh | None = None, activation_rules: Table | None = None,
           segments_BS: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention, softmax in fp32: context-parallel when the layout cuts the sequence, else one fused
    or XLA kernel over whole sequences (inside a pipeline stage, cuDNN's kernel runs in a nested manual region:
    `shardkit.attention.blocks.region_fused_attention` says why).

    `segments_BS` (packed documents, shardkit/data/packing.py): each position's segment id, queries and keys alike;
    no query attends to another segment's keys. On cuDNN they run its packed layout, in a region manual over every
    mesh axis (`shardkit.attention.packed`), pipeline stage or not.
    """
    kernel = setup.kernel_for(q_BSKGE, causal, packed=segments_BS is not None)
    if setup.ring_axis is not None and mesh is not None and mesh.shape[setup.ring_axis] > 1:
        return context_parallel_attention(q_BSKGE, k_BTKE, v_BTKE, mesh, setup.ring_axis, setup.context_parallel,
                                          kernel, causal, keys_spec(k_BTKE, mesh, activation_rules), segments_BS,
                                          setup.balanced, setup.tick_branch)
    if kernel == "cudnn" and segments_BS is not None:
        return packed_region_attention(q_BSKGE, k_BTKE, v_BTKE, segments_BS, causal,
                                       keys_spec(k_BTKE, mesh, activation_rules), mesh)
    if kernel == "cudnn" and getattr(mesh, "manual_axes", ()):
        return region_fused_attention(q_BSKGE, k_BTKE, v_BTKE, causal, keys_spec(k_BTKE, mesh, activation_rules))
    if kernel == "xla" and q_BSKGE.dtype == jnp.float16:
        # XLA's path of jax.nn.dot_product_attention asks for fp16 x fp16 -> fp32 dots, which XLA:CPU cannot compile
        # ("precision F16_F16_F32 is not supported"); the reference (softmax in fp32) serves fp16 instead.
        return reference_attention(q_BSKGE, k_BTKE, v_BTKE, causal, segments_BS)
    batch, seq, kv_heads, groups, head_dim = q_BSKGE.shape
    # Query head h = k * G + g belongs to kv head k, the grouping jax.nn.dot_product_attention uses for GQA.
    q_BSHE = q_BSKGE.reshape(batch, seq, kv_heads * groups, head_dim)
    # The causal part stays `is_causal` (XLA builds it from iota); segments add a (B, 1, S, T) mask.
    mask_B1ST = None if segments_BS is None else attention_mask(seq, k_BTKE.shape[1], False, segments_BS)
    out_BSHE = jax.nn.dot_product_attention(q_BSHE, k_BTKE, v_BTKE, mask=mask_B1ST, is_causal=causal,
                                            implementation=kernel)
    return out_BSHE.reshape(q_BSKGE.shape)
