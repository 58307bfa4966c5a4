"""Context parallelism: exact attention over a sequence sharded across one mesh axis, in two variants.

    ring       each device keeps its query block; key/value blocks travel around the ring with `ppermute`, n - 1 hops
               per layer (each overlapping a block's compute). K/V per device: O(s / n).
    allgather  each device all-gathers the whole K/V over the axis once per layer (the backward reduce-scatters dK/dV,
               by autodiff of the gather) and attends its own queries against it: fewer, larger messages, cheap with
               few KV heads (MaxText's GPU default), but O(s) K/V per device.

Both run the same per-block work: a fused kernel (shardkit.attention.blocks, `implementation` xla or cudnn) returns
each block's output and fp32 log-sum-exp, and the partial results are merged exactly (out = sum_i exp(lse_i - lse)
out_i, lse = logsumexp_i lse_i). The backward is a custom VJP: each block's gradients come from (q, k_i, v_i, the
global output and log-sum-exp, dout), as Transformer Engine's ring does with cuDNN; dq accumulates locally, and dk/dv
travel around the ring with their k/v block (ring) or accumulate into the gathered buffer (allgather).

Causal load balancing (zigzag): the sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i. Positions
then increase along every device's block, so the diagonal block (a device's queries against its own keys) is plain
causal attention on local indices, and every other block needs exactly half of the (2c x 2c) block, unmasked: either
all its queries against the first key chunk (the block comes from an earlier device) or its second query chunk against
both key chunks (a later device). Every device does the same work at every step, and only two kernel forms occur:
causal on a square block and unmasked. (cuDNN's causal mask in JAX 0.10.2 is top-left aligned only, so "causal with
an offset" is always expressed this way, for the all-gather variant too.) Where the rows arrive in contiguous order,
the reorder is two small ppermute rounds in and out of every layer; a training step that puts its rows in the
load-balanced order once (`Plan.balanced`: `balanced_order` of the tokens, with their rotary positions, segment ids
and targets, shardkit.attention.context) hands every layer blocks already in zigzag order, and nothing is reordered.

Packed documents: with segment ids (`segments_BS`, shardkit/data/packing.py), the queries' ids take the zigzag
reorder with the queries, the keys' ids travel with K/V (around the ring, or in the gather), and every block masks
pairs from different documents on top of the zigzag halves (the XLA block kernel). On cuDNN, the all-gather variant
runs cuDNN's packed layout instead, on the contiguous blocks (shardkit.attention.packed.gathered_packed_attention);
the ring, and rows already in the load-balanced order (the 1F1B family's), keep the XLA block kernel (the kernel
choice says why).

Dimension letters: B batch, S local queries, T local keys, K kv heads, G query heads per kv head, E head_dim, N blocks.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from shardkit.attention.blocks import (
    DEFAULT_CHUNK,
    IMPLEMENTATIONS,
    block_backward,
    block_forward,
    check_cudnn_inputs,
    merge_pair,
)
from shardkit.attention.packed import gathered_packed_attention
from shardkit.attention.reference import reference_attention
from shardkit.nested import region_call

VARIANTS = ("ring", "allgather")


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the blocks are computed: the variant, the block kernel, the mask, the XLA kernel's key chunk, and whether
    the sequence already arrives in the load-balanced order (`balanced_order`: each device's block is its zigzag
    chunks) rather than in contiguous blocks.

    `tick_branch`: the attention runs inside a branch of the 1F1B tick switch (shardkit/pipeline/one_f_one_b.py),
    which only some pipeline stages take. XLA:CPU's collective-permute meets every device of the program at one
    rendezvous, whatever its source-target pairs (jax 0.10.2: "Expected 16 threads to join the rendezvous"), so
    stages in another branch never arrive and it deadlocks; its all-gather, reduce-scatter and all-to-all meet only
    their replica group (the stage's own devices). There the ring's hops are all-gathers over the ring with each
    device keeping its predecessor's block (`_hop`: ring-size times the bytes, CPU meshes only), and the zigzag
    reorder, a collective-permute too, is refused: the executor puts its rows in the load-balanced order once."""

    variant: str = "ring"
    implementation: str = "xla"
    causal: bool = True
    chunk: int = DEFAULT_CHUNK
    balanced: bool = False
    tick_branch: bool = False

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"context-parallel variant must be one of {list(VARIANTS)}, got {self.variant!r}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"attention implementation must be one of {list(IMPLEMENTATIONS)}, "
                             f"got {self.implementation!r}")


def ring_attention(q_BSKGE, k_BTKE, v_BTKE, mesh: Mesh, axis: str, causal: bool = True, chunk: int = DEFAULT_CHUNK,
                   implementation: str = "xla", kv_spec: PartitionSpec | None = None,
                   segments_BS: jax.Array | None = None) -> jax.Array:
    """Ring attention on global arrays whose sequence dimension is sharded over `axis`; see `context_attention`."""
    plan = Plan("ring", implementation, causal, chunk)
    return context_attention(q_BSKGE, k_BTKE, v_BTKE, mesh, axis, plan, kv_spec, segments_BS)


def allgather_attention(q_BSKGE, k_BTKE, v_BTKE, mesh: Mesh, axis: str, causal: bool = True,
                        chunk: int = DEFAULT_CHUNK, implementation: str = "xla",
                        kv_spec: PartitionSpec | None = None, segments_BS: jax.Array | None = None) -> jax.Array:
    """All-gather-KV attention on global arrays whose sequence is sharded over `axis`; see `context_attention`."""
    plan = Plan("allgather", implementation, causal, chunk)
    return context_attention(q_BSKGE, k_BTKE, v_BTKE, mesh, axis, plan, kv_spec, segments_BS)


def context_attention(q_BSKGE, k_BTKE, v_BTKE, mesh: Mesh, axis: str, plan: Plan = Plan(),
                      kv_spec: PartitionSpec | None = None, segments_BS: jax.Array | None = None) -> jax.Array:
    """Attention on global arrays whose sequence dimension is sharded over `axis` (contiguous blocks, in order).

    The region is manual over every mesh axis not already manual, laid out as `kv_spec` says (the keys' spec,
    B T K E; the queries' adds an unsharded G): pass the layout's activation spec, or the batch and heads are
    replicated there. The cuDNN kernel cannot be partitioned inside a partially manual region; and with the XLA
    kernel in a region manual over `axis` alone, XLA:GPU gathered the batch over `fsdp` into it (recipes/cp.toml on
    h100x8: twice the K/V gathered and every fsdp rank attending the whole batch).

    Args:
        q_BSKGE, k_BTKE, v_BTKE: queries, keys and values of the whole sequence.
        mesh: the mesh holding `axis`.
        axis: the mesh axis the sequence is split over (`sequence`).
        plan: variant (ring | allgather), block kernel (xla | cudnn), causal mask, XLA key chunk.
        kv_spec: the keys' PartitionSpec over the mesh (the region's layout of batch and heads).
        segments_BS: packed documents' segment ids of the sequence (queries and keys alike), or None.
    """
    ring = mesh.shape[axis]
    if ring == 1:
        return reference_attention(q_BSKGE, k_BTKE, v_BTKE, plan.causal, segments_BS)
    check_sequence_divisible(q_BSKGE.shape[1], ring, plan.causal)
    if segments_BS is not None and plan.implementation == "cudnn" and (plan.variant == "ring" or plan.balanced):
        # Packed blocks of a ring, or in the load-balanced order (cuDNN's packed layout attends contiguous blocks):
        # see the module docstring.
        plan = dataclasses.replace(plan, implementation="xla")
    if plan.implementation == "cudnn":
        check_cudnn_inputs(q_BSKGE.dtype, q_BSKGE.shape[-1])
    manual = _manual_axes(mesh)
    kv_spec = _region_spec(kv_spec, axis, manual)
    q_spec = PartitionSpec(*kv_spec[:3], None, kv_spec[3])
    segments_spec = PartitionSpec(*kv_spec[:2])
    body = functools.partial(_region_body, axis=axis, plan=plan)
    return region_call(body, mesh, (q_spec, kv_spec, kv_spec, segments_spec), q_spec, manual, differentiable=3)(
        q_BSKGE, k_BTKE, v_BTKE, segments_BS)


def balanced_order(seq: int, ring: int) -> np.ndarray:
    """The load-balanced (zigzag) order of a sequence of `seq` positions over a ring of `ring` devices: the positions
    that device d's contiguous block holds are chunks d and 2 x ring - 1 - d of 2 x ring equal chunks."""
    chunks = np.arange(seq).reshape(2 * ring, seq // (2 * ring))
    return np.concatenate([chunks[c] for d in range(ring) for c in (d, 2 * ring - 1 - d)])


def check_sequence_divisible(seq: int, ring: int, causal: bool) -> None:
    """A ValueError unless `seq` splits into the ring's blocks (2 chunks per device for the causal zigzag)."""
    pieces = 2 * ring if causal else ring
    if seq % pieces:
        raise ValueError(f"sequence length {seq} is not divisible by {pieces} ({'2 x ' if causal else ''}ring of "
                         f"{ring})")


def _manual_axes(mesh: Mesh) -> set[str]:
    """Every mesh axis that an enclosing region has not made manual."""
    enclosing = set(jax.sharding.get_abstract_mesh().manual_axes)
    return set(mesh.axis_names) - enclosing


def _region_spec(kv_spec: PartitionSpec | None, axis: str, manual: set[str]) -> PartitionSpec:
    """The keys' spec inside the region: the sequence over `axis`, batch and heads over the manual axes they use."""
    entries = list(kv_spec or ()) + [None] * (4 - len(kv_spec or ()))
    keep = lambda entry: tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ()) if a in manual) or None
    batch, _, heads, head_dim = (keep(e) for e in entries)
    return PartitionSpec(batch, axis, heads, head_dim)


def _region_body(q_BSKGE, k_BTKE, v_BTKE, segments_BS, *, axis: str, plan: Plan):
    """The local block: queries (and their segment ids) to zigzag unless they arrive so, then the variant; K/V's
    segment ids go with them. Packed rows on cuDNN (all-gather only) stay in their contiguous blocks."""
    if segments_BS is not None and plan.implementation == "cudnn":
        if plan.balanced and plan.causal:
            raise ValueError("cuDNN's packed layout attends contiguous blocks: rows in the load-balanced order cannot "
                             "take it")
        return gathered_packed_attention(q_BSKGE, k_BTKE, v_BTKE, segments_BS, axis, "cudnn", plan.causal)
    reorder = plan.causal and not plan.balanced
    if reorder and plan.tick_branch:
        raise ValueError("inside the 1F1B tick switch the rows must arrive in the load-balanced order (Plan.balanced): "
                         "the zigzag reorder's collective-permutes would wait for stages in other branches")
    zigzag = (lambda x: x if x is None else to_zigzag(x, axis)) if reorder else (lambda x: x)
    q_BSKGE, q_segments_BS = zigzag(q_BSKGE), zigzag(segments_BS)
    if plan.variant == "allgather":
        out_BSKGE = _gathered(q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, segments_BS, axis, plan)
    else:
        out_BSKGE = _ring(q_BSKGE, zigzag(k_BTKE), zigzag(v_BTKE), q_segments_BS, q_segments_BS, axis, plan)
    return from_zigzag(out_BSKGE, axis) if reorder else out_BSKGE


# ---- layout helpers: contiguous blocks <-> zigzag chunks (inside shard_map, over `axis`) -----------------------------
def zigzag_moves(ring: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(zigzag slot, contiguous slot) -> ppermute pairs (source device, destination device).

    Contiguously, device d holds chunks 2d and 2d+1 (slots 0 and 1); in zigzag, device d holds chunks d and 2n-1-d.
    Grouping the moves by (slot, slot) gives four ppermutes, each a partial permutation (sources and destinations
    distinct), because chunk -> (device, slot) is a bijection.
    """
    moves: dict[tuple[int, int], list[tuple[int, int]]] = {(t, u): [] for t in (0, 1) for u in (0, 1)}
    for dst in range(ring):
        for zig_slot, chunk_id in enumerate((dst, 2 * ring - 1 - dst)):
            moves[(zig_slot, chunk_id % 2)].append((chunk_id // 2, dst))
    return moves


def to_zigzag(x_BS: jax.Array, axis: str) -> jax.Array:
    """This device's contiguous block (chunks 2d, 2d+1) -> its zigzag block (chunks d, 2n-1-d), along dimension 1."""
    slots = jnp.split(x_BS, 2, axis=1)
    moves = zigzag_moves(jax.lax.axis_size(axis))
    new = [sum(jax.lax.ppermute(slots[u], axis, moves[(t, u)]) for u in (0, 1)) for t in (0, 1)]
    return jnp.concatenate(new, axis=1)


def from_zigzag(x_BS: jax.Array, axis: str) -> jax.Array:
    """The inverse of `to_zigzag`: every move sent back along the reversed pairs."""
    slots = jnp.split(x_BS, 2, axis=1)
    moves = zigzag_moves(jax.lax.axis_size(axis))
    back = lambda pairs: [(dst, src) for src, dst in pairs]
    new = [sum(jax.lax.ppermute(slots[t], axis, back(moves[(t, u)])) for t in (0, 1)) for u in (0, 1)]
    return jnp.concatenate(new, axis=1)


def _gathered_blocks(x_BTKE: jax.Array, axis: str, causal: bool, balanced: bool = False) -> jax.Array:
    """The whole sequence's keys (or values) gathered over `axis`, as the n devices' blocks (N, B, T, K, E).

    Causal: device j's zigzag block (chunks j and 2n-1-j), cut straight from the contiguous gather, so keys and
    values need no zigzag reorder of their own; `balanced`: the devices' blocks are their zigzag blocks already.
    """
    ring = jax.lax.axis_size(axis)
    whole_BSKE = jax.lax.all_gather(x_BTKE, axis, axis=1, tiled=True)
    pieces = 2 * ring if causal else ring
    batch, length = whole_BSKE.shape[:2]
    chunks_BNCKE = whole_BSKE.reshape(batch, pieces, length // pieces, *whole_BSKE.shape[2:])
    if causal and not balanced:
        order = [c for j in range(ring) for c in (j, 2 * ring - 1 - j)]
        chunks_BNCKE = chunks_BNCKE[:, jnp.array(order)]
    blocks_BNTKE = chunks_BNCKE.reshape(batch, ring, x_BTKE.shape[1], *x_BTKE.shape[2:])
    return jnp.moveaxis(blocks_BNTKE, 1, 0)


def _next_device(ring: int) -> list[tuple[int, int]]:
    return [(d, (d + 1) % ring) for d in range(ring)]


def _hop(plan: Plan, axis: str):
    """The ring's hop: each device's block to the next device over `axis`. A collective-permute, except inside a
    tick branch on a CPU mesh (`Plan.tick_branch` says why): an all-gather over `axis`, each device keeping its
    predecessor's block."""
    ring = jax.lax.axis_size(axis)
    if not (plan.tick_branch and on_cpu()):
        return lambda x: jax.lax.ppermute(x, axis, _next_device(ring))
    previous = (jax.lax.axis_index(axis) - 1) % ring
    return lambda x: jax.lax.dynamic_index_in_dim(jax.lax.all_gather(x, axis), previous, 0, keepdims=False)


def on_cpu() -> bool:
    """Whether the enclosing region's mesh is on CPU."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    return (device.platform if device is not None else jax.default_backend()) == "cpu"


# ---- one visited block: forward merge and backward gradients ---------------------------------------------------------
def _segments(q_segments_BS, k_segments_BT, queries=slice(None), keys=slice(None)):
    """The block kernel's `segments` for these query and key slices of the block (None without packing)."""
    if q_segments_BS is None:
        return None
    return q_segments_BS[:, queries], k_segments_BT[:, keys]


def _fold_block(acc, q_BSKGE, k_BTKE, v_BTKE, source, device, plan: Plan, q_segments_BS=None, k_segments_BT=None):
    """Merge another device's block into acc = (out fp32, lse): all of it, or its balanced half (zigzag causal)."""
    out_BSKGE, lse_BKGS = acc
    kernel = functools.partial(block_forward, causal=False, implementation=plan.implementation, chunk=plan.chunk)
    segments = functools.partial(_segments, q_segments_BS, k_segments_BT)
    if not plan.causal:
        return merge_pair(out_BSKGE, lse_BKGS, *kernel(q_BSKGE, k_BTKE, v_BTKE, segments=segments()))
    half = q_BSKGE.shape[1] // 2

    def early():  # the block is from an earlier device: all queries see its first chunk, none its second
        new = kernel(q_BSKGE, k_BTKE[:, :half], v_BTKE[:, :half], segments=segments(keys=slice(None, half)))
        return merge_pair(out_BSKGE, lse_BKGS, *new)

    def late():  # from a later device: only the second query chunk sees it, and sees all of it
        new = kernel(q_BSKGE[:, half:], k_BTKE, v_BTKE, segments=segments(queries=slice(half, None)))
        out_half, lse_half = merge_pair(out_BSKGE[:, half:], lse_BKGS[..., half:], *new)
        return (jnp.concatenate([out_BSKGE[:, :half], out_half], 1),
                jnp.concatenate([lse_BKGS[..., :half], lse_half], -1))

    return jax.lax.cond(source < device, early, late)


def _grad_block(grads, q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, do_BSKGE, source, device, plan: Plan,
                q_segments_BS=None, k_segments_BT=None):
    """Add another device's block's gradients to grads = (dq, dk, dv) (fp32), the same halves as `_fold_block`."""
    dq, dk, dv = grads
    kernel = functools.partial(block_backward, causal=False, implementation=plan.implementation, chunk=plan.chunk)
    segments = functools.partial(_segments, q_segments_BS, k_segments_BT)
    if not plan.causal:
        g = kernel(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, do_BSKGE, segments=segments())
        return dq + g[0], dk + g[1], dv + g[2]
    half = q_BSKGE.shape[1] // 2

    def early():
        g = kernel(q_BSKGE, k_BTKE[:, :half], v_BTKE[:, :half], out_BSKGE, lse_BKGS, do_BSKGE,
                   segments=segments(keys=slice(None, half)))
        return dq + g[0], dk.at[:, :half].add(g[1]), dv.at[:, :half].add(g[2])

    def late():
        g = kernel(q_BSKGE[:, half:], k_BTKE, v_BTKE, out_BSKGE[:, half:], lse_BKGS[..., half:], do_BSKGE[:, half:],
                   segments=segments(queries=slice(half, None)))
        return dq.at[:, half:].add(g[0]), dk + g[1], dv + g[2]

    return jax.lax.cond(source < device, early, late)


def _own_block(q_BSKGE, k_BTKE, v_BTKE, plan: Plan, segments=None):
    """The diagonal block (a device's queries against its own keys): causal on local indices when causal."""
    out_BSKGE, lse_BKGS = block_forward(q_BSKGE, k_BTKE, v_BTKE, plan.causal, plan.implementation, plan.chunk,
                                        segments)
    return out_BSKGE.astype(jnp.float32), lse_BKGS


def _own_grads(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, do_BSKGE, plan: Plan, segments=None):
    return block_backward(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, do_BSKGE, plan.causal, plan.implementation,
                          plan.chunk, segments)


# ---- the ring --------------------------------------------------------------------------------------------------------
# The segment ids (None without packing) are integer inputs of the custom VJPs: their cotangent is None.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring(q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, axis: str, plan: Plan):
    return _ring_forward(q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, axis, plan)[0]


class _ForwardHop(NamedTuple):
    """The forward ring's loop state: the visiting K/V block with its segment ids, and the running (out, lse)."""

    k_BTKE: jax.Array
    v_BTKE: jax.Array
    k_segments_BT: jax.Array | None
    acc: tuple


def _ring_forward(q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, axis, plan):
    ring, device = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    hop_on = _hop(plan, axis)

    def ring_step(carry: _ForwardHop, hop):
        k_BTKE, v_BTKE, k_segments_BT = jax.tree.map(hop_on, (carry.k_BTKE, carry.v_BTKE, carry.k_segments_BT))
        acc = _fold_block(carry.acc, q_BSKGE, k_BTKE, v_BTKE, (device - hop) % ring, device, plan, q_segments_BS,
                          k_segments_BT)
        return _ForwardHop(k_BTKE, v_BTKE, k_segments_BT, acc), None

    own = _own_block(q_BSKGE, k_BTKE, v_BTKE, plan, _segments(q_segments_BS, k_segments_BT))
    last, _ = jax.lax.scan(ring_step, _ForwardHop(k_BTKE, v_BTKE, k_segments_BT, own), jnp.arange(1, ring))
    out_BSKGE, lse_BKGS = last.acc
    out_BSKGE = out_BSKGE.astype(q_BSKGE.dtype)
    return out_BSKGE, (q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, out_BSKGE, lse_BKGS)


class _BackwardHop(NamedTuple):
    """The backward ring's loop state: the queries' gradient stays, the K/V block, its segment ids and its gradients
    travel."""

    dq: jax.Array
    k_BTKE: jax.Array
    v_BTKE: jax.Array
    k_segments_BT: jax.Array | None
    dk: jax.Array
    dv: jax.Array


def _ring_backward(axis, plan, residuals, do_BSKGE):
    q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, out_BSKGE, lse_BKGS = residuals
    ring, device = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    hop_on = _hop(plan, axis)
    visit = functools.partial(_grad_block, out_BSKGE=out_BSKGE, lse_BKGS=lse_BKGS, do_BSKGE=do_BSKGE, plan=plan,
                              q_segments_BS=q_segments_BS)

    def ring_step(carry: _BackwardHop, hop):
        # dk/dv travel with the k/v block they belong to.
        k_BTKE, v_BTKE, k_segments_BT, dk, dv = jax.tree.map(
            hop_on, (carry.k_BTKE, carry.v_BTKE, carry.k_segments_BT, carry.dk, carry.dv))
        dq, dk, dv = visit((carry.dq, dk, dv), q_BSKGE, k_BTKE, v_BTKE, source=(device - hop) % ring, device=device,
                           k_segments_BT=k_segments_BT)
        return _BackwardHop(dq, k_BTKE, v_BTKE, k_segments_BT, dk, dv), None

    dq, dk, dv = _own_grads(q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS, do_BSKGE, plan,
                            _segments(q_segments_BS, k_segments_BT))
    first = _BackwardHop(dq, k_BTKE, v_BTKE, k_segments_BT, dk, dv)
    last, _ = jax.lax.scan(ring_step, first, jnp.arange(1, ring))
    dq, dk, dv = last.dq, last.dk, last.dv
    dk, dv = hop_on(dk), hop_on(dv)  # the last hop home
    return dq.astype(q_BSKGE.dtype), dk.astype(k_BTKE.dtype), dv.astype(v_BTKE.dtype), None, None


_ring.defvjp(_ring_forward, _ring_backward)


# ---- all-gather KV ---------------------------------------------------------------------------------------------------
# The gather is inside the custom VJP, which keeps only the local K/V as residuals (O(s / n)) and gathers again in the
# backward (as Transformer Engine's all-gather context parallelism does), then reduce-scatters dK/dV in fp32 before
# casting them to the input dtype, so the n partial gradients of a key are summed at full precision. The keys'
# segment ids are gathered with them (contiguous in, cut into the same blocks).
@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gathered(q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, axis: str, plan: Plan):
    return _gathered_forward(q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, axis, plan)[0]


def _gather_keys(k_BTKE, v_BTKE, k_segments_BT, axis, plan):
    """K, V and the keys' segment ids (or None) of the whole sequence, as the devices' blocks."""
    return jax.tree.map(lambda x: _gathered_blocks(x, axis, plan.causal, plan.balanced),
                        (k_BTKE, v_BTKE, k_segments_BT))


def _gathered_forward(q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, axis, plan):
    keys = _gather_keys(k_BTKE, v_BTKE, k_segments_BT, axis, plan)
    out_BSKGE, lse_BKGS = _attend_gathered(q_BSKGE, *keys, q_segments_BS, axis, plan)
    return out_BSKGE, (q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, out_BSKGE, lse_BKGS)


def _gathered_backward(axis, plan, residuals, do_BSKGE):
    q_BSKGE, k_BTKE, v_BTKE, q_segments_BS, k_segments_BT, out_BSKGE, lse_BKGS = residuals
    k_NBTKE, v_NBTKE, k_segments_NBT = _gather_keys(k_BTKE, v_BTKE, k_segments_BT, axis, plan)
    dq, dk_NBTKE, dv_NBTKE = _gathered_grads(q_BSKGE, k_NBTKE, v_NBTKE, k_segments_NBT, q_segments_BS, out_BSKGE,
                                             lse_BKGS, do_BSKGE, axis, plan)
    # The transpose of `_gathered_blocks`, run in fp32: a reduce-scatter of the whole sequence's dK/dV.
    _, scatter = jax.vjp(lambda x: _gathered_blocks(x, axis, plan.causal, plan.balanced), k_BTKE.astype(jnp.float32))
    dk, dv = (scatter(x)[0] for x in (dk_NBTKE, dv_NBTKE))
    return dq.astype(q_BSKGE.dtype), dk.astype(k_BTKE.dtype), dv.astype(v_BTKE.dtype), None, None


_gathered.defvjp(_gathered_forward, _gathered_backward)


def _block(x_N, index):
    """Block `index` of stacked blocks (None stays None)."""
    return None if x_N is None else jax.lax.dynamic_index_in_dim(x_N, index, 0, keepdims=False)


def _whole(x_NBT):
    """The stacked blocks side by side again, along the sequence (None stays None)."""
    return None if x_NBT is None else jnp.concatenate(list(x_NBT), axis=1)


def _attend_gathered(q_BSKGE, k_NBTKE, v_NBTKE, k_segments_NBT, q_segments_BS, axis, plan):
    """Not causal: one unmasked call against the whole sequence. Causal: the ring's blocks, read from the gather."""
    ring, device = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    if not plan.causal:
        segments = _segments(q_segments_BS, _whole(k_segments_NBT))
        out_BSKGE, lse_BKGS = _own_block(q_BSKGE, _whole(k_NBTKE), _whole(v_NBTKE), plan, segments)
        return out_BSKGE.astype(q_BSKGE.dtype), lse_BKGS

    def step(acc, hop):
        source = (device - hop) % ring
        return _fold_block(acc, q_BSKGE, _block(k_NBTKE, source), _block(v_NBTKE, source), source, device, plan,
                           q_segments_BS, _block(k_segments_NBT, source)), None

    own_segments = _segments(q_segments_BS, _block(k_segments_NBT, device))
    acc = _own_block(q_BSKGE, _block(k_NBTKE, device), _block(v_NBTKE, device), plan, own_segments)
    (out_BSKGE, lse_BKGS), _ = jax.lax.scan(step, acc, jnp.arange(1, ring))
    return out_BSKGE.astype(q_BSKGE.dtype), lse_BKGS


class _GatheredGrads(NamedTuple):
    """The all-gather backward's loop state: the queries' gradient and every block's K/V gradient so far (fp32)."""

    dq: jax.Array
    dk_NBTKE: jax.Array
    dv_NBTKE: jax.Array


def _gathered_grads(q_BSKGE, k_NBTKE, v_NBTKE, k_segments_NBT, q_segments_BS, out_BSKGE, lse_BKGS, do_BSKGE, axis,
                    plan):
    """(dq, dK, dV) in fp32, dK/dV for the whole gathered sequence (N, B, T, K, E), before the reduce-scatter."""
    ring, device = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    if not plan.causal:
        blocks = lambda x_BSKE: jnp.stack(jnp.split(x_BSKE, ring, axis=1))
        segments = _segments(q_segments_BS, _whole(k_segments_NBT))
        dq, dk, dv = _own_grads(q_BSKGE, _whole(k_NBTKE), _whole(v_NBTKE), out_BSKGE, lse_BKGS, do_BSKGE, plan,
                                segments)
        return dq, blocks(dk), blocks(dv)
    visit = functools.partial(_grad_block, out_BSKGE=out_BSKGE, lse_BKGS=lse_BKGS, do_BSKGE=do_BSKGE, plan=plan,
                              q_segments_BS=q_segments_BS)

    def step(grads: _GatheredGrads, hop):
        source = (device - hop) % ring
        dq, dk, dv = visit((grads.dq, _block(grads.dk_NBTKE, source), _block(grads.dv_NBTKE, source)), q_BSKGE,
                           _block(k_NBTKE, source), _block(v_NBTKE, source), source=source, device=device,
                           k_segments_BT=_block(k_segments_NBT, source))
        put = lambda buffer, block: jax.lax.dynamic_update_index_in_dim(buffer, block, source, 0)
        return _GatheredGrads(dq, put(grads.dk_NBTKE, dk), put(grads.dv_NBTKE, dv)), None

    own_segments = _segments(q_segments_BS, _block(k_segments_NBT, device))
    dq, dk, dv = _own_grads(q_BSKGE, _block(k_NBTKE, device), _block(v_NBTKE, device), out_BSKGE, lse_BKGS,
                            do_BSKGE, plan, own_segments)
    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    dk_NBTKE = jax.lax.dynamic_update_index_in_dim(zeros(k_NBTKE), dk, device, 0)
    dv_NBTKE = jax.lax.dynamic_update_index_in_dim(zeros(v_NBTKE), dv, device, 0)
    grads, _ = jax.lax.scan(step, _GatheredGrads(dq, dk_NBTKE, dv_NBTKE), jnp.arange(1, ring))
    return grads.dq, grads.dk_NBTKE, grads.dv_NBTKE
