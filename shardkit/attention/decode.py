"""Attention for generation with a KV cache: new queries against every key and value cached so far.

Dimension letters: B batch, S new tokens (queries), T cache length (keys), K kv heads, G query heads per kv head,
E head_dim, L layers.

The cache holds a fixed number of positions (prompt + new tokens), so each decoding step has the same shapes and
compiles once; positions not yet written are masked out, as are those after each query (causal).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from shardkit.attention.blocks import NEG_INF


class KVCache(NamedTuple):
    """Keys and values of the positions generated so far: (B, T, K, E) for one layer, (L, B, T, K, E) for a stack."""

    k_BTKE: jax.Array
    v_BTKE: jax.Array

    @classmethod
    def empty(cls, layers: int, batch: int, length: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
        """A stack's cache of `length` positions, all still to be written."""
        shape = (layers, batch, length, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    def write(self, k_BSKE: jax.Array, v_BSKE: jax.Array, starts_B: jax.Array) -> KVCache:
        """One layer's cache with S new keys and values written in each row b at positions starts_B[b], ...,
        starts_B[b] + S - 1 (rows of right-padded prompts of different lengths write at different positions)."""
        row = lambda cache_TKE, new_SKE, start: jax.lax.dynamic_update_slice_in_dim(
            cache_TKE, new_SKE.astype(cache_TKE.dtype), start, axis=0)
        write = jax.vmap(row)
        return KVCache(write(self.k_BTKE, k_BSKE, starts_B), write(self.v_BTKE, v_BSKE, starts_B))


def cached_attention(q_BSKGE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, positions_BS: jax.Array) -> jax.Array:
    """Grouped-query attention of queries at `positions_BS` against a cache: key t is visible to a query at position p
    when t <= p (what causal attention over the whole sequence gives it). Softmax in fp32, as every kernel does."""
    scale = q_BSKGE.shape[-1] ** -0.5
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE).astype(jnp.float32) * scale
    visible_BST = jnp.arange(k_BTKE.shape[1])[None, None, :] <= positions_BS[:, :, None]
    scores_BKGST = jnp.where(visible_BST[:, None, None], scores_BKGST, NEG_INF)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BTKE.dtype)
    return jnp.einsum("bkgst,btke->bskge", probs_BKGST, v_BTKE)
