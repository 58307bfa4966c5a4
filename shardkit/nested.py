"""A shard_map region nested in another (context-parallel attention or the experts inside a pipeline's stages).

Context-parallel attention (shardkit.attention.ring) and expert parallelism (shardkit.moe) are shard_map regions
manual over axes their caller left automatic, with hand-written collectives inside. Inside a pipeline's region they
are nested, and JAX's own differentiation of a nested region does not compile: the residuals that its partial
evaluation and linearization cut out of the inner region (its values that do not depend on the differentiated
inputs, such as axis indices) are laid out over every axis they vary along, the enclosing region's manual axes
included, which Shardy refuses ("all manual axes must come before free axes"; jax 0.10.2).

Two things avoid it. The nested region's body is `opaque`: one custom VJP whose backward recomputes the body from its
inputs and pulls the cotangent through it, so linearizing it cuts nothing out (one more forward of the region per
backward: the price of nesting). And the enclosing pipeline runs the loops its backward differentiates as Python
loops (`shardkit.pipeline.config.unrolled_layers`), since a differentiated `jax.lax.scan` partially evaluates its
body, the opaque call included. A region that is not nested is the plain shard_map, differentiated by JAX as before.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec


def nested(mesh) -> bool:
    """Whether an enclosing region is already manual over some of `mesh`'s axes."""
    return bool(set(jax.sharding.get_abstract_mesh().manual_axes) & set(mesh.axis_names))


def region_call(body: Callable, mesh: Mesh, in_specs: tuple, out_spec: PartitionSpec, manual: set[str],
                differentiable: int) -> Callable:
    """`jax.shard_map(body, ...)` manual over `manual`, differentiable in its first `differentiable` inputs (the
    others, e.g. integer segment ids or None, get no cotangent); under an enclosing region, its body is `opaque`."""
    if nested(mesh):
        body = opaque(body, (True,) * differentiable + (False,) * (len(in_specs) - differentiable))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, axis_names=manual)


def opaque(body: Callable, differentiable: tuple[bool, ...]) -> Callable:
    """`body` as one custom VJP, differentiable in the inputs `differentiable` marks (the others get no cotangent),
    whose backward recomputes it and pulls the cotangent through: what a region nested in another runs (see above)."""

    @jax.custom_vjp
    def call(*inputs):
        return body(*inputs)

    def forward(*inputs):
        return body(*inputs), inputs

    def backward(inputs, cotangent):
        def of_differentiable(*values):
            given = iter(values)
            return body(*[next(given) if wanted else x for x, wanted in zip(inputs, differentiable)])

        wrt = [x for x, wanted in zip(inputs, differentiable) if wanted]
        _, pullback = jax.vjp(of_differentiable, *wrt)
        grads = iter(pullback(cotangent))
        return tuple(next(grads) if wanted else None for wanted in differentiable)

    call.defvjp(forward, backward)
    return call
