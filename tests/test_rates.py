"""Kernel rates (shardkit.analysis.predicted.rates): the GEMM table, its interpolation, and one pricing for both
step-time models."""

from __future__ import annotations

import math
from itertools import pairwise

import pytest

from shardkit.analysis.compiled.hlo_parse import parse_hlo
from shardkit.analysis.predicted import kernels, overlap
from shardkit.analysis.predicted import rates as rates_module
from shardkit.analysis.predicted.rates import (
    DTYPE_BY_ITEMSIZE,
    GEMM_TABLE,
    RATES,
    GemmCurve,
    GemmPoint,
    gemm_flops,
    gemm_seconds,
)
from shardkit.analysis.predicted.step_model import step_time
from shardkit.analysis.predicted.targets import GPUS, parse_target
from shardkit.analysis.search.planned import base_layout, candidate_layout
from shardkit.analysis.search.published import BF16, LLAMA2_7B
from shardkit.analysis.search.suggest import load_base

ITEMSIZE = {dtype: size for size, dtype in DTYPE_BY_ITEMSIZE.items()}
CURVES = [(gpu, dtype, curve) for gpu, table in GEMM_TABLE.items() for dtype, curve in table.items()]
CURVE_IDS = [f"{gpu}-{dtype}" for gpu, dtype, _ in CURVES]


def test_the_8192_cubed_bf16_h100_gemm_runs_at_the_measured_798_tflops():
    seconds = gemm_seconds(RATES["h100"], 8192, 8192, 8192)
    assert 2 * 8192**3 / seconds == pytest.approx(798e12, rel=1e-12)


@pytest.mark.parametrize("gpu, dtype, curve", CURVES, ids=CURVE_IDS)
def test_every_table_entry_is_priced_at_its_own_rate(gpu, dtype, curve):
    """Exact at the entries: each point's own M x N x K in its dtype gets the rate it was measured or published at."""
    for point in curve.points:
        assert gemm_flops(RATES[gpu], *point.shape, ITEMSIZE[dtype]) == point.flops


@pytest.mark.parametrize("gpu, dtype, curve", CURVES, ids=CURVE_IDS)
def test_rates_grow_with_size_and_are_log_linear_between_entries(gpu, dtype, curve):
    sizes = [2**i for i in range(4, 16)]
    assert all(curve.rate(small) <= curve.rate(big) for small, big in pairwise(sizes))
    # What a square GEMM achieves, the HBM floor included, does not fall as it grows either.
    achieved = [2 * n**3 / gemm_seconds(RATES[gpu], n, n, n, ITEMSIZE[dtype]) for n in sizes]
    assert all(a <= b * (1 + 1e-12) for a, b in pairwise(achieved)), achieved
    for low, high in pairwise(curve.points):
        middle = math.sqrt(low.smallest * high.smallest)  # halfway in log size: halfway in rate
        assert curve.rate(middle) == pytest.approx((low.flops + high.flops) / 2)


def test_a_curve_is_held_beyond_its_ends_and_refuses_a_rate_that_falls_with_size():
    curve = GemmCurve((GemmPoint((1024, 4096, 4096), 500e12), GemmPoint((4096, 4096, 4096), 700e12)))
    assert curve.rate(64) == 500e12 and curve.rate(65536) == 700e12 and curve.rate(2048) == pytest.approx(600e12)
    with pytest.raises(ValueError, match="grow"):
        GemmCurve((GemmPoint((1024, 4096, 4096), 700e12), GemmPoint((4096, 4096, 4096), 500e12)))


def test_skinny_gemms_are_priced_at_hbm_bandwidth_and_fp32_at_tf32s_half_rate():
    h100 = RATES["h100"]
    skinny = gemm_seconds(h100, 16, 8192, 8192)  # reads the 128 MiB weight
    assert skinny == pytest.approx((16 * 8192 * 2 + 8192**2) * 2 / h100.streaming_bandwidth)
    assert gemm_seconds(h100, 8192, 8192, 8192, itemsize=4) == pytest.approx(
        2 * gemm_seconds(h100, 8192, 8192, 8192, itemsize=2))


def test_hbm_bandwidth_is_read_from_the_targets_gpu_spec():
    assert set(RATES) == set(GPUS)
    assert all(RATES[gpu].memory_bandwidth == spec.memory_bandwidth for gpu, spec in GPUS.items())


def test_suggest_and_the_replay_price_the_same_gemm_through_one_function_with_the_same_rates(monkeypatch):
    """step_model.step_time (through kernels.compute_time) and the replay of a compiled schedule (overlap) both call
    `rates.gemm_seconds` with the target's `RATES` entry: a Llama2-7B layer's first GEMM, written as an HLO dot and
    replayed, costs what the analytic model charges for it (both x kernels.OVERHEAD)."""
    calls = []

    def recording(rates, *shape):
        calls.append((rates, shape))
        return rates_module.gemm_seconds(rates, *shape)

    monkeypatch.setattr(kernels, "gemm_seconds", recording)
    monkeypatch.setattr(overlap, "gemm_seconds", recording)
    target = parse_target("h100x8")
    recipe = load_base("recipes/fsdp.toml", (*LLAMA2_7B, *BF16, "train.global_batch=32", "train.seq_len=4096"))
    layout = candidate_layout(base_layout(recipe), recipe, target)
    step_time(layout, target)
    analytic_rates, (m, n, k, itemsize) = calls[0]
    assert (m, n, k, itemsize) == (4 * 4096, 4096, 4096, 2)  # tokens x q width x embed, bf16

    module = parse_hlo(f"""HloModule m, is_scheduled=true

ENTRY %main (a: bf16[{m},{k}], b: bf16[{k},{n}]) -> bf16[{m},{n}] {{
  %a = bf16[{m},{k}]{{1,0}} parameter(0)
  %b = bf16[{k},{n}]{{1,0}} parameter(1)
  ROOT %dot = bf16[{m},{n}]{{1,0}} dot(%a, %b), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
}}
""")
    entry = module.computations[module.entry]
    [dot] = [i for i in entry.instructions if i.opcode == "dot"]
    replayer = overlap._Replayer(module, {}, overlap.Pricing.for_target(target, layout.mesh.shape))
    replayed = replayer.kernel_seconds(dot, entry.shapes())
    replay_rates, replay_shape = calls[-1]
    assert replay_rates is analytic_rates is RATES["h100"] and replay_shape == (m, n, k, itemsize)
    assert replayed == kernels.OVERHEAD * rates_module.gemm_seconds(analytic_rates, m, n, k, itemsize)
