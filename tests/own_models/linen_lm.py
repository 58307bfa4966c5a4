# ruff: noqa: RUF012, UP035 - written as Flax users write them: a dict of presets, typing.Callable
"""A decoder-only language model written in Linen as Flax's Linen examples (lm1b, T5X) write theirs, knowing nothing of
shardkit, bridged into NNX by a three-member adapter (`LinenLM`: `Config`, `PRESETS`, `__call__`).

The authors' conventions: `DenseGeneral` attention kernels annotated with two logical names however many dimensions the
kernel has (`('embed', 'kv')` for q/k/v, `('joined_kv', 'embed')` for the output), their own names `kv` and
`joined_kv`, a config holding an initializer and a dtype, and the decoder shifting its inputs right itself, so that
`logits[t]` predicts `tokens[t]` (the adapter says so with `inputs_shifted = True`).
Letters: B batch, L length, E embed, H heads, K head_dim, M mlp, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int = 256
    emb_dim: int = 64
    num_heads: int = 4
    num_layers: int = 2
    qkv_dim: int = 64
    mlp_dim: int = 128
    dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.xavier_uniform()
    bias_init: Callable = nn.initializers.normal(stddev=1e-6)


def shift_right(x_BL: jax.Array) -> jax.Array:
    """Shift the input to the right by one position, a zero first."""
    return jnp.pad(x_BL, ((0, 0), (1, 0)))[:, :-1]


class SelfAttention(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLE, mask):
        cfg = self.config
        head_dim = cfg.qkv_dim // cfg.num_heads
        dense = lambda name: nn.DenseGeneral(
            features=(cfg.num_heads, head_dim), axis=-1, dtype=cfg.dtype, name=name, use_bias=False,
            kernel_init=nn.with_logical_partitioning(cfg.kernel_init, ("embed", "kv")))
        query_BLHK, key_BLHK, value_BLHK = dense("query")(x_BLE), dense("key")(x_BLE), dense("value")(x_BLE)
        y_BLHK = nn.dot_product_attention(query_BLHK, key_BLHK, value_BLHK, mask=mask, dtype=cfg.dtype)
        return nn.DenseGeneral(features=x_BLE.shape[-1], axis=(-2, -1), dtype=cfg.dtype, name="out",
                               kernel_init=nn.with_logical_partitioning(cfg.kernel_init, ("joined_kv", "embed")),
                               bias_init=nn.with_logical_partitioning(cfg.bias_init, ("embed",)))(y_BLHK)


class MlpBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLE):
        cfg = self.config
        h_BLM = nn.Dense(cfg.mlp_dim, dtype=cfg.dtype,
                         kernel_init=nn.with_logical_partitioning(cfg.kernel_init, ("embed", "mlp")),
                         bias_init=nn.with_logical_partitioning(cfg.bias_init, ("mlp",)))(x_BLE)
        return nn.Dense(x_BLE.shape[-1], dtype=cfg.dtype,
                        kernel_init=nn.with_logical_partitioning(cfg.kernel_init, ("mlp", "embed")),
                        bias_init=nn.with_logical_partitioning(cfg.bias_init, ("embed",)))(nn.relu(h_BLM))


def layer_norm(cfg: TransformerConfig) -> nn.LayerNorm:
    return nn.LayerNorm(dtype=cfg.dtype, scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))


class EncoderDecoder1DBlock(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x_BLE, mask):
        x_BLE = x_BLE + SelfAttention(self.config)(layer_norm(self.config)(x_BLE), mask)
        return x_BLE + MlpBlock(self.config)(layer_norm(self.config)(x_BLE))


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, inputs_BL):
        cfg = self.config
        embed = nn.Embed(cfg.vocab_size, cfg.emb_dim, embedding_init=nn.with_logical_partitioning(
            nn.initializers.normal(stddev=1.0), ("vocab", "embed")), name="embed")
        x_BLE = embed(shift_right(inputs_BL)).astype(cfg.dtype)
        mask = nn.make_causal_mask(inputs_BL, dtype=cfg.dtype)
        for index in range(cfg.num_layers):
            x_BLE = EncoderDecoder1DBlock(cfg, name=f"encoderdecoderblock_{index}")(x_BLE, mask)
        x_BLE = layer_norm(cfg)(x_BLE)
        return embed.attend(x_BLE.astype(jnp.float32)) / jnp.sqrt(x_BLE.shape[-1])


class LinenLM(nnx.Module):
    """The adapter: the Linen decoder through `nnx.bridge.ToNNX`."""

    Config = TransformerConfig
    PRESETS = {"tiny": TransformerConfig()}
    inputs_shifted = True  # logits[t] predicts tokens[t]: the decoder shifts its inputs right itself

    def __init__(self, config: TransformerConfig, *, rngs: nnx.Rngs):
        self.decoder = bridge.ToNNX(Decoder(config), rngs=rngs)
        bridge.lazy_init(self.decoder, jnp.zeros((1, 8), jnp.int32))

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        return self.decoder(tokens_BL)


class UnshiftedLinenLM(LinenLM):
    """The same adapter without saying that the decoder shifts its inputs."""

    inputs_shifted = False
