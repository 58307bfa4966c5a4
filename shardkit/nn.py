"""The small API that models use: parameters with logical names, activation constraints and stacked layers.

Models call these and know nothing else about parallelism. What the calls do is decided by the `ModelContext` that
shardkit's training and planning code sets around a forward pass: which mesh and activation rules resolve `constrain`,
and which remat policy wraps each layer of `scan_stack`. Outside a context, `constrain` does nothing and layers run
without remat, so a model also works as plain Flax.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Sequence

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from shardkit.rules import Table, resolve_spec

LOGICAL_AXES = "logical_axes"  # the Variable metadata key holding a parameter's logical names


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """What a forward pass needs from the layout. `remat` wraps one layer's function; `layer_loop` replaces the scan."""

    mesh: Mesh | None = None
    activation_rules: Table | None = None
    remat: Callable[[Callable], Callable] | None = None
    layer_loop: Callable | None = None


_CONTEXT: contextvars.ContextVar[ModelContext] = contextvars.ContextVar("shardkit_model_context", default=ModelContext())


@contextlib.contextmanager
def model_context(**changes: Any):
    """Set parts of the model context for the duration of a `with` block (nestable)."""
    token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), **changes))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> ModelContext:
    return _CONTEXT.get()


def param(rngs: nnx.Rngs, init: Callable, shape: Sequence[int], logical: Sequence[str | None], dtype=jax.numpy.float32):
    """A parameter initialised by `init(key, shape, dtype)`, carrying its logical axis names."""
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), **{LOGICAL_AXES: tuple(logical)})


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by its logical axes; a no-op outside a model context."""
    context = _CONTEXT.get()
    if context.mesh is None or context.activation_rules is None:
        return x
    spec = resolve_spec("activation", x.shape, logical, context.activation_rules, dict(context.mesh.shape), "activations")
    return jax.lax.with_sharding_constraint(x, NamedSharding(context.mesh, spec))


def stack(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` independently initialised copies of a module, their parameters stacked along a leading `layers` axis."""
    keys = jax.random.split(rngs.params(), count)
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    states = jax.vmap(lambda key: nnx.split(make(nnx.Rngs(params=key)))[1])(keys)
    stacked = nnx.merge(graphdef, states)
    for _, variable in nnx.iter_graph(stacked):
        if isinstance(variable, nnx.Variable) and LOGICAL_AXES in variable.get_metadata():
            variable.set_metadata(LOGICAL_AXES, ("layers",) + tuple(variable.get_metadata()[LOGICAL_AXES]))
    return stacked


def scan_stack(stacked: nnx.Module, x: jax.Array, *args: Any) -> jax.Array:
    """Apply a stacked module layer by layer: `x = layer(x, *args)`, as a scan so compile time does not grow with depth.

    The context may wrap each layer in a remat policy, or replace the whole loop (a pipeline does).
    """
    graphdef, state = nnx.split(stacked)

    def layer(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, *args)

    context = _CONTEXT.get()
    if context.remat is not None:
        layer = context.remat(layer)
    if context.layer_loop is not None:
        return context.layer_loop(layer, x, state)
    x, _ = jax.lax.scan(lambda carry, layer_state: (layer(carry, layer_state), None), x, state)
    return x
