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
import zlib
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from shardkit.attention.blocks import region_fused_attention
from shardkit.errors import ShardkitError
from shardkit.recipe import ATTENTION_MODES
from shardkit.attention.ring import reference_attention
from shardkit.rules import Table, resolve_spec

# Flax's own Variable metadata key for a parameter's sharding annotation (what `nnx.with_partitioning` and
# `sharding_names=` write in Flax 0.12). shardkit reads it as logical axis names, resolved by the recipe's rules.
LOGICAL_AXES = "out_sharding"


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """What a forward pass needs from the layout. `remat` wraps one layer's function; `layer_loop` replaces the scan.

    `ring_axis` names the mesh axis that `attention` runs context-parallel over (None: plain attention), as
    `context_parallel` says (`allgather` | `ring`, the recipe's train.context). `dropout_key`
    with `dropout_rate` > 0 turns `dropout` on; `scan_stack` folds the layer index into the key for each layer.
    `attention` is the recipe's `train.attention` (auto, cudnn or xla) and `nvidia_gpu` whether the layout's devices
    are NVIDIA GPUs: together they pick the kernel of plain attention (see `attention_implementation`).
    """

    mesh: Mesh | None = None
    activation_rules: Table | None = None
    remat: Callable[[Callable], Callable] | None = None
    layer_loop: Callable | None = None
    ring_axis: str | None = None
    context_parallel: str = "allgather"
    dropout_rate: float = 0.0
    dropout_key: jax.Array | None = None
    attention: str = "xla"
    nvidia_gpu: bool = False


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
    spec = resolve_spec("activation", x.shape, logical, context.activation_rules, dict(context.mesh.shape), "activations")
    return jax.lax.with_sharding_constraint(x, NamedSharding(context.mesh, spec))


def stack(make: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` independently initialised copies of a module, their parameters stacked along a leading `layers` axis.

    Flax's own stacking: `nnx.vmap` with `transform_metadata`, which prepends `layers` to each parameter's sharding
    names, as a model stacking its layers with `nnx.vmap`/`nnx.scan` itself would.
    """
    keys = jax.random.split(rngs.params(), count)
    create = nnx.vmap(lambda key: make(nnx.Rngs(params=key)), transform_metadata={nnx.PARTITION_NAME: "layers"})
    return create(keys)


def scan_stack(stacked: nnx.Module, x: jax.Array, *args: Any) -> jax.Array:
    """Apply a stacked module layer by layer: `x = layer(x, *args)`, as a scan so compile time does not grow with depth.

    The context may wrap each layer in a remat policy, or replace the whole loop (a pipeline does).
    """
    graphdef, state = nnx.split(stacked)

    def layer(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, *args)

    context = _CONTEXT.get()
    if context.dropout_key is not None:
        layer, state = _with_layer_dropout_keys(layer, state, context.dropout_key)
    if context.remat is not None:
        layer = context.remat(layer)
    if context.layer_loop is not None:
        return context.layer_loop(layer, x, state)
    x, _ = jax.lax.scan(lambda carry, layer_state: (layer(carry, layer_state), None), x, state)
    return x


def _with_layer_dropout_keys(layer: Callable, state: Any, key: jax.Array) -> tuple[Callable, Any]:
    """Give each layer its own dropout key: the layer index rides along the stacked state (so a scan or a pipeline's
    layer loop hands each layer its own index) and is folded into the step's key inside the layer."""
    count = jax.tree.leaves(state)[0].shape[0]

    def keyed_layer(x, indexed_state):
        layer_state, index = indexed_state
        with model_context(dropout_key=jax.random.fold_in(key, index)):
            return layer(x, layer_state)

    return keyed_layer, (state, jnp.arange(count, dtype=jnp.uint32))


def attention(q_BSKGE: jax.Array, k_BTKE: jax.Array, v_BTKE: jax.Array, causal: bool = True) -> jax.Array:
    """Grouped-query attention: queries (B, S, K, G, E) against keys and values (B, T, K, E), softmax in fp32.

    Context-parallel attention over the context's `ring_axis` when the layout splits the sequence over it
    (shardkit.attention.context.context_parallel_attention: all-gather or ring, `context_parallel`); otherwise
    `jax.nn.dot_product_attention` with native GQA (K/V are not repeated per query head), on cuDNN's fused kernel or
    XLA's as `attention_implementation` picks from the context. Inside a pipeline stage (a shard_map manual over
    `pipeline`), cuDNN's kernel runs through `shardkit.attention.blocks.region_fused_attention` instead (see the note
    on pipelines below).
    """
    from shardkit.attention.context import context_parallel_attention  # a real cycle: shardkit.attention.context imports this module

    context = _CONTEXT.get()
    if context.ring_axis is not None and context.mesh is not None and context.mesh.shape[context.ring_axis] > 1:
        return context_parallel_attention(q_BSKGE, k_BTKE, v_BTKE, context, causal)
    batch, seq, kv_heads, groups, head_dim = q_BSKGE.shape
    implementation = attention_implementation(context.attention, context.nvidia_gpu, q_BSKGE.dtype, head_dim)
    if implementation == "cudnn" and getattr(context.mesh, "manual_axes", ()):  # inside a pipeline: see below
        return region_fused_attention(q_BSKGE, k_BTKE, v_BTKE, causal, keys_spec(k_BTKE, context))
    if implementation == "xla" and q_BSKGE.dtype == jnp.float16:
        # XLA's path of jax.nn.dot_product_attention asks for fp16 x fp16 -> fp32 dots, which XLA:CPU cannot compile
        # ("precision F16_F16_F32 is not supported"); the reference (softmax in fp32) serves fp16 instead.
        return reference_attention(q_BSKGE, k_BTKE, v_BTKE, causal)
    # Query head h = k * G + g belongs to kv head k, the grouping jax.nn.dot_product_attention uses for GQA.
    q_BSHE = q_BSKGE.reshape(batch, seq, kv_heads * groups, head_dim)
    out_BSHE = jax.nn.dot_product_attention(q_BSHE, k_BTKE, v_BTKE, is_causal=causal, implementation=implementation)
    return out_BSHE.reshape(q_BSKGE.shape)


def keys_spec(k_BTKE: jax.Array, context: ModelContext):
    """The keys' PartitionSpec under the context's activation rules (None without rules)."""
    if context.activation_rules is None:
        return None
    return resolve_spec("attention keys", k_BTKE.shape, ("batch", "sequence", "kv_heads", "head_dim"),
                        context.activation_rules, dict(context.mesh.shape), "activations")


CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 128  # cuDNN's flash attention before Hopper (and what JAX checks when compiling for a target)


# Pipelines (jax 0.10.2): inside a pipeline's shard_map region, manual over `pipeline` (and `data`), XLA cannot run the
# custom partitioning rule that `jax.nn.dot_product_attention` wraps cuDNN's kernel in (an AssertionError in the
# partitioner), so a stage binds the kernel's primitives itself in a nested region manual over the remaining axes
# (shardkit.attention.blocks.region_fused_attention). Context parallelism inside a pipeline is refused by the layout
# checks (shardkit.attention.context.check_sequence_layout).


def cudnn_unsupported(nvidia_gpu: bool, dtype, head_dim: int | None) -> str | None:
    """Why cuDNN's fused attention cannot run on these inputs, or None when it can.

    `head_dim` None (not known before tracing) is not checked here; `attention` checks it on the real queries.
    """
    if not nvidia_gpu:
        return "the devices are not NVIDIA GPUs (a GPU target, --target h100x8, compiles for them)"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return f"it needs bf16 or fp16 compute, not {jnp.dtype(dtype).name} (precision.policy)"
    if head_dim is not None and (head_dim > CUDNN_MAX_HEAD_DIM or head_dim % 8):
        return f"it needs head_dim <= {CUDNN_MAX_HEAD_DIM} and a multiple of 8, not {head_dim}"
    return None


def attention_implementation(mode: str, nvidia_gpu: bool, dtype, head_dim: int | None) -> str:
    """`cudnn` or `xla` for `jax.nn.dot_product_attention`: `auto` takes cuDNN wherever it can run.

    Raises:
        ShardkitError: on `train.attention` when the mode is unknown, or `cudnn` cannot run here.
    """
    if mode not in ATTENTION_MODES:
        raise ShardkitError("train.attention", f"must be one of {list(ATTENTION_MODES)}, got {mode!r}")
    if mode == "xla":
        return "xla"
    reason = cudnn_unsupported(nvidia_gpu, dtype, head_dim)
    if mode == "cudnn" and reason is not None:
        raise ShardkitError("train.attention", f"'cudnn' cannot run here: {reason}; use 'auto' or 'xla'")
    return "xla" if reason else "cudnn"


def is_nvidia_gpu(device) -> bool:
    """Whether a device (a real one, or a compile-only one of a GPU target) is an NVIDIA GPU.

    Looks at the device, not at the process's backend: a `--target` compile runs on a CPU process.
    """
    if device.platform not in ("gpu", "cuda"):
        return False
    kind = f"{device.device_kind} {getattr(device.client, 'platform_version', '')}".lower()
    return "nvidia" in kind or "cuda" in kind


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
