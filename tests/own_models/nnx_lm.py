# ruff: noqa: RUF009, RUF012 - written as Flax users write them: PartitionSpec defaults, a dict of presets
"""A decoder-only language model written with `flax.nnx` as Flax's own examples write theirs, knowing nothing of
shardkit: a config with enums, dtypes and a nested dataclass of PartitionSpecs that name mesh axes (`fsdp`, `tp`), no
`vocab` field (the vocabulary is `num_embed`), grouped-query attention with qk-norm and rotary positions, its own
causal and sliding-window masks applied with `jnp.where`, a gated MLP, and the embedding's `attend` as the head.

`Transformer` keeps its layers in an `nnx.List`; `StackedTransformer` stacks them with `nnx.vmap` and runs them with
`nnx.scan`. The other classes are variants a user might try that shardkit cannot run as they are (see
tests/test_own_models.py).
Letters: B batch, T/S sequence, D embed, N query heads, K kv heads, G query heads per kv head, H head_dim, F hidden,
V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

K_MASK = -2.3819763e38  # the large negative that masked scores take (gemma's value)


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Where each weight lives, by mesh axis name: `fsdp` for the data-parallel shards, `tp` for tensor parallelism."""

    emb_vd: P = P("tp", "fsdp")
    q_dnh: P = P("fsdp", "tp", None)
    kv_dkh: P = P("fsdp", "tp", None)
    o_nhd: P = P("tp", None, "fsdp")
    ffw_df: P = P("fsdp", "tp")
    ffw_fd: P = P("tp", "fsdp")
    norm_d: P = P("fsdp")
    act_btd: P = P("fsdp", None, None)


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    num_layers: int = 2
    num_embed: int = 256
    embed_dim: int = 64
    hidden_dim: int = 128
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 8
    attention_types: tuple[AttentionType, ...] = (AttentionType.GLOBAL, AttentionType.LOCAL_SLIDING)
    sliding_window_size: int = 16
    use_qk_norm: bool = True
    rope_base_frequency: int = 10_000
    dtype: Any = jnp.float32
    shd_config: ShardingConfig = ShardingConfig()


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, base_frequency: int) -> jax.Array:
    half = x_BTNH.shape[-1] // 2
    timescale_H = base_frequency ** (2 * jnp.arange(half) / x_BTNH.shape[-1])
    angle_BTH = positions_BT[..., None] / timescale_H[None, None, :]
    sin, cos = jnp.sin(angle_BTH)[:, :, None, :], jnp.cos(angle_BTH)[:, :, None, :]
    first, second = jnp.split(x_BTNH, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x_BTNH.dtype)


class Attention(nnx.Module):
    def __init__(self, config: TransformerConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
        shd = config.shd_config
        init = nnx.initializers.normal(0.05)
        self.config, self.attn_type = config, attn_type
        d, n, k, h = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_einsum = nnx.Einsum("BTD,DNH->BTNH", (d, n, h), kernel_init=nnx.with_partitioning(init, shd.q_dnh),
                                   rngs=rngs)
        self.k_einsum = nnx.Einsum("BSD,DKH->BSKH", (d, k, h), kernel_init=nnx.with_partitioning(init, shd.kv_dkh),
                                   rngs=rngs)
        self.v_einsum = nnx.Einsum("BSD,DKH->BSKH", (d, k, h), kernel_init=nnx.with_partitioning(init, shd.kv_dkh),
                                   rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (n, h, d),
                                          kernel_init=nnx.with_partitioning(init, shd.o_nhd), rngs=rngs)
        if config.use_qk_norm:
            ones = nnx.with_partitioning(nnx.initializers.ones, (None,))
            self.query_norm = nnx.RMSNorm(h, scale_init=ones, rngs=rngs)
            self.key_norm = nnx.RMSNorm(h, scale_init=ones, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, attn_mask_BTS: jax.Array) -> jax.Array:
        config = self.config
        query_BTNH, key_BSKH, value_BSKH = self.q_einsum(x_BTD), self.k_einsum(x_BTD), self.v_einsum(x_BTD)
        if config.use_qk_norm:
            query_BTNH, key_BSKH = self.query_norm(query_BTNH), self.key_norm(key_BSKH)
        query_BTNH = apply_rope(query_BTNH, positions_BT, config.rope_base_frequency) * config.head_dim**-0.5
        key_BSKH = apply_rope(key_BSKH, positions_BT, config.rope_base_frequency)
        batch, seq, heads, head_dim = query_BTNH.shape
        query_BTKGH = query_BTNH.reshape(batch, seq, config.num_kv_heads, heads // config.num_kv_heads, head_dim)
        logits_BTKGS = jnp.einsum("BTKGH,BSKH->BTKGS", query_BTKGH, key_BSKH)
        if self.attn_type == AttentionType.LOCAL_SLIDING:
            distance_TS = positions_BT[0][:, None] - positions_BT[0][None, :]
            attn_mask_BTS = attn_mask_BTS & (distance_TS < config.sliding_window_size)[None]
        logits_BTKGS = jnp.where(attn_mask_BTS[:, :, None, None, :], logits_BTKGS, K_MASK)
        probs_BTKGS = jax.nn.softmax(logits_BTKGS, axis=-1).astype(value_BSKH.dtype)
        encoded_BTKGH = jnp.einsum("BTKGS,BSKH->BTKGH", probs_BTKGS, value_BSKH)
        return self.attn_vec_einsum(encoded_BTKGH.reshape(batch, seq, heads, head_dim))


class FeedForward(nnx.Module):
    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        shd, init = config.shd_config, nnx.initializers.lecun_normal()
        d, f = config.embed_dim, config.hidden_dim
        self.gate = nnx.Linear(d, f, use_bias=False, kernel_init=nnx.with_partitioning(init, shd.ffw_df), rngs=rngs)
        self.up = nnx.Linear(d, f, use_bias=False, kernel_init=nnx.with_partitioning(init, shd.ffw_df), rngs=rngs)
        self.down = nnx.Linear(f, d, use_bias=False, kernel_init=nnx.with_partitioning(init, shd.ffw_fd), rngs=rngs)

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.gate(x_BTD)) * self.up(x_BTD))


class Block(nnx.Module):
    def __init__(self, config: TransformerConfig, attn_type: AttentionType, *, rngs: nnx.Rngs):
        ones = nnx.with_partitioning(nnx.initializers.ones, config.shd_config.norm_d)
        self.pre_attention_norm = nnx.RMSNorm(config.embed_dim, scale_init=ones, rngs=rngs)
        self.attn = Attention(config, attn_type, rngs=rngs)
        self.pre_ffw_norm = nnx.RMSNorm(config.embed_dim, scale_init=ones, rngs=rngs)
        self.mlp = FeedForward(config, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, attn_mask_BTS):
        x_BTD = x_BTD + self.attn(self.pre_attention_norm(x_BTD), positions_BT, attn_mask_BTS)
        return x_BTD + self.mlp(self.pre_ffw_norm(x_BTD))


class Transformer(nnx.Module):
    Config = TransformerConfig
    PRESETS = {"tiny": TransformerConfig()}

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        shd = config.shd_config
        self.embedder = nnx.Embed(config.num_embed, config.embed_dim, rngs=rngs,
                                  embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.05), shd.emb_vd))
        self.layers = nnx.List([Block(config, config.attention_types[i % len(config.attention_types)], rngs=rngs)
                                for i in range(config.num_layers)])
        self.final_norm = nnx.RMSNorm(config.embed_dim, rngs=rngs,
                                      scale_init=nnx.with_partitioning(nnx.initializers.ones, shd.norm_d))

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        x_BTD, positions_BT, attn_mask_BTS = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_BT, attn_mask_BTS)
        return self.embedder.attend(self.final_norm(x_BTD))

    def embed(self, tokens_BT):
        """The scaled embeddings, the positions and the causal mask (one row of each, for every row of the batch)."""
        seq = tokens_BT.shape[1]
        x_BTD = self.embedder(tokens_BT) * jnp.sqrt(self.config.embed_dim).astype(self.config.dtype)
        return x_BTD, jnp.arange(seq)[None], jnp.tril(jnp.ones((1, seq, seq), bool))


class StackedTransformer(Transformer):
    """The same model with its layers stacked by `nnx.vmap` (all global attention) and run by `nnx.scan`; four layers,
    one per stage of recipes/pp.toml."""

    PRESETS = {"tiny": TransformerConfig(num_layers=4, attention_types=(AttentionType.GLOBAL,))}

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        shd = config.shd_config
        self.embedder = nnx.Embed(config.num_embed, config.embed_dim, rngs=rngs,
                                  embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.05), shd.emb_vd))

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create_layers(rngs):
            return Block(config, config.attention_types[0], rngs=rngs)

        self.layers = create_layers(rngs)
        self.final_norm = nnx.RMSNorm(config.embed_dim, rngs=rngs,
                                      scale_init=nnx.with_partitioning(nnx.initializers.ones, shd.norm_d))

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        x_BTD, positions_BT, attn_mask_BTS = self.embed(tokens_BT)

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(layer, x_BTD):
            return layer(x_BTD, positions_BT, attn_mask_BTS)

        return self.embedder.attend(self.final_norm(run(self.layers, x_BTD)))


class UnstackedLayersForgotten(StackedTransformer):
    """Stacked with `nnx.vmap` but without `transform_metadata`: the layer weights' names miss the leading `layers`."""

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embedder = nnx.Embed(config.num_embed, config.embed_dim, rngs=rngs,
                                  embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.05), ("tp", "fsdp")))

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_layers(rngs):
            return Block(config, config.attention_types[0], rngs=rngs)

        self.layers = create_layers(rngs)
        self.final_norm = nnx.RMSNorm(config.embed_dim, rngs=rngs,
                                      scale_init=nnx.with_partitioning(nnx.initializers.ones, ("fsdp",)))


class ExplicitShardingTransformer(Transformer):
    """Pins its activations in JAX's explicit form, `out_sharding=P(...)` (meaningful under a mesh of Explicit axes)."""

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        x_BTD, positions_BT, attn_mask_BTS = self.embed(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_BT, attn_mask_BTS)
        x_BTD = jnp.einsum("BTD,D->BTD", x_BTD, self.final_norm.scale.value,
                           out_sharding=self.config.shd_config.act_btd)
        return self.embedder.attend(x_BTD)


class CachedTransformer(Transformer):
    """A decoding signature, `(tokens, positions, cache, mask) -> (logits, cache)`, rather than `tokens -> logits`."""

    def __call__(self, tokens_BT, positions_BT, cache, attn_mask_BTS):
        x_BTD = self.embedder(tokens_BT)
        for layer in self.layers:
            x_BTD = layer(x_BTD, positions_BT, attn_mask_BTS)
        return self.embedder.attend(self.final_norm(x_BTD)), cache
