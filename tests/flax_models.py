"""Models written with `flax.nnx` only, annotated the way Flax documents sharding (no shardkit import).

Loaded by `module:Class` like a user's own model (tests/test_flax_models.py). They cover the common layers:
`nnx.Embed` (with `attend` as the output head), `nnx.Linear`, `nnx.RMSNorm`, `nnx.LayerNorm`, layers kept in an
`nnx.List` (one model also pins its activations with Flax's `with_logical_constraint`), layers stacked with `nnx.vmap`
and run with `nnx.scan`, and a Linen block through `nnx.bridge`. Letters: B batch, S sequence, D embed, F mlp, V vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx import bridge

normal = nnx.initializers.normal
lecun = nnx.initializers.lecun_normal()


@dataclasses.dataclass(frozen=True)
class FlaxConfig:
    layers: int = 2
    embed: int = 64
    mlp: int = 128
    vocab: int = 256


class Block(nnx.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, cfg: FlaxConfig, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(cfg.embed, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                                  bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("embed",)), rngs=rngs)
        self.up = nnx.Linear(cfg.embed, cfg.mlp, kernel_init=nnx.with_partitioning(lecun, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("mlp",)), rngs=rngs)
        self.down = nnx.Linear(cfg.mlp, cfg.embed, use_bias=False,
                               kernel_init=nnx.with_partitioning(lecun, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x_BSD):
        return x_BSD + self.down(jax.nn.gelu(self.up(self.norm(x_BSD))))


class _Embedded(nnx.Module):
    """Embedding in, RMSNorm and the tied embedding (`attend`) out."""

    def __init__(self, cfg: FlaxConfig, rngs: nnx.Rngs):
        self.embedding = nnx.Embed(cfg.vocab, cfg.embed, rngs=rngs,
                                   embedding_init=nnx.with_partitioning(normal(0.1), ("vocab", "embed")))
        self.final_norm = nnx.RMSNorm(cfg.embed, scale_init=nnx.with_partitioning(nnx.initializers.ones, ("embed",)),
                                      rngs=rngs)

    def logits(self, x_BSD):
        return self.embedding.attend(self.final_norm(x_BSD))


class ListModel(_Embedded):
    """Blocks in an `nnx.List`, applied in a Python loop."""

    Config = FlaxConfig
    PRESETS = {"tiny": FlaxConfig()}

    def __init__(self, cfg: FlaxConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])

    def __call__(self, tokens_BS):
        x_BSD = self.embedding(tokens_BS)
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return self.logits(x_BSD)


class ConstrainedModel(ListModel):
    """ListModel whose blocks' hidden activations are pinned with Flax's own `with_logical_constraint`."""

    def __call__(self, tokens_BS):
        x_BSD = self.embedding(tokens_BS)
        for block in self.blocks:
            x_BSD = linen.with_logical_constraint(block(x_BSD), ("batch", "sequence", "embed"))
        return self.logits(x_BSD)


class ScanModel(_Embedded):
    """Blocks stacked with `nnx.vmap` (their sharding names get a leading `layers`) and run with `nnx.scan`: a pipeline
    finds that scan in the traced forward pass (shardkit/pipeline/scan_layers.py). Four layers: one per stage of
    recipes/pp.toml."""

    Config = FlaxConfig
    PRESETS = {"tiny": FlaxConfig(layers=4)}

    def __init__(self, cfg: FlaxConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = create_blocks(rngs)

    def __call__(self, tokens_BS):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def run(block, x_BSD):
            return block(x_BSD)

        return self.logits(run(self.blocks, self.embedding(tokens_BS)))


class LinenMLP(linen.Module):
    """A Linen block annotated with `with_logical_partitioning`, for `nnx.bridge.ToNNX`."""

    mlp: int

    @linen.compact
    def __call__(self, x_BSD):
        init = linen.with_logical_partitioning(linen.initializers.lecun_normal(), ("embed", "mlp"))
        h_BSF = linen.Dense(self.mlp, use_bias=False, kernel_init=init)(x_BSD)
        init = linen.with_logical_partitioning(linen.initializers.lecun_normal(), ("mlp", "embed"))
        return x_BSD + linen.Dense(x_BSD.shape[-1], use_bias=False, kernel_init=init)(jax.nn.gelu(h_BSF))


class BridgeModel(_Embedded):
    """A Linen block wrapped by `nnx.bridge.ToNNX` between NNX layers."""

    Config = FlaxConfig
    PRESETS = {"tiny": FlaxConfig()}

    def __init__(self, cfg: FlaxConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.block = bridge.ToNNX(LinenMLP(cfg.mlp), rngs=rngs)
        bridge.lazy_init(self.block, jnp.zeros((1, 1, cfg.embed)))

    def __call__(self, tokens_BS):
        return self.logits(self.block(self.embedding(tokens_BS)))


class BareLinenModel(_Embedded):
    """A Linen block stored without the bridge: refused."""

    Config = FlaxConfig
    PRESETS = {"tiny": FlaxConfig()}

    def __init__(self, cfg: FlaxConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.block = LinenMLP(cfg.mlp)

    def __call__(self, tokens_BS):
        return self.logits(self.embedding(tokens_BS))


class UnannotatedModel(_Embedded):
    """An `nnx.Linear` whose kernel has no sharding names: refused, naming the parameter."""

    Config = FlaxConfig
    PRESETS = {"tiny": FlaxConfig()}

    def __init__(self, cfg: FlaxConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.proj = nnx.Linear(cfg.embed, cfg.embed, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BS):
        return self.logits(self.proj(self.embedding(tokens_BS)))


class NoPresets(nnx.Module):
    """Lacks PRESETS: refused by the protocol check."""

    Config = FlaxConfig

    def __init__(self, cfg: FlaxConfig, *, rngs: nnx.Rngs):
        self.proj = nnx.Linear(cfg.embed, cfg.embed, rngs=rngs)

    def __call__(self, tokens_BS):
        return tokens_BS


LinenOnly = LinenMLP  # a Linen class named directly as the model: refused with how to wrap it


class StackedModel(_Embedded):
    """Blocks stacked with `nnx.vmap` along `layers` and run by `shardkit.nn.scan_stack` (named in LAYER_STACK): the
    one shardkit call a pipeline needs, since its stages replace that loop."""

    Config = FlaxConfig
    PRESETS = {"tiny": FlaxConfig(layers=4)}
    LAYER_STACK = "blocks"

    def __init__(self, cfg: FlaxConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create_blocks(rngs):
            return Block(cfg, rngs)

        self.blocks = create_blocks(rngs)

    def __call__(self, tokens_BS):
        from shardkit.nn import scan_stack

        return self.logits(scan_stack(self.blocks, self.embedding(tokens_BS)))
