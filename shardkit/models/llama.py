"""A Llama-style decoder: token embedding, RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP.

Dimension letters used in tensor names:
    B batch          S sequence (queries)   T sequence (keys)   D embed (model width)
    H query heads    K kv heads             G query heads per kv head (H = K * G)
    E head_dim       F mlp hidden           V vocab             L layers

Logical axis names (what recipes map onto a mesh): batch, sequence, embed, heads, kv_heads, head_dim, mlp, vocab,
layers, and residual_sequence (the sequence of the residual stream, outside attention and the MLP).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardkit.nn import (
    KVCache,
    attention,
    cached_attention,
    constrain,
    dot,
    dropout,
    lookup,
    param,
    scan_decode,
    scan_stack,
    stack,
)

# The residual stream (embeddings, norms, dropout, block outputs) has its own sequence name, so a layout may cut it
# along the sequence differently from the attention and MLP internals, which use `sequence` (a recipe does this for
# Megatron sequence parallelism).
RESIDUAL_BSD = ("batch", "residual_sequence", "embed")
# A KV cache is laid out like the attention that reads it (heads over `tensor` in most recipes); its length is never
# cut, since each new token reads all of it.
KV_CACHE_BTKE = ("batch", None, "kv_heads", "head_dim")

normal = jax.nn.initializers.normal
ones = jax.nn.initializers.ones
ROPE_TYPES = ("default", "llama3")


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
    # Rotary frequency scaling: "default" (none) or "llama3" (Llama 3.1/3.2's long-context scaling, the four fields
    # below; Hugging Face's rope_scaling = {factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings}).
    rope_type: str = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192

    def __post_init__(self):
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type must be one of {list(ROPE_TYPES)}, got {self.rope_type!r}")
        if self.rope_type == "llama3" and not self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise ValueError("llama3 rope scaling needs rope_low_freq_factor < rope_high_freq_factor")


def rms_norm(x_BSD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32 whatever the compute dtype, then cast back."""
    x32 = x_BSD.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale = scale_D.astype(jnp.float32).reshape((1,) * (x_BSD.ndim - 1) + (-1,))
    return (normed * scale).astype(x_BSD.dtype)


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """Rotary inverse frequencies (head_dim // 2,), float32, with the config's scaling applied.

    llama3 scaling (Llama 3.1/3.2, as Hugging Face computes it): wavelengths shorter than
    original / high_freq_factor keep their frequency, those longer than original / low_freq_factor are divided by
    `factor`, and the band between interpolates linearly in original / wavelength.
    """
    exponents = np.arange(0, cfg.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(cfg.head_dim)
    inv_freq = (1.0 / np.float32(cfg.rope_theta) ** exponents).astype(np.float32)
    if cfg.rope_type == "default":
        return inv_freq
    original, factor = cfg.rope_original_max_positions, cfg.rope_factor
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = (2 * np.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return np.where(medium, interpolated, scaled).astype(np.float32)


def rotary(x_BSNE: jax.Array, inv_freq_E: np.ndarray, positions_BS: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding over the last axis (split-halves convention, Hugging Face's `rotate_half`), angles
    computed in fp32. `inv_freq_E` holds head_dim // 2 frequencies; positions default to 0, 1, ..., S - 1."""
    if positions_BS is None:
        positions_BS = jnp.arange(x_BSNE.shape[1])[None, :]
    angles_BSE = positions_BS.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq_E, jnp.float32)[None, None, :]
    sin, cos = jnp.sin(angles_BSE)[:, :, None, :], jnp.cos(angles_BSE)[:, :, None, :]
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

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array | None = None,
                 segments_BS: jax.Array | None = None) -> jax.Array:
        q_BSKGE, k_BTKE, v_BTKE = self.project(x_BSD, positions_BS)
        return self.output(attention(q_BSKGE, k_BTKE, v_BTKE, causal=True, segments_BS=segments_BS))

    def decode(self, x_BSD: jax.Array, positions_BS: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Attention of S new tokens at `positions_BS` (consecutive in each row, from each row's own start) against
        the keys and values cached before them and their own, which are written into the cache at their positions."""
        q_BSKGE, k_BSKE, v_BSKE = self.project(x_BSD, positions_BS)
        cache = cache.write(k_BSKE, v_BSKE, positions_BS[:, 0])
        cache = KVCache(constrain(cache.k_BTKE, KV_CACHE_BTKE), constrain(cache.v_BTKE, KV_CACHE_BTKE))
        return self.output(cached_attention(q_BSKGE, cache.k_BTKE, cache.v_BTKE, positions_BS)), cache

    def project(self, x_BSD: jax.Array, positions_BS: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries (grouped by kv head), keys and values, rotated to their positions."""
        cfg = self.cfg
        groups = cfg.heads // cfg.kv_heads
        q_BSHE = dot("bsd,dhe->bshe", x_BSD, self.wq_DHE[...], "attn/q")
        k_BTKE = dot("bsd,dke->bske", x_BSD, self.wk_DKE[...], "attn/k")
        v_BTKE = dot("bsd,dke->bske", x_BSD, self.wv_DKE[...], "attn/v")
        q_BSHE = checkpoint_name(q_BSHE, "query_proj")
        k_BTKE = checkpoint_name(k_BTKE, "key_proj")
        v_BTKE = checkpoint_name(v_BTKE, "value_proj")
        inv_freq_E = rope_frequencies(cfg)
        q_BSHE = constrain(rotary(q_BSHE, inv_freq_E, positions_BS), ("batch", "sequence", "heads", "head_dim"))
        k_BTKE = constrain(rotary(k_BTKE, inv_freq_E, positions_BS), ("batch", "sequence", "kv_heads", "head_dim"))
        v_BTKE = constrain(v_BTKE, ("batch", "sequence", "kv_heads", "head_dim"))
        q_BSKGE = q_BSHE.reshape(*q_BSHE.shape[:2], cfg.kv_heads, groups, cfg.head_dim)
        return q_BSKGE, k_BTKE, v_BTKE

    def output(self, out_BSKGE: jax.Array) -> jax.Array:
        """The output projection of the attended values."""
        out_BSHE = out_BSKGE.reshape(*out_BSKGE.shape[:2], self.cfg.heads, self.cfg.head_dim)
        out_BSHE = checkpoint_name(constrain(out_BSHE, ("batch", "sequence", "heads", "head_dim")), "attention_out")
        return checkpoint_name(dot("bshe,hed->bsd", out_BSHE, self.wo_HED[...], "attn/o"), "out_proj")


class SwiGLU(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d_init, f_init = normal(cfg.embed**-0.5), normal(cfg.mlp**-0.5)
        self.w_gate_DF = param(rngs, d_init, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.w_up_DF = param(rngs, d_init, (cfg.embed, cfg.mlp), ("embed", "mlp"))
        self.w_down_FD = param(rngs, f_init, (cfg.mlp, cfg.embed), ("mlp", "embed"))

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        gate_BSF = checkpoint_name(dot("bsd,df->bsf", x_BSD, self.w_gate_DF[...], "mlp/gate"), "mlp_gate")
        up_BSF = checkpoint_name(dot("bsd,df->bsf", x_BSD, self.w_up_DF[...], "mlp/up"), "mlp_up")
        hidden_BSF = constrain(jax.nn.silu(gate_BSF) * up_BSF, ("batch", "sequence", "mlp"))
        return dot("bsf,fd->bsd", hidden_BSF, self.w_down_FD[...], "mlp/down")


class Block(nnx.Module):
    """Pre-norm decoder block: x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x)))."""

    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        self.attn = Attention(cfg, rngs)
        self.mlp_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array | None = None,
                 segments_BS: jax.Array | None = None) -> jax.Array:
        attend = lambda normed_BSD: self.attn(normed_BSD, positions_BS, segments_BS)
        x_BSD = self._residual(x_BSD, self.attn_norm_D[...], attend, "attention")
        x_BSD = self._residual(x_BSD, self.mlp_norm_D[...], self.mlp, "mlp")
        return constrain(x_BSD, RESIDUAL_BSD)

    def decode(self, x_BSD: jax.Array, positions_BS: jax.Array, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """The block for generation: attention reads and extends the layer's KV cache (no dropout: not training)."""
        normed_BSD = rms_norm(x_BSD, self.attn_norm_D[...], self.cfg.norm_eps)
        attended_BSD, cache = self.attn.decode(normed_BSD, positions_BS, cache)
        x_BSD = constrain(x_BSD + attended_BSD, RESIDUAL_BSD)
        return self._residual(x_BSD, self.mlp_norm_D[...], self.mlp, "mlp"), cache

    def _residual(self, x_BSD, norm_D, sublayer, site: str) -> jax.Array:
        """x + dropout(sublayer(norm(x))): norm and dropout in the residual layout, the sublayer on whole sequences
        (under sequence parallelism the two constraints around the sublayer are its all-gather and reduce-scatter)."""
        normed_BSD = constrain(rms_norm(x_BSD, norm_D, self.cfg.norm_eps), RESIDUAL_BSD)
        out_BSD = sublayer(constrain(normed_BSD, ("batch", "sequence", "embed")))
        return x_BSD + dropout(constrain(out_BSD, RESIDUAL_BSD), site)


# Meta's released configurations (their Hugging Face config.json files), exactly.
_LLAMA3 = dict(vocab=128256, kv_heads=8, rope_theta=500000.0, norm_eps=1e-5, rope_type="llama3")
LLAMA3_PRESETS = {
    "llama3.2-1b": LlamaConfig(layers=16, embed=2048, heads=32, head_dim=64, mlp=8192, tie_embeddings=True,
                               rope_factor=32.0, **_LLAMA3),
    "llama3.2-3b": LlamaConfig(layers=28, embed=3072, heads=24, head_dim=128, mlp=8192, tie_embeddings=True,
                               rope_factor=32.0, **_LLAMA3),
    "llama3.1-8b": LlamaConfig(layers=32, embed=4096, heads=32, head_dim=128, mlp=14336, rope_factor=8.0, **_LLAMA3),
}

# Llama 3 8B's published pretraining settings. The Llama 3 paper ("The Llama 3 Herd of Models", Grattafiori et al.
# 2024, Table 3) gives its peak learning rate, 3e-4, and (section 3.4.1) the schedule's form: linear warmup, then
# cosine decay. It states nothing else for 8B, so the rest is the Llama 2 recipe it builds on (Touvron et al. 2023,
# "Llama 2", section 2.2): AdamW with b1 = 0.9, b2 = 0.95, eps = 1e-5, weight decay 0.1, gradient clipping at 1.0,
# 2000 warmup steps and cosine decay to 10% of the peak. The Llama 3.2 models (1b, 3b) were pruned and distilled
# from larger ones, with no pretraining rate published: they take the width rule (shardkit/optimizer.py).
LLAMA3_8B_OPTIMIZER = {"lr": 3e-4, "warmup": 2000, "min_lr_ratio": 0.1, "weight_decay": 0.1, "b1": 0.9, "b2": 0.95,
                       "eps": 1e-5, "clip": 1.0}


class Llama(nnx.Module):
    """Decoder-only language model: tokens_BS -> logits_BSV.

    Split for pipeline schedules that run the loss inside the last stage (1F1B, shardkit/pipeline/one_f_one_b.py):
    `__call__` is exactly `unembed(scan_stack(getattr(self, LAYER_STACK), embed(tokens_BS)))`, and `unembed` is the
    head `head_weight()` applied to `final_hidden(x)` (the lean loss, shardkit/loss.py, never forms all the logits).
    """

    Config = LlamaConfig
    LAYER_STACK = "blocks"  # the attribute holding the stacked decoder blocks
    PRESETS = {
        "tiny": LlamaConfig(),
        "small": LlamaConfig(layers=12, embed=768, heads=12, kv_heads=12, head_dim=64, mlp=2048, vocab=32000),
        **LLAMA3_PRESETS,
        "1b": LLAMA3_PRESETS["llama3.2-1b"],
        "8b": LLAMA3_PRESETS["llama3.1-8b"],
    }
    # Published optimizer settings by preset name (shardkit/optimizer.py's defaults; others follow its width rule).
    OPTIMIZER_PRESETS = {"llama3.1-8b": LLAMA3_8B_OPTIMIZER, "8b": LLAMA3_8B_OPTIMIZER}

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        # A tied head is the embedding itself (as in Llama), so its rows start at norm ~1 to keep the first logits
        # O(1) (normed activations have norm ~sqrt(embed)); an untied model keeps unit-variance embeddings.
        embed_std = cfg.embed**-0.5 if cfg.tie_embeddings else 1.0
        self.embedding_VD = param(rngs, normal(embed_std), (cfg.vocab, cfg.embed), ("vocab", "embed"))
        self.blocks = self.layer_stack(cfg, rngs)
        self.final_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        if not cfg.tie_embeddings:
            self.head_DV = param(rngs, normal(cfg.embed**-0.5), (cfg.embed, cfg.vocab), ("embed", "vocab"))

    @staticmethod
    def layer_stack(cfg: LlamaConfig, rngs: nnx.Rngs):
        """The stacked decoder blocks (`LAYER_STACK`); a variant model (models/moe.py) stacks its own unit here."""
        return stack(lambda r: Block(cfg, r), cfg.layers, rngs)

    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
                 segments_BS: jax.Array | None = None) -> jax.Array:
        """Logits of every position; `positions_BS` (rotary positions) defaults to 0, 1, ..., S - 1 in every row.

        Packed documents (shardkit/data/packing.py) give both: positions restarting at each document and
        `segments_BS`, each token's document, which attention never crosses. Under a pipeline, positions must be
        (B, S) like the tokens: they travel through the stages with the activations.
        """
        if segments_BS is not None and positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
        rows = tuple(x for x in (positions_BS, segments_BS) if x is not None)  # what each block takes after x_BSD
        return self.unembed(scan_stack(self.blocks, self.embed(tokens_BS), *rows))

    def decode(self, tokens_BS: jax.Array, cache: KVCache, start: jax.Array) -> tuple[jax.Array, KVCache]:
        """Generation with a KV cache: the logits of the last of `tokens_BS`, placed at positions start, ...,
        start + S - 1, each attending to the cache's earlier positions and to itself; and the cache with their keys
        and values written in. `start` is one position for every row or one per row, (B,). Prefill is the prompt at
        start 0; each step after it is one token."""
        starts_B1 = jnp.reshape(jnp.asarray(start), (-1, 1))
        positions_BS = jnp.broadcast_to(starts_B1 + jnp.arange(tokens_BS.shape[1])[None, :], tokens_BS.shape)
        x_BSD, cache = scan_decode(self.blocks, self.embed(tokens_BS), cache, positions_BS)
        return self.unembed(x_BSD[:, -1:])[:, 0], cache

    def empty_cache(self, batch: int, length: int, dtype) -> KVCache:
        """A KV cache for `batch` rows of up to `length` positions (`decode` fills it)."""
        cfg = self.cfg
        return KVCache.empty(cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim, dtype)

    def embed(self, tokens_BS: jax.Array) -> jax.Array:
        """Token embedding: tokens_BS -> x_BSD, in the residual layout."""
        return constrain(lookup(self.embedding_VD[...], tokens_BS), RESIDUAL_BSD)

    def unembed(self, x_BSD: jax.Array) -> jax.Array:
        """Final norm and output head: x_BSD -> logits_BSV."""
        logits_BSV = jnp.einsum("bsd,dv->bsv", self.final_hidden(x_BSD), self.head_weight())
        return constrain(logits_BSV, ("batch", "sequence", "vocab"))

    def final_hidden(self, x_BSD: jax.Array) -> jax.Array:
        """The final norm: what the head reads (the lean loss, shardkit/loss.py, takes it with `head_weight`)."""
        return rms_norm(x_BSD, self.final_norm_D[...], self.cfg.norm_eps)

    def head_weight(self) -> jax.Array:
        """The output head head_DV: the transposed embedding itself when tied (no extra scale, as in Hugging Face's
        Llama)."""
        return self.embedding_VD[...].T if self.cfg.tie_embeddings else self.head_DV[...]
