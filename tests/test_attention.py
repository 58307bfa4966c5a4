"""Attention dispatch (shardkit/attention/): what `train.attention` picks, that it equals `reference_attention`, the
errors for `cudnn` where it cannot run, and, with the CUDA plugin, cuDNN's fused kernel in the compiled GPU program.

Tolerance, fp32: 1e-5 relative plus 1e-5 of the largest entry, as in test_equivalence.py. The two implementations
differ only in the order of fp32 sums (XLA's attention scales and masks the scores at other points, and its softmax
normalises differently), around 1e-7; a wrong mask, a wrong head grouping or a missing scale is off by order one.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardkit.analysis.predicted.targets import cuda_plugin_available
from shardkit.attention.kernel import Platform, choose_kernel, platform_of
from shardkit.attention.plain import AttentionSetup
from shardkit.attention.reference import reference_attention
from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.nn import attention, model_context
from shardkit.step import build_step
from tests.equivalence import trace
from tests.helpers import RECIPES, recipe

FP32_RTOL = 1e-5
needs_plugin = pytest.mark.skipif(not cuda_plugin_available(),
                                  reason='needs the jax[cuda12] plugin: pip install "jax[cuda12]==0.10.2"')


def _qkv(batch=2, seq=16, kv_heads=2, groups=3, head_dim=8):
    """Grouped-query inputs: 6 query heads sharing 2 kv heads."""
    k_q, k_k, k_v = jax.random.split(jax.random.key(0), 3)
    q_BSKGE = jax.random.normal(k_q, (batch, seq, kv_heads, groups, head_dim))
    k_BTKE = jax.random.normal(k_k, (batch, seq, kv_heads, head_dim))
    v_BTKE = jax.random.normal(k_v, (batch, seq, kv_heads, head_dim))
    return q_BSKGE, k_BTKE, v_BTKE


def _assert_close(got, want, rtol=FP32_RTOL):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max())


HOPPER_GPU = Platform(nvidia_gpu=True, hopper=True, process_sees_gpu=True)
AMPERE_GPU = Platform(nvidia_gpu=True, hopper=False, process_sees_gpu=True)
CUDNN_LOADS = lambda: 90000  # noqa: E731  the library probe, as on a machine with cuDNN 9


def test_auto_picks_xla_on_the_cpu():
    cpu = platform_of(jax.devices()[0])
    assert not cpu.nvidia_gpu
    choice = choose_kernel("auto", cpu, jnp.bfloat16, 64)
    assert choice.kernel == "xla" and "not NVIDIA GPUs" in choice.reason


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mode", ["auto", "xla"])
def test_attention_equals_reference_forward_and_gradients(mode, causal):
    """What the mode picks on this machine (XLA's kernel on the CPU) against the definition, with GQA."""
    cotangent = jax.random.normal(jax.random.key(1), _qkv()[0].shape)

    def loss(fn, q, k, v):
        return (fn(q, k, v, causal) * cotangent).sum()

    def dispatched(q, k, v, causal):
        platform = platform_of(jax.devices()[0])
        setup = AttentionSetup(choose_kernel(mode, platform, q.dtype, q.shape[-1]), mode, platform)
        with model_context(attention=setup):
            return attention(q, k, v, causal)

    def compiled(fn):  # one compile per side rather than one per primitive, op by op
        return jax.jit(fn, static_argnums=3), jax.jit(jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2)))

    (forward, grads), (want_forward, want_grads) = compiled(dispatched), compiled(reference_attention)
    q, k, v = _qkv()
    _assert_close(forward(q, k, v, causal), want_forward(q, k, v, causal))
    _assert_close(grads(q, k, v), want_grads(q, k, v))


def test_the_check_catches_a_wrong_head_grouping():
    """Not vacuous: queries regrouped onto the wrong kv heads fail the comparison."""
    q, k, v = _qkv()
    swapped = q.swapaxes(2, 3).reshape(q.shape)
    with pytest.raises(AssertionError):
        _assert_close(attention(swapped, k, v), reference_attention(q, k, v))


@pytest.mark.parametrize("platform, dtype, head_dim, reason", [
    (Platform(), jnp.bfloat16, 64, "not NVIDIA GPUs"),
    (HOPPER_GPU, jnp.float32, 64, "bf16 or fp16 compute, not float32"),
    (HOPPER_GPU, jnp.bfloat16, 12, "multiple of 8, not 12"),
    (HOPPER_GPU, jnp.bfloat16, 264, "head_dim <= 256"),
    (AMPERE_GPU, jnp.bfloat16, 192, "head_dim <= 128"),
])
def test_cudnn_where_it_cannot_run_names_the_field_and_why(platform, dtype, head_dim, reason):
    with pytest.raises(ShardkitError, match=rf"train\.attention.*{reason}"):
        choose_kernel("cudnn", platform, dtype, head_dim, version_probe=CUDNN_LOADS)
    assert choose_kernel("auto", platform, dtype, head_dim, version_probe=CUDNN_LOADS).kernel == "xla"


def test_auto_takes_cudnn_on_nvidia_gpus_when_it_can_run():
    assert choose_kernel("auto", HOPPER_GPU, jnp.bfloat16, 64, version_probe=CUDNN_LOADS).kernel == "cudnn"
    assert choose_kernel("auto", HOPPER_GPU, jnp.float16, 256, version_probe=CUDNN_LOADS).kernel == "cudnn"
    assert choose_kernel("auto", AMPERE_GPU, jnp.float16, 128, version_probe=CUDNN_LOADS).kernel == "cudnn"
    assert choose_kernel("xla", HOPPER_GPU, jnp.bfloat16, 64, version_probe=CUDNN_LOADS).kernel == "xla"


def test_cudnn_on_the_cpu_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "hlo"
    code = main(["hlo", str(RECIPES / "dp.toml"), "--set", "train.attention=cudnn", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "train.attention" in err and "'cudnn' cannot run here" in err
    assert not out.exists()


def test_an_unknown_attention_mode_is_refused_by_the_recipe():
    with pytest.raises(ShardkitError, match=r"train\.attention.*'auto', 'cudnn', 'xla'"):
        recipe("single", "train.attention=flash")


@pytest.mark.slow
def test_minimal_with_context_gives_the_gradients_of_no_remat():
    one, small = jax.devices()[:1], ("model.layers=2", "train.global_batch=4")
    got = trace(recipe("single", "train.remat=minimal_with_context", *small), steps=0, devices=one)
    want = trace(recipe("single", *small), steps=0, devices=one)
    for path, reference in want.grads.items():
        _assert_close(got.grads[path], reference)


# ---- the compiled GPU program (compile-only devices of a target; needs the CUDA plugin) -----------------------------
def _cudnn_calls(*overrides: str) -> dict[str, int]:
    """Custom-call targets of cuDNN's fused attention in the optimized HLO of the tiny model's bf16 step on one H100."""
    from shardkit.analysis.predicted.targets import parse_target, target_devices

    small = ("model.layers=2", "train.global_batch=2")
    layout = build_layout(recipe("single", "precision.policy=bf16", *small, *overrides),
                          target_devices(parse_target("h100x1")))
    text = build_step(layout).compile().as_text()
    calls = re.findall(r'custom_call_target="(__cudnn\$fmha[^"]*)"', text)
    return {name: calls.count(name) for name in set(calls)}


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("remat, forward_kernels", [("minimal_with_context", 1), ("full", 2)])
def test_auto_compiles_to_cudnn_fused_attention_on_a_gpu_target(remat, forward_kernels):
    """The target's devices are GPUs while this process runs on the CPU: `auto` still picks cuDNN.

    The layer scan's forward runs the kernel once; `full` runs it again in the backward's recompute, while
    `minimal_with_context` keeps its output and statistics, so the backward runs only the backward kernel.
    """
    assert _cudnn_calls(f"train.remat={remat}") == {
        "__cudnn$fmhaSoftmax": forward_kernels, "__cudnn$fmhaSoftmaxBackward": 1}


@pytest.mark.slow
@needs_plugin
def test_xla_mode_keeps_cudnn_out_of_the_gpu_program():
    assert _cudnn_calls("train.attention=xla") == {}
