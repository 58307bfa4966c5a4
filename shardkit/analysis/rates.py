"""What one GPU kernel costs: GEMMs by shape, fused attention at its measured rate, the rest at HBM bandwidth.

One cost model for the analytic step time (`shardkit.analysis.suggest.step_time`) and the replay of XLA's compiled
schedule (`shardkit.analysis.overlap`), so that both price the same kernel the same way.

- A GEMM of M x N x K takes the larger of its FLOPs at the device's achieved large-GEMM rate, scaled by the share of
  the last wave of output tiles that is filled (wave quantisation: cuBLAS on Hopper tiles the output in 128 x 256
  blocks, one per SM at a time), and its operand and result bytes at HBM bandwidth (small or skinny GEMMs are
  memory-bound). fp32 GEMMs run on TF32 tensor cores at half the bf16 rate.
- Fused attention (cuDNN flash attention) runs at its own measured rate; XLA's unfused attention at its own.
- Everything else (norms, rotary, activations, the loss's softmax, the optimizer update) moves bytes at HBM
  bandwidth x `HBM_EFFICIENCY`.

Where each rate comes from is `RATES`' comment; rates this project has not measured are marked as assumptions.
"""

from __future__ import annotations

import dataclasses
import math

# cuBLAS's Hopper bf16 kernels tile the output in 128 x 256 blocks (CUTLASS's default SM90 tile for large GEMMs).
TILE_M, TILE_N = 128, 256
# Share of the datasheet HBM bandwidth that streaming kernels reach: assumed, not measured by this project (NVIDIA
# quotes 3.35 TB/s for the H100 SXM; copy kernels published for it reach about 90%, fused elementwise chains less).
HBM_EFFICIENCY = 0.8


@dataclasses.dataclass(frozen=True)
class KernelRates:
    """Achieved rates of one device kind, in FLOP/s and bytes/s."""

    gemm_flops: float  # large bf16 GEMMs
    fused_attention_flops: float  # cuDNN flash attention, forward and backward together
    xla_attention_flops: float  # XLA's unfused attention (scores materialised)
    memory_bandwidth: float  # datasheet HBM bandwidth
    sm_count: int

    @property
    def streaming_bandwidth(self) -> float:
        """What memory-bound kernels reach: datasheet bandwidth x `HBM_EFFICIENCY`."""
        return self.memory_bandwidth * HBM_EFFICIENCY


# H100 SXM 80GB, measured by this project on one H100 (issue 10): bf16 matmul 798 TFLOP/s (8192^3), cuDNN fused
# attention forward + backward 347 TFLOP/s, XLA attention 19 TFLOP/s. H200: the same GH100 die and clocks, so the
# H100's compute rates (not measured on an H200). A100 SXM: 0.81 of its 312 TFLOP/s peak assumed for GEMMs as on the
# H100; FlashAttention-2's paper reports up to 230 TFLOP/s forward+backward on A100 (Dao 2023, fig. 4; cuDNN's is
# taken to be the same); XLA attention at the H100's share of peak (19/989). Not measured by this project.
# Grand Teton's 500 W H100 (torchtitan's runs): its bf16 peak is not published; torchtitan's paper (arXiv
# 2410.06511) puts it between the H100 SXM's (989 TFLOP/s at 700 W) and the H100 NVL's (835 dense at 400 W, NVIDIA's
# datasheet). Taken linear in the power limit between those two points.
GRAND_TETON_PEAK = 835e12 + (989e12 - 835e12) * (500 - 400) / (700 - 400)
GT_SCALE = GRAND_TETON_PEAK / 989e12
RATES = {
    "h100": KernelRates(798e12, 347e12, 19e12, 3.35e12, 132),
    "h200": KernelRates(798e12, 347e12, 19e12, 4.8e12, 132),
    "h100-a3": KernelRates(798e12, 347e12, 19e12, 3.35e12, 132),  # the same H100 SXM, another network
    # Grand Teton's 500 W H100: the H100's rates scaled by its peak over the H100 SXM's; its HBM2e's 2.4 TB/s.
    "h100-gt": KernelRates(798e12 * GT_SCALE, 347e12 * GT_SCALE, 19e12 * GT_SCALE, 2.4e12, 132),
    "a100": KernelRates(0.81 * 312e12, 230e12, 6e12, 2.039e12, 108),
}


def gemm_seconds(rates: KernelRates, m: int, n: int, k: int, itemsize: int = 2, batch: int = 1) -> float:
    """One (batched) GEMM: FLOPs at the large-GEMM rate over the filled share of its tile waves, or its bytes at
    streaming bandwidth, whichever is slower. fp32 operands (`itemsize` 4) run at the TF32 rate, half of bf16's."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    tiles = math.ceil(m / TILE_M) * math.ceil(n / TILE_N) * batch
    waves = math.ceil(tiles / rates.sm_count)
    filled = tiles / (waves * rates.sm_count)
    # fp32 operands run at the TF32 rate (half of bf16's); FP8 operands (the fp8 policy) at twice bf16's, Hopper's FP8
    # tensor-core peak (1979 vs 989 TFLOP/s dense), assumed reached as efficiently (not measured by this project).
    rate = rates.gemm_flops * filled * (0.5 if itemsize >= 4 else 2.0 if itemsize == 1 else 1.0)
    traffic = (m * k + k * n + m * n) * batch * itemsize
    return max(flops / rate, traffic / rates.streaming_bandwidth)


def attention_seconds(rates: KernelRates, flops: float, fused: bool) -> float:
    """Attention's score and value matmuls (forward and backward FLOPs as counted by the caller)."""
    return flops / (rates.fused_attention_flops if fused else rates.xla_attention_flops)


def streaming_seconds(rates: KernelRates, traffic: float) -> float:
    """A memory-bound kernel reading and writing `traffic` bytes."""
    return traffic / rates.streaming_bandwidth
