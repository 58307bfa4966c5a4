"""GPipe and circular pipelines for a model that scans its own stacked layers (`nnx.vmap` + `nnx.scan`, no shardkit
import), found in its traced forward pass.

Why an interpreter. A pipeline replaces the loop over the model's layers (`ModelContext.layer_loop`,
shardkit/pipeline/gpipe.py). `shardkit.nn.scan_stack` hands it that loop; a model written with Flax alone runs its
layers inside `nnx.scan`, i.e. `jax.lax.scan`, which shardkit cannot reach without patching Flax or JAX. So the forward
pass `(params, *inputs) -> logits` is traced to a jaxpr and evaluated equation by equation (JAX's documented "custom
jaxpr interpreter" pattern): every equation is bound as it is, except the scan over the stacked `layers` parameters,
whose body runs one layer at a time inside the context's `layer_loop`. The interpreter runs while the train step is
traced, so the result is differentiated and compiled like any other code.

Which scan. The flat inputs whose logical names lead with `layers` are marked stacked; the layer scan is the scan whose
scanned inputs include one of them and whose length is the number of layers. It may sit inside `jit`, `closed_call`,
`remat` or custom-derivative equations: those whose one sub-jaxpr takes and returns their operands one to one are
entered when they hold the layer scan (their boundary is dropped: the pipeline region takes over what they did, and
JAX differentiates their body directly), and bound as they are otherwise.

Shapes. A jaxpr is traced for one set of shapes (a reshape's sizes are parameters), so the body a layer runs on a
micro-batch comes from the forward pass traced again at the micro-batch's size, inside the region. The forward pass is
traced with the pipeline loop and remat off, so a `shardkit.nn.scan_stack` in a model without `LAYER_STACK` is found as
a plain scan too; the interpreter then adds the context's remat around the one-layer function, as `scan_stack` does.

What the scan may be. Its carry becomes the pipeline's carry, cut into micro-batches, so every carry leaf must lead with
the batch; its constants are closed over by every layer; it must not also return per-layer outputs (a pipeline returns
only the carry) and must run forwards (stages hold the layers in order).

The two JAX internals this relies on (scan's parameters, `Primitive.get_bind_params`) are read in `_layer_scan` and
`_bind` only; tests/test_flax_models.py fails loudly if JAX changes them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal
from jax.extend.core.primitives import scan_p

from shardkit.errors import ShardkitError
from shardkit.manual import to_varying
from shardkit.nn import current_context, model_context
from shardkit.registry import is_stacked, scans_own_layers

FIELD = "mesh.pipeline"


class LayerScan(NamedTuple):
    """The parameters of a `scan` equation that the interpreter reads."""

    body: ClosedJaxpr
    num_consts: int
    num_carry: int
    length: int
    reverse: bool


def _layer_scan(eqn: JaxprEqn) -> LayerScan | None:
    """A scan equation's parameters, or None for any other equation. Scan's parameter names are JAX internals."""
    if eqn.primitive is not scan_p:
        return None
    params = eqn.params
    return LayerScan(params["jaxpr"], params["num_consts"], params["num_carry"], params["length"], params["reverse"])


def _bind(eqn: JaxprEqn, invals: list) -> list:
    """Bind one equation as it is, as `jax.core.eval_jaxpr` does (`get_bind_params` turns parameters back into what
    `bind` takes, e.g. a custom_jvp call's jaxpr into its function; a JAX internal). Unlike `eval_jaxpr` it does not
    enter the context the equation was traced in (`eqn.ctx`): that holds the mesh outside the pipeline region, while a
    layer's equations are bound inside it, where the pipeline's axes are manual."""
    out = eqn.primitive.bind(*_same_varying(invals), **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def _same_varying(invals: list) -> list:
    """Inside a manual region a primitive's operands must vary over the same manual axes. `jax.numpy` casts them
    where they meet; a jaxpr traced outside the region has no such casts (its literals and closed-over constants are
    replicated), so they are added here, as the numpy layer would have."""
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return invals
    varying = [jax.typeof(value).manual_axis_type.varying for value in invals]
    union = frozenset().union(*varying)
    return [value if axes == union else jax.lax.pcast(value, tuple(sorted(union - axes)), to="varying")
            for value, axes in zip(invals, varying)]


def _sole_subjaxpr(eqn: JaxprEqn) -> tuple[Jaxpr, list] | None:
    """(jaxpr, consts) of an equation that wraps one sub-jaxpr taking and returning its operands one to one (jit,
    closed_call, remat, custom_jvp/vjp calls); None for others (cond, while, scan, ...)."""
    subs = [value for value in eqn.params.values() if isinstance(value, (ClosedJaxpr, Jaxpr))]
    if len(subs) != 1:
        return None
    jaxpr, consts = (subs[0].jaxpr, subs[0].consts) if isinstance(subs[0], ClosedJaxpr) else (subs[0], [])
    if len(jaxpr.invars) != len(eqn.invars) or len(jaxpr.outvars) != len(eqn.outvars):
        return None
    return jaxpr, consts


# Calls whose body is evaluated equation by equation inside a manual region rather than bound whole.
_INLINED_CALLS = ("jit", "pjit", "closed_call")


def _inlined(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a jit (such as `jnp.where`'s) to evaluate inside rather than bind, which it is inside a manual
    region: its jaxpr was traced outside, where nothing varies over the region's axes, so bound whole with varying
    operands its transpose returns cotangents without those axes (JAX then fails: "Expected cotangent type
    float32[...]{V:(pipeline,data)} but got float32[...]"). Evaluated inside, each equation gets `_same_varying`'s
    casts, as the layer's own code would traced there."""
    return (eqn.primitive.name in _INLINED_CALLS and bool(jax.sharding.get_abstract_mesh().manual_axes)
            and _sole_subjaxpr(eqn) is not None)


def _stacked_inputs(eqn: JaxprEqn, stacked: set) -> list[bool]:
    return [not isinstance(var, Literal) and var in stacked for var in eqn.invars]


def _inner_stacked(jaxpr: Jaxpr, stacked_in: list[bool]) -> set:
    return {var for var, is_stacked in zip(jaxpr.invars, stacked_in) if is_stacked}


def _is_layer_scan(eqn: JaxprEqn, stacked_in: list[bool], layers: int) -> bool:
    scan = _layer_scan(eqn)
    return scan is not None and scan.length == layers and any(stacked_in[scan.num_consts + scan.num_carry:])


def _layer_scans(jaxpr: Jaxpr, stacked: set, layers: int) -> list[JaxprEqn]:
    """The layer scans in `jaxpr` and in the calls it makes that take stacked parameters (`stacked`: the variables
    holding them)."""
    found = []
    for eqn in jaxpr.eqns:
        stacked_in = _stacked_inputs(eqn, stacked)
        if _is_layer_scan(eqn, stacked_in, layers):
            found.append(eqn)
        elif any(stacked_in) and (sub := _sole_subjaxpr(eqn)) is not None:
            found += _layer_scans(sub[0], _inner_stacked(sub[0], stacked_in), layers)
    return found


def _enters(eqn: JaxprEqn, stacked_in: list[bool], layers: int) -> bool:
    """Whether `eqn` is a call holding the layer scan: evaluated inside rather than bound."""
    sub = _sole_subjaxpr(eqn) if any(stacked_in) else None
    return sub is not None and bool(_layer_scans(sub[0], _inner_stacked(sub[0], stacked_in), layers))


class _Traced(NamedTuple):
    """The forward pass traced for some batch size, with the variables holding stacked parameters."""

    closed: ClosedJaxpr
    out_tree: Any
    stacked: set


@dataclasses.dataclass(frozen=True)
class _Forward:
    """The model's forward pass, its stacked-parameter mask and its number of layers; traces it and finds its one
    layer scan."""

    forward: Callable
    stacked: Any  # a tree like the parameters: True where stacked along `layers`
    layers: int
    model: str

    def trace(self, params, *inputs) -> _Traced:
        closed, out_shape = jax.make_jaxpr(self.forward, return_shape=True)(params, *inputs)
        flags = jax.tree.leaves(self.stacked)
        return _Traced(closed, jax.tree.structure(out_shape),
                       {var for var, flag in zip(closed.jaxpr.invars, flags) if flag})

    def layer_scan(self, traced: _Traced) -> JaxprEqn:
        """The one scan over the stacked layers, refused in one line when there is none or more than one."""
        scans = _layer_scans(traced.closed.jaxpr, traced.stacked, self.layers)
        if len(scans) != 1:
            raise ShardkitError(FIELD, f"{self.model}'s forward pass has {len(scans)} scans over its {self.layers} "
                                "stacked layers; a pipeline runs exactly one (nnx.scan over the nnx.vmap-stacked "
                                "blocks, or shardkit.nn.scan_stack); or use mesh.pipeline=1")
        return scans[0]


@dataclasses.dataclass(frozen=True)
class _Interpreter:
    """Evaluates a forward jaxpr with its layer scan run by `layer_loop(layer, carry, stacked_state) -> carry`.

    A jaxpr is traced for one set of shapes (a reshape's sizes are in its parameters), so the scan body that the layer
    function runs on micro-batches comes from the forward pass traced again at the micro-batch's size
    (`micro_body(batch)`), outside the region's manual mesh.
    """

    layer_loop: Callable
    remat: Callable[[Callable], Callable] | None
    layers: int
    batch: int
    model: str
    micro_body: Callable[[int], LayerScan]

    def evaluate(self, jaxpr: Jaxpr, consts: list, args: list, stacked: set) -> list:
        env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))

        def read(var):
            return var.val if isinstance(var, Literal) else env[var]

        for eqn in jaxpr.eqns:
            invals, stacked_in = [read(var) for var in eqn.invars], _stacked_inputs(eqn, stacked)
            if _is_layer_scan(eqn, stacked_in, self.layers):
                outvals = self.pipelined_scan(eqn, invals)
            elif _enters(eqn, stacked_in, self.layers) or _inlined(eqn):
                sub, sub_consts = _sole_subjaxpr(eqn)
                outvals = self.evaluate(sub, sub_consts, invals, _inner_stacked(sub, stacked_in))
            else:
                outvals = _bind(eqn, invals)
            env.update(zip(eqn.outvars, outvals))
        return [read(var) for var in jaxpr.outvars]

    def pipelined_scan(self, eqn: JaxprEqn, invals: list) -> list:
        """The layer scan through the pipeline: one iteration of its body per layer, the scan's carry as the
        pipeline's carry, its constants closed over."""
        scan = _layer_scan(eqn)
        self.check_scan(scan, len(eqn.outvars), invals)
        consts = invals[:scan.num_consts]
        carry = tuple(invals[scan.num_consts:scan.num_consts + scan.num_carry])
        stacked_state = tuple(invals[scan.num_consts + scan.num_carry:])

        def layer(carry, layer_state):
            body = self.micro_body(carry[0].shape[0]).body
            self.check_consts(consts, body)
            return tuple(self.evaluate(body.jaxpr, _varying(body.consts), [*_varying(consts), *carry, *layer_state],
                                       set()))

        if self.remat is not None:
            layer = self.remat(layer)
        return list(self.layer_loop(layer, carry, stacked_state))

    def check_scan(self, scan: LayerScan, outputs: int, invals: list) -> None:
        """Refuse a layer scan a pipeline cannot run (see the module docstring), in one line."""
        if outputs > scan.num_carry:
            raise ShardkitError(FIELD, f"{self.model}'s scan over its layers also returns per-layer outputs; a "
                                "pipeline returns only the scan's carry: return everything through the carry, or "
                                "use mesh.pipeline=1")
        if scan.reverse:
            raise ShardkitError(FIELD, f"{self.model} scans its layers in reverse; a pipeline runs them first to "
                                "last: scan forwards, or use mesh.pipeline=1")
        carry = invals[scan.num_consts:scan.num_consts + scan.num_carry]
        if any(jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != self.batch for leaf in carry):
            shapes = [tuple(jnp.shape(leaf)) for leaf in carry]
            raise ShardkitError(FIELD, f"{self.model}'s scan over its layers carries {shapes}; a pipeline cuts the "
                                f"carry into micro-batches, so every carried array must lead with the batch "
                                f"({self.batch}); or use mesh.pipeline=1")


    def check_consts(self, consts: list, body: ClosedJaxpr) -> None:
        """The scan's constants are closed over by every layer as they are: refused when their shape depends on the
        batch (the body traced for a micro-batch then expects others)."""
        shapes = [tuple(jnp.shape(value)) for value in consts]
        if shapes != [tuple(aval.shape) for aval in body.in_avals[:len(consts)]]:
            raise ShardkitError(FIELD, f"{self.model}'s scan over its layers closes over values whose shape depends "
                                f"on the batch ({shapes}); a pipeline runs the layers on micro-batches: pass them "
                                "through the carry, or use mesh.pipeline=1")


def _varying(values: list) -> list:
    """The scan's constants as per-device values over the region's manual axes, like the carry they meet (see
    `shardkit.manual.to_varying`)."""
    return [to_varying(value) if isinstance(value, jax.Array) or hasattr(value, "aval") else value
            for value in values]


def with_layer_loop(forward: Callable, stacked: Any, layer_loop: Callable,
                    remat: Callable[[Callable], Callable] | None = None, model: str = "the model") -> Callable:
    """`forward(params, tokens_BS, *rows)` with its scan over the stacked layers run by `layer_loop`.

    Args:
        forward: the model's forward pass on a dict of parameters.
        stacked: a tree like the parameters, True where a parameter is stacked along `layers` (leading axis).
        layer_loop: `layer_loop(layer, carry, stacked_state) -> carry`, a pipeline's (shardkit/pipeline/gpipe.py).
        remat: wraps the one-layer function, as `shardkit.nn.scan_stack` does (None: no remat).
        model: the model's name, for error messages.

    Raises:
        ShardkitError: on `mesh.pipeline`, when the forward pass has no single scan over the stacked layers or one a
            pipeline cannot run.
    """

    def run(params, tokens_BS, *rows):
        flags = jax.tree.leaves(stacked)
        layers = next(leaf.shape[0] for leaf, flag in zip(jax.tree.leaves(params), flags) if flag)
        traced_forward = _Forward(forward, stacked, layers, model)
        traced = traced_forward.trace(params, tokens_BS, *rows)
        traced_forward.layer_scan(traced)
        micro_body = _micro_body(traced_forward, params, (tokens_BS, *rows))
        interpreter = _Interpreter(layer_loop, remat, layers, tokens_BS.shape[0], model, micro_body)
        flat = jax.tree.leaves((params, tokens_BS, rows))
        outs = interpreter.evaluate(traced.closed.jaxpr, traced.closed.consts, flat, traced.stacked)
        return jax.tree.unflatten(traced.out_tree, outs)

    return run


def _micro_body(forward: _Forward, params, inputs: tuple) -> Callable[[int], LayerScan]:
    """`batch -> the layer scan of the forward pass traced with `batch` rows`, once per size, where the layers run
    (inside the pipeline region: its mesh and activation rules are the ones the layer's equations are bound under)."""
    params = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), params)

    @functools.cache
    def micro_body(batch: int) -> LayerScan:
        rows = [jax.ShapeDtypeStruct((batch, *jnp.shape(x)[1:]), x.dtype) for x in inputs]
        return _layer_scan(forward.layer_scan(forward.trace(params, *rows)))

    return micro_body


def apply_for(layout) -> Callable:
    """The forward pass `(params, tokens_BS, *rows) -> logits` the step runs for a layout: `layout.apply`, or, when a
    pipeline must find the model's own layer scan (`shardkit.registry.scans_own_layers`), that pass with its scan run
    by the context's pipeline loop (whenever the context has one: training and evaluation)."""
    if not layout.pipeline.enabled or not scans_own_layers(layout.model_class, layout.logical):
        return layout.apply
    stacked = jax.tree.map(is_stacked, layout.logical, is_leaf=lambda leaf: isinstance(leaf, tuple))

    def apply(params, tokens_BS, *rows):
        context = current_context()
        if context.layer_loop is None:
            return layout.apply(params, tokens_BS, *rows)
        run = with_layer_loop(_plain_apply(layout), stacked, context.layer_loop, context.remat,
                              layout.model_class.__name__)
        return run(params, tokens_BS, *rows)

    return apply


def _plain_apply(layout) -> Callable:
    """`layout.apply` traced without the pipeline loop and remat (the interpreter adds both to the layer scan), so a
    `shardkit.nn.scan_stack` inside a model that does not name it in `LAYER_STACK` is found as a plain scan too."""

    def apply(params, tokens_BS, *rows):
        with model_context(layer_loop=None, remat=None):
            return layout.apply(params, tokens_BS, *rows)

    return apply
