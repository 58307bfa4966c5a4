"""The analytic model: its formulas on known layouts, and beside XLA's compiled figures (tiny Llama, fp32, 8 devices)."""

from __future__ import annotations

import math

import jax
import pytest

from shardkit.estimate import (
    communication_estimate, flops_per_step, memory_estimate, mfu, peak_flops, pipeline_bubble,
    training_flops_per_token,
)
from shardkit.partition import build_layout
from shardkit.plan import analytic_vs_compiled, format_comparison
from tests.helpers import recipe


def _layout(name: str, *overrides: str):
    return build_layout(recipe(name, *overrides))


def _params(layout) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(layout.abstract_params))


def test_peak_and_flops_per_token_unchanged():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12 and peak_flops("cpu") is None
    layout = _layout("dp")
    config = layout.config
    expected = 6.0 * _params(layout) + 12.0 * config.layers * config.heads * config.head_dim * 64
    assert training_flops_per_token(config, _params(layout), 64) == expected
    assert flops_per_step(layout) == expected * 16 * 64
    assert mfu(989e12, 1.0, 8, 989e12) == pytest.approx(1 / 8)


def test_memory_by_precision_and_zero_stage():
    """fp32 AdamW: 4 + 4 + 8 bytes per parameter replicated under DP; ZeRO-1 shards the 8, ZeRO-2 also the 4 of
    the gradients, over data=8; bf16-params adds an fp32 master copy sharded like the optimizer state."""
    params = _params(_layout("dp"))
    dp = memory_estimate(_layout("dp"))
    assert (dp.params, dp.gradients, dp.optimizer) == (4 * params, 4 * params, 8 * params)
    zero1 = memory_estimate(_layout("zero1"))
    assert (zero1.params, zero1.gradients, zero1.optimizer) == (4 * params, 4 * params, params)
    zero2 = memory_estimate(_layout("zero2"))
    assert (zero2.params, zero2.gradients, zero2.optimizer) == (4 * params, params / 2, params)
    mixed = memory_estimate(_layout("zero1", "precision.policy=bf16-params"))
    assert (mixed.params, mixed.master) == (2 * params, params / 2)


def test_full_remat_keeps_only_layer_inputs():
    none = memory_estimate(_layout("dp")).activations
    full = memory_estimate(_layout("dp", "train.remat=full")).activations
    config = _layout("dp").config
    b, s, h = 2, 64, config.embed
    per_layer_none = none / config.layers
    assert full == pytest.approx(config.layers * b * s * h * 4 + per_layer_none)


def test_communication_by_layout():
    params = _params(_layout("dp"))
    (dp,) = communication_estimate(_layout("dp"))
    assert (dp.kind, dp.axes, dp.bytes) == ("all-reduce", ("data",), 4 * params)
    assert dp.wire_bytes == pytest.approx(4 * params * 2 * 7 / 8)
    zero2 = {item.kind: item for item in communication_estimate(_layout("zero2"))}
    assert zero2["reduce-scatter"].bytes == zero2["all-gather"].bytes == 4 * params  # same volume as DP
    fsdp = communication_estimate(_layout("fsdp"))
    assert sum(item.wire_bytes for item in fsdp) == pytest.approx(1.5 * dp.wire_bytes)  # ZeRO-3: 1.5x DP
    tp_layout = _layout("tp")
    (tensor,) = [item for item in communication_estimate(tp_layout) if item.axes == ("tensor",)]
    assert tensor.bytes == 4 * tp_layout.config.layers * (16 // 2) * 64 * tp_layout.config.embed * 4
    assert pipeline_bubble(4, 12) == pytest.approx(3 / 15) and pipeline_bubble(4, 12, 2) == pytest.approx(3 / 30)


@pytest.fixture(scope="module")
def fsdp_comparison():
    return analytic_vs_compiled(_layout("fsdp"))


def test_state_memory_matches_compiled(fsdp_comparison):
    state = next(row for row in fsdp_comparison["memory"] if row["what"].startswith("state"))
    assert state["ratio"] == pytest.approx(1.0, abs=0.01)


def test_tiny_temporaries_gap_is_what_xla_saves_beyond_the_formula(fsdp_comparison):
    """For `tiny` XLA:CPU's temporaries are about 2x the analytic figure. The itemised gap, from the residuals of the
    compiled forward loop (per layer, b*s*h = one unit): the formula keeps 30 units, XLA keeps 52: the pre-softmax
    scores as well as the probabilities (+8), q before and after rotary (+2), sigmoid(gate) and the SwiGLU products
    (+12), extra residual copies (+2 sbh); plus per-layer weight-gradient buffers. On `small` the same comparison is
    within 3% (see test_small_within_ten_percent), where activations dominate and fixed overheads do not."""
    temporaries = next(row for row in fsdp_comparison["memory"] if row["what"].startswith("step temporaries"))
    assert 1.5 < temporaries["ratio"] < 2.5
    assert "XLA:CPU reduces with all-reduce" in format_comparison(fsdp_comparison)


@pytest.mark.slow
def test_small_within_ten_percent():
    """`small` on XLA:CPU (about a minute to compile): analytic state, temporaries and peak within 10%."""
    comparison = analytic_vs_compiled(_layout("fsdp", "model.preset=small"))
    for row in comparison["memory"]:
        assert row["ratio"] == pytest.approx(1.0, abs=0.10), row
