"""The smallest model: token embedding, a deep stack of residual MLP layers, an output head.

Each position is predicted from its own token only (a bigram model), which is enough to learn the synthetic data and
small enough to test every layout quickly. Letters: B batch, S sequence, D embed, F mlp, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.nn import constrain, param, scan_stack, stack

normal = jax.nn.initializers.normal


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    layers: int = 4
    embed: int = 64
    mlp: int = 256
    vocab: int = 256


class MLPLayer(nnx.Module):
    def __init__(self, cfg: MLPConfig, rngs: nnx.Rngs):
        self.w_in_DF = param(rngs, normal(cfg.embed**-0.5), (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.w_out_FD = param(rngs, normal(cfg.mlp**-0.5), (cfg.mlp, cfg.embed), ("mlp", "embed"))

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        hidden_BSF = constrain(jax.nn.gelu(x_BSD @ self.w_in_DF[...]), ("batch", "sequence", "mlp"))
        return constrain(x_BSD + hidden_BSF @ self.w_out_FD[...], ("batch", "sequence", "embed"))


class DeepMLP(nnx.Module):
    """tokens_BS -> logits_BSV through `layers` residual MLP layers.

    Split for pipeline schedules that run the loss inside the last stage (1F1B, shardkit/pipeline/one_f_one_b.py):
    `__call__` is exactly `unembed(scan_stack(getattr(self, LAYER_STACK), embed(tokens_BS)))`.
    """

    Config = MLPConfig
    LAYER_STACK = "layers"  # the attribute holding the stacked MLP layers
    PRESETS = {
        "tiny": MLPConfig(),
        "small": MLPConfig(layers=24, embed=1024, mlp=4096, vocab=32000),
    }

    def __init__(self, cfg: MLPConfig, *, rngs: nnx.Rngs):
        self.embedding_VD = param(rngs, normal(1.0), (cfg.vocab, cfg.embed), ("vocab", "embed"))
        self.layers = stack(lambda r: MLPLayer(cfg, r), cfg.layers, rngs)
        self.head_DV = param(rngs, normal(cfg.embed**-0.5), (cfg.embed, cfg.vocab), ("embed", "vocab"))

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        return self.unembed(scan_stack(self.layers, self.embed(tokens_BS)))

    def embed(self, tokens_BS: jax.Array) -> jax.Array:
        """Token embedding: tokens_BS -> x_BSD."""
        return constrain(jnp.take(self.embedding_VD[...], tokens_BS, axis=0), ("batch", "sequence", "embed"))

    def unembed(self, x_BSD: jax.Array) -> jax.Array:
        """Output head: x_BSD -> logits_BSV."""
        return constrain(jnp.einsum("bsd,dv->bsv", x_BSD, self.head_DV[...]), ("batch", "sequence", "vocab"))
