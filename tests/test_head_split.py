"""The last stage's head split over `fsdp` by vocabulary (shardkit/pipeline/head_split.py).

Exactness against the lean loss on the whole head, fp32: 1e-6 relative on the loss and the gradients (the split
changes only the order of sums: the log-sum-exp's over four vocabulary shards, the hidden state's gradient over the
shards); a row credited to the wrong rank, a missing shard or a target picked on the wrong shard is off by far more.
Each rank's loss is weighted by its own factor, so a backward that gave a row another rank's cotangent fails.
tests/test_one_f_one_b.py holds pp_fsdp_tp, where the head is split, to one device under 1f1b (trained end to end),
interleaved_1f1b and zero_bubble (first-batch loss and gradients).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import shardkit.pipeline.head_split as head_split
from shardkit.loss import cross_entropy_sum as lean_cross_entropy_sum
from shardkit.pipeline.config import pipeline_region
from shardkit.testing import requires_devices
from tests.helpers import recipe

RANKS, ROWS, SEQ, EMBED, VOCAB = 4, 2, 8, 16, 64
RTOL = 1e-6


def _inputs():
    k_hidden, k_head, k_targets = jax.random.split(jax.random.key(0), 3)
    hidden_RSD = jax.random.normal(k_hidden, (RANKS * ROWS, SEQ, EMBED))
    head_DV = jax.random.normal(k_head, (EMBED, VOCAB)) / 4
    targets_RS = jax.random.randint(k_targets, (RANKS * ROWS, SEQ), 0, VOCAB)
    weights_R = jnp.arange(1.0, RANKS + 1)  # each rank's loss weighted differently
    return hidden_RSD, head_DV, targets_RS, weights_R


def _split_losses(hidden_RSD, head_DV, targets_RS, weights_R):
    """Each rank's weighted loss: its rows, its vocabulary shard of the head, inside a region manual over `fsdp`."""
    mesh = Mesh(np.array(jax.devices()[:RANKS]), ("fsdp",))

    def per_rank(hidden_bSD, head_DVf, targets_bS, weight_1):
        return (head_split.cross_entropy_sum(hidden_bSD, head_DVf, targets_bS) * weight_1[0])[None]

    rows, vocab = PartitionSpec("fsdp"), PartitionSpec(None, "fsdp")
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(rows, vocab, rows, rows), out_specs=rows)(
        hidden_RSD, head_DV, targets_RS, weights_R)


def _whole_losses(hidden_RSD, head_DV, targets_RS, weights_R):
    """The same weighted losses from the lean loss on the whole head, one rank's rows at a time."""
    rows = lambda x, r: x[r * ROWS:(r + 1) * ROWS]
    return jnp.stack([lean_cross_entropy_sum(rows(hidden_RSD, r), head_DV, rows(targets_RS, r)) * weights_R[r]
                      for r in range(RANKS)])


@requires_devices(RANKS)
@pytest.mark.parametrize("vocab_whole", [True, False], ids=["gather", "one-hot"])
def test_split_head_loss_and_gradients_equal_the_whole_heads(vocab_whole, monkeypatch):
    """Both ways of picking the target's logit: a gather (vocabulary whole on the device) and the one-hot mask (the
    vocabulary further split over `tensor`)."""
    monkeypatch.setattr(head_split, "vocab_is_whole", lambda: vocab_whole)
    inputs = _inputs()
    np.testing.assert_allclose(jax.jit(_split_losses)(*inputs), _whole_losses(*inputs), rtol=RTOL)
    grad = lambda losses: jax.jit(jax.grad(lambda h, w: losses(h, w, *inputs[2:]).sum(), argnums=(0, 1)))
    for got, want, name in zip(grad(_split_losses)(*inputs[:2]), grad(_whole_losses)(*inputs[:2]), ("hidden", "head")):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()), err_msg=name)


def _split_losses_with_tensor(hidden_RSD, head_DV, targets_RS, weights_R):
    """As `_split_losses` on fsdp 2 x tensor 2, the region manual over `fsdp` only: the head enters as its FSDP shard
    (split along embed) with the vocabulary over `tensor`, and `split_by_vocab` makes it a shard of each of the two
    `tensor` blocks (`vocab_blocks`=2)."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("fsdp", "tensor"))
    head_DV = jax.device_put(head_DV, jax.sharding.NamedSharding(mesh, PartitionSpec("fsdp", "tensor")))

    def per_rank(hidden_bSD, head_DfV, targets_bS, weight_1):
        head_DVf = head_split.split_by_vocab(head_DfV, 0, 1, PartitionSpec(None, "tensor"))
        return (head_split.cross_entropy_sum(hidden_bSD, head_DVf, targets_bS, vocab_blocks=2) * weight_1[0])[None]

    rows = PartitionSpec("fsdp")
    return jax.shard_map(per_rank, mesh=mesh, in_specs=(rows, PartitionSpec("fsdp"), rows, rows), out_specs=rows,
                         axis_names={"fsdp"})(hidden_RSD, head_DV, targets_RS, weights_R)


@requires_devices(4)
def test_split_head_over_tensor_blocks_equals_the_whole_heads():
    """With the vocabulary also split over `tensor`, each fsdp rank holds its part of each tensor block: the targets'
    owners and offsets follow those blocks (a plain f-th of the vocabulary would pick other ids' logits)."""
    hidden_RSD, head_DV, targets_RS, _ = _inputs()
    weights_R = jnp.arange(1.0, 3.0)  # two fsdp ranks, each its own weight
    whole = lambda h, w: jnp.stack([lean_cross_entropy_sum(h[r * 4:(r + 1) * 4], w, targets_RS[r * 4:(r + 1) * 4])
                                    * weights_R[r] for r in range(2)])
    split = lambda h, w: _split_losses_with_tensor(h, w, targets_RS, weights_R)
    np.testing.assert_allclose(jax.jit(split)(hidden_RSD, head_DV), whole(hidden_RSD, head_DV), rtol=RTOL)
    grads = lambda f: jax.jit(jax.grad(lambda h, w: f(h, w).sum(), argnums=(0, 1)))(hidden_RSD, head_DV)
    for got, want, name in zip(grads(split), grads(whole), ("hidden", "head")):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()), err_msg=name)


@requires_devices(8)
def test_the_head_is_split_only_where_the_region_gathers_fsdp_and_the_vocabulary_divides():
    from shardkit.layout import build_layout

    def split(name, *overrides):
        layout = build_layout(recipe(name, "pipeline.schedule=1f1b", *overrides))
        return head_split.split_dims(layout, pipeline_region(layout), ("head_DV", "final_norm_D"))

    assert split("pp_fsdp_tp") == {"head_DV": 1, "final_norm_D": -1}  # (embed, vocab): split along the vocabulary
    assert split("pp")["head_DV"] == -1  # no fsdp: the head enters whole
    assert split("pp_fsdp_tp", "pipeline.fsdp_gather=per_use")["head_DV"] == -1  # the region does not gather
    assert split("pp_fsdp_tp", "model.vocab=250")["head_DV"] == -1  # 250 over fsdp 2 x tensor 2 does not divide


def test_the_analytic_model_moves_the_split_head_from_gathers_to_all_to_alls():
    """pp_fsdp_tp under 1f1b (h100x8 compiled: fsdp gathers 321.25 KiB, reductions 321.26 KiB, all-to-all 32 KiB, the
    same analytic): the head leaves the fsdp gather and reduction and enters by an all-to-all, its gradient back by
    another; gpipe's loss region splits the head the same way (compiled: two all-to-alls of 16 KiB over fsdp)."""
    from shardkit.analysis.predicted.comm_terms import split_head_elements
    from shardkit.analysis.predicted.estimate import communication_estimate
    from shardkit.layout import build_layout

    def by_kind(schedule):
        layout = build_layout(recipe("pp_fsdp_tp", f"pipeline.schedule={schedule}"))
        totals = {}
        for item in communication_estimate(layout):
            if item.axes == ("fsdp",):
                totals[item.kind] = totals.get(item.kind, 0.0) + item.bytes
        return layout, totals

    split, one_f_one_b = by_kind("1f1b")
    gpipe = by_kind("gpipe")[1]
    head_bytes = split_head_elements(split) * 4  # fp32 policy: 64 x 256 over tensor 2
    assert head_bytes == 32 * 1024
    assert one_f_one_b["all-to-all"] == 2 * head_bytes / 2
    assert gpipe["all-to-all"] == one_f_one_b["all-to-all"]
