"""The definition every attention kernel must equal: plain grouped-query attention on whole sequences.

Dimension letters: B batch, S queries, T keys, K kv heads, G query heads per kv head, E head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardkit.attention.blocks import NEG_INF


def reference_attention(q_BSKGE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, causal: bool = True,
                        segments_BS: jax.Array | None = None) -> jax.Array:
    """Plain grouped-query attention on whole sequences (the definition ring attention must equal); fp32 softmax.
    `segments_BS` (packed documents: the segment id of each position, queries and keys alike) masks pairs from
    different documents."""
    scale = q_BSKGE.shape[-1] ** -0.5
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE).astype(jnp.float32) * scale
    mask_B11ST = attention_mask(q_BSKGE.shape[1], k_BTKE.shape[1], causal, segments_BS)
    if mask_B11ST is not None:
        scores_BKGST = jnp.where(mask_B11ST[:, :, None], scores_BKGST, NEG_INF)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BTKE.dtype)
    return jnp.einsum("bkgst,btke->bskge", probs_BKGST, v_BTKE)


def attention_mask(queries: int, keys: int, causal: bool, segments_BS: jax.Array | None) -> jax.Array | None:
    """Which (query, key) pairs count, (B or 1, 1, S, T) as `jax.nn.dot_product_attention` takes it: by position
    when causal, by segment with segment ids; None when every pair counts."""
    mask_11ST = jnp.tril(jnp.ones((queries, keys), dtype=bool))[None, None] if causal else None
    if segments_BS is None:
        return mask_11ST
    same_B1ST = (segments_BS[:, :, None] == segments_BS[:, None, :])[:, None]
    return same_B1ST if mask_11ST is None else same_B1ST & mask_11ST
