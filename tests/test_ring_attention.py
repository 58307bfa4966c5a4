"""Ring and all-gather-KV attention equal plain attention, forward and backward, causal and not, with grouped-query
heads (2 kv heads x 2), at lengths 24, 40 and 64 and ring sizes 4 and 8; the exact log-sum-exp merge of partial blocks
equals attention over all keys.

Tolerance (fp32): 1e-5 absolute on outputs and gradients of O(1) random inputs. Context parallelism computes the same
sums as plain attention in another order (per-block softmax merged by log-sum-exp, key chunks), so the results differ
by a few fp32 ulps (observed <= 2e-6); a wrong mask, a lost block or a misrouted gradient is off by O(0.1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from shardkit.attention.blocks import block_forward, merge_blocks, merge_pair
from shardkit.attention.ring import (
    Plan,
    allgather_attention,
    balanced_order,
    context_attention,
    from_zigzag,
    reference_attention,
    ring_attention,
    to_zigzag,
    zigzag_moves,
)
from shardkit.mesh import build_mesh
from shardkit.recipe import MeshSection

TOL = 1e-5


def _mesh(ring: int):
    return build_mesh(MeshSection(sequence=ring, data=jax.device_count() // ring))


def _inputs(seq: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (2, seq, 2, 2, 8))  # batch 2, kv heads 2, 2 query heads per kv head, head_dim 8
    k = jax.random.normal(keys[1], (2, seq, 2, 8))
    v = jax.random.normal(keys[2], (2, seq, 2, 8))
    cotangent = jax.random.normal(keys[3], q.shape)
    return q, k, v, cotangent


def _output_and_grads(attend, q, k, v, cotangent):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(cotangent)


@pytest.mark.parametrize(
    "variant, ring, causal, seq, chunk",
    [
        (ring_attention, 4, True, 40, 2),  # several key chunks per block, a length that is not a power of two
        (ring_attention, 8, True, 64, 512),  # the whole 8-device ring
        (ring_attention, 4, False, 24, 4),  # no mask: contiguous blocks, no zigzag
        (allgather_attention, 4, True, 40, 2),  # zigzag blocks cut from the gathered keys, reduce-scattered dK/dV
        (allgather_attention, 8, False, 64, 16),  # no mask: one call against the whole gathered sequence
    ],
    ids=["ring-causal-40", "ring-causal-64x8", "ring-full-24", "allgather-causal-40", "allgather-full-64x8"],
)
def test_context_parallel_attention_equals_plain_attention(variant, ring, causal, seq, chunk):
    mesh = _mesh(ring)
    q, k, v, cotangent = _inputs(seq)
    ring_fn = jax.jit(lambda *a: _output_and_grads(
        lambda q, k, v: variant(q, k, v, mesh, "sequence", causal, chunk), *a))
    plain_fn = jax.jit(lambda *a: _output_and_grads(lambda q, k, v: reference_attention(q, k, v, causal), *a))
    (out, grads), (want_out, want_grads) = ring_fn(q, k, v, cotangent), plain_fn(q, k, v, cotangent)
    np.testing.assert_allclose(out, want_out, atol=TOL, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"d{name}")
    # The mask matters: a causal ring that ignored it would match the unmasked reference instead.
    other = reference_attention(q, k, v, not causal)
    assert np.abs(np.asarray(out) - np.asarray(other)).max() > 1e-2


@pytest.mark.parametrize("variant", ["ring", "allgather"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_rows_already_in_the_balanced_order_equal_plain_attention(variant, packed):
    """Rows the step put in the load-balanced order (`Plan.balanced`): attention on them, output and gradients, is
    plain causal attention in that order, packed documents too, and no layer reorders anything (no collective
    permute in the all-gather variant's program)."""
    ring, seq = 4, 40
    mesh, order = _mesh(ring), balanced_order(seq, ring)
    q, k, v, cotangent = (x[:, order] for x in _inputs(seq))
    segments = jnp.asarray(np.repeat([[0, 1, 2, 3], [0, 0, 1, 1]], 10, axis=1))[:, order] if packed else None
    plan = Plan(variant, "xla", True, chunk=2, balanced=True)
    attend = lambda q, k, v: context_attention(q, k, v, mesh, "sequence", plan, segments_BS=segments)
    ring_fn = jax.jit(lambda *a: _output_and_grads(attend, *a))
    back = np.argsort(order)
    unpermuted = lambda q, k, v: reference_attention(q[:, back], k[:, back], v[:, back], True,
                                                      None if segments is None else segments[:, back])[:, order]
    (out, grads), (want_out, want_grads) = ring_fn(q, k, v, cotangent), _output_and_grads(unpermuted, q, k, v,
                                                                                           cotangent)
    np.testing.assert_allclose(out, want_out, atol=TOL, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=0, err_msg=f"d{name}")
    if variant == "allgather":
        assert "collective-permute" not in ring_fn.lower(q, k, v, cotangent).compile().as_text()


def test_balanced_order_gives_each_device_its_zigzag_chunks():
    assert balanced_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]


def test_zigzag_moves_are_partial_permutations():
    for ring in (2, 3, 4, 8):
        moves = zigzag_moves(ring)
        landed = sorted((dst, slot) for (slot, _), pairs in moves.items() for _, dst in pairs)
        assert landed == [(dst, slot) for dst in range(ring) for slot in (0, 1)]  # every zigzag slot filled once
        for pairs in moves.values():
            sources, destinations = zip(*pairs)
            assert len(set(sources)) == len(sources) and len(set(destinations)) == len(destinations)


def test_zigzag_layout_matches_sequential_reference():
    """Device d holds chunks d and 2n-1-d after `to_zigzag`, and `from_zigzag` restores the contiguous order."""
    ring, seq = 4, 16
    mesh = _mesh(ring)
    x = jnp.arange(2 * seq, dtype=jnp.float32).reshape(2, seq)
    spec = PartitionSpec(None, "sequence")
    shard = lambda fn: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, axis_names={"sequence"}))
    zig = shard(lambda block: to_zigzag(block, "sequence"))(x)
    chunks = np.split(np.asarray(x), 2 * ring, axis=1)
    expected = np.concatenate([np.concatenate([chunks[d], chunks[2 * ring - 1 - d]], 1) for d in range(ring)], 1)
    np.testing.assert_array_equal(zig, expected)
    np.testing.assert_array_equal(shard(lambda block: from_zigzag(block, "sequence"))(zig), x)


def test_indivisible_sequence_is_an_error():
    q, k, v, _ = _inputs(20)
    with pytest.raises(ValueError, match="not divisible by 8"):
        ring_attention(q, k, v, _mesh(4), "sequence", causal=True)


def test_log_sum_exp_merge_of_random_blocks_equals_attention_over_all_keys():
    """Keys cut into blocks of random sizes; each block's (out, lse) from the XLA kernel, merged pairwise in a random
    order and all at once, equals attention over all keys, and the merged lse equals the log-sum-exp of all scores."""
    q, k, v, _ = _inputs(24, seed=1)
    cuts = [0, 3, 4, 13, 24]  # blocks of 3, 1, 9 and 11 keys

    @jax.jit
    def merged(q, k, v):
        parts = [block_forward(q, k[:, a:b], v[:, a:b], causal=False, implementation="xla", chunk=4)
                 for a, b in zip(cuts, cuts[1:])]
        out, lse = parts[2]
        for index in (0, 3, 1):
            out, lse = merge_pair(out, lse, *parts[index])
        return merge_blocks(jnp.stack([p[0] for p in parts]), jnp.stack([p[1] for p in parts])), (out, lse)

    want = reference_attention(q, k, v, causal=False)
    scores = jnp.einsum("bskge,btke->bkgst", q, k) * q.shape[-1] ** -0.5
    for got_out, got_lse in merged(q, k, v):
        np.testing.assert_allclose(got_out, want, atol=TOL, rtol=0)
        np.testing.assert_allclose(got_lse, jax.nn.logsumexp(scores, axis=-1), atol=TOL, rtol=0)


def test_cudnn_kernel_refuses_what_it_cannot_run():
    q, k, v, _ = _inputs(16)  # fp32, head_dim 8
    with pytest.raises(ValueError, match="bf16 or fp16"):
        ring_attention(q, k, v, _mesh(4), "sequence", implementation="cudnn")
    with pytest.raises(ValueError, match="variant must be one of"):
        from shardkit.attention.ring import Plan

        Plan(variant="tree")
