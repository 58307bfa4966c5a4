"""Every layout trains like one device: same losses over 3 steps and same gradients, per recipe and policy.

Tolerance, fp32: 1e-5 relative on losses, and on gradients 1e-5 relative plus 1e-5 of the leaf's largest entry.
The layouts change only the order of floating-point sums (a reduction split over devices, micro-batches accumulated):
fp32 has a 6e-8 unit roundoff and these sums run over at most a few thousand terms, so the observed differences are
around 1e-7 to 1e-6 and 1e-5 leaves an order of magnitude of margin while still catching any real error (a missing
reduction, a wrong scale or a wrong shard is off by tens of percent). The absolute part scaled by the leaf's largest
entry exists because entries that are ~0 have no meaningful relative error.

bf16 compute: 2e-2. bf16 has an 8-bit mantissa (unit roundoff 3.9e-3) and each layout rounds intermediate results at
different points, so logits differ by a few roundings; 2e-2 is about five unit roundoffs of bf16, loose enough for
reassociation and tight enough that a layout bug (errors of order 1) fails.
"""

from __future__ import annotations

import jax
import pytest

from tests.equivalence import BF16_RTOL, FP32_RTOL, assert_losses_close, assert_traces_close, trace
from tests.helpers import recipe

pytestmark = pytest.mark.slow  # every layout's step compiled and run against one device's


# Three steps show two updates, the second from the optimizer state the first left; 32 tokens per row keep every
# layout's sequence splits (the sums reordered are the same kind, over fewer terms).
STEPS = 3
SHAPE = ("train.seq_len=32",)
ACCUM2 = "train.grad_accum=2"  # 2 micro-batches of the default 16 rows: one row per data-parallel device each
# name -> (recipe, its overrides, the overrides of the one-device reference). A remat policy only recomputes what
# the backward pass reads, whatever the layout, so each runs combined with an accumulating layout (one trace fewer
# each): full remat with FSDP's, selective with ZeRO-2's. Every recipe is trained: dp, fsdp and zero2 with
# accumulation only, since their sharding and reductions are the same with one micro-batch, where the step without
# an accumulation loop is trained by zero1 (dp's replicated compute and data reduction), tp and fsdp_tp (fsdp's
# gathers and reduce-scatters, which zero2's gradients share).
LAYOUTS = {
    "zero1": ("zero1", (), ()),
    "tp": ("tp", (), ()),
    "fsdp_tp": ("fsdp_tp", (), ()),
    "fsdp_accum2_remat_full": ("fsdp", (ACCUM2, "train.remat=full"), ()),
    "dp_accum2": ("dp", (ACCUM2,), ()),
    "zero2_accum2_remat_selective": ("zero2", (ACCUM2, "train.remat=selective"), ()),
    "mlp_fsdp_tp": ("fsdp_tp", ("model.name=mlp",), ("model.name=mlp",)),
}


def _trace(name: str, *overrides: str, **kwargs):
    return trace(recipe(name, *SHAPE, *overrides), steps=STEPS, **kwargs)


@pytest.fixture(scope="module")
def single():
    """The one-device reference traces, per model and policy."""
    cache = {}

    def get(*overrides):
        if overrides not in cache:
            cache[overrides] = _trace("single", *overrides, devices=jax.devices()[:1])
        return cache[overrides]

    return get


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fp32_layout_matches_one_device(name, single):
    recipe_name, overrides, reference = LAYOUTS[name]
    assert_traces_close(_trace(recipe_name, *overrides), single(*reference), FP32_RTOL)


@pytest.mark.parametrize("policy", ["bf16", "bf16-params"])
def test_bf16_layout_matches_one_device(policy, single):
    setting = f"precision.policy={policy}"
    assert_traces_close(_trace("fsdp_tp", setting), single(setting), BF16_RTOL)


def test_tolerance_catches_a_wrong_layout(single):
    """The comparison is not vacuous: a learning rate 3% off (a stand-in for a wrong update) fails it. The losses are
    what catch it (the first-batch gradients are taken at the initial parameters, which no update has touched), so
    only the steps are compiled."""
    with pytest.raises(AssertionError):
        assert_losses_close(_trace("dp", "optimizer.lr=0.0031", gradients=False), single(), FP32_RTOL)
