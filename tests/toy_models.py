"""Small models for tests, loaded by `module:Class` the way a user's own model is."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.nn import constrain, param, scan_stack, stack


@dataclasses.dataclass(frozen=True)
class OddConfig:
    embed: int = 64
    vocab: int = 256


class OddModel(nnx.Module):
    """A model with a logical axis name ("mystery") that no rule table knows."""

    Config = OddConfig
    PRESETS = {"tiny": OddConfig()}

    def __init__(self, cfg: OddConfig, *, rngs: nnx.Rngs):
        self.embedding_VD = param(rngs, jax.nn.initializers.normal(1.0), (cfg.vocab, cfg.embed), ("vocab", "embed"))
        self.w_DX = param(rngs, jax.nn.initializers.normal(1.0), (cfg.embed, 8), ("embed", "mystery"))

    def __call__(self, tokens_BS):
        return jnp.take(self.embedding_VD[...], tokens_BS, axis=0) @ self.embedding_VD[...].T


@dataclasses.dataclass(frozen=True)
class UserConfig:
    layers: int = 2
    embed: int = 64
    mlp: int = 128
    vocab: int = 256


class UserLayer(nnx.Module):
    def __init__(self, cfg: UserConfig, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w_in_DF = param(rngs, init, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.w_out_FD = param(rngs, init, (cfg.mlp, cfg.embed), ("mlp", "embed"))

    def __call__(self, x_BSD):
        h_BSF = constrain(jax.nn.gelu(x_BSD @ self.w_in_DF[...]), ("batch", "sequence", "mlp"))
        return constrain(x_BSD + h_BSF @ self.w_out_FD[...], ("batch", "sequence", "embed"))


class UserModel(nnx.Module):
    """The README's "bring your own model" example, trained by tests/test_user_model.py through `module:Class`."""

    Config = UserConfig
    PRESETS = {"tiny": UserConfig()}
    LAYER_STACK = "layers"  # run by scan_stack: pipeline recipes can split it

    def __init__(self, cfg: UserConfig, *, rngs: nnx.Rngs):
        self.embedding_VD = param(rngs, nnx.initializers.normal(1.0), (cfg.vocab, cfg.embed), ("vocab", "embed"))
        self.layers = stack(lambda r: UserLayer(cfg, r), cfg.layers, rngs)

    def __call__(self, tokens_BS):
        x_BSD = jnp.take(self.embedding_VD[...], tokens_BS, axis=0)
        x_BSD = scan_stack(self.layers, constrain(x_BSD, ("batch", "sequence", "embed")))
        return x_BSD @ self.embedding_VD[...].T
