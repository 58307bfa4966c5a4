"""Small models for tests, loaded by `module:Class` the way a user's own model is."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.nn import param


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
