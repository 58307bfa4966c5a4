"""Precision policies: parsing, casting, and fp16 dynamic loss scaling through a forced overflow."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardkit.data.source import TokenSource
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.precision import parse_policy
from shardkit.step import build_step, next_loss_scale
from tests.helpers import recipe


def test_presets_and_jmp_strings():
    assert parse_policy("bf16").compute_dtype == jnp.bfloat16 and parse_policy("bf16").param_dtype == jnp.float32
    assert parse_policy("bf16-params").master_weights
    assert parse_policy("fp16").loss_scaling and not parse_policy("bf16").loss_scaling
    custom = parse_policy("params=float32,compute=bfloat16,output=float32")
    assert (custom.param_dtype, custom.compute_dtype, custom.output_dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
    assert parse_policy("params=bf16").master_weights
    assert parse_policy("bfloat16").master_weights, "a bare narrow dtype keeps an fp32 master copy too"
    assert not parse_policy("float32").master_weights
    with pytest.raises(ShardkitError, match="precision.policy"):
        parse_policy("params=float8")


def test_casts_leave_integers_alone():
    tree = {"w": jnp.ones(2, jnp.float32), "tokens": jnp.ones(2, jnp.int32)}
    cast = parse_policy("bf16").cast_to_compute(tree)
    assert cast["w"].dtype == jnp.bfloat16 and cast["tokens"].dtype == jnp.int32


def test_loss_scale_rules():
    state = {"scale": jnp.float32(8.0), "good_steps": jnp.int32(1)}
    grown = next_loss_scale(state, jnp.bool_(True), period=2)
    assert float(grown["scale"]) == 16.0 and int(grown["good_steps"]) == 0
    kept = next_loss_scale({"scale": jnp.float32(8.0), "good_steps": jnp.int32(0)}, jnp.bool_(True), period=2)
    assert float(kept["scale"]) == 8.0 and int(kept["good_steps"]) == 1
    halved = next_loss_scale(state, jnp.bool_(False), period=2)
    assert float(halved["scale"]) == 4.0 and int(halved["good_steps"]) == 0


@pytest.mark.slow
def test_fp16_overflow_skips_the_step_halves_the_scale_and_training_continues():
    """A loss scale of 2^40 overflows fp16 gradients: those steps change nothing and halve the scale, until the scale
    fits and the updates go through."""
    r = recipe("dp", "precision.policy=fp16", f"precision.loss_scale_init={2.0**40}", "train.steps=30")
    builder = build_step(build_layout(r))
    compiled = builder.compile()
    state = builder.init_state(0)
    source = TokenSource(r.data, builder.layout.config.vocab, r.train.seq_len, 0)
    records = []
    for step in range(r.train.steps):
        before = jax.device_get(state["params"])
        state, metrics = compiled(state, source.global_batch(step, r.train.global_batch, builder.batch_sharding()))
        metrics = jax.device_get(metrics)
        changed = any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state["params"])))
        records.append((int(metrics["skipped"]), float(metrics["loss_scale"]), changed, float(metrics["loss"])))
    skipped = [r_ for r_ in records if r_[0]]
    assert records[0][0] == 1 and not records[0][2], "the first, overflowing step must be skipped"
    assert records[1][1] == records[0][1] / 2, "a skipped step halves the scale"
    assert all(not changed for _, _, changed, _ in skipped), "a skipped step must not touch the parameters"
    applied = [r_ for r_ in records if not r_[0]]
    assert len(applied) >= 5 and all(changed for _, _, changed, _ in applied), "training continues once the scale fits"
    assert applied[-1][3] < applied[0][3], "and the loss falls"
