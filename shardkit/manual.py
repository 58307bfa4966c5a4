"""Collectives written by hand inside a manual (`jax.shard_map`) region, for any region: pipeline stages, the split
head's loss, attention blocks or a model's own. They depend on JAX alone.

`psum` and `to_varying` are checked under bf16 on CPU meshes by tests/test_bf16_pipeline.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def to_varying(x: jax.Array) -> jax.Array:
    """`x` as a per-device value over every manual axis of the enclosing region (a no-op where it already is).

    Inside a region, an input replicated over a manual axis (a stage's weights over `data`) that meets per-device
    values is cast to varying where it is used; inside a loop body that cast's transpose, a psum, would run every
    iteration. Casting once, before the loop, puts the psum of its gradient there instead. On a CPU mesh a bf16 `x`
    is cast in fp32 (exact both ways), so that psum sums in fp32: see `psum`.
    """
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(axis for axis in jax.sharding.get_abstract_mesh().manual_axes if axis not in varying)
    if not missing:
        return x
    if sum_bf16_in_fp32(x):
        return jax.lax.pcast(x.astype(jnp.float32), missing, to="varying").astype(x.dtype)
    return jax.lax.pcast(x, missing, to="varying")


def to_varying_max(x: jax.Array) -> jax.Array:
    """`to_varying`, whose transpose takes the maximum over the axes it casts over instead of the sum: for a value
    whose gradient is its next value, the same on every device but for a per-device maximum (the FP8 scaling state,
    whose amax histories then hold the maximum over every device's rows, as one device running them all would)."""
    varying = jax.typeof(x).manual_axis_type.varying
    missing = tuple(axis for axis in jax.sharding.get_abstract_mesh().manual_axes if axis not in varying)
    return _to_varying_max(x, missing) if missing else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _to_varying_max(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.pcast(x, axes, to="varying")


def _to_varying_max_forward(x, axes):
    return _to_varying_max(x, axes), None


def _to_varying_max_backward(axes, _, g):
    return (jax.lax.pmax(g, axes),)


_to_varying_max.defvjp(_to_varying_max_forward, _to_varying_max_backward)


def psum(x: jax.Array, axes) -> jax.Array:
    """`jax.lax.psum` over manual axes of a pipeline region; on a CPU mesh a bf16 `x` is summed in fp32.

    Why: XLA:CPU (jax 0.10.2) aborts the process compiling a bf16 psum inside a `jax.shard_map` that is manual over
    only some of the mesh's axes, as the pipeline regions are ("hlo_instruction.cc:1615] Invalid binary instruction
    opcode copy", SIGABRT). JAX lowers the psum's reducer there with a sharding annotation on its result, which Shardy
    exports as `copy(add)`; XLA:CPU's AllReducePromotion pass, which widens every bf16 all-reduce to fp32, rebuilds
    the reducer as a binary op of the root's opcode, `copy`, and fails a CHECK. An fp32 sum gives it nothing to widen
    and is the sum it meant to compute (fp32, rounded back to bf16). Other meshes are untouched: XLA:GPU widens no
    float all-reduce and compiles the bf16 psum as it is. Minimal repro: tests/xla_cpu_bf16_psum_abort.py.
    """
    if sum_bf16_in_fp32(x):
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype)
    return jax.lax.psum(x, axes)


def sum_bf16_in_fp32(x: jax.Array) -> bool:
    """Whether `x` is bf16 and the enclosing region's mesh is on CPU (where `psum` must widen it)."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    platform = device.platform if device is not None else jax.default_backend()
    return x.dtype == jnp.bfloat16 and platform == "cpu"
