# ruff: noqa: RUF012 - written as Flax users write them: a dict of presets
"""A minimal decoder LM in Linen as a lab writes one for its own FSDP trainer, knowing nothing of shardkit, bridged
into NNX by the adapter docs/guide/own-models.md shows (`LabLM`: `Config`, `PRESETS`, `__call__`).

The authors' conventions: their one mesh axis is `data`, and they shard the first dimension of each kernel and
embedding over it (`nn.with_partitioning(init, ("data", None))`, mesh-axis names, not logical ones); the q/k/v and
output `DenseGeneral` kernels carry three names, right for the stored 3-D kernel, while `DenseGeneral` initialises
them flat (2-D) and reshapes; LayerNorm scales and biases carry no names (their trainer's `nn.get_sharding`
replicates them); heads and MLP widths are never named; positions come from a learned table of `max_len` entries,
read with `jnp.take` (which gives NaN past its end).
Letters: B batch, L length, E embed, H heads, K head_dim, M mlp, V vocab, P max_len.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.nnx import bridge


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    embed: int = 64
    heads: int = 4
    layers: int = 2
    mlp: int = 256
    max_len: int = 128
    dtype: Any = jnp.float32


def sharded(init, *names):
    """The authors' FSDP annotation: the first dimension over their `data` mesh axis."""
    return nn.with_partitioning(init, names)


class CausalAttn(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x_BLE):
        cfg = self.cfg
        init = nn.initializers.lecun_normal()
        qkv = lambda name: nn.DenseGeneral((cfg.heads, cfg.embed // cfg.heads), use_bias=False, name=name,
                                           kernel_init=sharded(init, "data", None, None), dtype=cfg.dtype)
        q_BLHK, k_BLHK, v_BLHK = qkv("query")(x_BLE), qkv("key")(x_BLE), qkv("value")(x_BLE)
        mask = nn.make_causal_mask(jnp.ones(x_BLE.shape[:2]))
        y_BLHK = nn.dot_product_attention(q_BLHK, k_BLHK, v_BLHK, mask=mask, dtype=cfg.dtype)
        return nn.DenseGeneral(cfg.embed, axis=(-2, -1), use_bias=False, name="out", dtype=cfg.dtype,
                               kernel_init=sharded(init, None, None, "data"))(y_BLHK)


class Mlp(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x_BLE):
        init = nn.initializers.lecun_normal()
        h_BLM = nn.Dense(self.cfg.mlp, use_bias=False, kernel_init=sharded(init, "data", None), name="up")(x_BLE)
        return nn.Dense(self.cfg.embed, use_bias=False, kernel_init=sharded(init, "data", None),
                        name="down")(nn.gelu(h_BLM))


class Block(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x_BLE):
        x_BLE = x_BLE + CausalAttn(self.cfg)(nn.LayerNorm()(x_BLE))
        return x_BLE + Mlp(self.cfg)(nn.LayerNorm()(x_BLE))


class Decoder(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens_BL):
        cfg = self.cfg
        embed = nn.Embed(cfg.vocab, cfg.embed, embedding_init=sharded(nn.initializers.normal(1.0), "data", None),
                         name="embed")
        pos_PE = self.param("pos_embed", sharded(nn.initializers.normal(0.02), None, "data"), (cfg.max_len, cfg.embed))
        positions_L = jnp.arange(tokens_BL.shape[1])
        x_BLE = embed(tokens_BL) + jnp.take(pos_PE, positions_L, axis=0)[None]
        for index in range(cfg.layers):
            x_BLE = Block(cfg, name=f"blocks_{index}")(x_BLE)
        x_BLE = nn.LayerNorm(name="final_norm")(x_BLE)
        return nn.Dense(cfg.vocab, use_bias=False, name="head",
                        kernel_init=sharded(nn.initializers.lecun_normal(), "data", None))(x_BLE)


class LabLM(nnx.Module):
    """The adapter: the authors' decoder through `nnx.bridge.ToNNX`, nothing else."""

    Config = Config
    PRESETS = {"tiny": Config()}

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.lm = bridge.ToNNX(Decoder(config), rngs=rngs)
        bridge.lazy_init(self.lm, jnp.zeros((1, 8), jnp.int32))

    def __call__(self, tokens_BL: jax.Array) -> jax.Array:
        return self.lm(tokens_BL)


class OverNamed(nn.Module):
    """A table annotated with three names, one more than its two dimensions (names kept from a 3-D version)."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens_BL):
        table_VE = self.param("table", sharded(nn.initializers.normal(1.0), "data", None, None),
                              (self.cfg.vocab, self.cfg.embed))
        return jnp.take(table_VE, tokens_BL, axis=0) @ table_VE.T


class OverNamedLM(LabLM):
    """The adapter around `OverNamed`: its names cannot fit the stored table."""

    def __init__(self, config: Config, *, rngs: nnx.Rngs):
        self.lm = bridge.ToNNX(OverNamed(config), rngs=rngs)
        bridge.lazy_init(self.lm, jnp.zeros((1, 8), jnp.int32))
