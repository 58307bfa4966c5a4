"""cuDNN's fused attention inside pipeline stages (shardkit.attention.blocks.region_fused_attention).

On the CPU: the nested region and its custom VJP, run with the XLA block kernel inside a shard_map manual over
`pipeline` and `data` as a pipeline stage is, equal `reference_attention` in the forward and the gradients (fp32,
1e-5 relative plus 1e-5 of the largest entry, as test_attention.py), also under `minimal_with_context` remat.
With the CUDA plugin: the compiled h100x8 program of a tiny bf16 GPipe pipeline calls cuDNN's forward and backward
kernels.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from shardkit.analysis.predicted.targets import cuda_plugin_available
from shardkit.attention.blocks import region_fused_attention
from shardkit.attention.ring import reference_attention
from shardkit.layout import build_layout
from shardkit.mesh import build_mesh
from shardkit.recipe import MeshSection
from shardkit.remat import minimal_with_context_policy
from shardkit.step import build_step
from tests.helpers import recipe

FP32_RTOL = 1e-5
STAGE_AXES = {"pipeline", "data"}  # what a pipeline region with data parallelism is manual over
needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason='needs the jax[cuda12] plugin: pip install "jax[cuda12]==0.10.2"')


def _qkv(batch=4, seq=16, kv_heads=2, groups=3, head_dim=8):
    k_q, k_k, k_v, k_o = jax.random.split(jax.random.key(0), 4)
    q_BSKGE = jax.random.normal(k_q, (batch, seq, kv_heads, groups, head_dim))
    k_BTKE = jax.random.normal(k_k, (batch, seq, kv_heads, head_dim))
    v_BTKE = jax.random.normal(k_v, (batch, seq, kv_heads, head_dim))
    return q_BSKGE, k_BTKE, v_BTKE, jax.random.normal(k_o, q_BSKGE.shape)


def _assert_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=FP32_RTOL, atol=FP32_RTOL * np.abs(w).max())


def _in_a_stage(attend, mesh):
    """`attend(q, k, v)` inside a shard_map manual over pipeline and data, the batch split over data."""
    q_spec, kv_spec = PartitionSpec("data", None, None, None, None), PartitionSpec("data", None, None, None)
    return jax.shard_map(attend, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         axis_names=STAGE_AXES)


@pytest.mark.parametrize("causal, remat", [(True, False), (False, False), (True, True)])
def test_the_nested_region_equals_reference_attention(causal, remat):
    """Heads split over `tensor` inside the nested region; the spec's `data` (manual already) is dropped there."""
    mesh = build_mesh(MeshSection(pipeline=2, data=2, tensor=2))
    kv_spec = PartitionSpec("data", None, "tensor", None)

    def attend(q, k, v):
        return region_fused_attention(q, k, v, causal, kv_spec, implementation="xla")

    if remat:  # as a pipeline's layers under minimal_with_context: the region's outputs are kept by name
        attend = jax.checkpoint(attend, policy=minimal_with_context_policy(True, pipelined=True))
    q, k, v, cotangent = _qkv()
    staged = jax.jit(_in_a_stage(attend, mesh))
    loss = lambda fn: lambda *a: (fn(*a) * cotangent).sum()
    reference = lambda q, k, v: reference_attention(q, k, v, causal)
    _assert_close(staged(q, k, v), reference(q, k, v))
    _assert_close(jax.jit(jax.grad(loss(staged), argnums=(0, 1, 2)))(q, k, v),
                  jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v))


def test_the_comparison_catches_a_wrong_mask():
    """Not vacuous: the unmasked region against the causal reference fails."""
    mesh = build_mesh(MeshSection(pipeline=2, data=2, tensor=2))
    q, k, v, _ = _qkv()
    staged = _in_a_stage(lambda q, k, v: region_fused_attention(q, k, v, False, implementation="xla"), mesh)
    with pytest.raises(AssertionError):
        _assert_close(jax.jit(staged)(q, k, v), reference_attention(q, k, v, True))


# ---- the compiled GPU program (compile-only devices of a target; needs the CUDA plugin) -----------------------------
def _cudnn_calls(name: str, *overrides: str) -> dict[str, int]:
    """Custom-call targets of cuDNN's fused attention in the optimized HLO of a tiny bf16 pipeline on 8 H100s."""
    from shardkit.analysis.predicted.targets import parse_target, target_devices

    layout = build_layout(recipe(name, "precision.policy=bf16", *overrides), target_devices(parse_target("h100x8")))
    text = build_step(layout).compile().as_text()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text)
    return {call: calls.count(call) for call in set(calls)}


@pytest.mark.slow
@needs_plugin
def test_pipeline_stages_compile_to_cudnn_fused_attention():
    """GPipe over 4 stages x data 2 with `cudnn` asked for (accepted now). One compile only (about 25 s); 1F1B,
    circular and pp_fsdp_tp were checked with `shardkit hlo --target h100x8` (README, "Fast attention")."""
    calls = _cudnn_calls("pp", "train.attention=cudnn", "pipeline.microbatches=4")
    assert set(calls) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}, calls
