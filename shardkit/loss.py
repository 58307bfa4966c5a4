"""Next-token cross entropy without the full (tokens x vocab) fp32 logits: the lean loss.

The plain loss materialises logits_BSV in the compute dtype, then an fp32 copy for the softmax, and autodiff keeps
both for the backward: at seq 4096 x batch 4 x a 128k vocab the fp32 copy alone is 4096 x 4 x 128k x 4 bytes. Here the
logits exist one chunk of token rows at a time (the head matmul included), as `(rows x full vocab)` tiles in the compute
dtype with an
fp32 log-sum-exp. A custom VJP saves only the per-token log-sum-exp (fp32, one number a token) and recomputes each
chunk's logits in the backward, where softmax - one_hot gives the logits' gradient.

Exactness. In the forward each chunk's logits are the same matmul the plain head does, cast through the policy's output
dtype to fp32 exactly as `StepBuilder`'s plain loss casts them; the backward's casts are the transposes of those casts.
So the result equals optax's softmax cross entropy of the full fp32 logits up to summation order (tests/test_loss.py).

Chunks. Chunk c holds sequence positions c, c + C, c + 2C, ... of every row (C chunks): the sequence splits as
(S / C, C) with the chunk index minor, so however the layout shards batch and sequence, each device's part of a chunk
stays on it and the loop over chunks moves no data. Inside a chunk the logits are constrained like the model's
(`batch`, `sequence`, `vocab`), so under tensor parallelism the vocabulary stays sharded.

Letters: B batch, S sequence, L positions per chunk (S / C), C chunks, D embed, V vocab.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from shardkit.nn import constrain, current_context, token_rows
from shardkit.rules import logical_degree

DEFAULT_CHUNK_ROWS = 4096  # token rows per device per chunk: a 4096 x 128k bf16 tile is 2**30 bytes
def logits_cross_entropy_sum(logits_BSV: jax.Array, targets_BS: jax.Array) -> jax.Array:
    """Summed next-token cross entropy of whole logits: optax's formula (logsumexp minus the target's logit), in the
    logits' dtype (pass fp32), with the target's logit picked by a one-hot mask instead of a gather.

    Why the mask: inside a pipeline stage's branch with the vocabulary sharded over `tensor`, XLA's SPMD partitioner
    aborts on the gather and its scatter transpose (a CHECK in spmd_partitioner_util.cc); a masked sum of one term
    is exact. The models without the lean split (shardkit.registry.ModelCapabilities) take this loss.
    """
    vocab_ids_V = jnp.arange(logits_BSV.shape[-1], dtype=targets_BS.dtype).reshape((1,) * targets_BS.ndim + (-1,))
    target_logits_BS = jnp.where(targets_BS[..., None] == vocab_ids_V, logits_BSV, 0.0).sum(axis=-1)
    return (jax.nn.logsumexp(logits_BSV, axis=-1) - target_logits_BS).sum()


def cross_entropy_sum(hidden_BSD: jax.Array, head_DV: jax.Array, targets_BS: jax.Array,
                      output_dtype=jnp.float32, chunk_rows: int | None = None) -> jax.Array:
    """Summed next-token cross entropy (fp32) of the logits `hidden_BSD @ head_DV`, never all of them at once.

    Args:
        hidden_BSD: the final hidden state, in the compute dtype.
        head_DV: the output head, in the compute dtype.
        targets_BS: integer token ids.
        output_dtype: the precision policy's output dtype; the logits pass through it before fp32, as the plain loss's.
        chunk_rows: about how many token rows one device turns into logits at a time (None: DEFAULT_CHUNK_ROWS).
    """
    batch, seq = targets_BS.shape
    chunks = chunk_count(batch, seq, chunk_rows or DEFAULT_CHUNK_ROWS, *_row_shards())
    # The head in its compute layout (gathered over fsdp, vocab still over tensor) before the custom VJP: that copy is
    # what the backward reads, so it is gathered once. It lives only from the loss's forward to its backward, which
    # follow each other.
    head_DV = constrain(head_DV, ("embed", "vocab"))
    return _chunked_cross_entropy(chunks, jnp.dtype(output_dtype), vocab_is_whole(), hidden_BSD, head_DV, targets_BS)


def chunk_count(batch: int, seq: int, chunk_rows: int, batch_shards: int = 1, seq_shards: int = 1) -> int:
    """The fewest chunks C (a divisor of `seq`) with at most `chunk_rows` rows per device, each chunk's S / C
    positions still divisible by the sequence's shards; the most such chunks when none is small enough."""
    rows_per_device = math.ceil(batch / batch_shards) * math.ceil(seq / seq_shards)
    valid = [c for c in _divisors(seq) if (seq // c) % seq_shards == 0] or [1]
    return next((c for c in valid if math.ceil(rows_per_device / c) <= chunk_rows), valid[-1])


@functools.lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of `n`, ascending, found up to its square root and kept (`suggest` asks for the same long
    sequences many times)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def _row_shards() -> tuple[int, int]:
    """How many ways the context's layout splits `batch` and `sequence` (1, 1 outside a layout)."""
    context = current_context()
    if context.mesh is None or context.activation_rules is None:
        return 1, 1
    sizes = dict(context.mesh.shape)
    return (logical_degree(context.activation_rules, "batch", sizes),
            logical_degree(context.activation_rules, "sequence", sizes))


def chunk_positions(x_BS_, index, chunks: int) -> jax.Array:
    """Positions index, index + C, ... of every row: (B, S, ...) -> (B, S / C, ...)."""
    batch, seq = x_BS_.shape[:2]
    x_BLC_ = x_BS_.reshape(batch, seq // chunks, chunks, *x_BS_.shape[2:])
    return jax.lax.dynamic_index_in_dim(x_BLC_, index, axis=2, keepdims=False)


def logits_f32(hidden_BLD, head_DV, output_dtype) -> jax.Array:
    """One chunk's logits: the head matmul in the compute dtype, laid out like the model's, then fp32."""
    logits_BLV = constrain(jnp.einsum("bld,dv->blv", hidden_BLD, head_DV), ("batch", "sequence", "vocab"))
    return logits_BLV.astype(output_dtype).astype(jnp.float32)


def target_logits(logits_BLV, targets_BL, vocab_whole: bool) -> jax.Array:
    """Each row's logit of its target. With the vocabulary whole on each device a gather, which reads one logit a
    row; a one-hot masked sum otherwise (see `one_hot_mask`), which XLA:CPU materialises before the sum (fp32 logits'
    size at the pipeline's peak). Both are exact."""
    if vocab_whole:
        return jnp.take_along_axis(logits_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return jnp.where(one_hot_mask(targets_BL, logits_BLV.shape[-1]), logits_BLV, 0.0).sum(-1)


def vocab_is_whole() -> bool:
    """Whether the context's layout keeps the vocabulary whole on each device (also outside a layout)."""
    context = current_context()
    if context.mesh is None or context.activation_rules is None:
        return True
    return logical_degree(context.activation_rules, "vocab", dict(context.mesh.shape)) == 1


def one_hot_mask(targets_BL, vocab: int) -> jax.Array:
    # A mask rather than a gather: the gather's SPMD partitioning fails with the vocabulary sharded inside a pipeline
    # stage (see logits_cross_entropy_sum).
    return targets_BL[..., None] == jnp.arange(vocab, dtype=targets_BL.dtype).reshape(1, 1, vocab)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _chunked_cross_entropy(chunks, output_dtype, vocab_whole, hidden_BSD, head_DV, targets_BS):
    return _forward(chunks, output_dtype, vocab_whole, hidden_BSD, head_DV, targets_BS)[0]


def _forward(chunks, output_dtype, vocab_whole, hidden_BSD, head_DV, targets_BS):
    """The loss sum and the saved residuals: the inputs and each token's fp32 log-sum-exp (chunk-major, C x B x L)."""

    def one_chunk(_, index):
        logits_BLV = logits_f32(chunk_positions(hidden_BSD, index, chunks), head_DV, output_dtype)
        targets_BL = chunk_positions(targets_BS, index, chunks)
        lse_BL = jax.nn.logsumexp(logits_BLV, axis=-1)
        return None, ((lse_BL - target_logits(logits_BLV, targets_BL, vocab_whole)).sum(), lse_BL)

    if chunks == 1:  # no loop: the step's program stays as it was for small batches
        _, (loss, lse_BL) = one_chunk(None, 0)
        return loss, (hidden_BSD, head_DV, targets_BS, lse_BL[None])
    _, (loss_C, lse_CBL) = jax.lax.scan(one_chunk, None, jnp.arange(chunks))
    return loss_C.sum(), (hidden_BSD, head_DV, targets_BS, lse_CBL)


def _backward(chunks, output_dtype, vocab_whole, residuals, d_loss):
    """Per chunk: recompute the logits, d_logits = d_loss * (softmax - one_hot), then the head matmul's transposes.

    The head's gradient accumulates in fp32 over the chunks (the first chunk's starts the sum, so the carry has the
    types of real values, inside a shard_map region too); the hidden state's comes out chunk by chunk.
    """
    hidden_BSD, head_DV, targets_BS, lse_CBL = residuals

    def one_chunk(index):
        hidden_BLD = chunk_positions(hidden_BSD, index, chunks)
        logits_BLV = logits_f32(hidden_BLD, head_DV, output_dtype)
        probs_BLV = jnp.exp(logits_BLV - lse_CBL[index][:, :, None])
        targets_BL = chunk_positions(targets_BS, index, chunks)
        d_logits_BLV = d_loss * (probs_BLV - one_hot_mask(targets_BL, probs_BLV.shape[-1]))
        # The transposes of the forward's casts (compute -> output -> fp32), then of the layout constraint.
        d_logits_BLV = d_logits_BLV.astype(output_dtype).astype(hidden_BLD.dtype)
        d_logits_BLV = constrain(d_logits_BLV, ("batch", "sequence", "vocab"))
        d_hidden_BLD = jnp.einsum("blv,dv->bld", d_logits_BLV, head_DV)
        d_head_DV = _head_gradient(hidden_BLD, d_logits_BLV)
        return d_hidden_BLD, d_head_DV

    d_hidden_BLD, d_head_DV = one_chunk(0)
    if chunks == 1:
        return d_hidden_BLD.astype(hidden_BSD.dtype), d_head_DV.astype(head_DV.dtype), None

    def step(d_head_DV, index):
        d_hidden_BLD, d_head_chunk_DV = one_chunk(index)
        return d_head_DV + d_head_chunk_DV, d_hidden_BLD

    d_head_DV, d_hidden_rest_CBLD = jax.lax.scan(step, d_head_DV, jnp.arange(1, chunks))
    d_hidden_CBLD = jnp.concatenate([d_hidden_BLD[None], d_hidden_rest_CBLD], axis=0)
    batch, seq, embed = hidden_BSD.shape
    d_hidden_BSD = jnp.moveaxis(d_hidden_CBLD, 0, 2).reshape(batch, seq, embed)
    return d_hidden_BSD.astype(hidden_BSD.dtype), d_head_DV.astype(head_DV.dtype), None


def _head_gradient(hidden_BLD, d_logits_BLV) -> jax.Array:
    """The head's gradient (fp32). With the sequence split, over the token rows as one dimension (`token_rows`), so
    that it is summed over the batch's and the sequence's axes at once: over batch and sequence as two dimensions,
    XLA:CPU summed it over each axis in turn."""
    if _row_shards()[1] == 1:
        return jnp.einsum("bld,blv->dv", hidden_BLD, d_logits_BLV, preferred_element_type=jnp.float32)
    return jnp.einsum("nd,nv->dv", token_rows(hidden_BLD, ("embed",)), token_rows(d_logits_BLV, ("vocab",)),
                      preferred_element_type=jnp.float32)


_chunked_cross_entropy.defvjp(_forward, _backward)
