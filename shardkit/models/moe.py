"""A mixture-of-experts Llama (Mixtral / DeepSeek style): the reference decoder with routed SwiGLU experts.

Every `moe_every`-th decoder layer replaces its MLP by a router and `experts` SwiGLU experts, of which each token uses
`top_k`; the other layers are the dense Llama block. The experts' weights are stacked along the logical axis `experts`,
which a recipe maps onto the `expert` mesh axis (expert parallelism); how routed tokens reach their experts (one
device, or all-to-all between expert ranks) is `shardkit.moe.routed_experts`'s business, not the model's.

Dimension letters (as in models/llama.py, plus): X experts, K here is top_k (choices per token), M MoE layers.
    B batch   S sequence   D embed   F mlp hidden (per expert)   V vocab

Routing. Gate scores over all experts (softmax of the router logits, or their sigmoid as in DeepSeek-V3); each token
takes its top_k experts and weighs their outputs by the chosen scores renormalised to sum to 1 (for softmax this is
Mixtral's softmax over the chosen logits). `routing = "dropless"` computes every choice; `"capacity"` gives each
expert `ceil(capacity_factor * S * top_k / experts)` slots per sequence and drops the choices that overflow (first
choices of all tokens before any second choice, then by position), reporting the dropped fraction.

Auxiliary losses, both computed per sequence and averaged over sequences and MoE layers, so that they do not depend on
how a layout splits the batch (data replicas, micro-batches, pipeline micro-batches):
    balance   Switch / Mixtral load balancing, X * sum_x f_x * P_x, with f_x the fraction of the sequence's choices
              routed to expert x (no gradient) and P_x its mean gate probability (DeepSeek-V3's sequence-wise form);
              1 when perfectly balanced.
    z         ST-MoE's router z-loss, the mean squared log-sum-exp of the router logits.
The training loss adds `aux_loss_weight * balance + z_loss_weight * z` (`MoeLlama.aux_loss`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardkit.moe import Routing, routed_experts
from shardkit.nn import constrain, dropout, param, scan_stack, stack

from .llama import RESIDUAL_BSD, Attention, Block, Llama, LlamaConfig, SwiGLU, normal, ones, rms_norm

GATINGS = ("softmax", "sigmoid")
ROUTINGS = ("dropless", "capacity")


@dataclasses.dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    """The Llama fields (`mlp` is each expert's hidden width) and the mixture's."""

    experts: int = 8
    top_k: int = 2
    moe_every: int = 1  # every n-th layer is MoE (the n-th of each group of n), the others dense
    gating: str = "softmax"
    shared_expert: bool = False  # one dense SwiGLU of width `mlp` that every token also goes through (DeepSeek)
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.001
    routing: str = "dropless"
    capacity_factor: float = 1.25

    def __post_init__(self):
        super().__post_init__()
        if self.top_k > self.experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be at most model.experts ({self.experts})")
        if self.layers % self.moe_every:
            raise ValueError(f"model.layers ({self.layers}) must be a multiple of model.moe_every ({self.moe_every})")
        if self.gating not in GATINGS:
            raise ValueError(f"model.gating must be one of {list(GATINGS)}, got {self.gating!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"model.routing must be one of {list(ROUTINGS)}, got {self.routing!r}")
        if self.capacity_factor <= 0 or self.aux_loss_weight < 0 or self.z_loss_weight < 0:
            raise ValueError("model.capacity_factor must be > 0 and the aux loss weights >= 0")

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every

    def capacity(self, seq_len: int) -> int:
        """Slots per expert per sequence under capacity routing."""
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.experts)


class RouterStats(NamedTuple):
    """What the MoE layers report, per sequence (row), summed over the layers so far.

    `layer_B` counts the MoE layers passed (the same in every row), so each layer files its expert load under its own
    index in `load_BMX`.
    """

    balance_B: jax.Array
    z_B: jax.Array
    load_BMX: jax.Array
    dropped_B: jax.Array
    layer_B: jax.Array

    @classmethod
    def zeros(cls, batch: int, cfg: MoeConfig) -> "RouterStats":
        f32 = lambda *shape: jnp.zeros(shape, jnp.float32)
        return cls(f32(batch), f32(batch), f32(batch, cfg.moe_layers, cfg.experts), f32(batch),
                   jnp.zeros((batch,), jnp.int32))


class Carry(NamedTuple):
    """What flows from layer to layer: the residual stream and the router statistics."""

    x_BSD: jax.Array
    stats: RouterStats


def top_k(scores_BSX: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` over the last axis (the same choices, ties to the lower index) as k rounds of argmax: XLA's
    SPMD partitioner splits an argmax along the batch, but gathers the whole batch for a TopK."""
    chosen, remaining = [], scores_BSX
    for _ in range(k):
        index_BS = jnp.argmax(remaining, axis=-1)
        chosen.append(index_BS)
        remaining = jnp.where(jax.nn.one_hot(index_BS, scores_BSX.shape[-1], dtype=bool), -jnp.inf, remaining)
    expert_BSK = jnp.stack(chosen, axis=-1)
    return jnp.take_along_axis(scores_BSX, expert_BSK, axis=-1), expert_BSK


class Router(nnx.Module):
    """Router logits (fp32), top-k choices and their weights, and the per-sequence auxiliary statistics."""

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        # The expert dimension is not `experts`: every rank routes its own tokens over all experts.
        self.w_DX = param(rngs, normal(cfg.embed**-0.5), (cfg.embed, cfg.experts), ("embed", None))

    def __call__(self, x_BSD: jax.Array):
        cfg = self.cfg
        logits_BSX = jnp.einsum("bsd,dx->bsx", x_BSD, self.w_DX[...]).astype(jnp.float32)
        scores_BSX = jax.nn.softmax(logits_BSX, -1) if cfg.gating == "softmax" else jax.nn.sigmoid(logits_BSX)
        top_BSK, expert_BSK = top_k(scores_BSX, cfg.top_k)
        weight_BSK = top_BSK / jnp.sum(top_BSK, axis=-1, keepdims=True)
        return expert_BSK, weight_BSK, self._balance(scores_BSX, expert_BSK), self._z(logits_BSX)

    def _balance(self, scores_BSX, expert_BSK) -> jax.Array:
        """Per sequence: X * sum_x f_x * P_x (f without gradient; P of normalised scores under sigmoid gating)."""
        cfg = self.cfg
        chosen_BSX = jax.nn.one_hot(expert_BSK, cfg.experts, dtype=jnp.float32).sum(axis=2)
        fraction_BX = jax.lax.stop_gradient(chosen_BSX.mean(axis=1) / cfg.top_k)
        probs_BSX = scores_BSX / jnp.sum(scores_BSX, axis=-1, keepdims=True)
        return cfg.experts * jnp.sum(fraction_BX * probs_BSX.mean(axis=1), axis=-1)

    @staticmethod
    def _z(logits_BSX) -> jax.Array:
        return jnp.mean(jax.nn.logsumexp(logits_BSX, axis=-1) ** 2, axis=1)


class Experts(nnx.Module):
    """`experts` SwiGLU experts, their weights stacked along the logical `experts` axis."""

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        d_init, f_init = normal(cfg.embed**-0.5), normal(cfg.mlp**-0.5)
        shape_XDF, shape_XFD = (cfg.experts, cfg.embed, cfg.mlp), (cfg.experts, cfg.mlp, cfg.embed)
        self.w_gate_XDF = param(rngs, d_init, shape_XDF, ("experts", "embed", "mlp"))
        self.w_up_XDF = param(rngs, d_init, shape_XDF, ("experts", "embed", "mlp"))
        self.w_down_XFD = param(rngs, f_init, shape_XFD, ("experts", "mlp", "embed"))


class MoeBlock(nnx.Module):
    """Pre-norm decoder block whose MLP is routed experts (plus an optional shared expert)."""

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attn_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        self.attn = Attention(cfg, rngs)
        self.mlp_norm_D = param(rngs, ones, (cfg.embed,), ("embed",))
        self.router = Router(cfg, rngs)
        self.experts = Experts(cfg, rngs)
        if cfg.shared_expert:
            self.shared = SwiGLU(cfg, rngs)

    def __call__(self, carry: Carry, positions_BS: jax.Array | None = None,
                 segments_BS: jax.Array | None = None) -> Carry:
        x_BSD, stats = carry
        attend = lambda h: self.attn(h, positions_BS, segments_BS)
        x_BSD = Block._residual(self, x_BSD, self.attn_norm_D[...], attend, "attention")
        normed_BSD = constrain(rms_norm(x_BSD, self.mlp_norm_D[...], self.cfg.norm_eps), RESIDUAL_BSD)
        moe_BSD, stats = self._moe(constrain(normed_BSD, ("batch", "sequence", "embed")), stats)
        x_BSD = x_BSD + dropout(constrain(moe_BSD, RESIDUAL_BSD), "mlp")
        return Carry(constrain(x_BSD, RESIDUAL_BSD), stats)

    def _moe(self, x_BSD: jax.Array, stats: RouterStats) -> tuple[jax.Array, RouterStats]:
        cfg = self.cfg
        expert_BSK, weight_BSK, balance_B, z_B = self.router(x_BSD)
        routing = Routing(cfg.routing, cfg.capacity(x_BSD.shape[1]))
        experts = self.experts
        out_BSD, dropped_B = routed_experts(x_BSD, expert_BSK, weight_BSK, experts.w_gate_XDF[...],
                                            experts.w_up_XDF[...], experts.w_down_XFD[...], routing)
        if cfg.shared_expert:
            out_BSD = out_BSD + self.shared(x_BSD)
        load_BX = jax.nn.one_hot(expert_BSK, cfg.experts, dtype=jnp.float32).sum(axis=(1, 2))
        slot_BM = jax.nn.one_hot(stats.layer_B, cfg.moe_layers, dtype=jnp.float32)
        stats = RouterStats(stats.balance_B + balance_B, stats.z_B + z_B,
                            stats.load_BMX + slot_BM[:, :, None] * load_BX[:, None, :],
                            stats.dropped_B + dropped_B, stats.layer_B + 1)
        return out_BSD, stats


class LayerGroup(nnx.Module):
    """`moe_every - 1` dense blocks then one MoE block: the unit the layer stack repeats."""

    def __init__(self, cfg: MoeConfig, rngs: nnx.Rngs):
        if cfg.moe_every > 1:
            self.dense = nnx.List([Block(cfg, rngs) for _ in range(cfg.moe_every - 1)])
        self.moe = MoeBlock(cfg, rngs)

    def __call__(self, carry: Carry, positions_BS: jax.Array | None = None,
                 segments_BS: jax.Array | None = None) -> Carry:
        x_BSD, stats = carry
        for block in getattr(self, "dense", ()):
            x_BSD = block(x_BSD, positions_BS, segments_BS)
        return self.moe(Carry(x_BSD, stats), positions_BS, segments_BS)


MIXTRAL_8X7B = MoeConfig(layers=32, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, vocab=32000,
                         rope_theta=1e6, norm_eps=1e-5, experts=8, top_k=2, aux_loss_weight=0.02)


class MoeLlama(Llama):
    """Decoder-only mixture-of-experts language model: tokens_BS -> logits_BSV.

    The split the training loss uses (shardkit/loss.py's lean protocol, with `layers_with_aux` in place of the plain
    scan over `LAYER_STACK`): `__call__` is `unembed(layers_with_aux(embed(tokens))[0])`.
    """

    Config = MoeConfig
    LAYER_STACK = "blocks"
    PRESETS = {
        "moe-tiny": MoeConfig(mlp=128),
        "tiny": MoeConfig(mlp=128),
        "mixtral-8x7b": MIXTRAL_8X7B,
    }

    @staticmethod
    def layer_stack(cfg: MoeConfig, rngs: nnx.Rngs):
        """`moe_layers` stacked `LayerGroup`s: the Llama's embedding, final norm and head stay as they are."""
        return stack(lambda r: LayerGroup(cfg, r), cfg.moe_layers, rngs)

    def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None) -> jax.Array:
        extra = () if positions_BS is None else (positions_BS,)
        return self.unembed(self.layers_with_aux(self.embed(tokens_BS), *extra)[0])

    def layers_with_aux(self, x_BSD: jax.Array, *extra, first_layer=0) -> tuple[jax.Array, jax.Array, dict]:
        """The layer stack: (x_BSD, the auxiliary loss to add to the mean cross entropy, its metrics as sums over rows).

        The metric sums add up over micro-batches and replicas; `shardkit.moe.moe_metrics` turns them into means.
        A pipeline of the 1F1B family (shardkit/pipeline/one_f_one_b.py) runs the stack chunk by chunk, each holding
        the layer groups from `first_layer` (an int or a traced index) on: a chunk's loss and sums are its layers'
        share (the rows counted as their share of the MoE layers too), so the chunks' add up to the whole stack's.
        """
        held = jax.tree.leaves(nnx.state(self.blocks))[0].shape[0]  # the layer groups this stack holds
        stats = RouterStats.zeros(x_BSD.shape[0], self.cfg)
        stats = stats._replace(layer_B=stats.layer_B + first_layer)
        carry = scan_stack(self.blocks, Carry(x_BSD, stats), *extra)
        stats, layers = carry.stats, self.cfg.moe_layers
        balance_B, z_B = stats.balance_B / layers, stats.z_B / layers
        aux_loss = self.cfg.aux_loss_weight * balance_B.mean() + self.cfg.z_loss_weight * z_B.mean()
        sums = {"rows": jnp.float32(x_BSD.shape[0] * held / layers), "balance": balance_B.sum(), "z": z_B.sum(),
                "load_MX": stats.load_BMX.sum(axis=0), "dropped": stats.dropped_B.sum(),
                "choices": jnp.float32(x_BSD.shape[0] * x_BSD.shape[1] * self.cfg.top_k * held)}
        return carry.x_BSD, aux_loss, sums
