"""The last stage's head split over `fsdp` by vocabulary, and its cross entropy (the 1F1B family, FSDP gathered once
per step inside the region).

Why: gathering the head over `fsdp` once per step puts the whole head (D x V), its gradient as the matmul's output
and the gradient's sum through the ticks on every device of the last stage, at the step's peak (the loss's backward
tick: docs/guide/parallelism.md, "FSDP inside a pipeline"). Split by vocabulary instead, each `fsdp` rank holds D x V/f
of the head, and the micro-batch's rows, which are split over `fsdp`, are gathered instead: the logits keep their size
(f times the
rows, a f-th of the vocabulary), the head and its gradient shrink f times. Megatron's vocab-parallel cross entropy,
over `fsdp` instead of `tensor`.

- Into the region, the head's FSDP shard (D/f x V, split along its FSDP dimension) becomes its vocabulary shard
  (D x V/f) by one all-to-all; the summed gradient goes back by the reverse all-to-all. Each rank's vocabulary shard
  of the gradient already sums every row of the stage's micro-batches, so no reduction over `fsdp` is needed.
- The loss (`cross_entropy_sum`): the rows and targets all-gathered over `fsdp`, the logits of this rank's
  vocabulary, the log-sum-exp from a max and a sum over `fsdp`, the target's logit from the rank that holds it, and
  each rank's loss is that of its own rows. The backward (a custom VJP) recomputes the logits; the hidden state's
  gradient, a partial sum over the vocabulary shards, is reduce-scattered back onto the rows' owners.

Exactness: the same fp32 log-sum-exp and target logit as `shardkit.loss`, summed over the shards in another order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shardkit.axes import FSDP
from shardkit.loss import logits_f32, one_hot_mask, target_logits, vocab_is_whole
from shardkit.pipeline.config import PipelineRegion, fsdp_dim
from shardkit.pipeline.sends import on_shards, reduce_scatter_stage
from shardkit.rules import logical_degree


def vocab_dim(logical) -> int:
    """The dimension of a head parameter (by its logical axis names) that holds the vocabulary; -1 for none."""
    return list(logical or ()).index("vocab") if "vocab" in (logical or ()) else -1


def vocab_blocks(layout, region: PipelineRegion) -> int:
    """How many blocks the region's automatic axes split the head's vocabulary into (`tensor`; 1: none)."""
    return logical_degree(region.rules.params, "vocab", dict(layout.mesh.shape))


def splits(layout, region: PipelineRegion, logical) -> bool:
    """Whether the 1F1B region splits a head parameter (by its logical names) over `fsdp` by vocabulary: only where
    the region gathers per step, the model has the lean loss's split (final hidden state and head weight), and the
    parameter has an FSDP dimension besides its vocabulary, which `fsdp` x the vocabulary's other shards divide."""
    if not (region.gathers_per_step and layout.capabilities.lean_loss):
        return False
    vocab, fsdp = vocab_dim(logical), fsdp_dim(logical, layout.rules)
    ranks = layout.mesh.shape[FSDP] * vocab_blocks(layout, region)
    return vocab >= 0 and fsdp >= 0 and fsdp != vocab and layout.vocab % ranks == 0


def split_dims(layout, region: PipelineRegion, head_keys) -> dict:
    """Per head parameter (the keys the last stage's loss reads), the vocabulary dimension the region splits it
    along over `fsdp` (`splits`), -1 where it gathers it."""
    dim = lambda names: vocab_dim(names) if splits(layout, region, names) else -1
    return {key: jax.tree.map(dim, layout.logical[key], is_leaf=lambda x: isinstance(x, tuple)) for key in head_keys}


def split_by_vocab(w: jax.Array, fsdp_dim: int, vocab: int, kept: PartitionSpec | None = None) -> jax.Array:
    """A head parameter's FSDP shard (split along `fsdp_dim`) as its vocabulary shard (whole along `fsdp_dim`, split
    along `vocab`): one all-to-all over `fsdp`, on the shards of the region's automatic axes `kept` names (as
    `shardkit.pipeline.sends.gather_stage`, so a vocabulary split over `tensor` stays split). With the vocabulary in
    T blocks over those axes, fsdp rank f then holds the f-th part of each block (`cross_entropy_sum`'s
    `vocab_blocks`)."""
    return on_shards(lambda shard: jax.lax.all_to_all(shard, FSDP, split_axis=vocab, concat_axis=fsdp_dim,
                                                      tiled=True), w, kept)


def unsplit_by_vocab(g: jax.Array, fsdp_dim: int, vocab: int, kept: PartitionSpec | None = None) -> jax.Array:
    """`split_by_vocab`'s reverse, for the gradient: the vocabulary shard back onto the FSDP shard."""
    return on_shards(lambda shard: jax.lax.all_to_all(shard, FSDP, split_axis=fsdp_dim, concat_axis=vocab,
                                                      tiled=True), g, kept)


def cross_entropy_sum(hidden_bSD: jax.Array, head_DVf: jax.Array, targets_bS: jax.Array,
                      output_dtype=jnp.float32, vocab_blocks: int = 1) -> jax.Array:
    """This rank's rows' summed next-token cross entropy (fp32), with the head split over `fsdp` by vocabulary.

    Args:
        hidden_bSD: this rank's rows of the final hidden state, in the compute dtype.
        head_DVf: this rank's vocabulary shard of the head (`split_by_vocab`), in the compute dtype.
        targets_bS: this rank's rows' token ids.
        output_dtype: the precision policy's output dtype (as `shardkit.loss.cross_entropy_sum`).
        vocab_blocks: T, how many blocks the vocabulary is split into over the region's automatic axes (`tensor`):
            this rank's shard is the f-th part of each of the T blocks, in block order (`split_by_vocab`).
    """
    return _split_cross_entropy(jnp.dtype(output_dtype), vocab_blocks, hidden_bSD, head_DVf, targets_bS)


def _gather_rows(x_b_: jax.Array) -> jax.Array:
    """Every `fsdp` rank's rows, in rank order: (b, ...) -> (f*b, ...)."""
    return jax.lax.all_gather(x_b_, FSDP, axis=0, tiled=True)


def fsdp_rank() -> jax.Array:
    """This device's index over `fsdp` (int32), without `jax.lax.axis_index`.

    Why: in a region manual over some mesh axes only (the pipeline's), `axis_index` lowers to XLA's PartitionId, which
    XLA:GPU's SPMD partitioner rejects ("PartitionId instruction is not supported for SPMD partitioning"; jax 0.10.2,
    compiling the loss region for h100x8). An all-to-all of the ranks' iota hands rank r element r of every rank's
    copy, so its first element is r: a few bytes over `fsdp`, with no PartitionId.
    """
    ranks = jax.lax.axis_size(FSDP)
    iota_F = jax.lax.pcast(jnp.arange(ranks, dtype=jnp.int32), (FSDP,), to="varying")
    return jax.lax.all_to_all(iota_F, FSDP, 0, 0, tiled=True)[0]


def _local_targets(targets_RS: jax.Array, vocab_shard: int, vocab_blocks: int) -> tuple[jax.Array, jax.Array]:
    """Token ids as indices into this rank's vocabulary shard, and whether this rank holds them.

    The shard is the f-th part (P ids) of each of the T blocks of the vocabulary (f P-id parts a block): id
    `block * f * P + part * P + offset` is held by rank `part`, at `block * P + offset`."""
    part_size = vocab_shard // vocab_blocks
    block_size = part_size * jax.lax.axis_size(FSDP)
    block, in_block = targets_RS // block_size, targets_RS % block_size
    held_RS = in_block // part_size == fsdp_rank()
    return block * part_size + in_block % part_size, held_RS


def _local_target_logits(logits_RSV: jax.Array, targets_RS: jax.Array, vocab_blocks: int) -> jax.Array:
    """Each row's target logit where this rank's vocabulary shard holds the target, 0 elsewhere (as
    `shardkit.loss.target_logits`: a gather where the shard is whole on the device)."""
    local_RS, held_RS = _local_targets(targets_RS, logits_RSV.shape[-1], vocab_blocks)
    return jnp.where(held_RS, target_logits(logits_RSV, local_RS, vocab_is_whole()), 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _split_cross_entropy(output_dtype, vocab_blocks, hidden_bSD, head_DVf, targets_bS):
    return _forward(output_dtype, vocab_blocks, hidden_bSD, head_DVf, targets_bS)[0]


def _forward(output_dtype, vocab_blocks, hidden_bSD, head_DVf, targets_bS):
    """The loss of this rank's rows, and the residuals: every rank's rows and targets, and their log-sum-exp."""
    hidden_RSD, targets_RS = _gather_rows(hidden_bSD), _gather_rows(targets_bS)
    logits_RSV = logits_f32(hidden_RSD, head_DVf, output_dtype)
    # The max only keeps exp() in range; any value common to the shards gives the same log-sum-exp.
    max_RS = jax.lax.pmax(logits_RSV.max(axis=-1), FSDP)
    lse_RS = jnp.log(jax.lax.psum(jnp.exp(logits_RSV - max_RS[..., None]).sum(axis=-1), FSDP)) + max_RS
    target_RS = jax.lax.psum(_local_target_logits(logits_RSV, targets_RS, vocab_blocks), FSDP)
    rows = hidden_bSD.shape[0]
    own_bS = jax.lax.dynamic_slice_in_dim(lse_RS - target_RS, fsdp_rank() * rows, rows, axis=0)
    return own_bS.sum(), (hidden_RSD, head_DVf, targets_RS, lse_RS)


def _backward(output_dtype, vocab_blocks, residuals, d_loss):
    """d_logits = d_loss of the row's owner x (softmax - one_hot) on this rank's vocabulary; the head's gradient is
    whole for that shard, the hidden state's is summed over the shards onto the rows' owners."""
    hidden_RSD, head_DVf, targets_RS, lse_RS = residuals
    ranks = jax.lax.axis_size(FSDP)
    d_loss_R = jax.lax.all_gather(d_loss, FSDP)  # each row's cotangent is its owner's
    d_loss_RS = jnp.repeat(d_loss_R, hidden_RSD.shape[0] // ranks)[:, None]
    logits_RSV = logits_f32(hidden_RSD, head_DVf, output_dtype)
    probs_RSV = jnp.exp(logits_RSV - lse_RS[..., None])
    local_RS, held_RS = _local_targets(targets_RS, head_DVf.shape[-1], vocab_blocks)
    mask_RSV = one_hot_mask(local_RS, logits_RSV.shape[-1]) & held_RS[..., None]
    d_logits_RSV = d_loss_RS[..., None] * (probs_RSV - mask_RSV)
    # The transposes of the forward's casts (compute -> output -> fp32).
    d_logits_RSV = d_logits_RSV.astype(output_dtype).astype(hidden_RSD.dtype)
    d_hidden_RSD = jnp.einsum("rsv,dv->rsd", d_logits_RSV, head_DVf)
    d_head_DVf = jnp.einsum("rsd,rsv->dv", hidden_RSD, d_logits_RSV, preferred_element_type=jnp.float32)
    return reduce_scatter_stage(d_hidden_RSD, 0), d_head_DVf.astype(head_DVf.dtype), None


_split_cross_entropy.defvjp(_forward, _backward)
