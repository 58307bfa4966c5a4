"""The compute side of the analytic step time: one device's kernels for one step, priced by
`shardkit.analysis.predicted.rates`.

A decoder layer on one device runs, per micro-batch of T = rows x sequence tokens (heads and mlp divided by the
tensor-parallel degree t):
- seven GEMMs forward (q, k, v, output projection, gate, up, down), each twice backward (input and weight gradient,
  the weight gradient contracting over T), and again forward where remat recomputes them;
- attention: causal score and value matmuls, 2·T·s·H·E/t FLOPs forward (the causal half of 4·T·s·H·E/t), 2.5 times
  that backward, again forward under `full` or (fused kernel) `selective` remat;
- memory-bound kernels: `STREAMED_TENSORS` passes over the layer's residual-stream and MLP-width tensors.
Outside the layers: the output head (three GEMMs), the loss's softmax over the logits, and the AdamW update over the
device's parameter shard.

`OVERHEAD` is the one calibrated constant: the ratio of a published step time to the sum of these kernel times
(see its comment); every other rate is measured, published or marked assumed (`rates.GEMM_TABLE`, `rates.RATES`).
"""

from __future__ import annotations

import dataclasses

from shardkit.analysis.predicted.flops import is_transformer
from shardkit.analysis.predicted.memory_terms import attention_is_fused, local_batch, sequence_parallel, sharded_bytes
from shardkit.analysis.predicted.rates import KernelRates, attention_seconds, gemm_seconds, streaming_seconds

# Passes of one residual-stream tensor (D wide) and one MLP-width tensor (F / t wide) a layer's memory-bound kernels
# make per token, forward and backward together: two RMSNorms (fp32 statistics; input, output and their gradients),
# two residual adds, rotary on q and k, SwiGLU's product and its gradient, read and written. Counted from the Llama
# block in models/llama.py, not measured.
STREAMED_TENSORS = {"residual": 30.0, "mlp": 9.0, "qk": 6.0}
ADAM_BYTES_PER_PARAMETER = 28  # fp32 parameter read + write, two moments read + write, the gradient read
# Step time / sum of kernel times, from one published run: MaxText's Llama2-7B on one 8 x H100 node (FSDP 8, seq 4096,
# global batch 32, minimal_flash remat) publishes 492 TFLOP/s per GPU, i.e. 1.454 s per step with MaxText's causal
# FLOP count (AI-Hypercomputer/maxtext, MaxText/configs/a3/llama_2_7b/README.md and 1vm.sh). There the kernels above,
# priced by `rates.GEMM_TABLE`, sum to 1.111 s and 0.008 s of communication is exposed: OVERHEAD = (1.454 - 0.008) /
# 1.111 = 1.30 (1.28 under the earlier single 798 TFLOP/s rate x wave quantisation). Fitted on that row only, never
# per row. What it stands for, not modelled one by one: kernel launches and gaps, GEMMs at their real layouts and
# transposes below the table's rates, compute slowed by the NCCL kernels that run beside it. Why it is kept: the same
# constant predicts the thirteen other published rows (`shardkit.analysis.search.published`: MaxText on 2 and 16 A3 VMs
# and on 64 H100s, torchtitan on Grand Teton, NeMo, Megatron-LM on 512 to 3,072 A100s, Meta's Llama 3 405B on 8,192 and
# 16,384 H100s; five frameworks, five clusters) within 10%. The replay of XLA's schedule applies it to every kernel as
# well, so both step-time models share it.
# `bench/gpu_step.py` records measured against predicted step times and GEMM rates, to replace it by measured costs.
OVERHEAD = 1.30


@dataclasses.dataclass(frozen=True)
class ComputeTime:
    """One device's kernel seconds for one step, by kind (overhead included)."""

    gemm: float
    attention: float
    memory: float

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.memory


def compute_time(layout, rates: KernelRates) -> ComputeTime:
    """The kernels of one training step on one device (module docstring), times `OVERHEAD`."""
    config, train = layout.config, layout.recipe.train
    itemsize = layout.policy.compute_size
    rows, seq = local_batch(layout)
    tokens = rows * seq
    t = layout.mesh.shape["tensor"]
    layers = max(getattr(config, "layers", 1) // layout.mesh.shape["pipeline"], 1)
    micro = train.grad_accum * layers
    gemm_itemsize = 1 if layout.policy.fp8 else itemsize  # the layers' GEMMs in FP8
    gemm = micro * _layer_gemm_seconds(layout, rates, tokens, t, gemm_itemsize)
    attention = micro * _layer_attention_seconds(layout, rates, rows, seq, t)
    memory = micro * streaming_seconds(rates, _layer_streamed_bytes(layout, tokens, t, itemsize))
    head = output_head_seconds(layout, rates)
    memory += streaming_seconds(rates, sharded_bytes(layout, "optimizer", 1) * ADAM_BYTES_PER_PARAMETER)
    return ComputeTime(gemm * OVERHEAD + head.gemm, attention * OVERHEAD, memory * OVERHEAD + head.memory)


def output_head_seconds(layout, rates: KernelRates) -> ComputeTime:
    """The output head's three GEMMs and the loss's softmax over its logits, for one step on one device, times
    `OVERHEAD` (part of `compute_time`; `shardkit.analysis.search.suggest` takes it off a pipeline stage whose framework
    gives the head a layer's slot on the last stage)."""
    config = layout.config
    if not hasattr(config, "vocab"):
        return ComputeTime(0.0, 0.0, 0.0)
    itemsize = layout.policy.compute_size
    rows, seq = local_batch(layout)
    tokens = rows * seq * layout.recipe.train.grad_accum
    vocab = config.vocab // layout.mesh.shape["tensor"]
    gemm = 3 * gemm_seconds(rates, tokens, vocab, config.embed, itemsize)
    memory = streaming_seconds(rates, tokens * vocab * (itemsize + 3 * 4))  # logits, fp32 softmax + grad
    return ComputeTime(gemm * OVERHEAD, 0.0, memory * OVERHEAD)


# Attention as batched GEMMs (Megatron-LM's ParallelAttention: `torch.baddbmm` scores over the full square, the
# causal mask applied by the fused `scale_mask_softmax`, `attention_dropout` at its default 0.1, `torch.bmm` with V):
# passes over the (rows x heads/t x s x s) 2-byte score tensor its memory-bound kernels make, counted from that code,
# not measured. Forward: the softmax reads and writes (2), dropout reads, writes and stores a 1-byte mask (2.5);
# backward: dropout reads the gradient and the mask and writes (2.5), the softmax reads the gradient and its output
# and writes (3).
GEMM_ATTENTION_SCORE_PASSES = {"forward": 4.5, "backward": 5.5}


def gemm_attention_seconds(layout, rates: KernelRates) -> float:
    """Attention of one step on one device run as batched GEMMs around a fused softmax, times `OVERHEAD`: per layer
    and micro-batch, forward Q K^T (s x s x d) and P V (s x d x s), backward two GEMMs for each, batched over rows x
    heads / t; the score tensor's `GEMM_ATTENTION_SCORE_PASSES`; remat's recomputed forward again."""
    config, train = layout.config, layout.recipe.train
    if not is_transformer(config):
        return 0.0
    rows, queries = local_batch(layout)
    batch = rows * config.heads // layout.mesh.shape["tensor"]
    keys, d = train.seq_len, config.head_dim
    itemsize = layout.policy.compute_size

    def gemm(m: int, n: int, k: int) -> float:
        return gemm_seconds(rates, m, n, k, itemsize, batch)

    forward = gemm(queries, keys, d) + gemm(queries, d, keys)  # S = Q K^T, O = P V
    backward = gemm(queries, d, keys) + gemm(keys, d, queries)  # dQ = dS K, dK = dS^T Q
    backward += gemm(queries, keys, d) + gemm(keys, d, queries)  # dP = dO V^T, dV = P^T dO
    scores = batch * queries * keys * itemsize
    forward += streaming_seconds(rates, GEMM_ATTENTION_SCORE_PASSES["forward"] * scores)
    backward += streaming_seconds(rates, GEMM_ATTENTION_SCORE_PASSES["backward"] * scores)
    reruns = 1 if train.remat in ("full", "offload") else 0
    layers = max(config.layers // layout.mesh.shape["pipeline"], 1)
    return train.grad_accum * layers * (forward * (1 + reruns) + backward) * OVERHEAD


def _layer_gemms(config, t: int) -> list[tuple[int, int]]:
    """(output width, input width) of one layer's weight matrices on one device."""
    if not is_transformer(config):
        return [(config.mlp // t, config.embed), (config.embed, config.mlp // t)]
    q, kv, f = config.heads * config.head_dim // t, config.kv_heads * config.head_dim // t, config.mlp // t
    return [(q, config.embed), (kv, config.embed), (kv, config.embed), (config.embed, q),
            (f, config.embed), (f, config.embed), (config.embed, f)]


def _layer_gemm_seconds(layout, rates: KernelRates, tokens: int, t: int, itemsize: int) -> float:
    """Forward, both backward GEMMs, and the remat preset's recomputed forward, of one layer and micro-batch."""
    total = 0.0
    for n, k in _layer_gemms(layout.config, t):
        forward = gemm_seconds(rates, tokens, n, k, itemsize)
        backward = gemm_seconds(rates, tokens, k, n, itemsize) + gemm_seconds(rates, n, k, tokens, itemsize)
        total += forward * (2 if layout.recipe.train.remat in ("full", "offload") else 1) + backward
    return total


def _layer_attention_seconds(layout, rates: KernelRates, rows: int, seq: int, t: int) -> float:
    config = layout.config
    if not is_transformer(config):
        return 0.0
    full_seq = layout.recipe.train.seq_len
    forward = 2.0 * rows * seq * full_seq * config.heads * config.head_dim / t  # causal half of 4·T·s·H·E
    fused = attention_is_fused(layout)
    remat = layout.recipe.train.remat
    reruns = 1 if remat in ("full", "offload") or (remat == "selective" and fused) else 0
    return attention_seconds(rates, forward * (1 + 2.5 + reruns), fused)


def _layer_streamed_bytes(layout, tokens: int, t: int, itemsize: int) -> float:
    config = layout.config
    residual = config.embed / (t if sequence_parallel(layout) else 1)
    mlp = config.mlp / t
    qk = (config.heads + config.kv_heads) * config.head_dim / t if is_transformer(config) else 0.0
    width = (STREAMED_TENSORS["residual"] * residual + STREAMED_TENSORS["mlp"] * mlp + STREAMED_TENSORS["qk"] * qk)
    return tokens * width * itemsize
