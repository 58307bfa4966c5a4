"""The lean loss (shardkit/loss.py) equals optax's softmax cross entropy of the full fp32 logits.

Tolerance, fp32: 1e-6 relative on the loss; on gradients 1e-6 relative plus 1e-6 of the largest entry. Chunking changes
only the order of the sums over token rows (the head's gradient, the loss total): a few hundred fp32 additions, whose
rounding (unit roundoff 6e-8) stays near 1e-7, while a wrong chunk, a missing row or a wrong softmax is off by far more.
bf16 compute: the forward is the same matmul, so the loss holds to 1e-6; the head's gradient is accumulated in fp32
over chunks where the plain loss rounds one bf16 matmul, so gradients are compared at bf16's 2e-2 (test_equivalence.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import shardkit.layout
import shardkit.loss
import shardkit.pipeline.one_f_one_b
import shardkit.step
from shardkit.layout import build_layout
from shardkit.loss import chunk_count, cross_entropy_sum
from shardkit.models.llama import Llama
from shardkit.models.mlp import DeepMLP
from shardkit.registry import model_capabilities
from shardkit.step import build_step
from shardkit.testing import requires_devices
from tests.equivalence import flatten, trace
from tests.helpers import recipe

FP32_RTOL = 1e-6
BF16_RTOL = 2e-2


def _inputs(dtype, batch=3, seq=8, embed=16, vocab=50):
    k_hidden, k_head, k_targets = jax.random.split(jax.random.key(0), 3)
    hidden_BSD = jax.random.normal(k_hidden, (batch, seq, embed)).astype(dtype)
    head_DV = jax.random.normal(k_head, (embed, vocab)).astype(dtype)
    return hidden_BSD, head_DV, jax.random.randint(k_targets, (batch, seq), 0, vocab)


def _plain_sum(hidden_BSD, head_DV, targets_BS):
    """The definition: full logits in the compute dtype, cast to fp32, optax's cross entropy."""
    logits_BSV = jnp.einsum("bsd,dv->bsv", hidden_BSD, head_DV).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BSV, targets_BS).sum()


def _value_and_grads(loss, hidden_BSD, head_DV):
    """The loss and its gradients in both arguments, compiled once (rather than op by op)."""
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(hidden_BSD, head_DV)


def _assert_close(got, want, rtol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


@pytest.mark.parametrize("chunk_rows", [1000, 6, 3])  # one chunk; 4 chunks of 6 rows; 8 chunks of 3 rows
def test_lean_loss_equals_optax_fp32(chunk_rows):
    hidden_BSD, head_DV, targets_BS = _inputs(jnp.float32)
    lean = lambda h, w: cross_entropy_sum(h, w, targets_BS, chunk_rows=chunk_rows)
    plain = lambda h, w: _plain_sum(h, w, targets_BS)
    got_loss, got_grads = _value_and_grads(lean, hidden_BSD, head_DV)
    want_loss, want_grads = _value_and_grads(plain, hidden_BSD, head_DV)
    np.testing.assert_allclose(got_loss, want_loss, rtol=FP32_RTOL, atol=0)
    _assert_close(got_grads, want_grads, FP32_RTOL)


def test_lean_loss_in_bf16_matches_the_plain_loss():
    hidden_BSD, head_DV, targets_BS = _inputs(jnp.bfloat16)
    lean = lambda h, w: cross_entropy_sum(h, w, targets_BS, chunk_rows=6)
    plain = lambda h, w: _plain_sum(h, w, targets_BS)
    got_loss, got_grads = _value_and_grads(lean, hidden_BSD, head_DV)
    want_loss, want_grads = _value_and_grads(plain, hidden_BSD, head_DV)
    np.testing.assert_allclose(got_loss, want_loss, rtol=FP32_RTOL, atol=0)
    assert [g.dtype for g in got_grads] == [jnp.bfloat16, jnp.bfloat16]
    _assert_close(got_grads, want_grads, BF16_RTOL)


def test_chunks_divide_the_sequence_and_keep_its_shards_whole():
    assert chunk_count(4, 4096, 4096) == 4  # 16k rows -> 4 chunks of 4096
    assert chunk_count(4, 4096, 4096, batch_shards=4) == 1  # 4096 rows per device
    assert chunk_count(2, 12, 5) == 6  # 24 rows: 6 is the first divisor of 12 with <= 5 rows per chunk
    assert chunk_count(2, 12, 5, seq_shards=4) == 3  # 12 / 6 = 2 positions would not split over 4 shards
    assert chunk_count(1, 7, 1) == 7


def test_only_models_with_the_split_get_the_lean_loss():
    assert model_capabilities(Llama).lean_loss
    assert not model_capabilities(DeepMLP).lean_loss  # trained through its logits, as before


@pytest.fixture
def plain_loss(monkeypatch):
    """Within the test, every model takes the plain loss from its logits."""
    def use_plain():
        plain = lambda cls: dataclasses.replace(model_capabilities(cls), lean_loss=False)  # noqa: E731
        monkeypatch.setattr(shardkit.pipeline.one_f_one_b, "model_capabilities", plain)
        monkeypatch.setattr(shardkit.layout.Layout, "capabilities", property(lambda self: plain(self.model_class)))
    return use_plain


def _loss_and_grads(builder, params, tokens):
    fn = jax.jit(lambda p, t: builder.gradients(p, t, 1.0))
    loss, grads = fn(params, tokens)
    return float(loss), flatten(grads)


@pytest.mark.slow
@requires_devices(8)
def test_step_loss_with_the_vocab_sharded_over_tensor_equals_the_plain_loss(plain_loss, monkeypatch):
    """fsdp_tp: the head and the logits are sharded over tensor (4); 16 x 64 token rows over fsdp (2) are 512 a
    device, in 8 chunks of 64."""
    monkeypatch.setattr(shardkit.loss, "DEFAULT_CHUNK_ROWS", 64)
    builder = build_step(build_layout(recipe("fsdp_tp")))
    params = builder.init_state(0)["params"]
    tokens = jax.random.randint(jax.random.key(1), (16, 65), 0, builder.layout.config.vocab, dtype=jnp.int32)
    tokens = jax.device_put(tokens, builder.batch_sharding())
    lean_loss, lean_grads = _loss_and_grads(builder, params, tokens)
    plain_loss()
    want_loss, want_grads = _loss_and_grads(builder, params, tokens)
    np.testing.assert_allclose(lean_loss, want_loss, rtol=FP32_RTOL, atol=0)
    _assert_close(lean_grads, want_grads, 1e-5)  # the layout's own reduction order: test_equivalence.py's 1e-5


@pytest.mark.slow
@requires_devices(8)
def test_1f1b_last_stage_with_chunked_loss_equals_one_device(monkeypatch):
    """The lean loss inside the 1F1B region (a shard_map manual over pipeline and data): 2 stages x data 4, as many
    micro-batches as stages (warm-up, steady state and drain, at the fewest ticks to compile), a micro-batch two rows
    of 64 tokens per data replica, in 8 chunks of 16."""
    monkeypatch.setattr(shardkit.loss, "DEFAULT_CHUNK_ROWS", 16)
    got = trace(recipe("pp", "mesh.pipeline=2", "pipeline.schedule=1f1b", "pipeline.microbatches=2"), steps=0)
    want = trace(recipe("single", f"model.layers={got.builder.layout.config.layers}"), steps=0,
                 devices=jax.devices()[:1])
    _assert_close(got.grads, want.grads, 1e-5)
