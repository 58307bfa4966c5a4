"""The small API that models use: parameters with logical names, activation constraints and stacked layers.

Models call these and know nothing else about parallelism. What the calls do is decided by the `ModelContext` that a
resolved layout sets around a forward pass (`shardkit.layout.Layout.context`): which mesh and activation rules
resolve `constrain`, which remat policy wraps each layer of `scan_stack`, and which kernel `attention` runs.

Dropout keys: one per step, derived from (seed, step) alone, then folded with the micro-batch, the data-parallel
replica (under per-replica accumulation), the layer and the dropout site. Masks are drawn for the global activation
with JAX's partitionable threefry, so every layout draws the mask a single device would, each device only its shard.
Outside a context, `constrain` does nothing and layers run without remat, so a model also works as plain Flax.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import zlib
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.attention.decode import KVCache, cached_attention  # noqa: F401  (models call it through shardkit.nn)
from shardkit.attention.plain import AttentionSetup, attend
from shardkit.errors import ShardkitError
from shardkit.manual import psum, to_varying
from shardkit.precision import fp8_site_state
from shardkit.rules import Table, logical_degree, resolve_spec

# Flax's own Variable metadata key for a parameter's sharding annotation (what `nnx.with_partitioning` and
# `sharding_names=` write in Flax 0.12). shardkit reads it as logical axis names, resolved by the recipe's rules.
LOGICAL_AXES = "out_sharding"


@dataclasses.dataclass(frozen=True)
class Fp8Scaling:
    """The FP8 scaling state a forward pass reads (the fp8 precision policy): `{site: {leaf: array}}` for the matmul
    sites of the layer stack, each leaf with a leading `layers` axis (`shardkit.precision.fp8_site_state`).

    `scan_stack` hands each layer its own slice as `layer`; `dot` reads its site's state from that slice. FP8 covers
    the layer stack only: outside it (embedding, head) `dot` stays in the compute dtype. The state's gradient is its
    next value (Flax's overwrite-with-gradient convention), so the step differentiates it like a parameter.
    """

    stack: Mapping[str, Mapping[str, jax.Array]]
    layer: Mapping[str, Mapping[str, jax.Array]] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Stack:
    """The layer stack's FP8 scaling state as it rides along the stacked parameters through a layer loop (`scan_stack`
    hands each layer its slice): marked, so that a pipeline's loop can tell it from the weights. Its gradient is its
    next value, which a loop that uses one layer's state several times (a pipeline's ticks) must combine by maximum,
    not by autodiff's sum (`shardkit.pipeline.gpipe`)."""

    sites: Mapping[str, Mapping[str, jax.Array]]


def is_fp8_stack(node: Any) -> bool:
    """Whether a pytree node is the layer stack's FP8 scaling state (`Fp8Stack`)."""
    return isinstance(node, Fp8Stack)


class Fp8SiteRecorder(dict):
    """A stand-in for a layer's FP8 state that records the matmul sites a forward pass reaches (`fp8_sites`),
    handing each a fresh state so tracing can go on. A site reached twice in one trace would have two next states
    for one slot, so it is refused."""

    def __missing__(self, site: str):
        self[site] = fp8_site_state()
        return dict.__getitem__(self, site)

    def __getitem__(self, site: str):
        if site in self:
            raise ShardkitError("precision.policy", f"'fp8' needs each FP8 matmul site once per layer, but "
                                f"{site!r} is used twice (a layer holding two blocks); use bf16 for this model")
        return self.__missing__(site)


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """What a forward pass needs from the layout; built from a resolved layout by `shardkit.layout.Layout.context`.

    `remat` wraps one layer's function; `layer_loop` replaces the scan (a pipeline does). `attention` is how
    attention runs (kernel, context parallelism: `shardkit.attention.plain.AttentionSetup`). `dropout_key` with
    `dropout_rate` > 0 turns `dropout` on; `scan_stack` folds the layer index into the key for each layer. `fp8`
    (the fp8 precision policy: `fp8_scaling`) runs `dot` in FP8. `weight_grad_dtype` (the recipe's
    `precision.grad_reduce = "float32"`: `Policy.weight_grad_dtype`) is the dtype `dot` computes weight gradients in.
    """

    mesh: Mesh | None = None
    activation_rules: Table | None = None
    remat: Callable[[Callable], Callable] | None = None
    layer_loop: Callable | None = None
    attention: AttentionSetup = AttentionSetup()
    dropout_rate: float = 0.0
    dropout_key: jax.Array | None = None
    fp8: Fp8Scaling | None = None
    weight_grad_dtype: jnp.dtype | None = None


_CONTEXT: contextvars.ContextVar[ModelContext] = contextvars.ContextVar("shardkit_model_context",
                                                                       default=ModelContext())


@contextlib.contextmanager
def model_context(**changes: Any):
    """Set parts of the model context for the duration of a `with` block (nestable)."""
    token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), **changes))
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def current_context() -> ModelContext:
    """The model context in force (shardkit/moe.py reads the mesh and activation rules from it)."""
    return _CONTEXT.get()


def param(rngs: nnx.Rngs, init: Callable, shape: Sequence[int], logical: Sequence[str | None], dtype=jax.numpy.float32):
    """A parameter initialised by `init(key, shape, dtype)`, annotated the Flax way with its logical axis names.

    Exactly `nnx.Param(value, out_sharding=logical)`, what `nnx.with_partitioning(init, logical)` makes, with Flax's
    eager sharding off: the recipe, not a mesh in scope, decides where the parameter lives.
    """
    value = init(rngs.params(), tuple(shape), dtype)
    return nnx.Param(value, eager_sharding=False, **{LOGICAL_AXES: tuple(logical)})


def constrain(x: jax.Array, logical: Sequence[str | None]) -> jax.Array:
    """Pin an activation's layout by its logical axes; a no-op outside a model context."""
    context = _CONTEXT.get()
    if context.mesh is None or context.activation_rules is None:
        return x
    spec = resolve_spec("activation", x.shape, logical, context.activation_rules, dict(context.mesh.shape),
                        "activations")
    return jax.lax.with_sharding_constraint(x, NamedSharding(context.mesh, spec))


def lookup(table_VD: jax.Array, tokens_BS: jax.Array) -> jax.Array:
    """Embedding rows of `tokens_BS` from a (`vocab`, `embed`) table: x_BSD, whole rows; the caller pins its layout.

    With the vocabulary split over devices by the activation rules (vocab-parallel, Megatron's embedding), the table
    is pinned to its compute layout (its `embed` dimension gathered, as every FSDP weight is) and the rows whole:
    each device looks up the tokens of its vocabulary slice and one reduction over the vocabulary's axes sums the
    partial rows, written by hand (`_lookup_vocab_slice`) since a pin alone did not hold under a pipeline. Left
    free, XLA:GPU split the table's two dimensions over sub-groups of `tensor` under FSDP (a
    collective-permute of the table, then an all-gather of the rows besides their sum: recipes/fsdp_tp.toml), and
    gathered the whole table over `tensor` under sequence parallelism (recipes/tp_sp.toml; cheaper only while the
    table is smaller than the local rows, as the tiny preset's 256 x 64, never for a real vocabulary), both on h100x8.
    With whole rows on every device the lookup is left to XLA, which exchanges the looked-up rows by all-to-all
    rather than gathering the table (recipes/fsdp.toml)."""
    context = _CONTEXT.get()
    vocab_split = context.mesh is not None and context.activation_rules is not None and logical_degree(
        context.activation_rules, "vocab", dict(context.mesh.shape)) > 1
    if not vocab_split:
        return _lookup_token_rows(table_VD, tokens_BS)
    sizes = dict(context.mesh.shape)
    axes = tuple(axis for axis in context.activation_rules["vocab"] if sizes[axis] > 1)
    # Manual over the tokens' axes too, so that the backward's scatter-add stays on each device's own tokens and
    # the table's gradient is what crosses devices, not the rows' (XLA gathered those over `fsdp` for the scatter).
    tokens = resolve_spec("tokens", tokens_BS.shape, ("batch", "sequence"), context.activation_rules, sizes,
                          "activations")
    token_axes = {axis for entry in tokens if entry for axis in ((entry,) if isinstance(entry, str) else entry)}
    if not token_axes or token_axes & set(axes):
        # Tokens split over no axis: inside a per-replica vmap (shardkit.microbatch, whose rules leave the replica
        # axes out), where jax 0.10.2 cannot nest a shard_map that is not manual over its spmd_axis_name; or over
        # the vocabulary's own axes, whose slices need every token. The pinned lookup, left to XLA.
        rows_BSD = jnp.take(constrain(table_VD, ("vocab", "embed")), tokens_BS, axis=0)
        return constrain(rows_BSD, ("batch", "sequence", "embed"))
    rows_BSD = jax.shard_map(functools.partial(_lookup_vocab_slice, axes), mesh=context.mesh,
                             in_specs=(PartitionSpec(axes), tokens), out_specs=PartitionSpec(*tokens, None),
                             axis_names={*axes, *token_axes})(constrain(table_VD, ("vocab", "embed")), tokens_BS)
    return constrain(rows_BSD, ("batch", "sequence", "embed"))


def _lookup_token_rows(table_VD: jax.Array, tokens_BS: jax.Array) -> jax.Array:
    """The rows of the tokens. With the sequence split, looked up as one dimension of token rows (`token_rows`): the
    table's gradient is then summed over the batch's and the sequence's axes in one exchange, where over batch and
    sequence as two dimensions XLA:CPU summed the whole table's gradient over each axis in turn, and replicated the
    rows to re-split them."""
    if _row_degrees()[1] == 1:
        return jnp.take(table_VD, tokens_BS, axis=0)
    rows_ND = constrain(jnp.take(table_VD, token_rows(tokens_BS), axis=0), (("batch", "sequence"), "embed"))
    return from_token_rows(rows_ND, *tokens_BS.shape)


def token_rows(x_BS_: jax.Array, logical: Sequence[str | None] = ()) -> jax.Array:
    """A (B, S, ...) activation as (B x S, ...) token rows, one dimension split over the batch's and the sequence's
    axes together, each device's rows its own (B, S) block: a reshape that moves no data. For sums over every token
    (a weight's gradient), which XLA then reduces over those axes at once. `logical`: the other dimensions' names."""
    batch, seq = x_BS_.shape[:2]
    f, q = _row_degrees()
    blocks = x_BS_.reshape(f, batch // f, q, seq // q, *x_BS_.shape[2:]).swapaxes(1, 2)
    return constrain(blocks.reshape(batch * seq, *x_BS_.shape[2:]), (("batch", "sequence"), *logical))


def from_token_rows(x_N_: jax.Array, batch: int, seq: int) -> jax.Array:
    """The inverse of `token_rows`: (B x S, ...) token rows back to (B, S, ...)."""
    f, q = _row_degrees()
    blocks = x_N_.reshape(f, q, batch // f, seq // q, *x_N_.shape[1:]).swapaxes(1, 2)
    return blocks.reshape(batch, seq, *x_N_.shape[1:])


def _row_degrees() -> tuple[int, int]:
    """How many ways the context's activation rules split `batch` and `sequence` (1, 1 outside a layout)."""
    context = _CONTEXT.get()
    if context.mesh is None or context.activation_rules is None:
        return 1, 1
    sizes = dict(context.mesh.shape)
    return (logical_degree(context.activation_rules, "batch", sizes),
            logical_degree(context.activation_rules, "sequence", sizes))


def _lookup_vocab_slice(axes: tuple[str, ...], table_vD: jax.Array, tokens_BS: jax.Array) -> jax.Array:
    """Megatron's vocab-parallel lookup, written by hand in a region manual over the vocabulary's `axes`: the rows of
    the tokens in this device's slice of the vocabulary (zeros for the others), summed over the slices. Why by hand:
    left to XLA with a mesh axis the rows are not split over (`pipeline` in recipes/pp_fsdp_tp.toml, h100x8), it moved
    the table's vocabulary onto that axis (a collective-permute of the table forward and of its gradient backward) and
    summed the rows over it."""

    # Varying over the tokens' axes before use, so that the table's gradient is summed over them by `to_varying`'s
    # transpose (in fp32 on CPU), not by one JAX inserts in bf16, which XLA:CPU cannot compile.
    table_vD = to_varying(table_vD)
    rows = table_vD.shape[0]
    local_BS = tokens_BS - jax.lax.axis_index(axes) * rows
    inside_BS = (local_BS >= 0) & (local_BS < rows)
    rows_BSD = jnp.take(table_vD, jnp.where(inside_BS, local_BS, 0), axis=0)
    return psum(jnp.where(inside_BS[..., None], rows_BSD, jnp.zeros((), rows_BSD.dtype)), axes)


def stack(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` independently initialised copies of a module, their parameters stacked along a leading `layers` axis.

    Flax's own stacking: `nnx.vmap` with `transform_metadata`, which prepends `layers` to each parameter's sharding
    names, as a model stacking its layers with `nnx.vmap`/`nnx.scan` itself would.
    """
    keys = jax.random.split(rngs.params(), count)
    create = nnx.vmap(lambda key: make(nnx.Rngs(params=key)), transform_metadata={nnx.PARTITION_NAME: "layers"})
    return create(keys)


def scan_stack(stacked: nnx.Module, x: jax.Array, *rows: Any) -> jax.Array:
    """Apply a stacked module layer by layer: `x = layer(x, *rows)`, as a scan so compile time does not grow with depth.

    The context may wrap each layer in a remat policy, or replace the whole loop (a pipeline does). `rows` (e.g.
    packed documents' positions and segment ids) ride in the loop's carry beside `x`, unchanged: a pipeline cuts them
    into micro-batches with `x`, so like `x` they must lead with the batch.
    """
    graphdef, state = nnx.split(stacked)

    def layer(carry, layer_state):
        x, rows = carry
        return nnx.merge(graphdef, layer_state)(x, *rows), rows

    context = _CONTEXT.get()
    if context.fp8 is not None:
        layer, state = _with_layer_fp8(layer, state, context.fp8)
    if context.dropout_key is not None:
        layer, state = _with_layer_dropout_keys(layer, state, context.dropout_key)
    if context.remat is not None:
        layer = context.remat(layer)
    if context.layer_loop is not None:
        return context.layer_loop(layer, (x, rows), state)[0]
    (x, _), _ = jax.lax.scan(lambda carry, layer_state: (layer(carry, layer_state), None), (x, rows), state)
    return x


def scan_decode(stacked: nnx.Module, x: jax.Array, cache: KVCache, *args: Any) -> tuple[jax.Array, KVCache]:
    """`scan_stack` for generation with a KV cache: layer i runs `layer.decode(x, *args, cache_i)` -> (x, cache_i)
    with its own slice of the stacked cache, and the updated slices come back stacked. Nothing is differentiated and
    there is one batch of rows, so there is no remat and no pipeline loop."""
    graphdef, state = nnx.split(stacked)

    def layer(x, state_and_cache):
        layer_state, layer_cache = state_and_cache
        return nnx.merge(graphdef, layer_state).decode(x, *args, layer_cache)

    return jax.lax.scan(layer, x, (state, cache))


def _with_layer_dropout_keys(layer: Callable, state: Any, key: jax.Array) -> tuple[Callable, Any]:
    """Give each layer its own dropout key: the layer index rides along the stacked state (so a scan or a pipeline's
    layer loop hands each layer its own index) and is folded into the step's key inside the layer."""
    count = jax.tree.leaves(state)[0].shape[0]

    def keyed_layer(x, indexed_state):
        layer_state, index = indexed_state
        with model_context(dropout_key=jax.random.fold_in(key, index)):
            return layer(x, layer_state)

    return keyed_layer, (state, jnp.arange(count, dtype=jnp.uint32))


def _with_layer_fp8(layer: Callable, state: Any, fp8: Fp8Scaling) -> tuple[Callable, Any]:
    """Give each layer its own FP8 scaling state: the stack's state rides along the stacked parameters (its leading
    axis is `layers`), marked as `Fp8Stack`, so a scan hands each layer its slice. A recorder (`fp8_sites`) is
    handed to every layer as is."""
    if isinstance(fp8.stack, Fp8SiteRecorder):
        def recording_layer(x, layer_state):
            with model_context(fp8=Fp8Scaling(fp8.stack, layer=fp8.stack)):
                return layer(x, layer_state)

        return recording_layer, state

    def scaled_layer(x, state_and_fp8):
        layer_state, layer_fp8 = state_and_fp8
        with model_context(fp8=Fp8Scaling(fp8.stack, layer=layer_fp8.sites)):
            return layer(x, layer_state)

    return scaled_layer, (state, Fp8Stack(fp8.stack))


def fp8_scaling(stack: Mapping | None):
    """A context in which the layer stack's `dot`s run in FP8 with this scaling state (`Fp8Scaling.stack`); with
    None, in the compute dtype."""
    return model_context(fp8=None if stack is None else Fp8Scaling(stack))


def dot(equation: str, x: jax.Array, w: jax.Array, site: str) -> jax.Array:
    """`jnp.einsum(equation, x, w)` for an activation `x` and a weight `w`; under the fp8 policy, inside the layer
    stack, an FP8 matmul scaled by the state of `site` (a name unique within one layer, e.g. "attn/q").

    FP8 is Flax's `fp8_scaled_dot_general` (what `flax.linen.Fp8Einsum` runs): x and w quantized to e4m3 and the
    output gradient to e5m2, each with the scale its amax history gives (delayed scaling), the products accumulated
    and returned in w's dtype. XLA's GPU compiler turns it into cuBLASLt FP8 GEMMs; XLA:CPU emulates it.

    With a context `weight_grad_dtype` (`precision.grad_reduce = "float32"`) wider than w's dtype, the backward pass
    computes w's gradient in that dtype (`_dot_wide_weight_grad`), so that XLA reduces its partial sums across
    devices before rounding them to w's dtype.
    """
    context = _CONTEXT.get()
    fp8 = context.fp8
    if fp8 is None or fp8.layer is None:
        wide = context.weight_grad_dtype
        if wide is not None and jnp.dtype(wide).itemsize > jnp.dtype(w.dtype).itemsize:
            return _dot_wide_weight_grad(equation, jnp.dtype(wide), x, w)
        return jnp.einsum(equation, x, w)
    from flax.linen.fp8_ops import fp8_scaled_dot_general

    scaled = functools.partial(fp8_scaled_dot_general, quantize_compute_type=w.dtype, **fp8.layer[site])
    return jnp.einsum(equation, x.astype(w.dtype), w, _dot_general=scaled)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dot_wide_weight_grad(equation: str, wide: jnp.dtype, x: jax.Array, w: jax.Array) -> jax.Array:
    """`jnp.einsum(equation, x, w)` whose backward computes dw with `preferred_element_type=wide`.

    XLA's SPMD partitioner reduces dw across the replica axes at this matmul's output, in `wide`; the rounding to
    w's dtype comes after the reduction. A custom VJP rather than the forward's own `preferred_element_type`: that
    also reduces in fp32 (compiled for h100x8), but its transpose hands an fp32 output gradient to both backward
    matmuls, so dx and dw run as fp32 x fp32 GEMMs (14 of the tiny preset's, from its lowered step); here only dw
    leaves the compute dtype, as a bf16 x bf16 GEMM accumulated and returned in fp32, and dx is autodiff's own.
    """
    return jnp.einsum(equation, x, w)


def _dot_wide_forward(equation, wide, x, w):
    return jnp.einsum(equation, x, w), (x, w)


def _dot_wide_backward(equation, wide, residuals, dy):
    x, w = residuals
    inputs, out = equation.replace(" ", "").split("->")
    x_axes, w_axes = inputs.split(",")
    # dw contracts dy with x over every axis that is not w's (the batch and sequence: what the replicas split).
    dw = jnp.einsum(f"{out},{x_axes}->{w_axes}", dy, x, preferred_element_type=wide)
    _, x_pullback = jax.vjp(lambda x: jnp.einsum(equation, x, w), x)
    return x_pullback(dy)[0], dw.astype(w.dtype)


_dot_wide_weight_grad.defvjp(_dot_wide_forward, _dot_wide_backward)
# The name a traced `_dot_wide_weight_grad` shows in a jaxpr (`shardkit.layout.check_grad_reduce` looks for it).
WIDE_WEIGHT_GRAD_DOT = _dot_wide_weight_grad.__name__


def attention(q_BSKGE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, causal: bool = True,
              segments_BS: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention: queries (B, S, K, G, E) against keys and values (B, T, K, E), softmax in fp32, on the
    kernel and with the context parallelism that the layout resolved (`shardkit.attention.plain.attend`).
    `segments_BS`: packed documents' segment ids (queries and keys alike); no query sees another segment's keys."""
    context = _CONTEXT.get()
    return attend(q_BSKGE, k_BTKE, v_BTKE, causal, context.attention, context.mesh, context.activation_rules,
                  segments_BS)


DROPOUT_STREAM = 0xD0  # folded into the seed so dropout draws from a stream distinct from parameter init


def step_dropout_key(train, step) -> jax.Array | None:
    """The dropout key of training step `step` (None when dropout is off or no step is given)."""
    if train.dropout == 0.0 or step is None:
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(train.seed), DROPOUT_STREAM), step)



@contextlib.contextmanager
def dropout_stream(index: int | jax.Array):
    """Inside the block, dropout draws from the context's key folded with `index` (a micro-batch, a replica)."""
    key = _CONTEXT.get().dropout_key
    if key is None:
        yield
        return
    with model_context(dropout_key=jax.random.fold_in(key, index)):
        yield


def dropout(x: jax.Array, site: str) -> jax.Array:
    """Inverted dropout at the context's rate; the identity when the context sets no dropout key (evaluation).

    The mask is a pure function of (key, site, element index in the global array): with JAX's partitionable threefry
    (the default) every layout draws the same mask a single device would, each device computing only its own shard.
    `site` tells apart the dropout calls of one layer.
    """
    context = _CONTEXT.get()
    if context.dropout_key is None or context.dropout_rate == 0.0:
        return x
    key = jax.random.fold_in(context.dropout_key, zlib.crc32(site.encode()) & 0x7FFFFFFF)
    keep = jax.random.bernoulli(key, 1.0 - context.dropout_rate, x.shape)
    return jnp.where(keep, x / (1.0 - context.dropout_rate), jnp.zeros_like(x)).astype(x.dtype)
