"""Collectives written by hand beside tensor parallelism keep the `tensor` split (recipes/pp_fsdp_tp.toml's causes).

A pipeline x fsdp x tensor mesh of 8 CPU devices, tiny arrays, compiled on XLA:CPU, whose partitioner did what
XLA:GPU did for h100x8 before the fixes: gathered a stage's weights over `tensor` before their all-gather over `fsdp`,
and moved the embedding table's vocabulary onto `pipeline` by a collective-permute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from shardkit.analysis.compiled.hlo import collective_summary
from shardkit.nn import lookup, model_context
from shardkit.pipeline.sends import gather_stage
from shardkit.testing import requires_devices

pytestmark = requires_devices(8)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("pipeline", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3,
                         devices=jax.devices()[:8])


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))


def test_a_stage_gather_over_fsdp_moves_only_the_tensor_shards(mesh):
    """4 layers of (64, 256) weights, layers over `pipeline`, rows over `fsdp`, columns over `tensor`: the region
    gathers its stage's 2 layers over `fsdp` (a (2, 64, 128) fp32 tensor shard, 64 KiB) and reduce-scatters their
    gradient back, moving nothing over `tensor` but the layers' own activation sums; gradients as without a mesh."""
    w_LDF = jax.random.normal(jax.random.key(0), (4, 64, 256)) / 8
    x_BD = jax.random.normal(jax.random.key(1), (8, 64))

    def stage_loss(x_bD, w_lDF):
        w_lDF = gather_stage(w_lDF, 1, PartitionSpec(None, None, "tensor"))
        total = sum(jnp.tanh(x_bD @ w_lDF[layer]).sum() for layer in range(w_lDF.shape[0]))
        return jax.lax.psum(total, ("pipeline", "fsdp"))

    def loss(x_BD, w_LDF):
        return jax.shard_map(stage_loss, mesh=mesh, in_specs=(PartitionSpec("fsdp"), PartitionSpec("pipeline", "fsdp")),
                             out_specs=PartitionSpec(), axis_names={"pipeline", "fsdp"})(x_BD, w_LDF)

    gradient = jax.jit(jax.grad(loss, argnums=1))
    args = (_put(mesh, x_BD, "fsdp"), _put(mesh, w_LDF, "pipeline", "fsdp", "tensor"))
    with jax.set_mesh(mesh):
        compiled = gradient.lower(*args).compile()
        got = compiled(*args)
    collectives = collective_summary(compiled, mesh)
    assert collectives.count("all-gather", ("tensor",)) == 0, collectives.by_kind()
    shard_bytes = 2 * 64 * 128 * 4
    assert collectives.bytes("all-gather", ("fsdp",)) == shard_bytes
    assert collectives.bytes("reduce-scatter", ("fsdp",)) + collectives.bytes("all-reduce", ("fsdp",)) == shard_bytes
    expected = jax.grad(lambda w: sum(jnp.tanh(x_BD @ w[layer]).sum() for layer in range(4)))(w_LDF)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_the_vocab_parallel_lookup_sums_rows_over_tensor_without_moving_the_table(mesh):
    """A (256, 64) table, vocabulary over `tensor`, 16 x 8 tokens over `fsdp`: the rows are summed over `tensor`
    (one (8, 8, 64) fp32 all-reduce), nothing is permuted or summed over `pipeline`, and the rows and the table's
    gradient are `jnp.take`'s."""
    table_VD = jax.random.normal(jax.random.key(2), (256, 64))
    tokens_BS = jax.random.randint(jax.random.key(3), (16, 8), 0, 256)
    weight_BSD = jax.random.normal(jax.random.key(4), (16, 8, 64))
    rules = {"batch": ("fsdp",), "sequence": (), "embed": (), "vocab": ("tensor",)}

    def loss(table, tokens):
        with model_context(mesh=mesh, activation_rules=rules):
            return (lookup(table, tokens) * weight_BSD).sum()

    run = jax.jit(jax.value_and_grad(loss))
    args = (_put(mesh, table_VD, "tensor", "fsdp"), _put(mesh, tokens_BS, "fsdp"))
    with jax.set_mesh(mesh):
        compiled = run.lower(*args).compile()
        value, gradient = compiled(*args)
    collectives = collective_summary(compiled, mesh)
    assert collectives.count("collective-permute") == 0, collectives.by_kind()
    assert collectives.bytes("all-reduce", ("pipeline",)) == 0, collectives.by_kind()
    assert collectives.bytes("all-reduce", ("tensor",)) == 8 * 8 * 64 * 4
    expected_value, expected_gradient = jax.value_and_grad(
        lambda table: (jnp.take(table, tokens_BS, axis=0) * weight_BSD).sum())(table_VD)
    np.testing.assert_allclose(float(value), float(expected_value), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gradient), np.asarray(expected_gradient), rtol=1e-5, atol=1e-6)
