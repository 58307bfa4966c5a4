"""The definition every attention kernel must equal: plain grouped-query attention on whole sequences.

Dimension letters: B batch, S queries, T keys, K kv heads, G query heads per kv head, E head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from shardkit.attention.blocks import NEG_INF


def reference_attention(q_BSKGE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, causal: bool = True) -> jax.Array:
    """Plain grouped-query attention on whole sequences (the definition ring attention must equal); fp32 softmax."""
    scale = q_BSKGE.shape[-1] ** -0.5
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE).astype(jnp.float32) * scale
    if causal:
        seq, keys = q_BSKGE.shape[1], k_BTKE.shape[1]
        mask_111ST = jnp.tril(jnp.ones((seq, keys), dtype=bool))[None, None, None]
        scores_BKGST = jnp.where(mask_111ST, scores_BKGST, NEG_INF)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BTKE.dtype)
    return jnp.einsum("bkgst,btke->bskge", probs_BKGST, v_BTKE)
