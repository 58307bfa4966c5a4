"""XLA:GPU's split-K rewrite of small GEMMs, as analytic functions: how many pieces a dot's K is cut into, and the
fp32 partial sums that buffer holds until a separate fusion reduces them.

XLA:GPU rewrites a dot whose M x N tiles leave the GPU's SMs idle into a batched dot over `split` slices of K plus a
reduce over that new leading dimension (the Triton GEMM fusion then outputs `f32[split, ..., m, n]`). The choice is
made before autotuning, by a cost model, so a deviceless compile shows exactly what a real one would run.

Source: `xla/backends/gpu/transforms/splitk_rewriter.cc` (`SplitkRewriterVisitor::HandleDot`, `ChooseSplitK`,
`EstimateGemmCostAfterSplitK`, `GetCostWeights`), the cost-model version whose per-generation weights (Hopper
100 / 0.194136 / 193.1384 / 4.36e7) are the ones compiled into the jax[cuda12] 0.10.2 plugin (each weight's float64
found in `xla_cuda_plugin.so`; the older constant set of openxla/xla 1ae7b78e's file is absent). Read in the zml/xla
fork at 27985e8a, whose extra local-split path applies to ROCm only. tests/test_split_k.py checks the rule against
XLA's own choice for h100x1 across a sweep of shapes and dtypes.
"""

from __future__ import annotations

import dataclasses
import functools

# Hopper's SM count (H100 SXM and H200 alike); XLA reads it as the device description's core_count.
H100_SM_COUNT = 132
ACCUMULATOR_BYTES = 4  # f32: XLA's GEMM accumulator for f32, bf16, f16 and fp8 operands
# The split counts ChooseSplitK tries, in order; the first of equal costs wins.
CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TILE = 128  # kMTileSize = kNTileSize
FLOPS_PER_ELEMENT = 2  # a multiply and an add: the dot's default algorithm (the bf16x3/x6/x9 ones cost more)


@dataclasses.dataclass(frozen=True)
class CostWeights:
    """XLA's per-GPU-generation weights of the split-K cost model (`SplitKCostWeights`)."""

    compute: float
    memory: float
    reduction_memory: float
    reduction_launch: float


BLACKWELL = CostWeights(100.0, 0.0848863, 189.711, 1.21563e08)
HOPPER = CostWeights(100.0, 0.194136, 193.1384, 4.36e07)
OLDER = CostWeights(100.0, 0.0666955, 467.815, 5.65307e07)


def cost_weights(compute_capability: tuple[int, int]) -> CostWeights:
    """The weights XLA uses for a CUDA device of this compute capability (`GetCostWeights`)."""
    major = compute_capability[0]
    return BLACKWELL if major >= 10 else HOPPER if major >= 9 else OLDER


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One dot as XLA's cost model sees it: sizes, element sizes in bytes, and the device."""

    m: int
    n: int
    k: int
    batch: int
    operand_bytes: int
    output_bytes: int
    sm_count: int
    weights: CostWeights


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _dot_cost(gemm: Gemm, split: int) -> float:
    """The dot's own cost after the split: the larger of compute over waves of SMs and memory traffic.

    Written in the source's order of float operations so that near-ties resolve as XLA's do."""
    g, w = gemm, gemm.weights
    effective_k, effective_batch = _ceil_div(g.k, split), g.batch * split
    m_tile, n_tile = min(g.m, TILE), min(g.n, TILE)
    tiles = float(effective_batch * _ceil_div(g.m, TILE) * _ceil_div(g.n, TILE))
    # Tiles smaller than 128 x 128 are taken to run several at once on one SM.
    concurrent_tiles_per_sm = float(TILE * TILE) / float(m_tile * n_tile)
    waves = max(1.0, tiles / (float(g.sm_count) * concurrent_tiles_per_sm))
    compute = float(FLOPS_PER_ELEMENT) * m_tile * n_tile * effective_k * waves * w.compute
    read = float(g.m) * g.k * g.batch * (g.operand_bytes * 8) / 8.0 + float(g.n) * g.k * g.batch * (
        g.operand_bytes * 8) / 8.0
    written_bytes = ACCUMULATOR_BYTES if split > 1 else g.output_bytes  # partial sums are written in f32
    written = float(g.m) * g.n * effective_batch * (written_bytes * 8) / 8.0
    return max(compute, (read + written) * w.memory)


def _split_cost(gemm: Gemm, split: int) -> float:
    """The dot's cost plus, when split, the reduce fusion's launch and its read of the partial sums."""
    if split == 1:
        return _dot_cost(gemm, split)
    g = gemm
    reduce_read = float(g.batch * split) * g.m * g.n * (ACCUMULATOR_BYTES * 8) / 8.0
    reduce_write = float(g.batch) * g.m * g.n * (g.output_bytes * 8) / 8.0
    return _dot_cost(gemm, split) + g.weights.reduction_launch + (reduce_read + reduce_write) * (
        g.weights.reduction_memory)


@functools.lru_cache(maxsize=4096)
def split_k_pieces(m: int, n: int, k: int, dtype_bytes: int, batch: int = 1, *, output_bytes: int | None = None,
                   sm_count: int = H100_SM_COUNT, compute_capability: tuple[int, int] = (9, 0)) -> int:
    """How many pieces XLA:GPU splits a dot's contracting dimension into; 1 when it does not split. Kept per shape:
    `suggest` asks about the same layers' dots for many layouts.

    Args:
        m: the lhs's non-contracting size (tokens), all such dimensions multiplied.
        n: the rhs's non-contracting size, all such dimensions multiplied.
        k: the contracting size (one contracting dimension: XLA does not split dots with several).
        dtype_bytes: the operands' element size (4 for f32, 2 for bf16); XLA takes it from above any chain of
            unary elementwise ops feeding the dot (a convert it expects to fuse), so a bf16 weight converted to
            f32 counts 2.
        batch: the product of the dot's batch dimensions.
        output_bytes: the dot's result element size; the operands' when not given.
        sm_count: the device's SM count (132 on H100 and H200).
        compute_capability: picks XLA's cost weights (Hopper for 9.x).
    """
    gemm = Gemm(m, n, k, batch, dtype_bytes, dtype_bytes if output_bytes is None else output_bytes, sm_count,
                cost_weights(compute_capability))
    costs = [_split_cost(gemm, split) for split in CANDIDATES]
    return CANDIDATES[costs.index(min(costs))]


def split_k_partial_sum_bytes(m: int, n: int, k: int, dtype_bytes: int, batch: int = 1, **device) -> int:
    """Bytes of the f32 partial sums a split dot writes before the reduce (split x batch x m x n x 4); 0 unsplit.

    The partial sums are f32 whatever the operands (bf16 dots too): they are the GEMM's accumulator type. Keyword
    arguments are `split_k_pieces`'s."""
    split = split_k_pieces(m, n, k, dtype_bytes, batch, **device)
    return split * batch * m * n * ACCUMULATOR_BYTES if split > 1 else 0
