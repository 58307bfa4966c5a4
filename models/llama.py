"""A Llama-style decoder: token embedding, RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Dimension letters used in tensor names:
    B batch          S sequence (queries)   T sequence (keys)   D embed (model width)
    H query heads    K kv heads             G query heads per kv head (H = K * G)
    E head_dim       F mlp hidden           V vocab             L layers

Logical axis names (what recipes map onto a mesh): batch, sequence, embed, heads, kv_heads, head_dim, mlp, vocab, layers,
and residual_sequence (the sequence of the residual stream, outside attention and the MLP).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardkit.nn import attention, constrain, dropout, param, scan_stack, stack

# The residual stream (embeddings, norms, dropout, block outputs) has its own sequence name, so a layout may cut it
# along the sequence differently from the attention and MLP internals, which use `sequence` (a recipe does this for
# Megatron sequence parallelism).
RESIDUAL_BSD = ("batch", "residual_sequence", "embed")

normal = jax.nn.initializers.normal
ones = jax.nn.initializers.ones


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    layers: int = 4
    embed: int = 64
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 16
    mlp: int = 256
    vocab: int = 256
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")


def rms_norm(x_BSD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32 whatever the compute dtype, then cast back."""
    x32 = x_BSD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale = scale_D.astype(jnp.float32).reshape((1,) * (x_BSD.ndim - 1) + (-1,))
    return (normed * scale).astype(x_BSD.dtype)


def rotary(x_BSNE: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding over the last axis (split-halves convention), angles computed in fp32."""
    seq, dim = x_BSNE.shape[1], x_BSNE.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles_SE = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    sin, cos = jnp.sin(angles_SE)[None, :, None, :], jnp.cos(angles_SE)[None, :, None, :]
    x1, x2 = jnp.split(x_BSNE.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BSNE.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        d_init, o_init = normal(cfg.embed**-0.5), normal((cfg.heads * cfg.head_dim) ** -0.5)
        self.wq_DHE = param(rngs, d_init, (cfg.embed, cfg.heads, cfg.head_dim), ("embed", "heads", "head_dim"))
        self.wk_DKE = param(rngs, d_init, (cfg.embed, cfg.kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"))
        self.wv_DKE = param(rngs, d_init, (cfg.embed, cfg.kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim"))
        self.wo_HED = param(rngs, o_init, (cfg.heads, cfg.head_dim, cfg.embed), ("heads", "head_dim", "embed"))

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        cfg = self.cfg
        groups = cfg.heads // cfg.kv_heads
        q_BSHE = jnp.einsum("bsd,dhe->bshe", x_BSD, self.wq_DHE[...])
        k_BTKE = jnp.einsum("bsd,dke->bske", x_BSD, self.wk_DKE[...])
        v_BTKE = jnp.einsum("bsd,dke->bske", x_BSD, self.wv_DKE[...])
        q_BSHE = checkpoint_name(q_BSHE, "query_proj")
        k_BTKE = checkpoint_name(k_BTKE, "key_proj")
        v_BTKE = checkpoint_name(v_BTKE, "value_proj")
        q_BSHE = constrain(rotary(q_BSHE, cfg.rope_theta), ("batch", "sequence", "heads", "head_dim"))
        k_BTKE = constrain(rotary(k_BTKE, cfg.rope_theta), ("batch", "sequence", "kv_heads", "head_dim"))
        v_BTKE = constrain(v_BTKE, ("batch", "sequence", "kv_heads", "head_dim"))
        q_BSKGE = q_BSHE.reshape(*q_BSHE.shape[:2], cfg.kv_heads, groups, cfg.head_dim)
        out_BSKGE = attention(q_BSKGE, k_BTKE, v_BTKE, causal=True)
        out_BSHE = out_BSKGE.reshape(q_BSHE.shape)
        out_BSHE = checkpoint_name(out_BSHE, "attention_out")
        return checkpoint_name(jnp.einsum("bshe,hed->bsd", out_BSHE, self.wo_HED[...]), "out_proj")


class SwiGLU(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d_init, f_init = normal(cfg.embed**-0.5), normal(cfg.mlp**-0.5)
        self.w_gate_DF = param(rngs, d_init, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.w_up_DF = param(rngs, d_init, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.w_down_FD = param(rngs, f_init, (cfg.mlp, cfg.embed), ("mlp", "embed"))

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        gate_BSF = checkpoint_name(x_BSD @ self.w_gate_DF[...], "mlp_gate")
        up_BSF = checkpoint_name(x_BSD @ self.w_up_DF[...], "mlp_up")
        hidden_BSF = constrain(jax.nn.silu(gate_BSF) * up_BSF, ("batch", "sequence", "mlp"))
        return hidden_BSF @ self.w_down_FD[...]


class Block(nnx.Module):
    """Pre-norm decoder block: x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x)))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        self.attn = Attention(cfg, rngs)
        self.mlp_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = self._residual(x_BSD, self.attn_norm_D[...], self.attn, "attention")
        x_BSD = self._residual(x_BSD, self.mlp_norm_D[...], self.mlp, "mlp")
        return constrain(x_BSD, RESIDUAL_BSD)

    def _residual(self, x_BSD, norm_D, sublayer, site: str) -> jax.Array:
        """x + dropout(sublayer(norm(x))): norm and dropout in the residual layout, the sublayer on whole sequences
        (under sequence parallelism the two constraints around the sublayer are its all-gather and reduce-scatter)."""
        normed_BSD = constrain(rms_norm(x_BSD, norm_D, self.cfg.norm_eps), RESIDUAL_BSD)
        out_BSD = sublayer(constrain(normed_BSD, ("batch", "sequence", "embed")))
        return x_BSD + dropout(constrain(out_BSD, RESIDUAL_BSD), site)


class Llama(nnx.Module):
    """Decoder-only language model: tokens_BS -> logits_BSV.

    Split for pipeline schedules that run the loss inside the last stage (1F1B, shardkit/one_f_one_b.py):
    `__call__` is exactly `unembed(scan_stack(getattr(self, LAYER_STACK), embed(tokens_BS)))`, and `unembed` is the
    head `head_weight()` applied to `final_hidden(x)` (the lean loss, shardkit/loss.py, never forms all the logits).
    """

    Config = LlamaConfig
    LAYER_STACK = "blocks"  # the attribute holding the stacked decoder blocks
    PRESETS = {
        "tiny": LlamaConfig(),
        "small": LlamaConfig(layers=12, embed=768, heads=12, kv_heads=12, head_dim=64, mlp=2048, vocab=32000),
        "1b": LlamaConfig(layers=16, embed=2048, heads=32, kv_heads=8, head_dim=64, mlp=8192, vocab=128256,
                          tie_embeddings=True, rope_theta=500000.0),
        "8b": LlamaConfig(layers=32, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=128256,
                          rope_theta=500000.0),
    }

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding_VD = param(rngs, normal(1.0), (cfg.vocab, cfg.embed), ("vocab", "embed"))
        self.blocks = stack(lambda r: Block(cfg, r), cfg.layers, rngs)
        self.final_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, normal(cfg.embed**-0.5), (cfg.embed, cfg.vocab), ("embed", "vocab"))

    def __call__(self, tokens_BS: jax.Array) -> jax.Array:
        return self.unembed(scan_stack(self.blocks, self.embed(tokens_BS)))

    def embed(self, tokens_BS: jax.Array) -> jax.Array:
        """Token embedding: tokens_BS -> x_BSD, in the residual layout."""
        return constrain(jnp.take(self.embedding_VD[...], tokens_BS, axis=0), RESIDUAL_BSD)

    def unembed(self, x_BSD: jax.Array) -> jax.Array:
        """Final norm and output head: x_BSD -> logits_BSV."""
        logits_BSV = jnp.einsum("bsd,dv->bsv", self.final_hidden(x_BSD), self.head_weight())
        return constrain(logits_BSV, ("batch", "sequence", "vocab"))

    def final_hidden(self, x_BSD: jax.Array) -> jax.Array:
        """The final norm: what the head reads (the lean loss, shardkit/loss.py, takes it with `head_weight`)."""
        return rms_norm(x_BSD, self.final_norm_D[...], self.cfg.norm_eps)

    def head_weight(self) -> jax.Array:
        """The output head head_DV (the scaled, transposed embedding when tied)."""
        cfg = self.cfg
        return self.embedding_VD[...].T * cfg.embed**-0.5 if cfg.tie_embeddings else self.head_DV[...]
