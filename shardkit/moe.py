"""Mixture of experts: routed tokens reach their experts on one device, or across the `expert` mesh axis.

A model routes (router, top-k, gate weights: models/moe.py) and calls `routed_experts` with each token's chosen
experts, their weights and the stacked expert weights (logical axis `experts`). What runs depends on the layout:

    one device, or `experts` not split    dropless: the (token, choice) pairs sorted by expert, a grouped matmul
                                           (`jax.lax.ragged_dot`) per SwiGLU weight, then unsorted and combined.
                                           capacity: the expert-parallel path below without the all-to-alls.
    `experts` over a mesh axis (`expert`)  a `jax.shard_map` manual over that axis only (data, fsdp, tensor left to
                                           XLA): each rank scatters its own rows' choices into a (experts, rows,
                                           slots, D) buffer, an all-to-all sends every expert's slots to the rank
                                           holding it, that rank applies its experts to (ranks x rows x slots) tokens
                                           in one batched matmul, and an all-to-all sends the results back, where
                                           each token sums its choices' outputs weighted by its gates.

Slots are per expert and per sequence (row), so the routing never depends on how the batch is split:
`capacity` routing has `ceil(capacity_factor * S * k / experts)` slots and drops what overflows (all first choices
before any second choice, then by position); `dropless` under expert parallelism has S slots, as many as an expert can
be chosen by one sequence, and drops nothing. A fixed-size all-to-all therefore carries, per rank and per direction,
rows x experts x slots x D elements: tokens x k x D x capacity_factor under capacity routing, and tokens x experts x D
(experts / k times the routed tokens) under dropless routing. A ragged all-to-all would carry only the routed
tokens; XLA:CPU (where the tests run) does not implement it (jax 0.10.2), so both modes use the fixed one.

Letters: B batch, S sequence, D embed, F mlp (per expert), X experts (x: one rank's), K choices per token (top_k),
R one rank's rows, C slots per expert per row, N expert ranks, T tokens, A (token, choice) pairs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.manual import to_varying
from shardkit.nested import nested, opaque
from shardkit.nn import constrain, current_context
from shardkit.pipeline.schedule import TICK_SCHEDULES
from shardkit.rules import axes_degree

ROUTING_MODES = ("dropless", "capacity")
EXPERTS = "experts"  # the logical axis of the stacked expert weights


@dataclasses.dataclass(frozen=True)
class Routing:
    """`mode`: dropless or capacity; `capacity`: slots per expert per sequence under capacity routing."""

    mode: str = "dropless"
    capacity: int = 0

    def __post_init__(self):
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"routing must be one of {list(ROUTING_MODES)}, got {self.mode!r}")

    def slots(self, seq_len: int) -> int:
        """Slots per expert per sequence: an expert is chosen at most once per token, so S never drops."""
        return seq_len if self.mode == "dropless" else min(self.capacity, seq_len)


def routed_experts(x_BSD, expert_BSK, weight_BSK, w_gate_XDF, w_up_XDF, w_down_XFD,
                   routing: Routing = Routing()) -> tuple[jax.Array, jax.Array]:
    """The routed SwiGLU experts' combined output for every token, and the dropped choices per row (fp32).

    Args:
        x_BSD: the tokens (the MoE layer's normalised input).
        expert_BSK: each token's chosen experts (int), K distinct ones.
        weight_BSK: their gate weights.
        w_gate_XDF, w_up_XDF, w_down_XFD: the experts' SwiGLU weights, stacked on the logical `experts` axis.
        routing: dropless or capacity (with its slots per expert per sequence).
    """
    context = current_context()
    weights = (w_gate_XDF, w_up_XDF, w_down_XFD)
    axis = expert_axis(context)
    if axis is not None:
        return expert_parallel(x_BSD, expert_BSK, weight_BSK, weights, routing.slots(x_BSD.shape[1]), context, axis)
    if routing.mode == "dropless":
        return dropless_grouped(x_BSD, expert_BSK, weight_BSK, weights), jnp.zeros(x_BSD.shape[:1], jnp.float32)
    return _local_slots(x_BSD, expert_BSK, weight_BSK, weights, routing.slots(x_BSD.shape[1]))


def expert_axis(context) -> str | None:
    """The mesh axis the context's activation rules split `experts` over (None: not split, or no layout)."""
    if context.mesh is None or context.activation_rules is None:
        return None
    axes = [axis for axis in context.activation_rules.get(EXPERTS, ()) if context.mesh.shape[axis] > 1]
    return axes[0] if axes else None


def swiglu(x_MD, w_gate_DF, w_up_DF, w_down_FD, matmul) -> jax.Array:
    """SwiGLU with `matmul(x, w)` doing the grouping (a grouped or a batched matmul)."""
    hidden = jax.nn.silu(matmul(x_MD, w_gate_DF)) * matmul(x_MD, w_up_DF)
    return matmul(hidden, w_down_FD)


# ---- dropless on one device: sort by expert, grouped matmul ----------------------------------------------------------
def dropless_grouped(x_BSD, expert_BSK, weight_BSK, weights) -> jax.Array:
    """Every (token, choice) pair through its expert: pairs sorted by expert, `jax.lax.ragged_dot` per weight."""
    batch, seq, embed = x_BSD.shape
    choices = expert_BSK.shape[-1]
    experts = weights[0].shape[0]
    x_TD = x_BSD.reshape(batch * seq, embed)
    expert_A = expert_BSK.reshape(-1)
    order_A = jnp.argsort(expert_A, stable=True)
    sizes_X = jnp.bincount(expert_A, length=experts).astype(jnp.int32)
    grouped = lambda x, w: jax.lax.ragged_dot(x, w, sizes_X)
    y_AD = swiglu(x_TD[order_A // choices], *weights, grouped)
    y_TKD = jnp.zeros_like(y_AD).at[order_A].set(y_AD, unique_indices=True).reshape(batch * seq, choices, embed)
    weight_TK = weight_BSK.reshape(batch * seq, choices).astype(y_TKD.dtype)
    return jnp.einsum("tk,tkd->td", weight_TK, y_TKD).reshape(x_BSD.shape)


# ---- slots: dispatch into (experts, rows, slots) buffers and combine back --------------------------------------------
def assign_slots(expert_SK: jax.Array, experts: int, slots: int) -> jax.Array:
    """Each choice's slot at its expert within one sequence; `slots` (out of range) where it overflows.

    First choices of every token are placed before any second choice, each in position order (GShard's priority).
    """
    seq, choices = expert_SK.shape
    chosen_KSX = jax.nn.one_hot(expert_SK.T, experts, dtype=jnp.int32)
    before_KSX = jnp.cumsum(chosen_KSX.reshape(choices * seq, experts), axis=0).reshape(chosen_KSX.shape) - 1
    slot_KS = jnp.sum(before_KSX * chosen_KSX, axis=-1)
    return jnp.where(slot_KS < slots, slot_KS, slots).T


def _dispatch_row(x_SD, expert_SK, slot_SK, experts: int, slots: int) -> jax.Array:
    """One sequence's tokens into their experts' slots: (experts, slots, D), zeros where no choice landed."""
    x_SKD = jnp.broadcast_to(x_SD[:, None, :], (*expert_SK.shape, x_SD.shape[-1]))
    buffer_XCD = jnp.zeros((experts, slots, x_SD.shape[-1]), x_SD.dtype)
    return buffer_XCD.at[expert_SK, slot_SK].set(x_SKD, mode="drop", unique_indices=True)


def _combine_row(y_XCD, expert_SK, slot_SK, weight_SK) -> jax.Array:
    """One sequence's outputs: each token's choices read back from their slots (zero if dropped), gate-weighted."""
    y_SKD = y_XCD.at[expert_SK, slot_SK].get(mode="fill", fill_value=0, unique_indices=True)
    return jnp.einsum("sk,skd->sd", weight_SK.astype(y_XCD.dtype), y_SKD)


def dispatch(x_RSD, expert_RSK, experts: int, slots: int) -> tuple[jax.Array, jax.Array]:
    """Rows' tokens into a (experts, rows, slots, D) buffer, and every choice's slot (R, S, K)."""
    slot_RSK = jax.vmap(assign_slots, in_axes=(0, None, None))(expert_RSK, experts, slots)
    buffer_RXCD = jax.vmap(_dispatch_row, in_axes=(0, 0, 0, None, None))(x_RSD, expert_RSK, slot_RSK, experts, slots)
    return buffer_RXCD.swapaxes(0, 1), slot_RSK


def combine(y_XRCD, expert_RSK, slot_RSK, weight_RSK) -> jax.Array:
    """The inverse of `dispatch`, each token summing its choices' outputs with its gate weights: (R, S, D)."""
    return jax.vmap(_combine_row)(y_XRCD.swapaxes(0, 1), expert_RSK, slot_RSK, weight_RSK)


def batched_experts(buffer_XMD, weights) -> jax.Array:
    """Every expert on its own tokens: one batched matmul per SwiGLU weight."""
    return swiglu(buffer_XMD, *weights, lambda x, w: jnp.einsum("xmd,xdf->xmf", x, w))


def dropped(slot_RSK, slots: int) -> jax.Array:
    """Choices that found no slot, per row (fp32)."""
    return jnp.sum(slot_RSK >= slots, axis=(1, 2)).astype(jnp.float32)


def _local_slots(x_BSD, expert_BSK, weight_BSK, weights, slots: int) -> tuple[jax.Array, jax.Array]:
    """Slot routing with every expert here (capacity routing on one device)."""
    experts = weights[0].shape[0]
    buffer_XBCD, slot_BSK = dispatch(x_BSD, expert_BSK, experts, slots)
    shape = buffer_XBCD.shape
    y_XBCD = batched_experts(buffer_XBCD.reshape(experts, -1, shape[-1]), weights).reshape(shape)
    return combine(y_XBCD, expert_BSK, slot_BSK, weight_BSK), dropped(slot_BSK, slots)


# ---- expert parallelism: all-to-all over the expert axis -------------------------------------------------------------
EXPERT_WEIGHT_AXES = (("experts", "embed", "mlp"), ("experts", "embed", "mlp"), ("experts", "mlp", "embed"))


def expert_parallel(x_BSD, expert_BSK, weight_BSK, weights, slots: int, context, axis: str):
    """Slot routing with the experts split over mesh axis `axis`, in a shard_map manual over the batch's axes.

    Manual over every axis that splits the batch (`expert`, and `data`/`fsdp` when they are > 1), not over `expert`
    alone: XLA's SPMD partitioner (jax 0.10.2) cannot split an all-to-all's operand over an automatic axis and
    all-gathers the whole buffer over `data` (or `fsdp`) first, doubling the bytes per data rank. With those axes
    manual each rank holds its own rows and the all-to-all moves exactly its dispatch buffer. `tensor` (the experts'
    hidden dimension) stays automatic. The expert weights enter in their compute layout (activation rules: split over
    `axis`, FSDP's embed gathered as for any layer), so the region needs no collective of its own for them.
    """
    manual_already = set(getattr(context.mesh, "manual_axes", ()))
    batch_axes = tuple(a for a in context.activation_rules.get("batch", ())
                       if context.mesh.shape[a] > 1 and a not in manual_already)
    weights = tuple(constrain(w, logical) for w, logical in zip(weights, EXPERT_WEIGHT_AXES))
    region = ExpertRegion(context.mesh, batch_axes, axis, weights[0].shape[0], slots)
    return region.forward()(x_BSD, expert_BSK, weight_BSK, *weights)


@dataclasses.dataclass(frozen=True)
class ExpertRegion:
    """The expert-parallel shard_map: its mesh (concrete, or a pipeline region's abstract one), the axes it is manual
    over (the batch's, `axis` among them), the expert axis, the expert count and the slots per expert per row."""

    mesh: Any
    batch_axes: tuple[str, ...]
    axis: str
    experts: int
    slots: int

    def body(self, x_RSD, expert_RSK, weight_RSK, *weights):
        return _expert_parallel_body(x_RSD, expert_RSK, weight_RSK, *weights, axis=self.axis, experts=self.experts,
                                     slots=self.slots)

    def _map(self, body, in_specs, out_specs):
        if nested(self.mesh):  # inside a pipeline stage: see shardkit.nested
            body = opaque(body, (True, False) + (True,) * (len(in_specs) - 2))  # the choices are integers
        return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(self.batch_axes))

    def forward(self):
        """(x, choices, gate weights, expert weights) -> (out, dropped per row)."""
        rows, experts = PartitionSpec(self.batch_axes), PartitionSpec(self.axis)
        return self._map(self.body, (rows,) * 3 + (experts,) * 3, (rows, rows))


def _expert_parallel_body(x_RSD, expert_RSK, weight_RSK, w_gate_xDF, w_up_xDF, w_down_xFD, *, axis: str,
                          experts: int, slots: int):
    """One expert rank: dispatch its rows, all-to-all to the experts' ranks, experts, all-to-all back, combine.

    The expert weights are replicated over the region's other manual axes (`data`, `fsdp`): cast to per-rank values
    once here, so their gradients' psum over those axes is one sum, and on a CPU mesh an fp32 one (`to_varying`:
    XLA:CPU aborts compiling a bf16 psum in a partially manual region, tests/xla_cpu_bf16_psum_abort.py).
    """
    w_gate_xDF, w_up_xDF, w_down_xFD = (to_varying(w) for w in (w_gate_xDF, w_up_xDF, w_down_xFD))
    buffer_XRCD, slot_RSK = dispatch(x_RSD, expert_RSK, experts, slots)
    local_experts = w_gate_xDF.shape[0]
    # Expert e lives on rank e // x: rank n's chunk of the buffer goes to rank n, which receives one per sender.
    buffer_NxRCD = buffer_XRCD.reshape(experts // local_experts, local_experts, *buffer_XRCD.shape[1:])
    received_NxRCD = jax.lax.all_to_all(buffer_NxRCD, axis, split_axis=0, concat_axis=0, tiled=True)
    y_NxRCD = _experts_of_rank(received_NxRCD, (w_gate_xDF, w_up_xDF, w_down_xFD))
    returned_NxRCD = jax.lax.all_to_all(y_NxRCD, axis, split_axis=0, concat_axis=0, tiled=True)
    out_RSD = combine(returned_NxRCD.reshape(buffer_XRCD.shape), expert_RSK, slot_RSK, weight_RSK)
    return out_RSD, dropped(slot_RSK, slots)


def _experts_of_rank(received_NxRCD, weights) -> jax.Array:
    """This rank's experts on what every sender dispatched to them (the senders' rows stay a dimension of their own)."""
    matmul = lambda x, w: jnp.einsum("nxrcd,xdf->nxrcf", x, w)
    return swiglu(received_NxRCD, *weights, matmul)


# ---- layout checks, metrics and the analytic all-to-all ------------------------------------------------------------
def model_experts(logical: Mapping) -> bool:
    """Whether any parameter of the model has the logical axis `experts`."""
    leaves = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    return any(EXPERTS in axes for axes in leaves)


def check_expert_layout(recipe, config: Any, logical: Mapping, rules, mesh_sizes: Mapping[str, int]) -> None:
    """Raise a ShardkitError naming the field when the layout cannot place the experts as the recipe asks.

    Checked before any parameter's spec, so the message names the mesh axis rather than one weight: `experts` mapped
    (or `mesh.expert` > 1) for a model without experts; an expert count the expert axis does not divide; `experts`
    laid out differently for parameters and compute, or over more than one axis; a layer stack a pipeline cannot
    split; capacity routing under the 1F1B family with context parallelism (the load-balanced order).
    """
    ranks = mesh_sizes["expert"]
    mentions = _rules_mention_experts(recipe.rules)
    if not model_experts(logical):
        if ranks > 1:
            raise ShardkitError("mesh.expert", f"mesh.expert = {ranks} but model {recipe.model.name!r} has no experts "
                                "(no parameter on the logical axis 'experts'); use mesh.expert = 1 or a "
                                "mixture-of-experts model (model.name = \"moe\")")
        if mentions:
            raise ShardkitError(mentions, f"maps 'experts' but model {recipe.model.name!r} has no experts (no "
                                "parameter on the logical axis 'experts'); remove it or use model.name = \"moe\"")
        return
    param_axes, compute_axes = rules.params.get(EXPERTS, ()), rules.activations.get(EXPERTS, ())
    if tuple(param_axes) != tuple(compute_axes) or len(compute_axes) > 1:
        raise ShardkitError("rules.expert", f"'experts' must map to one mesh axis, the same for parameters and "
                            f"compute; got params {list(param_axes)} and activations {list(compute_axes)}")
    degree = axes_degree(compute_axes, mesh_sizes)
    if degree > 1 and compute_axes[0] not in rules.activations.get("batch", ()):
        raise ShardkitError("rules.activations.batch", f"expert parallelism over {compute_axes[0]!r} needs the batch "
                            f"split over it too (each rank routes its own rows); add {compute_axes[0]!r} to the rule")
    if config.experts % degree:
        field = f"mesh.{compute_axes[0]}" if compute_axes else "mesh.expert"
        raise ShardkitError(field, f"{degree} expert ranks cannot hold model.experts = {config.experts} evenly; use a "
                            f"size that divides {config.experts}")
    _check_expert_pipeline(recipe, config, mesh_sizes)


def _rules_mention_experts(section) -> str | None:
    """The first `[rules]` field that maps `experts`, or None."""
    if EXPERTS in (section.expert or ()):
        return "rules.expert"
    for table in ("params", "activations"):
        if any(name == EXPERTS and axes for name, axes in getattr(section, table)):
            return f"rules.{table}.{EXPERTS}"
    return None


def _check_expert_pipeline(recipe, config, mesh_sizes) -> None:
    stages = mesh_sizes["pipeline"]
    if stages == 1:
        return
    if recipe.pipeline.schedule in TICK_SCHEDULES and mesh_sizes["sequence"] > 1 and config.routing == "capacity":
        raise ShardkitError("model.routing", f"capacity routing drops choices by position, and under "
                            f"{recipe.pipeline.schedule!r} with context parallelism the stages see the sequence in "
                            "the load-balanced order (shardkit.pipeline.one_f_one_b.in_step_order), so it would drop "
                            "others than one device; use routing = \"dropless\" or pipeline.schedule = 'gpipe'")
    groups, chunks = config.moe_layers, stages * recipe.pipeline.repeats
    if groups % chunks:
        raise ShardkitError("model.layers", f"{groups} layer groups (model.layers / model.moe_every) cannot be split "
                            f"into {stages} stages x {recipe.pipeline.repeats} repeats; use a multiple of {chunks}")
    train, replicas = recipe.train, mesh_sizes["data"] * mesh_sizes["fsdp"] * mesh_sizes["expert"]
    rows = train.global_batch // train.grad_accum // recipe.pipeline.microbatches
    if rows % replicas:
        raise ShardkitError("pipeline.microbatches", f"each micro-batch of {rows} sequences must split over the "
                            f"{replicas} data x fsdp x expert ranks; use fewer micro-batches or a larger "
                            "train.global_batch")


def moe_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Step metrics from the MoE layers' sums over rows (empty for a model without them).

    moe_balance_loss and moe_z_loss are means over sequences and MoE layers (before their weights);
    moe_load_min / moe_load_max the fewest and most choices any expert of any MoE layer received in the step;
    moe_dropped_fraction the share of choices that capacity routing dropped.
    """
    if not sums:
        return {}
    return {
        "moe_balance_loss": sums["balance"] / sums["rows"], "moe_z_loss": sums["z"] / sums["rows"],
        "moe_load_min": sums["load_MX"].min(), "moe_load_max": sums["load_MX"].max(),
        "moe_dropped_fraction": sums["dropped"] / sums["choices"],
    }


def all_to_all_bytes(layout) -> float:
    """Analytic all-to-all bytes per step per device over the expert axis: each MoE layer sends its rows' dispatch
    buffer (rows x experts x slots x D, the compute dtype) to the experts and the results back, and the backward pass
    sends both gradients, 4 buffers a layer per micro-batch (6 when a remat policy recomputes the forward's).

    Under capacity routing rows x experts x slots is the analytic tokens x k x capacity_factor (rounded up to whole
    slots per sequence); dropless routing has S slots, tokens x experts. 0 without expert parallelism.
    """
    cfg, recipe, sizes = layout.config, layout.recipe, layout.mesh.shape
    axes = [axis for axis in layout.rules.activations.get(EXPERTS, ()) if sizes[axis] > 1]
    if not axes or not hasattr(cfg, "experts"):
        return 0.0
    train = recipe.train
    batch_degree = layout.degree("batch")
    rows = train.global_batch // train.grad_accum // batch_degree
    slots = Routing(cfg.routing, cfg.capacity(train.seq_len)).slots(train.seq_len)
    itemsize = jax.numpy.dtype(layout.policy.compute_dtype).itemsize
    buffer = rows * cfg.experts * slots * cfg.embed * itemsize
    passes = 6 if train.remat != "none" else 4
    layers_here = cfg.moe_layers // sizes["pipeline"]
    return float(buffer * passes * layers_here * train.grad_accum)


def expert_placement(layout) -> dict[str, Any] | None:
    """The `plan` entry of a mixture-of-experts layout (None for a dense model): which rank of the expert axis holds
    which experts, the routing, and the analytic all-to-all bytes per step (`all_to_all_bytes`)."""
    cfg = layout.config
    if not hasattr(cfg, "experts"):
        return None
    axes = [axis for axis in layout.rules.params.get(EXPERTS, ()) if layout.mesh.shape[axis] > 1]
    ranks = layout.mesh.shape[axes[0]] if axes else 1
    per_rank = cfg.experts // ranks
    seq_len = layout.recipe.train.seq_len
    return {
        "experts": cfg.experts, "top_k": cfg.top_k, "moe_layers": cfg.moe_layers, "axis": axes[0] if axes else None,
        "ranks": ranks, "placement": [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks)],
        "routing": cfg.routing, "slots_per_sequence": Routing(cfg.routing, cfg.capacity(seq_len)).slots(seq_len),
        "all_to_all_bytes": all_to_all_bytes(layout),
    }


def format_placement(entry: Mapping[str, Any]) -> str:
    """The experts section of `shardkit plan`'s text output."""
    where = f"over mesh axis {entry['axis']!r} ({entry['ranks']} ranks)" if entry["axis"] else "on every device"
    lines = [f"experts: {entry['experts']} per MoE layer x {entry['moe_layers']} layers, top-{entry['top_k']}, "
             f"{entry['routing']} routing ({entry['slots_per_sequence']} slots per expert per sequence), {where}"]
    if entry["axis"]:
        placement = enumerate(entry["placement"])
        lines += [f"  rank {rank}: experts {experts[0]}-{experts[-1]}" for rank, experts in placement]
        lines.append(f"  all-to-all per step (dispatch + combine, forward + backward, per device): "
                     f"{entry['all_to_all_bytes']:,.0f} bytes")
    return "\n".join(lines)
