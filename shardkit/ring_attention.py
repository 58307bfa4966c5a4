"""Ring attention: exact attention over a sequence sharded across one mesh axis (context parallelism).

Each device keeps its query block; key/value blocks travel around the ring with `ppermute`, and each device folds every
block it sees into a numerically stable online softmax (running max `m`, running sum `l`, unnormalised output `o`).
Within a block the keys are processed in chunks of at most `chunk` keys, so the score matrix that exists at any moment
is (local queries x chunk), never (local queries x local keys): stored activations are O(s / n) per device.

Causal load balancing (zigzag): the sequence is cut into 2n chunks and device i holds chunks i and 2n-1-i. At every
ring step after the first, a device then needs exactly half of the (2c x 2c) block, either all its queries against the
first key chunk (the block comes from an earlier device) or its second query chunk against both key chunks (a later
device), so every device does the same work at every step. The reorder from the contiguous layout that the rest of the
model uses is two small ppermute rounds in and out, about the bytes of one all-to-all of q, k, v and the output.

Backward: a custom VJP in the FlashAttention-2 style. The forward keeps q, k, v, the output and the log-sum-exp; the
backward recomputes the probabilities block by block, accumulates dq locally, and sends dk/dv around the ring with
their k/v blocks, so after n hops each device holds the gradient of its own keys and values.

Dimension letters: B batch, S local queries, T local keys, K kv heads, G query heads per kv head, E head_dim,
C key chunk, N number of chunks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

NEG_INF = float(jnp.finfo(jnp.float32).min)  # finite, so a fully masked chunk never makes inf - inf
DEFAULT_CHUNK = 512


def reference_attention(q_BSKGE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, causal: bool = True) -> jax.Array:
    """Plain grouped-query attention on whole sequences (the definition ring attention must equal); fp32 softmax."""
    scale = q_BSKGE.shape[-1] ** -0.5
    scores_BKGST = jnp.einsum("bskge,btke->bkgst", q_BSKGE, k_BTKE).astype(jnp.float32) * scale
    if causal:
        seq, keys = q_BSKGE.shape[1], k_BTKE.shape[1]
        mask_111ST = jnp.tril(jnp.ones((seq, keys), dtype=bool))[None, None, None]
        scores_BKGST = jnp.where(mask_111ST, scores_BKGST, NEG_INF)
    probs_BKGST = jax.nn.softmax(scores_BKGST, axis=-1).astype(v_BTKE.dtype)
    return jnp.einsum("bkgst,btke->bskge", probs_BKGST, v_BTKE)


def ring_attention(
    q_BSKGE: jax.Array,
    k_BTKE: jax.Array,
    v_BTKE: jax.Array,
    mesh: Mesh,
    axis: str,
    causal: bool = True,
    chunk: int = DEFAULT_CHUNK,
) -> jax.Array:
    """Attention on global arrays whose sequence dimension is sharded over `axis` (contiguous blocks, in order).

    The region is manual over `axis` only; batch and heads keep whatever sharding XLA gives them on the other axes.

    Args:
        q_BSKGE, k_BTKE, v_BTKE: queries, keys and values of the whole sequence.
        mesh: the mesh holding `axis`.
        axis: the mesh axis the sequence is split over (`sequence`).
        causal: mask keys after each query; uses the zigzag layout for an even load.
        chunk: the most keys scored at once (the transient memory knob).
    """
    ring = mesh.shape[axis]
    if ring == 1:
        return reference_attention(q_BSKGE, k_BTKE, v_BTKE, causal)
    check_sequence_divisible(q_BSKGE.shape[1], ring, causal)
    seq_spec = PartitionSpec(None, axis)
    body = functools.partial(_ring_body, axis=axis, causal=causal, chunk=chunk)
    return jax.shard_map(
        body, mesh=mesh, in_specs=(seq_spec, seq_spec, seq_spec), out_specs=seq_spec, axis_names={axis}
    )(q_BSKGE, k_BTKE, v_BTKE)


def check_sequence_divisible(seq: int, ring: int, causal: bool) -> None:
    """A ValueError unless `seq` splits into the ring's blocks (2 chunks per device for the causal zigzag)."""
    pieces = 2 * ring if causal else ring
    if seq % pieces:
        raise ValueError(f"sequence length {seq} is not divisible by {pieces} ({'2 x ' if causal else ''}ring of {ring})")


def _ring_body(q_BSKGE, k_BTKE, v_BTKE, *, axis: str, causal: bool, chunk: int):
    if not causal:
        return _ring(q_BSKGE, k_BTKE, v_BTKE, axis, causal, chunk)
    q_BSKGE, k_BTKE, v_BTKE = (to_zigzag(x, axis) for x in (q_BSKGE, k_BTKE, v_BTKE))
    return from_zigzag(_ring(q_BSKGE, k_BTKE, v_BTKE, axis, causal, chunk), axis)


# ---- layout helpers: contiguous blocks <-> zigzag chunks (inside shard_map, over `axis`) ------------------------------
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


def _positions(device: jax.Array, ring: int, length: int, causal: bool) -> jax.Array:
    """Global sequence positions of the `length` rows a device holds (zigzag when causal, contiguous otherwise)."""
    if not causal:
        return device * length + jnp.arange(length)
    half = length // 2
    first, second = device * half, (2 * ring - 1 - device) * half
    return jnp.concatenate([first + jnp.arange(half), second + jnp.arange(half)])


def _device_index(axis: str, anchor: jax.Array) -> jax.Array:
    """This device's index on `axis`, made to depend on `anchor` (the block's queries) through an optimization barrier.

    Why: the causal masks are a function of the device index, the ring step and the key chunk alone. Inside a scan
    over layers, JAX's scan linearization hoists such loop-invariant values out of the loop as residuals, so the masks
    (and the fill values broadcast to their shape) of every ring step and key chunk would be materialised once for the
    whole training step: (s / n) x (s / 2) x heads elements per device, quadratic in s. Tied to the queries, the
    index varies per layer, and each mask lives only while its (queries x chunk) block is scored. Only the forward
    needs this: the backward runs in the transposed loop, which is not linearized again.
    """
    index, _ = jax.lax.optimization_barrier((jax.lax.axis_index(axis), anchor))
    return index


def _next_device(ring: int) -> list[tuple[int, int]]:
    return [(d, (d + 1) % ring) for d in range(ring)]


# ---- block kernels (local arrays) -------------------------------------------------------------------------------------
def _scores(q_BSKGE, qpos_S, k_CKE, kpos_C, causal: bool):
    """Scaled scores (B, K, G, S, C) in fp32 and the mask of the pairs that count (None when all do)."""
    scale = q_BSKGE.shape[-1] ** -0.5
    scores = jnp.einsum("bskge,bcke->bkgsc", q_BSKGE, k_CKE, preferred_element_type=jnp.float32) * scale
    if not causal:
        return scores, None
    mask_111SC = (qpos_S[:, None] >= kpos_C[None, :])[None, None, None]
    return jnp.where(mask_111SC, scores, NEG_INF), mask_111SC


def _chunked(x_BT: jax.Array, pos_T: jax.Array, chunk: int):
    """Split keys (dimension 1) into N chunks of at most `chunk`: (N, B, C, ...) and positions (N, C)."""
    length = x_BT.shape[1]
    size = max(d for d in range(1, min(chunk, length) + 1) if length % d == 0)
    count = length // size
    x_NBC = jnp.moveaxis(x_BT.reshape(x_BT.shape[0], count, size, *x_BT.shape[2:]), 1, 0)
    return x_NBC, pos_T.reshape(count, size)


def _attend(acc, q_BSKGE, qpos_S, k_BTKE, v_BTKE, kpos_T, causal: bool, chunk: int):
    """Fold the keys/values of one block into the online-softmax accumulators `acc` = (o_BSKGE, m_BKGS, l_BKGS)."""
    k_NBCKE, kpos_NC = _chunked(k_BTKE, kpos_T, chunk)
    v_NBCKE, _ = _chunked(v_BTKE, kpos_T, chunk)

    def step(acc, chunk_xs):
        o_BSKGE, m_BKGS, l_BKGS = acc
        k_CKE, v_CKE, kpos_C = chunk_xs
        scores, mask = _scores(q_BSKGE, qpos_S, k_CKE, kpos_C, causal)
        m_new = jnp.maximum(m_BKGS, scores.max(axis=-1))
        probs = jnp.exp(scores - m_new[..., None])
        if mask is not None:
            probs = jnp.where(mask, probs, 0.0)  # a fully masked row adds nothing, whatever its running max
        correction_BKGS = jnp.exp(m_BKGS - m_new)
        l_new = l_BKGS * correction_BKGS + probs.sum(axis=-1)
        pv = jnp.einsum("bkgsc,bcke->bskge", probs.astype(v_CKE.dtype), v_CKE, preferred_element_type=jnp.float32)
        o_new = o_BSKGE * jnp.einsum("bkgs->bskg", correction_BKGS)[..., None] + pv
        return (o_new, m_new, l_new), None

    acc, _ = jax.lax.scan(step, acc, (k_NBCKE, v_NBCKE, kpos_NC))
    return acc


def _block_grads(q_BSKGE, qpos_S, k_BTKE, v_BTKE, kpos_T, do_BSKGE, lse_BKGS, delta_BKGS, causal: bool, chunk: int):
    """Gradients (dq, dk, dv) in fp32 from one query block against one key/value block, probabilities recomputed."""
    scale = q_BSKGE.shape[-1] ** -0.5
    k_NBCKE, kpos_NC = _chunked(k_BTKE, kpos_T, chunk)
    v_NBCKE, _ = _chunked(v_BTKE, kpos_T, chunk)

    def step(dq_BSKGE, chunk_xs):
        k_CKE, v_CKE, kpos_C = chunk_xs
        scores, mask = _scores(q_BSKGE, qpos_S, k_CKE, kpos_C, causal)
        probs = jnp.exp(scores - lse_BKGS[..., None])
        if mask is not None:
            probs = jnp.where(mask, probs, 0.0)
        dv_CKE = jnp.einsum("bkgsc,bskge->bcke", probs, do_BSKGE)
        dprobs = jnp.einsum("bskge,bcke->bkgsc", do_BSKGE, v_CKE)
        dscores = probs * (dprobs - delta_BKGS[..., None]) * scale
        dq_BSKGE = dq_BSKGE + jnp.einsum("bkgsc,bcke->bskge", dscores, k_CKE)
        dk_CKE = jnp.einsum("bkgsc,bskge->bcke", dscores, q_BSKGE)
        return dq_BSKGE, (dk_CKE, dv_CKE)

    dq, (dk_NBCKE, dv_NBCKE) = jax.lax.scan(step, jnp.zeros_like(q_BSKGE), (k_NBCKE, v_NBCKE, kpos_NC))
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(k_BTKE.shape)
    return dq, unchunk(dk_NBCKE), unchunk(dv_NBCKE)


# ---- the ring ---------------------------------------------------------------------------------------------------------
def _visit(device, source, ring, causal, fn_all, fn_early, fn_late):
    """Dispatch one ring step: everything (not causal), or the balanced half of the block (zigzag causal)."""
    if not causal:
        return fn_all()
    return jax.lax.cond(source < device, fn_early, fn_late)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q_BSKGE, k_BTKE, v_BTKE, axis: str, causal: bool, chunk: int):
    return _ring_forward(q_BSKGE, k_BTKE, v_BTKE, axis, causal, chunk)[0]


def _ring_forward(q_BSKGE, k_BTKE, v_BTKE, axis, causal, chunk):
    ring, device = jax.lax.axis_size(axis), _device_index(axis, q_BSKGE)
    length, half = q_BSKGE.shape[1], q_BSKGE.shape[1] // 2
    qpos_S = _positions(device, ring, length, causal)
    batch, _, kv_heads, groups, _ = q_BSKGE.shape
    stats_shape = (batch, kv_heads, groups, length)
    acc = (jnp.zeros(q_BSKGE.shape, jnp.float32), jnp.full(stats_shape, NEG_INF), jnp.zeros(stats_shape, jnp.float32))
    acc = jax.lax.pcast(acc, (axis,), to="varying")  # each device's accumulators are its own (shard_map's vma check)
    acc = _attend(acc, q_BSKGE, qpos_S, k_BTKE, v_BTKE, qpos_S, causal, chunk)  # own block first: the diagonal

    def ring_step(carry, hop):
        k_BTKE, v_BTKE, acc = carry
        k_BTKE, v_BTKE = (jax.lax.ppermute(x, axis, _next_device(ring)) for x in (k_BTKE, v_BTKE))
        source = (device - hop) % ring
        kpos_T = _positions(source, ring, length, causal)
        attend = functools.partial(_attend, causal=causal, chunk=chunk)

        def early():  # the block is from an earlier device: all queries see its first chunk, none its second
            return attend(acc, q_BSKGE, qpos_S, k_BTKE[:, :half], v_BTKE[:, :half], kpos_T[:half])

        def late():  # from a later device: only the second query chunk sees it, and sees all of it
            late_acc = tuple(x[:, half:] if x.ndim == 5 else x[..., half:] for x in acc)
            new = attend(late_acc, q_BSKGE[:, half:], qpos_S[half:], k_BTKE, v_BTKE, kpos_T)
            return tuple(
                jnp.concatenate([old[:, :half], upd], 1) if old.ndim == 5 else jnp.concatenate([old[..., :half], upd], -1)
                for old, upd in zip(acc, new)
            )

        acc = _visit(device, source, ring, causal, lambda: attend(acc, q_BSKGE, qpos_S, k_BTKE, v_BTKE, kpos_T),
                     early, late)
        return (k_BTKE, v_BTKE, acc), None

    (_, _, (o_BSKGE, m_BKGS, l_BKGS)), _ = jax.lax.scan(ring_step, (k_BTKE, v_BTKE, acc), jnp.arange(1, ring))
    out_BSKGE = (o_BSKGE / jnp.einsum("bkgs->bskg", l_BKGS)[..., None]).astype(q_BSKGE.dtype)
    lse_BKGS = m_BKGS + jnp.log(l_BKGS)
    return out_BSKGE, (q_BSKGE, k_BTKE, v_BTKE, out_BSKGE, lse_BKGS)


def _ring_backward(axis, causal, chunk, residuals, dout_BSKGE):
    q_in, k_in, v_in, out_BSKGE, lse_BKGS = residuals
    q_BSKGE, k_BTKE, v_BTKE, do_BSKGE = (x.astype(jnp.float32) for x in (q_in, k_in, v_in, dout_BSKGE))
    ring, device = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    length, half = q_BSKGE.shape[1], q_BSKGE.shape[1] // 2
    qpos_S = _positions(device, ring, length, causal)
    delta_BKGS = jnp.einsum("bskge->bkgs", do_BSKGE * out_BSKGE.astype(jnp.float32))
    grads = functools.partial(_block_grads, causal=causal, chunk=chunk)

    dq, dk, dv = grads(q_BSKGE, qpos_S, k_BTKE, v_BTKE, qpos_S, do_BSKGE, lse_BKGS, delta_BKGS)

    def ring_step(carry, hop):
        # dk/dv travel with the k/v block they belong to.
        moving = tuple(jax.lax.ppermute(x, axis, _next_device(ring)) for x in carry[1:])
        dq, (k_BTKE, v_BTKE, dk, dv) = carry[0], moving
        source = (device - hop) % ring
        kpos_T = _positions(source, ring, length, causal)

        def all_pairs():
            g = grads(q_BSKGE, qpos_S, k_BTKE, v_BTKE, kpos_T, do_BSKGE, lse_BKGS, delta_BKGS)
            return dq + g[0], dk + g[1], dv + g[2]

        def early():
            g = grads(q_BSKGE, qpos_S, k_BTKE[:, :half], v_BTKE[:, :half], kpos_T[:half], do_BSKGE, lse_BKGS,
                      delta_BKGS)
            return dq + g[0], dk.at[:, :half].add(g[1]), dv.at[:, :half].add(g[2])

        def late():
            g = grads(q_BSKGE[:, half:], qpos_S[half:], k_BTKE, v_BTKE, kpos_T, do_BSKGE[:, half:],
                      lse_BKGS[..., half:], delta_BKGS[..., half:])
            return dq.at[:, half:].add(g[0]), dk + g[1], dv + g[2]

        dq, dk, dv = _visit(device, source, ring, causal, all_pairs, early, late)
        return (dq, k_BTKE, v_BTKE, dk, dv), None

    (dq, _, _, dk, dv), _ = jax.lax.scan(ring_step, (dq, k_BTKE, v_BTKE, dk, dv), jnp.arange(1, ring))
    dk, dv = (jax.lax.ppermute(x, axis, _next_device(ring)) for x in (dk, dv))  # the last hop home
    return dq.astype(q_in.dtype), dk.astype(k_in.dtype), dv.astype(v_in.dtype)


_ring.defvjp(_ring_forward, _ring_backward)
