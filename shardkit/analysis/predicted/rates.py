"""What one GPU kernel costs: GEMMs by shape, fused attention at its measured rate, the rest at HBM bandwidth.

One cost model for the analytic step time (`shardkit.analysis.predicted.step_model.step_time`) and the replay of XLA's
compiled schedule (`shardkit.analysis.predicted.overlap`), so that both price the same kernel the same way: both call
`gemm_seconds`, `attention_seconds` and `streaming_seconds` below with the target's `RATES` entry.

- A GEMM of M x N x K takes the larger of its FLOPs at the achieved rate of its shape class and operand dtype
  (`GEMM_TABLE`: measured or published TFLOP/s by the GEMM's smallest dimension, log-linear between entries) and its
  operand and result bytes at streaming HBM bandwidth (small or skinny GEMMs are memory-bound).
- Fused attention (cuDNN flash attention) runs at its own measured rate; XLA's unfused attention at its own.
- Everything else (norms, rotary, activations, the loss's softmax, the optimizer update) moves bytes at HBM
  bandwidth x `HBM_EFFICIENCY`.

The table has no separate wave-quantisation factor (the 128 x 256-tile wave count used before it): a measured rate
already holds the tail effects of its own shape, and cuBLAS picks its tile (and split-K) per shape, so a fixed tile's
wave count does not describe what runs; the published best H100 shape, 2048 x 2048 x 13312, is a single wave of such
tiles and reaches 794.5 TFLOP/s. HBM bandwidth comes from the target's datasheet description
(`shardkit.analysis.predicted.targets.GpuSpec.memory_bandwidth`), the one place it is written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from shardkit.analysis.predicted.targets import GPUS

# Share of the datasheet HBM bandwidth that streaming kernels reach: assumed, not measured by this project (NVIDIA
# quotes 3.35 TB/s for the H100 SXM; copy kernels published for it reach about 90%, fused elementwise chains less).
HBM_EFFICIENCY = 0.8
# The operand dtype class of a GEMM by its operands' itemsize: fp32 operands run on TF32 tensor cores (what XLA:GPU
# does at JAX's default matmul precision), FP8 operands (the fp8 policy) on FP8 tensor cores.
DTYPE_BY_ITEMSIZE = {1: "fp8", 2: "bf16", 4: "tf32"}


@dataclasses.dataclass(frozen=True)
class GemmPoint:
    """One measured or published GEMM: its M x N x K and the FLOP/s it reached (its source where it is defined)."""

    shape: tuple[int, int, int]
    flops: float

    @property
    def smallest(self) -> int:
        return min(self.shape)


@dataclasses.dataclass(frozen=True)
class GemmCurve:
    """Achieved FLOP/s of one device kind's GEMMs in one dtype, by the GEMM's smallest dimension: exact at each
    point, log-linear in the smallest dimension between points, held at the first and last points beyond them."""

    points: tuple[GemmPoint, ...]

    def __post_init__(self):
        sizes = [point.smallest for point in self.points]
        rates = [point.flops for point in self.points]
        # A rate that fell with size would say a bigger GEMM keeps the tensor cores less busy: a data error.
        if not sizes or sizes != sorted(set(sizes)) or rates != sorted(rates):
            raise ValueError(f"GEMM points must grow in smallest dimension and rate, got {self.points}")

    def rate(self, smallest: int) -> float:
        """FLOP/s of a GEMM whose smallest dimension is `smallest`."""
        first, last = self.points[0], self.points[-1]
        if smallest <= first.smallest:
            return first.flops
        if smallest >= last.smallest:
            return last.flops
        upper = next(i for i, point in enumerate(self.points) if point.smallest >= smallest)
        low, high = self.points[upper - 1], self.points[upper]
        share = math.log(smallest / low.smallest) / math.log(high.smallest / low.smallest)
        return low.flops + share * (high.flops - low.flops)

    def scaled(self, factor: float) -> GemmCurve:
        """The same curve at `factor` times the rate (a dtype at a fixed ratio of peaks, a power-limited device)."""
        return GemmCurve(tuple(GemmPoint(point.shape, point.flops * factor) for point in self.points))


# ---- the GEMM table: achieved FLOP/s by shape class and dtype, per device kind --------------------------------------
# H100 SXM, bf16 (dense peak 989 TFLOP/s):
H100_BF16 = GemmCurve((
    # stas00/ml-engineering compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table": H100 SXM
    # bf16 794.5 TFLOP/s, best shape 2048x2048x13312 (torch 2.7.0+cu126 torch.mm, i.e. cuBLAS; mean of 100 iterations
    # after 50 warm-up), "H200 is the same".
    GemmPoint((2048, 2048, 13312), 794.5e12),
    # This project, one H100 SXM: jnp.matmul of bf16 8192 x 8192 x 8192, 798 TFLOP/s.
    GemmPoint((8192, 8192, 8192), 798e12),
))
# Below a smallest dimension of 2048 no published bf16 cuBLAS figure for the H100 was found: the rate is held at the
# 2048 entry there (optimistic where a GEMM has too few output tiles to fill 132 SMs) and the HBM floor takes over for
# skinny GEMMs; `bench/gpu_step.py` measures these shapes on a lent GPU.

# H100 SXM, FP8 (dense peak 1979 TFLOP/s):
H100_FP8 = GemmCurve((
    # DeepGEMM's README performance table (deepseek-ai/DeepGEMM, February 2025; read here through a summary quoting
    # it): FP8 GEMMs on an H800 SXM, whose tensor cores and clocks are the H100 SXM's (NVIDIA's H800 datasheet: the same
    # 1979 dense FP8 TFLOP/s): 64x2112x7168 at 206 TFLOP/s, 128x4096x7168 at 533. DeepGEMM's own kernels, not cuBLAS.
    GemmPoint((64, 2112, 7168), 206e12),
    GemmPoint((128, 4096, 7168), 533e12),
    # stas00/ml-engineering (as above), FP8 (float8_e4m3fn) table: H100 SXM 1402.6 TFLOP/s at 1024x9216x14336
    # (torch 2.7.0+cu126).
    GemmPoint((1024, 9216, 14336), 1402.6e12),
))
# H200 SXM: the H100's GH100 die and clocks with faster HBM3e. bf16: the H100's curve (stas00's table: "H200 is the
# same"; this project has not measured an H200). FP8: stas00's table (as above) measures the H200 SXM itself, 1453.4
# TFLOP/s at 1280x4096x12032 (torch 2.7.1+cu128); below it DeepGEMM's H800 figures, as for the H100.
H200_FP8 = GemmCurve((*H100_FP8.points[:2], GemmPoint((1280, 4096, 12032), 1453.4e12)))
# A100 SXM, bf16 (dense peak 312 TFLOP/s): stas00/ml-engineering (as above), 271.2 TFLOP/s at 1024x10240x5120 (torch
# 2.6.0+cu126). One point: held at every size (assumed; no size sweep was found).
A100_BF16 = GemmCurve((GemmPoint((1024, 10240, 5120), 271.2e12),))
# TF32 (fp32 operands): assumed at the bf16 rate x the datasheets' ratio of dense TF32 to dense bf16 peaks (H100 SXM
# 494.7 / 989, A100 156 / 312: one half), as no measured TF32 figure was found.
TF32_OF_BF16 = 0.5
# Meta's Grand Teton H100s run at a 500 W power limit: the H100's curves scaled by its peak over the H100 SXM's
# (`targets.GRAND_TETON_PEAK`), assumed (rates proportional to the power-limited peak, as for attention below).
GT_SCALE = GPUS["h100-gt"].peak_bf16_flops / GPUS["h100"].peak_bf16_flops


def _curves(bf16: GemmCurve, fp8: GemmCurve) -> dict[str, GemmCurve]:
    return {"bf16": bf16, "tf32": bf16.scaled(TF32_OF_BF16), "fp8": fp8}


GEMM_TABLE: Mapping[str, Mapping[str, GemmCurve]] = {
    "h100": _curves(H100_BF16, H100_FP8),
    "h200": _curves(H100_BF16, H200_FP8),
    "h100-a3": _curves(H100_BF16, H100_FP8),  # the same H100 SXM, another network
    "h100-gt": _curves(H100_BF16.scaled(GT_SCALE), H100_FP8.scaled(GT_SCALE)),
    # The A100 has no FP8 tensor cores: an FP8 dot runs as bf16 there (assumed at the bf16 curve).
    "a100": _curves(A100_BF16, A100_BF16),
}


@dataclasses.dataclass(frozen=True)
class KernelRates:
    """Achieved rates of one device kind: GEMMs by dtype and shape class, attention in FLOP/s, HBM in bytes/s."""

    gemm: Mapping[str, GemmCurve]  # by operand dtype class: "bf16", "tf32", "fp8"
    fused_attention_flops: float  # cuDNN flash attention, forward and backward together
    xla_attention_flops: float  # XLA's unfused attention (scores materialised)
    memory_bandwidth: float  # datasheet HBM bandwidth, from the target's `GpuSpec`

    @property
    def streaming_bandwidth(self) -> float:
        """What memory-bound kernels reach: datasheet bandwidth x `HBM_EFFICIENCY`."""
        return self.memory_bandwidth * HBM_EFFICIENCY


# Attention, H100 SXM 80GB, measured by this project on one H100: cuDNN fused attention forward + backward
# 347 TFLOP/s, XLA attention 19 TFLOP/s. H200: the same GH100 die and clocks, so the H100's rates (not measured on an
# H200). A100 SXM: FlashAttention-2's paper reports up to 230 TFLOP/s forward+backward on A100 (Dao 2023, fig. 4;
# cuDNN's is taken to be the same); XLA attention at the H100's share of peak (19/989). Grand Teton's 500 W H100: the
# H100's rates scaled by its peak over the H100 SXM's.
ATTENTION_FLOPS = {"h100": (347e12, 19e12), "h200": (347e12, 19e12), "h100-a3": (347e12, 19e12),
                   "h100-gt": (347e12 * GT_SCALE, 19e12 * GT_SCALE), "a100": (230e12, 6e12)}
RATES = {gpu: KernelRates(GEMM_TABLE[gpu], *ATTENTION_FLOPS[gpu], GPUS[gpu].memory_bandwidth) for gpu in GPUS}


def gemm_flops(rates: KernelRates, m: int, n: int, k: int, itemsize: int = 2) -> float:
    """The compute rate of an M x N x K GEMM with operands of `itemsize` bytes: its dtype's curve at its smallest
    dimension (the HBM floor is `gemm_seconds`')."""
    # fp64 (itemsize 8) is not in the table: priced as TF32, as fp32.
    return rates.gemm[DTYPE_BY_ITEMSIZE[min(itemsize, 4)]].rate(min(m, n, k))


def gemm_seconds(rates: KernelRates, m: int, n: int, k: int, itemsize: int = 2, batch: int = 1) -> float:
    """One (batched) GEMM: its FLOPs at `gemm_flops` or its operand and result bytes at streaming bandwidth,
    whichever is slower."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    traffic = (m * k + k * n + m * n) * batch * itemsize
    return max(flops / gemm_flops(rates, m, n, k, itemsize), traffic / rates.streaming_bandwidth)


def attention_seconds(rates: KernelRates, flops: float, fused: bool) -> float:
    """Attention's score and value matmuls (forward and backward FLOPs as counted by the caller)."""
    return flops / (rates.fused_attention_flops if fused else rates.xla_attention_flops)


def streaming_seconds(rates: KernelRates, traffic: float) -> float:
    """A memory-bound kernel reading and writing `traffic` bytes."""
    return traffic / rates.streaming_bandwidth
