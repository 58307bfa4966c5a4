"""A small GPT written with Flax NNX alone, annotated the way Flax documents sharding: no shardkit import.

The walkthrough docs/tutorials/own-model.md trains it under shardkit's recipes from the repository root:

    shardkit plan fsdp_tp --devices 8 --set model.name=examples.tiny_gpt:TinyGPT
    shardkit train fsdp_tp --devices 8 --out runs/tiny_gpt --set model.name=examples.tiny_gpt:TinyGPT \
        --set data.source=text --set data.path=data/alice.txt
    shardkit generate runs/tiny_gpt --prompt "The "

What shardkit needs of a model (`shardkit.ModelProtocol`): a `Config` dataclass, a `PRESETS` dict with a "tiny"
entry, `__init__(config, *, rngs)` and `__call__(tokens_BS) -> logits_BSV`. Where each parameter lives is said with
logical axis names (`nnx.with_partitioning(init, ("embed", "mlp"))`), and the residual stream is pinned by logical
names too (`pin_residual`); a recipe maps those names onto the mesh.
tests/test_examples.py trains it under fsdp and fsdp_tp against one device.

Dimension letters: B batch, S sequence, D embed, H heads, K head_dim, F mlp, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen, nnx

lecun = nnx.initializers.lecun_normal()
ones = nnx.initializers.ones


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The model's sizes, by logical name: a recipe's `[model]` table (or `--set model.embed=128`) overrides them."""

    layers: int = 2
    embed: int = 64
    heads: int = 4
    head_dim: int = 16
    mlp: int = 256
    vocab: int = 256  # byte-level text: one token per byte value
    rope_theta: float = 10000.0


def rotary(x_BSHK: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding: each pair of features turned by an angle that grows with the position."""
    length, half = x_BSHK.shape[1], x_BSHK.shape[-1] // 2
    frequencies_K = 1.0 / (theta ** (jnp.arange(half) / half))
    angles_SK = jnp.arange(length)[:, None] * frequencies_K[None, :]
    cos, sin = jnp.cos(angles_SK)[None, :, None, :], jnp.sin(angles_SK)[None, :, None, :]
    first, second = x_BSHK[..., :half], x_BSHK[..., half:]
    return jnp.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


class Attention(nnx.Module):
    """Causal multi-head self-attention. The projections name their heads, so a recipe's `tensor` axis splits them
    (Megatron's column-parallel q/k/v, row-parallel output)."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        def projection(names):
            return nnx.with_partitioning(lecun, names)

        qkv = dict(in_features=cfg.embed, out_features=(cfg.heads, cfg.head_dim), use_bias=False, rngs=rngs,
                   kernel_init=projection(("embed", "heads", "head_dim")))
        self.query, self.key, self.value = nnx.LinearGeneral(**qkv), nnx.LinearGeneral(**qkv), nnx.LinearGeneral(**qkv)
        self.out = nnx.LinearGeneral(in_features=(cfg.heads, cfg.head_dim), out_features=cfg.embed, axis=(-2, -1),
                                     use_bias=False, kernel_init=projection(("heads", "head_dim", "embed")), rngs=rngs)
        self.rope_theta = cfg.rope_theta

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        q_BSHK, k_BSHK = rotary(self.query(x_BSD), self.rope_theta), rotary(self.key(x_BSD), self.rope_theta)
        attended_BSHK = jax.nn.dot_product_attention(q_BSHK, k_BSHK, self.value(x_BSD), is_causal=True)
        return self.out(attended_BSHK)


class MLP(nnx.Module):
    """GELU feed-forward: up to `mlp`, back to `embed`."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.up = nnx.Linear(cfg.embed, cfg.mlp, use_bias=False, rngs=rngs,
                             kernel_init=nnx.with_partitioning(lecun, ("embed", "mlp")))
        self.down = nnx.Linear(cfg.mlp, cfg.embed, use_bias=False, rngs=rngs,
                               kernel_init=nnx.with_partitioning(lecun, ("mlp", "embed")))

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        return self.down(jax.nn.gelu(self.up(x_BSD)))


class Block(nnx.Module):
    """A pre-norm transformer block: attention, then the MLP, each added to the residual stream."""

    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        norm = dict(num_features=cfg.embed, scale_init=nnx.with_partitioning(ones, ("embed",)), rngs=rngs)
        self.attention_norm, self.mlp_norm = nnx.RMSNorm(**norm), nnx.RMSNorm(**norm)
        self.attention, self.mlp = Attention(cfg, rngs), MLP(cfg, rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = x_BSD + self.attention(self.attention_norm(x_BSD))
        return x_BSD + self.mlp(self.mlp_norm(x_BSD))


class TinyGPT(nnx.Module):
    """Token embedding, `layers` blocks, a final norm and the tied embedding as the output head."""

    Config = GPTConfig
    PRESETS = {"tiny": GPTConfig(), "small": GPTConfig(layers=6, embed=256, heads=8, head_dim=32, mlp=1024)}

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.embedding = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs,
                                   embedding_init=nnx.with_partitioning(nnx.initializers.normal(0.02),
                                                                        ("vocab", "embed")))
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.final_norm = nnx.RMSNorm(cfg.embed, scale_init=nnx.with_partitioning(ones, ("embed",)), rngs=rngs)

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        x_BSD = pin_residual(self.embedding(tokens_BS))
        for block in self.blocks:
            x_BSD = pin_residual(block(x_BSD))
        return self.embedding.attend(self.final_norm(x_BSD))


def pin_residual(x_BSD: jax.Array) -> jax.Array:
    """The residual stream laid out by the recipe's activation rules for (batch, sequence, embed): the batch split
    over the data axes, the embedding whole. Without it XLA chooses, and may keep activations split along `embed`
    like the FSDP-sharded weights, reducing them across devices in every layer."""
    return linen.with_logical_constraint(x_BSD, ("batch", "sequence", "embed"))
