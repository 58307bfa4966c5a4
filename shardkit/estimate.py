"""The analytic model: FLOPs per token and peak device throughput (extended with memory and communication)."""

from __future__ import annotations

from typing import Any

# Dense bf16 peak FLOP/s by device kind (published specifications, without sparsity).
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "B200": 2250e12,
    "L40S": 362e12,
}


def peak_flops(device_kind: str) -> float | None:
    """The device's dense bf16 peak, or None when it is not in the table (CPU devices are not)."""
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in device_kind.lower():
            return flops
    return None


def training_flops_per_token(config: Any, parameters: int, seq_len: int) -> float:
    """6 x parameters (forward 2, backward 4) plus causal attention scores and values.

    The attention term is 12 * layers * (heads * head_dim) * seq_len: it counts the full square of the score matrix
    (as the PaLM and Megatron MFU formulas do), not the causal half. The embedding lookup is counted in `parameters`
    as if it were a matmul, which slightly overstates the FLOPs for untied embeddings: the convention MFU papers use.
    """
    attention = 0.0
    if all(hasattr(config, name) for name in ("layers", "heads", "head_dim")):
        attention = 12.0 * config.layers * config.heads * config.head_dim * seq_len
    return 6.0 * parameters + attention
