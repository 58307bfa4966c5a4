"""The resolved layout: everything a recipe decides about one run on its devices, computed once.

`build_layout(recipe, devices)` resolves the model, the mesh, the rule tables, the precision policy, the degree of each
logical name, the pipeline, the context-parallel mode, the remat preset and the attention kernel (with the reason for
the choice). Training, evaluation, generation, `plan`/`estimate`, `suggest` and `hlo` all read it, and every forward
pass runs inside `Layout.context(...)`, the one place a model context is built; train, eval and generate differ only
in dropout, remat and the step's key.

From a recipe to sharded parameters: abstract init, logical names, PartitionSpecs, then the real init.
The real initialisation is one jitted function whose `out_shardings` are the parameters' shardings, so each device
computes only its own shard and no device ever holds a full copy of a sharded parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen, nnx
from flax.nnx import bridge
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardkit.attention.context import check_sequence_layout, ring_axis
from shardkit.attention.kernel import Platform, choose_kernel, platform_of
from shardkit.attention.plain import AttentionSetup
from shardkit.errors import ShardkitError
from shardkit.linen_boxes import unconstrained_boxes
from shardkit.mesh import build_mesh
from shardkit.moe import check_expert_layout
from shardkit.naming import ParamNames, resolve_names
from shardkit.nn import LOGICAL_AXES, WIDE_WEIGHT_GRAD_DOT, model_context
from shardkit.pipeline import PipelineConfig, layer_loop_for, pipeline_config, validate_pipeline
from shardkit.platforms import mesh_platform
from shardkit.precision import Policy
from shardkit.recipe import Recipe, RulesSection
from shardkit.registry import (
    ModelCapabilities,
    check_pipeline_stack,
    create_model,
    is_builtin,
    load_model_class,
    model_capabilities,
    model_config,
)
from shardkit.remat import check_remat, remat_wrapper
from shardkit.rules import (
    DEFAULT_ACTIVATION_RULES,
    DEFAULT_PARAM_RULES,
    RuleSet,
    Table,
    build_rules,
    check_rule_names,
    logical_degree,
    resolve_spec,
    with_mesh_axis_names,
    without_shared_fsdp_ranks,
)
from shardkit.xla_flags import run_once_options

# Flax's own partitioning metadata, read as logical axis names: `out_sharding` is what nnx.with_partitioning,
# sharding_names= (remapped by Flax 0.12) and Linen's with_logical_partitioning through nnx.bridge all write;
# `sharding_names` and `sharding` are the keys older Flax releases wrote.
FLAX_LOGICAL_KEYS = (LOGICAL_AXES, "sharding_names", "sharding")


# Config fields that state how many positions a model can read (a learned position table, a trained range), by the
# names models give them; the first present (a positive int) is the limit.
POSITION_LIMIT_FIELDS = ("max_len", "max_position_embeddings", "max_seq_len", "max_seq_length", "max_length",
                         "n_positions", "max_positions", "context_length", "block_size")


def position_limit(config: Any) -> tuple[str, int] | None:
    """(field, positions) of the config's position limit, None where it states none."""
    for field in POSITION_LIMIT_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return field, value
    return None


def check_positions(recipe: Recipe, config: Any) -> None:
    """`train.seq_len` within the model's position limit: past it a learned table has no entry (NaN or garbage)."""
    limit = position_limit(config)
    if limit is not None and recipe.train.seq_len > limit[1]:
        raise ShardkitError("train.seq_len", f"{recipe.train.seq_len} is past the model's position limit, "
                            f"{type(config).__name__}.{limit[0]} = {limit[1]} (positions it has no entry for); use "
                            f"train.seq_len <= {limit[1]}")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Everything a recipe decides about where things live, computed without touching real parameter memory."""

    recipe: Recipe
    model_class: type
    config: Any
    mesh: Mesh
    rules: RuleSet
    graphdef: Any
    abstract_params: Mapping  # nested dict of jax.ShapeDtypeStruct
    logical: Mapping  # nested dict of logical-axis tuples, same structure
    # path -> where its names came from (`shardkit.naming`: "model", a path rule, "none"); empty where not resolved
    name_sources: Mapping = dataclasses.field(default_factory=dict, compare=False)

    def specs(self, table: Table, table_name: str = "params") -> Mapping:
        """PartitionSpec of every parameter under a rule table (params, optimizer or gradients)."""
        sizes = dict(self.mesh.shape)
        return jax.tree.map(
            lambda path, shape, logical: resolve_spec(path, shape.shape, logical, table, sizes, table_name),
            path_tree(self.abstract_params),
            self.abstract_params,
            self.logical,
            is_leaf=lambda x: isinstance(x, tuple),
        )

    def shard_elements(self, table: Table, table_name: str = "params") -> tuple[int, ...]:
        """Per parameter, in `jax.tree.leaves` order of `abstract_params`, the elements of one device's shard under a
        rule table."""
        sizes = dict(self.mesh.shape)
        specs = jax.tree.leaves(self.specs(table, table_name), is_leaf=lambda leaf: isinstance(leaf, PartitionSpec))
        return tuple(math.prod(device_shape(leaf.shape, spec, sizes))
                     for leaf, spec in zip(self.parameter_leaves(), specs, strict=True))

    def parameter_leaves(self) -> tuple:
        """`jax.tree.leaves(abstract_params)`: every parameter's abstract array, in the order the rest reads them."""
        return tuple(jax.tree.leaves(self.abstract_params))

    def logical_leaves(self) -> tuple:
        """Every parameter's logical axis names, in `parameter_leaves` order (each names tuple one leaf)."""
        return tuple(jax.tree.leaves(self.logical, is_leaf=lambda x: isinstance(x, tuple)))

    def shardings(self, table: Table, table_name: str = "params") -> Mapping:
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), self.specs(table, table_name))

    def splits(self, axis: str, table_name: str = "params") -> bool:
        """Whether mesh `axis` splits any parameter under a rule table (a spec of size-1 axes shows none)."""
        specs = jax.tree.leaves(self.specs(getattr(self.rules, table_name), table_name),
                                is_leaf=lambda leaf: isinstance(leaf, PartitionSpec))
        return any(axis == entry or isinstance(entry, tuple) and axis in entry for spec in specs for entry in spec)

    @property
    def param_shardings(self) -> Mapping:
        return self.shardings(self.rules.params, "params")

    @functools.cached_property
    def pipeline(self) -> PipelineConfig:
        """The pipeline with its stage count resolved from the mesh; `.enabled` and `.one_f_one_b` say which step
        runs (one stage: no pipeline)."""
        return pipeline_config(self.recipe, self.mesh.shape["pipeline"])

    @functools.cached_property
    def capabilities(self) -> ModelCapabilities:
        """What the model class offers beyond the protocol (1F1B stages, the lean loss, an auxiliary loss)."""
        return model_capabilities(self.model_class)

    @functools.cached_property
    def policy(self) -> Policy:
        """The precision policy, parsed once."""
        return self.recipe.precision.parsed

    @functools.cached_property
    def platform(self) -> Platform:
        """What the attention choice needs to know of the layout's devices (real or a GPU target's)."""
        return platform_of(self.mesh.devices.flat[0])

    @functools.cached_property
    def vocab(self) -> int:
        """The vocabulary size: the config's `vocab`, else the size of the parameter dimension named `vocab` (a
        config that calls it `vocab_size` or `num_embed`), else the logits' last dimension."""
        vocab = getattr(self.config, "vocab", None)
        vocab = vocab if isinstance(vocab, int) else named_size(self.abstract_params, self.logical, "vocab")
        return self.logits.shape[-1] if vocab is None else vocab

    @property
    def inputs_shifted(self) -> bool:
        """Whether the model shifts its inputs right itself (its `logits[t]` predicts `tokens[t]`), as it says with
        an `inputs_shifted = True` class attribute or Config field; the loss then takes the inputs as targets."""
        return bool(getattr(self.config, "inputs_shifted", getattr(self.model_class, "inputs_shifted", False)))

    @functools.cached_property
    def layers(self) -> int | None:
        """The number of stacked layers (`stacked_layers`), None for a model without a stack."""
        return stacked_layers(self.config, self.abstract_params, self.logical)

    @functools.cached_property
    def logits(self) -> Any:
        """The model's output on one batch of the recipe's rows (`check_forward`), traced abstractly."""
        return trace_logits(self)

    def degree(self, name: str, table: str = "activations") -> int:
        """How many devices a logical name is split over under a rule table (`activations`, `params`, ...)."""
        return logical_degree(getattr(self.rules, table), name, dict(self.mesh.shape))

    @functools.cached_property
    def attention(self) -> AttentionSetup:
        """How attention runs: the kernel chosen once from `train.attention`, the devices, the compute dtype and the
        config's head_dim (the queries' at trace time when the config has none), and context parallelism."""
        train, head_dim = self.recipe.train, getattr(self.config, "head_dim", None)
        packed, ring = self.recipe.data.packing == "documents", ring_axis(dict(self.mesh.shape))
        choice = choose_kernel(train.attention, self.platform, self.policy.compute_dtype, head_dim, packed=packed,
                               ring=ring is not None and train.context == "ring")
        return AttentionSetup(choice, train.attention, self.platform, head_dim is not None, ring, train.context, packed)

    @property
    def fused_attention(self) -> bool:
        """Whether plain attention runs cuDNN's fused kernel (what `minimal_with_context` remat keeps depends on it;
        never under context parallelism, whose block kernel is not what that policy matches)."""
        return self.attention.choice.fused and self.attention.ring_axis is None

    @functools.cached_property
    def remat(self) -> Callable[[Callable], Callable] | None:
        """The recipe's remat preset as a wrapper of one layer's function."""
        in_region = self.pipeline.enabled or self.attention.packed  # the kernel runs in a nested region
        return remat_wrapper(self.recipe.train.remat, mesh_platform(self.mesh), self.fused_attention,
                             in_region)

    @contextlib.contextmanager
    def context(self, *, training: bool = True, dropout_key: jax.Array | None = None):
        """The model context of a forward pass under this layout: mesh and activation rules, attention, the
        pipeline's layer loop; remat and dropout only when `training` (evaluation and generation keep no activations
        for a backward pass and draw no masks).

        The activation rules also stand as Flax's logical axis rules, with the mesh in scope (its abstract mesh: a
        context set while tracing), so a model that pins its activations with Flax's own `with_logical_constraint` is
        laid out by the recipe, as `shardkit.nn.constrain` is.
        """
        with contextlib.ExitStack() as stack:
            stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh))
            stack.enter_context(unconstrained_boxes())  # the parameters are placed: Linen's boxes must not re-lay them
            stack.enter_context(nnx.logical_axis_rules(flax_axis_rules(self.rules.activations)))
            stack.enter_context(model_context(
                mesh=self.mesh,
                activation_rules=self.rules.activations,
                remat=self.remat if training else None,
                layer_loop=layer_loop_for(self),
                attention=self.attention,
                dropout_rate=self.recipe.train.dropout if training else 0.0,
                dropout_key=dropout_key if training else None,
                weight_grad_dtype=self.policy.weight_grad_dtype,
            ))
            yield

    def apply(self, params: Mapping, tokens_BS: jax.Array, *documents: jax.Array) -> jax.Array:
        """The model's forward pass on a pure dict of parameters (`documents`: packed rows' positions and segment
        ids, shardkit/data/packing.py)."""
        return nnx.merge(self.graphdef, params)(tokens_BS, *documents)


def flax_axis_rules(table: Table) -> tuple[tuple[str, Any], ...]:
    """A shardkit rule table as Flax's logical axis rules: (logical name, mesh axis, axes or None) pairs."""
    return tuple((name, axes[0] if len(axes) == 1 else (tuple(axes) or None)) for name, axes in table.items())


def build_layout(recipe: Recipe, devices=None) -> Layout:
    """Resolve model, mesh and rules, and check every parameter's spec (strictly) before anything is allocated."""
    cls = load_model_class(recipe.model.name)
    config = model_config(cls, recipe.model)
    mesh = build_mesh(recipe.mesh, devices)
    graphdef, abstract_params, logical, sources = named_model(cls, config, recipe.rules)
    if mesh.shape["pipeline"] > 1:  # the missing stack first: the layer count check below assumes one
        check_pipeline_stack(cls, logical)
    validate_pipeline(recipe, stacked_layers(config, abstract_params, logical), dict(mesh.shape))
    check_positions(recipe, config)
    check_rule_names(recipe.rules, known_logical_names(cls, logical))
    rules = with_mesh_axis_names(build_rules(recipe.rules), model_names(logical))
    if mesh.shape["pipeline"] > 1:
        rules = without_shared_fsdp_ranks(rules)
    layout = Layout(recipe, cls, config, mesh, rules, graphdef, abstract_params, logical, sources)
    check_layout(layout)
    if not is_builtin(cls):  # the reference models follow the protocol: spared the trace
        check_forward(layout)
    return layout


# A PartitionSpec given to `out_sharding=` (einsum, `nnx.Embed.attend`, ...) under a mesh whose axes are Auto: JAX's
# ValueError says so with these words.
_EXPLICIT_SPEC_ERROR = "of type Auto or Manual"


def trace_logits(layout: Layout) -> Any:
    """The model's output (a ShapeDtypeStruct, or whatever tree it returns) on one batch of the recipe's token rows,
    traced abstractly under the layout's evaluation context with no pipeline loop: nothing compiles.

    Raises:
        ShardkitError: on `model` where the model pins an activation in JAX's explicit form, which needs a mesh of
            Explicit axes (shardkit's are Auto: XLA propagates the recipe's layout), saying what to write instead.
    """
    train = layout.recipe.train
    tokens_BS = jax.ShapeDtypeStruct((train.global_batch // train.grad_accum, train.seq_len), jnp.int32)

    def forward(params, tokens_BS):
        with layout.context(training=False), model_context(layer_loop=None):
            return layout.apply(params, tokens_BS)

    try:
        return jax.eval_shape(forward, layout.abstract_params, tokens_BS)
    except ValueError as err:
        if _EXPLICIT_SPEC_ERROR not in str(err):
            raise
        raise ShardkitError("model", f"{layout.model_class.__name__} passes a PartitionSpec to out_sharding= "
                            "(JAX's explicit sharding, for meshes of Explicit axes); shardkit's mesh axes are "
                            "Auto, the recipe's rules deciding the layout: drop out_sharding=, or pin the activation "
                            "with logical names, "
                            "flax.linen.with_logical_constraint(x, (\"batch\", None, \"embed\"))") from None


def check_forward(layout: Layout) -> None:
    """The model maps token rows (batch, seq) to logits (batch, seq, vocab): checked on an abstract trace before
    anything compiles (`trace_logits`).

    Raises:
        ShardkitError: on `model.name`, saying what the model returned.
    """
    rows, seq = layout.recipe.train.global_batch // layout.recipe.train.grad_accum, layout.recipe.train.seq_len
    logits = layout.logits
    if isinstance(logits, jax.ShapeDtypeStruct) and len(logits.shape) == 3 and logits.shape[:2] == (rows, seq):
        return
    got = (f"an array of shape {logits.shape}" if isinstance(logits, jax.ShapeDtypeStruct)
           else f"a {type(logits).__name__} of {len(jax.tree.leaves(logits))} arrays")
    raise ShardkitError("model.name", f"{layout.model_class.__name__}(tokens of shape {(rows, seq)}) returns {got}; "
                        f"shardkit needs the logits, shape {(rows, seq)} + (vocab,)")


def check_layout(layout: Layout) -> None:
    """What every layout must pass before a step is built on it: experts placeable on the mesh, every parameter's spec
    under each rule table (strictly), and the sequence axis usable. `build_layout` and `shardkit suggest` (on planned
    meshes) both call it.

    Raises:
        ShardkitError: naming the recipe field (or the parameter, its shape and the rule) that cannot work.
    """
    recipe, sizes = layout.recipe, dict(layout.mesh.shape)
    check_expert_layout(recipe, layout.config, layout.logical, layout.rules, sizes)  # before specs: names mesh.expert
    for table_name in ("params", "optimizer", "gradients"):
        layout.specs(getattr(layout.rules, table_name), table_name)  # raises on the first bad parameter
    check_sequence_layout(recipe, layout.config, sizes, layout.rules.activations)
    check_remat(recipe.train.remat, mesh_platform(layout.mesh))
    check_grad_reduce(layout)
    _ = layout.attention  # an explicit `cudnn` that cannot run fails here, before anything is traced


def check_grad_reduce(layout: Layout) -> None:
    """`precision.grad_reduce = "float32"` is honoured by `shardkit.nn.dot` under the step's autodiff; refused where
    it would not change the dtype gradients are reduced in, so that what `plan` states and the analytic model prices
    is what runs: for a model none of whose matmuls goes through `shardkit.nn.dot` (Flax's `nnx.Linear`, its own
    einsums), whose weight gradients are autodiff's, in the compute dtype (`reaches_wide_weight_grads`). Pipelines sum
    and reduce their stage gradients in it themselves (`shardkit.pipeline.gpipe`, `shardkit.pipeline.one_f_one_b`).
    """
    if layout.recipe.precision.grad_reduce != "float32" or layout.policy.weight_grad_dtype is None:
        return
    if not reaches_wide_weight_grads(layout):
        raise ShardkitError("precision.grad_reduce", f"'float32' applies to matmuls through shardkit.nn.dot, and "
                            f"model {layout.recipe.model.name} runs none (nnx.Linear and a model's own einsums reduce "
                            "in the compute dtype); use 'compute', or call shardkit.nn.dot for the weight matmuls")


def reaches_wide_weight_grads(layout: Layout) -> bool:
    """Whether the model's forward pass runs any `shardkit.nn.dot` whose backward computes the weight gradient in
    fp32 (`precision.grad_reduce = "float32"`): traced abstractly (a jaxpr, no compile) once per model and dtype,
    since `shardkit suggest` checks thousands of layouts of one model."""
    key = (layout.graphdef, jnp.dtype(layout.policy.compute_dtype), layout.policy.weight_grad_dtype)
    if key not in _WIDE_WEIGHT_GRAD_MODELS:
        def forward(params, tokens_BS):
            with model_context(weight_grad_dtype=layout.policy.weight_grad_dtype):
                return layout.apply(layout.policy.cast_to_compute(params), tokens_BS)

        jaxpr = jax.make_jaxpr(forward)(layout.abstract_params, jax.ShapeDtypeStruct((1, 8), jnp.int32))
        _WIDE_WEIGHT_GRAD_MODELS[key] = WIDE_WEIGHT_GRAD_DOT in str(jaxpr)
    return _WIDE_WEIGHT_GRAD_MODELS[key]


_WIDE_WEIGHT_GRAD_MODELS: dict[tuple, bool] = {}  # reaches_wide_weight_grads, by (graphdef, compute, weight grad)


def known_logical_names(cls: type, logical: Mapping) -> set[str]:
    """Names a rule may mention: the default tables', the model's parameters', and any activation names the model
    declares in an optional `ACTIVATION_AXES` attribute."""
    return (set(DEFAULT_PARAM_RULES) | set(DEFAULT_ACTIVATION_RULES) | set(getattr(cls, "ACTIVATION_AXES", ()))
            | model_names(logical))


def model_names(logical: Mapping) -> set[str]:
    """Every logical name the model's parameters carry (a tuple entry, several axes on one dimension, counts each)."""
    names: set[str] = set()
    for axes in jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple)):
        for name in axes:
            names.update(name if isinstance(name, tuple) else () if name is None else (name,))
    return names


def named_size(abstract_params: Mapping, logical: Mapping, name: str) -> int | None:
    """The size of the parameter dimension the model names `name` (the first found), None where none is."""
    shapes = jax.tree.leaves(abstract_params)
    names = jax.tree.leaves(logical, is_leaf=lambda x: isinstance(x, tuple))
    return next((shape.shape[axes.index(name)] for shape, axes in zip(shapes, names) if name in axes), None)


def stacked_layers(config: Any, abstract_params: Mapping, logical: Mapping) -> int | None:
    """The model's number of stacked layers: its config's `layers`, else the size of its parameters' `layers`
    dimension (a config that calls it `num_layers`), None where it has neither."""
    layers = getattr(config, "layers", None)
    return layers if isinstance(layers, int) else named_size(abstract_params, logical, "layers")


def abstract_model(cls: type, config: Any, rules: RulesSection | None = None) -> tuple[Any, dict, dict]:
    """Shapes and logical axes of a model's parameters, from an abstract init (no memory, no FLOPs): `named_model`
    without the names' sources."""
    return named_model(cls, config, rules)[:3]


def named_model(cls: type, config: Any, rules: RulesSection | None = None) -> tuple[Any, dict, dict, dict]:
    """Shapes, logical axes and the source of each parameter's names (`shardkit.naming`: a path rule of `rules`, the
    model's Flax metadata, or none), from an abstract init.

    Raises:
        ShardkitError: naming the first parameter that is not an `nnx.Param` or whose names cannot fit it, a path rule
            that cannot apply, or a Linen module stored without `nnx.bridge.ToNNX`.
    """
    abstract = nnx.eval_shape(lambda: create_model(cls, config, nnx.Rngs(0)))
    _check_no_bare_linen(abstract)
    graphdef, state = nnx.split(abstract)
    variables = nnx.to_flat_state(state)
    for path, variable in variables:
        if not isinstance(variable, nnx.Param):
            raise ShardkitError("model", f"{_joined(path)} is a {type(variable).__name__}; only nnx.Param is "
                                "supported in the model's state (e.g. create nnx.Dropout without rngs)")
    abstract_params = nnx.to_pure_dict(state)
    _check_no_forgotten_stack(variables)
    params = [ParamNames(_joined(path), tuple(variable.shape), _flax_names(variable)) for path, variable in variables]
    names, sources = resolve_names(params, RulesSection() if rules is None else rules)
    logical: dict = {}
    for (path, _), axes in zip(variables, names):
        node = logical
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = axes
    return graphdef, abstract_params, logical, {param.path: source for param, source in zip(params, sources)}


def _flax_names(variable: nnx.Variable) -> tuple | None:
    """A parameter's logical names from Flax's metadata (None where it has none), as written: read as JAX reads a
    PartitionSpec, fewer names than dimensions name the leading ones (`shardkit.naming`)."""
    metadata = variable.get_metadata()
    names = next((metadata[key] for key in FLAX_LOGICAL_KEYS if metadata.get(key) is not None), None)
    return None if names is None else tuple(tuple(name) if isinstance(name, (list, tuple)) else name
                                            for name in names)


def _check_no_forgotten_stack(variables: list) -> None:
    """Parameters read with fewer names than dimensions are what a stack made by `nnx.vmap` without
    `transform_metadata` looks like: its layers' weights keep their per-layer names on a new leading dimension, which
    would then be sharded by the first per-layer name. Refused where a whole module looks so: at least two parameters
    under one top-level attribute, every one short of exactly one name, all with the same leading size."""
    groups: dict = {}
    for path, variable in variables:
        names = _flax_names(variable)
        if names is None:  # unnamed: replicated or named by path, not a stack's short names
            continue
        groups.setdefault(path[0], []).append((path, len(tuple(names)), tuple(variable.shape)))
    for members in groups.values():
        shapes = [shape for _, count, shape in members if count + 1 == len(shape)]
        if len(members) >= 2 and len(shapes) == len(members) and len({shape[0] for shape in shapes}) == 1:
            path, count, shape = members[0]
            raise ShardkitError("model", f"parameter {_joined(path)} has shape {shape} but {count} logical names, one "
                                f"short like every parameter under {path[0]!r}: stacked with nnx.vmap/nnx.scan? pass "
                                "transform_metadata={nnx.PARTITION_NAME: \"layers\"} to both")


def _check_no_bare_linen(model: nnx.Module) -> None:
    """A Linen module kept as a plain attribute of an NNX model holds no parameters NNX can see: refused by path."""
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, nnx.Module) or isinstance(node, bridge.ToNNX):
            continue
        for attribute, value in vars(node).items():
            if isinstance(value, linen.Module):
                raise ShardkitError("model", f"{_joined((*path, attribute))} is a Linen {type(value).__name__} not "
                                    "wrapped for NNX; use nnx.bridge.ToNNX(module, rngs=rngs) and "
                                    "nnx.bridge.lazy_init(it, sample_input)")


def _joined(path: tuple) -> str:
    return "/".join(map(str, path)) or "(model)"


def path_tree(tree: Mapping) -> Mapping:
    """The same nested dict with each leaf replaced by its '/'-joined path."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path_str(path), tree)


def path_str(path: tuple) -> str:
    return "/".join(str(getattr(key, "key", getattr(key, "name", key))) for key in path)


def init_params(layout: Layout, seed: int, shardings: Mapping | None = None, dtype=jnp.float32) -> dict:
    """Initialise the parameters directly into their shards (a jit with out_shardings), in `dtype`; the program runs
    once, so it is compiled with `run_once_options`."""
    shardings = layout.param_shardings if shardings is None else shardings
    key = jax.random.key(seed)
    lowered = jax.jit(param_initializer(layout, dtype), out_shardings=shardings).lower(key)
    return lowered.compile(compiler_options=run_once_options(layout.mesh))(key)


def param_initializer(layout: Layout, dtype=jnp.float32) -> Callable[[jax.Array], dict]:
    """`init(key) -> {path: parameter}`: the model's own initialisers, cast to `dtype` (what `init_params` jits)."""
    cls, config = layout.model_class, layout.config

    def init(key):
        params = nnx.to_pure_dict(nnx.state(create_model(cls, config, nnx.Rngs(params=key)), nnx.Param))
        return jax.tree.map(lambda x: x.astype(dtype), params)

    return init


def device_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one device's shard."""
    out = list(shape)
    for index, entry in enumerate(spec[:len(out)]):  # the dimensions past the spec's entries are whole
        if isinstance(entry, str):
            out[index] //= mesh_sizes[entry]
        elif entry is not None:
            out[index] //= math.prod(mesh_sizes[axis] for axis in entry)
    return tuple(out)
