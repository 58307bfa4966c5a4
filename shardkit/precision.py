"""Mixed-precision policies in the style of jmp: which dtype parameters are kept in, computed in, and output in.

Presets:
    float32      everything in fp32.
    bf16         fp32 parameters, bf16 compute, fp32 output (gradients come back in fp32 through the cast).
    bf16-params  bf16 parameters for compute, an fp32 master copy kept by the optimizer, fp32 gradient accumulation.
    fp16         fp32 parameters, fp16 compute, fp32 output, with dynamic loss scaling.
    fp8          bf16's dtypes, and the layer stack's matmuls (shardkit.nn.dot) in FP8 with delayed scaling: operands
                 in e4m3, the output gradient in e5m2, each scaled from the amax history of its own matmul site (Flax's
                 `fp8_scaled_dot_general`, Transformer Engine's recipe). The scaling state is part of the train state.
Or any jmp-style string: `params=float32,compute=bfloat16,output=float32` (short names f32/bf16/f16 work too).

The gradient-reduction dtype is the recipe's `precision.grad_reduce`: `compute` (the compute dtype) or `float32`
(`Policy.grad_reduce_dtype` says what each means and where it applies).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from shardkit.errors import ShardkitError

DTYPES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32, "full": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class Policy:
    """Dtypes for parameters, compute and output; `master_weights` keeps an fp32 copy in the optimizer;
    `grad_reduce_fp32` reduces the layers' weight gradients across devices in fp32 (`grad_reduce_dtype`)."""

    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: jnp.dtype = jnp.float32
    output_dtype: jnp.dtype = jnp.float32
    master_weights: bool = False
    fp8: bool = False
    grad_reduce_fp32: bool = False

    @property
    def compute_size(self) -> int:
        """Bytes of one element in the compute dtype."""
        return jnp.dtype(self.compute_dtype).itemsize

    @property
    def param_size(self) -> int:
        """Bytes of one element in the parameter dtype."""
        return jnp.dtype(self.param_dtype).itemsize

    @property
    def grad_reduce_size(self) -> int:
        """Bytes of one element in the gradient-reduction dtype (`grad_reduce_dtype`)."""
        return self.grad_reduce_dtype.itemsize

    @property
    def loss_scaling(self) -> bool:
        """fp16's narrow exponent range needs loss scaling; bf16 has fp32's range and does not."""
        return jnp.dtype(self.compute_dtype) == jnp.float16 or jnp.dtype(self.param_dtype) == jnp.float16

    @property
    def grad_reduce_dtype(self) -> jnp.dtype:
        """The dtype the layers' weight gradients cross devices in: the compute dtype, or fp32 under
        `grad_reduce_fp32` (the recipe's `precision.grad_reduce = "float32"`).

        The step differentiates the parameters after their cast to the compute dtype, so each weight gradient is the
        output of a matmul; XLA's SPMD partitioner inserts the reduce-scatter / all-reduce over the replica axes at
        that matmul's output, in its dtype, and the cast back to the parameter dtype (the cast's transpose) comes
        after it, where it cannot move the reduction. So by default (`compute`) the layers' gradients cross devices in
        the compute dtype. Under `grad_reduce_fp32`, `shardkit.nn.dot` computes its weight gradient with
        `preferred_element_type=float32` (a custom VJP): the partial sums are reduced across devices in fp32 and
        rounded once to the compute dtype after the sum (that weight's cotangent dtype), where by default each
        device's partial sum is rounded before the reduction and the reduction itself runs in the compute dtype.
        Only matmuls through `shardkit.nn.dot` (the built-in models' layer stack) are affected; gradients computed
        in fp32 anyway (the norms' scales, the output head's from the fp32 logits) cross in fp32 either way, and a
        mixture of experts' own matmuls (shardkit.moe) stay in the compute dtype. Pipelines sum and reduce their
        stage gradients in this dtype themselves (the 1F1B family in its own backward, GPipe and circular through
        weights held in it: shardkit.pipeline.gpipe). Refused where it cannot apply: the fp8 policy (the recipe) and
        a model with no `shardkit.nn.dot` (`shardkit.layout.check_grad_reduce`).
        Compiled for h100x8 (tiny preset, fsdp, bf16): reduce-scatters in bf16 by default, fp32 under float32."""
        return jnp.dtype(jnp.float32) if self.grad_reduce_fp32 else jnp.dtype(self.compute_dtype)

    @property
    def weight_grad_dtype(self) -> jnp.dtype | None:
        """The dtype `shardkit.nn.dot` computes weight gradients in when it differs from the compute dtype (None:
        autodiff's own, the compute dtype)."""
        if self.grad_reduce_dtype == jnp.dtype(self.compute_dtype):
            return None
        return self.grad_reduce_dtype

    def cast_to_compute(self, tree):
        return cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree):
        """The model's outputs (logits) as the policy says; the loss then reads them in fp32 whatever this is."""
        return cast_floating(tree, self.output_dtype)


PRESETS = {
    "float32": Policy(),
    "bf16": Policy(compute_dtype=jnp.bfloat16),
    "bf16-params": Policy(param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16, master_weights=True),
    "fp16": Policy(compute_dtype=jnp.float16),
    "fp8": Policy(compute_dtype=jnp.bfloat16, fp8=True),
}

# Length of each FP8 site's amax history: Flax's default (`Fp8DotGeneralBase.amax_history_length`). A scale follows
# the largest |value| seen over this many steps, so one outlier step lowers it for that long.
AMAX_HISTORY = 1024
# The scaling state of one matmul site, named as `flax.linen.fp8_ops.fp8_scaled_dot_general` takes it: the scales in
# use (1 at the start) and the amax histories of the input (lhs), the weight (rhs) and the output gradient.
FP8_SCALES = ("lhs_scale", "rhs_scale", "grad_scale")
FP8_HISTORIES = ("lhs_amax_history", "rhs_amax_history", "grad_amax_history")


class Fp8Trained(NamedTuple):
    """What the step differentiates under the fp8 policy: the parameters and the FP8 scaling state, whose gradient is
    its next value (Flax's overwrite-with-gradient convention: the amax histories rolled on, the scales recomputed).

    Several passes over one step's rows (micro-batches of accumulation, data replicas, a pipeline's ticks) each give a
    next value; they combine by maximum (`combine_fp8`), so the state updates as on one device running the whole
    batch in one pass: each history's new entry the largest |value| over all the rows, the scales (the same in every
    pass) as they are."""

    params: Any
    fp8: Any


def combine_fp8(a, b):
    """Two passes' next FP8 scaling states as one (`Fp8Trained`): their elementwise maximum (scales and histories are
    positive, so zeros are neutral)."""
    return jax.tree.map(jnp.maximum, a, b)


def fp8_site_state(leading: tuple[int, ...] = ()) -> dict[str, jax.Array]:
    """The initial scaling state of one FP8 matmul site, each leaf with `leading` axes in front (a layer stack's)."""
    scales = {name: jnp.ones((*leading, 1), jnp.float32) for name in FP8_SCALES}
    histories = {name: jnp.zeros((*leading, AMAX_HISTORY), jnp.float32) for name in FP8_HISTORIES}
    return {**scales, **histories}


def cast_floating(tree, dtype):
    """Cast the floating-point leaves of a tree; integer leaves (tokens, counters) pass through."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def parse_policy(text: str) -> Policy:
    """A preset name or a jmp-style `params=...,compute=...,output=...` string."""
    if text in PRESETS:
        return PRESETS[text]
    if text in DTYPES:
        return _policy(DTYPES[text], DTYPES[text], DTYPES[text])
    fields = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in ("params", "compute", "output") or value not in DTYPES:
            raise ShardkitError(
                "precision.policy",
                f"cannot read {text!r}; use a preset {sorted(PRESETS)} or "
                f"params=<dtype>,compute=<dtype>,output=<dtype> "
                f"with dtypes from {sorted(set(DTYPES))}",
            )
        fields[key] = DTYPES[value]
    param = fields.get("params", jnp.float32)
    compute = fields.get("compute", param)
    return _policy(param, compute, fields.get("output", compute))


def _policy(param, compute, output) -> Policy:
    """Parameters narrower than fp32 always get an fp32 master copy: Adam's small updates vanish in bf16/fp16."""
    return Policy(param, compute, output, master_weights=jnp.dtype(param).itemsize < 4)
