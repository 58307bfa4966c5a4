"""The training step: state, shardings, loss, gradient accumulation, loss scaling and the optimizer update.

The state is a plain dict (easy to checkpoint and to inspect):
    step        int32 scalar
    params      parameters in the policy's parameter dtype, sharded by the parameter rules
    master      fp32 master copy when the policy keeps one (bf16-params), sharded by the optimizer rules
    opt_state   optax state, its per-parameter leaves sharded by the optimizer rules (ZeRO-1/2 shard them over data)
    loss_scale  {scale, good_steps} when the policy needs dynamic loss scaling (fp16)
    fp8         {site: FP8 scaling state} of the layer stack's matmuls under the fp8 policy (shardkit.nn.dot), each
                leaf with a leading `layers` axis, sharded like the stacked parameters along it
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.attention.context import balanced_ring, in_balanced_order
from shardkit.data.packing import Packing, document_rows, packing_of
from shardkit.errors import ShardkitError
from shardkit.layout import Layout, init_params
from shardkit.loss import cross_entropy_sum, logits_cross_entropy_sum
from shardkit.microbatch import accumulate, passes
from shardkit.moe import moe_metrics
from shardkit.nn import (
    Fp8Scaling,
    Fp8SiteRecorder,
    current_context,
    fp8_scaling,
    model_context,
    scan_stack,
    step_dropout_key,
)
from shardkit.optimizer import learning_rate_schedule, make_optimizer, optimizer_settings, schedule_count
from shardkit.pipeline import gpipe, held, one_f_one_b, scan_layers
from shardkit.precision import Fp8Trained, Policy, fp8_site_state
from shardkit.registry import check_pipeline_stack, model_capabilities
from shardkit.rules import resolve_spec


@dataclasses.dataclass(frozen=True)
class StepBuilder:
    """Builds the state and the jitted step of one layout. `compile()` lowers and compiles once.

    `loss_fn(model, batch) -> (loss, metrics)`, when given, replaces the next-token loss (the library API's user
    loss: `model` is the merged NNX model in compute dtype, `metrics` a dict of scalars added to the step's metrics,
    summed over micro-batches). `schedule` None (a user's optimizer) leaves `lr` out of the metrics.
    `packing` (data.packing = "documents"): the next-token loss runs the model on packed documents, whose positions
    and segment ids come from the tokens (`shardkit.data.packing`).
    """

    layout: Layout
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule | None
    loss_fn: Callable[[nnx.Module, Any], tuple[jax.Array, dict]] | None = None
    packing: Packing | None = None

    @property
    def policy(self) -> Policy:
        return self.layout.policy

    @property
    def mesh(self):
        return self.layout.mesh

    @property
    def recipe(self):
        return self.layout.recipe

    # ---- shardings -------------------------------------------------------------------------------------------------
    def replicated(self) -> NamedSharding:
        """A scalar's (or any fully replicated value's) sharding on this mesh."""
        return NamedSharding(self.mesh, PartitionSpec())

    def batch_sharding(self) -> NamedSharding:
        """Tokens (batch, seq_len + 1): rows over the activation rule for `batch`."""
        axes = tuple(a for a in self.layout.rules.activations["batch"] if self.mesh.shape[a] > 1)
        return NamedSharding(self.mesh, PartitionSpec(axes or None, None))

    def abstract_state(self) -> dict:
        """Shapes and dtypes of the state, with shardings attached (for lowering and for checkpoint restores)."""
        return jax.tree.map(
            lambda leaf, sharding: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding),
            self._unsharded_state_shapes, self.state_shardings(),
        )

    @functools.cached_property
    def _unsharded_state_shapes(self) -> dict:
        return jax.eval_shape(self._init_state_unsharded, jax.random.key(0))

    def state_shardings(self) -> dict:
        """The sharding of every state leaf: parameter rules for params, optimizer rules for its state and master."""
        return self._state_shardings

    @functools.cached_property
    def _state_shardings(self) -> dict:
        layout = self.layout
        opt_shardings = layout.shardings(layout.rules.optimizer, "optimizer")
        abstract = self._unsharded_state_shapes
        shardings = {
            "step": self.replicated(),
            "params": layout.param_shardings,
            "opt_state": optax.tree_map_params(
                self.optimizer, lambda _, sharding: sharding, abstract["opt_state"], opt_shardings,
                transform_non_params=lambda _: self.replicated(),
            ),
        }
        if self.policy.master_weights:
            shardings["master"] = opt_shardings
        if self.policy.loss_scaling:
            shardings["loss_scale"] = {"scale": self.replicated(), "good_steps": self.replicated()}
        if self.policy.fp8:
            shardings["fp8"] = self.fp8_shardings()
        return shardings

    # ---- FP8 scaling state -----------------------------------------------------------------------------------------
    @functools.cached_property
    def fp8_sites(self) -> tuple[str, ...]:
        """The layer stack's matmul sites that `shardkit.nn.dot` runs in FP8, found by tracing the model's loss once
        abstractly with a recorder for their scaling state (so any model calling `dot` gets FP8, not only Llama).
        Traced on one micro-batch of the recipe's shape: a pipeline's regions split its rows over their axes."""
        recorder = Fp8SiteRecorder()
        train = self.layout.recipe.train

        def trace(params, tokens_BS1):
            with model_context(fp8=Fp8Scaling(recorder)):
                return self.loss(params, tokens_BS1)

        micro_batch = jax.ShapeDtypeStruct((train.global_batch // train.grad_accum, train.seq_len + 1), jnp.int32)
        jax.eval_shape(trace, self.layout.abstract_params, micro_batch)
        return tuple(sorted(recorder))

    def initial_fp8(self) -> dict:
        """The FP8 scaling state of a fresh run: scales 1 and empty amax histories, one per layer and site."""
        layers = jax.tree.leaves(self.layout.abstract_params[self.layout.model_class.LAYER_STACK])[0].shape[0]
        return {site: fp8_site_state((layers,)) for site in self.fp8_sites}

    def fp8_shardings(self) -> dict:
        """Each FP8 state leaf (layers, n) is laid out along `layers` as the stacked parameters are (over `pipeline`
        when a recipe maps it there) and whole along its history."""
        layout, mesh_sizes = self.layout, dict(self.mesh.shape)

        def sharding(path, leaf):
            spec = resolve_spec(f"fp8/{path}", leaf.shape, ("layers", None), layout.rules.params, mesh_sizes)
            return NamedSharding(self.mesh, spec)

        abstract = jax.eval_shape(self.initial_fp8)
        return {site: {name: sharding(f"{site}/{name}", leaf) for name, leaf in leaves.items()}
                for site, leaves in abstract.items()}

    # ---- state -----------------------------------------------------------------------------------------------------
    def init_state(self, seed: int) -> dict:
        """The initial state, every leaf born in its own shards."""
        shardings = self.state_shardings()
        params = init_params(self.layout, seed, shardings["params"], self.policy.param_dtype)
        return jax.jit(self._state_from_params, out_shardings=shardings)(params)

    def state_from_params(self, params) -> dict:
        """A step-0 state around given parameters (an imported checkpoint): fresh optimizer state, born sharded."""
        return jax.jit(self._state_from_params, out_shardings=self.state_shardings())(params)

    def _init_state_unsharded(self, key) -> dict:
        params = jax.tree.map(
            lambda leaf: jnp.zeros(leaf.shape, self.policy.param_dtype), self.layout.abstract_params
        )
        return self._state_from_params(params)

    def _state_from_params(self, params) -> dict:
        master = self.master_params(params)
        state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.optimizer.init(master)}
        if self.policy.master_weights:
            state["master"] = master
        if self.policy.loss_scaling:
            scale = jnp.asarray(self.recipe.precision.loss_scale_init, jnp.float32)
            state["loss_scale"] = {"scale": scale, "good_steps": jnp.zeros((), jnp.int32)}
        if self.policy.fp8:
            state["fp8"] = self.initial_fp8()
        return state

    def dropout_key(self, step) -> jax.Array | None:
        """The step's dropout key (None when dropout is off): a function of (seed, step) alone, so a resumed run
        draws the masks an uninterrupted one would."""
        return step_dropout_key(self.recipe.train, step)

    def master_params(self, params):
        """The fp32 copy the optimizer updates when the policy keeps master weights; else the parameters."""
        return jax.tree.map(lambda p: p.astype(jnp.float32), params) if self.policy.master_weights else params

    # ---- the step --------------------------------------------------------------------------------------------------
    def loss(self, params, tokens_BS1) -> jax.Array:
        """The training loss (see `loss_with_aux`)."""
        return self.loss_with_aux(params, tokens_BS1)[0]

    def loss_with_aux(self, params, tokens_BS1) -> tuple[jax.Array, dict]:
        """Mean next-token cross entropy, computed in fp32 from the compute-dtype logits, plus the model's auxiliary
        losses; and the auxiliary metrics as sums over rows (`shardkit.moe.moe_metrics`; empty for dense models).

        Models that give their final hidden state and head weight (`Layout.capabilities.lean_loss`) get the lean
        loss, which never holds all the logits; others are differentiated through their full logits (under a pipeline,
        a model that scans its own layers has that scan found and pipelined: shardkit/pipeline/scan_layers.py). A model
        with `layers_with_aux` (models/moe.py) runs its layer stack through it and adds the auxiliary loss it returns.
        """
        if isinstance(params, held.HeldStage):  # the layer loop takes the held stage weights (pipeline/held.py)
            with held.holding(params.stage):
                return self.loss_with_aux(params.trained, tokens_BS1)
        if isinstance(params, Fp8Trained):
            with fp8_scaling(params.fp8):
                return self.loss_with_aux(params.params, tokens_BS1)
        if self.loss_fn is not None:
            return self.loss_fn(nnx.merge(self.layout.graphdef, self.policy.cast_to_compute(params)), tokens_BS1)
        inputs_BS = tokens_BS1[:, :-1]
        # A model that shifts its inputs itself predicts each input token at its own position.
        targets_BS = inputs_BS if self.layout.inputs_shifted else tokens_BS1[:, 1:]
        rows = document_rows(self.packing, inputs_BS)  # (positions_BS, segments_BS) when packing, else ()
        ring = balanced_ring(self.layout)
        if ring and current_context().mesh is not None:  # the load-balanced order, decided once for the whole step
            inputs_BS, targets_BS, *rows = in_balanced_order(ring, inputs_BS, targets_BS, rows)
            balanced = dataclasses.replace(current_context().attention, balanced=True)
            with model_context(attention=balanced):
                return self._lean_loss(params, inputs_BS, targets_BS, rows)
        if self.layout.capabilities.lean_loss:
            return self._lean_loss(params, inputs_BS, targets_BS, rows)
        logits_BSV = scan_layers.apply_for(self.layout)(self.policy.cast_to_compute(params), inputs_BS, *rows)
        logits_BSV = self.policy.cast_to_output(logits_BSV).astype(jnp.float32)
        return logits_cross_entropy_sum(logits_BSV, targets_BS) / targets_BS.size, {}

    def _lean_loss(self, params, inputs_BS, targets_BS, rows) -> tuple[jax.Array, dict]:
        """The lean loss of `loss_with_aux` on inputs and targets (rows: what each layer takes after x_BSD)."""
        model = nnx.merge(self.layout.graphdef, self.policy.cast_to_compute(params))
        x_BSD, aux_loss, aux = layer_stack(model, model.embed(inputs_BS), *rows)
        hidden_BSD = model.final_hidden(x_BSD)
        # Under GPipe and circular, a loss region that splits the rows over the stages (gpipe.cross_entropy_for).
        loss_fn = gpipe.cross_entropy_for(self.layout) or cross_entropy_sum
        loss_sum = loss_fn(hidden_BSD, model.head_weight(), targets_BS, self.policy.output_dtype)
        return loss_sum / targets_BS.size + aux_loss, aux

    def step(self, state: dict, tokens_BS1: jax.Array) -> tuple[dict, dict]:
        """One optimizer step over the global batch (all micro-batches)."""
        scale = state["loss_scale"]["scale"] if self.policy.loss_scaling else jnp.float32(1.0)
        trained = Fp8Trained(state["params"], state["fp8"]) if self.policy.fp8 else state["params"]
        loss, grads, aux = self.gradients_with_aux(trained, tokens_BS1, scale, step=state["step"])
        if self.policy.fp8:
            grads, next_fp8 = grads
        state, metrics = self.apply_update(state, loss, grads)
        if self.policy.fp8:
            state["fp8"] = next_fp8
        return state, {**metrics, **(aux if self.loss_fn is not None else moe_metrics(aux))}

    def gradients(self, params, tokens_BS1, scale=1.0, step=None) -> tuple[jax.Array, Any]:
        """Mean loss and fp32 gradients over the global batch (see `gradients_with_aux`)."""
        loss, grads, _ = self.gradients_with_aux(params, tokens_BS1, scale, step)
        return loss, grads

    def gradients_with_aux(self, params, tokens_BS1, scale=1.0, step=None) -> tuple[jax.Array, Any, dict]:
        """Mean loss and fp32 gradients over the global batch (`grad_accum` micro-batches), laid out by the gradient
        rules, and the auxiliary metric sums of the whole batch (`loss_with_aux`). `step` seeds dropout (none without
        it). `params` may be `Fp8Trained`: the gradients are then `Fp8Trained` too, their `fp8` the next FP8 state
        (over micro-batches and replicas, the maximum of theirs: `shardkit.precision.combine_fp8`); each pass's loss
        is then scaled by 1 / `shardkit.microbatch.passes` before it is differentiated and the result divided by it
        again, so each pass's output gradients (whose amax the state records) are what one device has for them.

        Loss scaling is applied and removed here and nowhere else: the loss is multiplied by `scale` before it is
        differentiated (`value_and_grad`), and the loss and gradients are divided by it once, after accumulation. With
        scale 1 this is plain value-and-grad.
        """
        if isinstance(params, Fp8Trained):
            scale = scale / passes(self.layout)
        with self.model_context(step):
            accumulated = held.accumulate if held.holds_stage(self.layout) else accumulate
            (scaled_loss, aux), scaled_grads = accumulated(self.value_and_grad(jnp.float32(scale)), self.layout)(
                params, tokens_BS1)
        unscale = lambda g: g / scale  # noqa: E731
        gradient_shardings = self.layout.shardings(self.layout.rules.gradients, "gradients")
        if isinstance(scaled_grads, Fp8Trained):
            grads = Fp8Trained(jax.tree.map(unscale, scaled_grads.params), scaled_grads.fp8)
            gradient_shardings = Fp8Trained(gradient_shardings, self.fp8_shardings())
        else:
            grads = jax.tree.map(unscale, scaled_grads)
        loss = scaled_loss / scale
        return loss, jax.lax.with_sharding_constraint(grads, gradient_shardings), aux

    def value_and_grad(self, scale) -> Callable:
        """`(params, tokens_BS1) -> ((scale * mean loss, auxiliary metric sums), its fp32 gradients)` on one batch:
        autodiff of `loss_with_aux`, or under 1F1B the pipeline's own stage-by-stage backward (which needs each
        micro-batch's loss inside the last stage, and adds each stage's share of the auxiliary loss there)."""
        if self.layout.pipeline.one_f_one_b:
            return one_f_one_b.value_and_grad(self.layout, self.policy, scale, self.packing)

        def scaled_loss(params, tokens_BS1):
            loss, aux = self.loss_with_aux(params, tokens_BS1)
            return loss * scale, aux

        scaled_value_and_grad = jax.value_and_grad(scaled_loss, has_aux=True)

        def run(params, tokens_BS1):
            loss_and_aux, grads = scaled_value_and_grad(params, tokens_BS1)
            return loss_and_aux, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

        return run

    def model_context(self, step=None):
        """The context the model runs in inside the step: the layout's (`Layout.context`), dropout keyed by `step`."""
        return self.layout.context(training=True, dropout_key=self.dropout_key(step))

    def apply_update(self, state: dict, loss: jax.Array, grads) -> tuple[dict, dict]:
        """The optimizer update; with loss scaling, skipped when the gradients are not finite."""
        grad_norm = optax.tree.norm(grads)
        weights = state["master"] if self.policy.master_weights else state["params"]
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], weights)
        weights = optax.apply_updates(weights, updates)
        new = dict(state, step=state["step"] + 1, opt_state=opt_state)
        if self.policy.master_weights:
            new["master"] = weights
            new["params"] = jax.tree.map(lambda w: w.astype(self.policy.param_dtype), weights)
        else:
            new["params"] = weights
        metrics = {"loss": loss, "grad_norm": grad_norm}
        if self.schedule is not None:
            metrics["lr"] = self.schedule(schedule_count(state["opt_state"]))
        if self.policy.loss_scaling:
            finite = jnp.isfinite(grad_norm)
            new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, state)
            new["step"] = state["step"] + 1
            new["loss_scale"] = next_loss_scale(state["loss_scale"], finite, self.recipe.precision.loss_scale_period)
            metrics.update(loss_scale=state["loss_scale"]["scale"], skipped=jnp.logical_not(finite).astype(jnp.int32))
        return new, metrics

    def jit(self) -> Callable:
        """The step, jitted with explicit shardings and the state donated."""
        return jax.jit(
            self.step,
            in_shardings=(self.state_shardings(), self.batch_sharding()),
            out_shardings=(self.state_shardings(), self.replicated()),
            donate_argnums=0,
        )

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        """The recipe's global batch of tokens (rows of seq_len + 1), sharded."""
        train = self.recipe.train
        return jax.ShapeDtypeStruct((train.global_batch, train.seq_len + 1), jnp.int32, sharding=self.batch_sharding())

    def lower(self):
        """Lower the step for the recipe's batch shape (no compile yet)."""
        return self.jit().lower(self.abstract_state(), self.abstract_batch())

    # ---- evaluation ------------------------------------------------------------------------------------------------
    def eval_loss(self, params, tokens_BS1) -> jax.Array:
        """The mean next-token loss as evaluation computes it: the training loss function in the layout's own
        context (same attention kernel, pipeline and context parallelism), without dropout or remat, over the whole
        batch at once."""
        with self.layout.context(training=False):
            return self.loss(params, tokens_BS1)

    def eval_jit(self) -> Callable:
        """`eval_loss`, jitted on the state's parameter shardings and the batch sharding."""
        return jax.jit(self.eval_loss, in_shardings=(self.state_shardings()["params"], self.batch_sharding()),
                       out_shardings=self.replicated())

    def lower_eval(self):
        """Lower the evaluation step for the recipe's batch shape (what `shardkit hlo --step eval` compiles)."""
        return self.eval_jit().lower(self.abstract_state()["params"], self.abstract_batch())

    def compile(self):
        """Lower and compile once; the result is called in the training loop and inspected by `hlo`/`plan`."""
        return self.lower().compile()


def layer_stack(model, x_BSD, *rows) -> tuple[jax.Array, jax.Array, dict]:
    """The model's layer stack: (x_BSD, auxiliary loss, auxiliary metric sums); a model without `layers_with_aux`
    is the plain scan over its `LAYER_STACK`, with no auxiliary loss. `rows`: what each layer takes after x_BSD
    (packed documents' positions and segment ids)."""
    if model_capabilities(type(model)).aux_loss:
        return model.layers_with_aux(x_BSD, *rows)
    return scan_stack(getattr(model, model.LAYER_STACK), x_BSD, *rows), jnp.float32(0), {}


def check_step_layout(layout: Layout) -> None:
    """The step's checks that need only the layout (no devices): the batch splits, per-step FSDP sync fits the
    pipeline, and 1F1B can split the model into stages. `build_step` and `shardkit suggest` both call it."""
    check_batch(layout)
    check_fp8(layout)
    if layout.pipeline.one_f_one_b:  # first: what the schedule asked for names the schedule
        # a model 1F1B cannot split into stages: fail before tracing
        one_f_one_b.check_model(layout.model_class, layout.pipeline.schedule)
        if layout.inputs_shifted:  # its last stage's loss takes the next tokens as targets
            raise ShardkitError("pipeline.schedule", f"{layout.pipeline.schedule!r} computes a next-token loss, and "
                                f"{layout.model_class.__name__} shifts its inputs itself (inputs_shifted); use 'gpipe' "
                                "or 'circular'")
    if layout.pipeline.enabled:
        check_pipeline_stack(layout.model_class, layout.logical)
        held.check_model(layout)


def check_fp8(layout: Layout) -> None:
    """The fp8 policy's scaling state rides with the layer stack through its layer loop and is differentiated with
    the parameters: through a plain scan, GPipe's and circular's tick loop (each stage its own layers' state) and
    accumulation. The 1F1B family's executor differentiates stage by stage on its own and does not carry it."""
    if not layout.policy.fp8:
        return
    if layout.pipeline.one_f_one_b:
        raise ShardkitError("precision.policy", f"'fp8' runs under the 'gpipe' and 'circular' pipeline schedules, not "
                            f"{layout.pipeline.schedule!r} (the 1F1B family's stage-by-stage backward does not carry "
                            "the FP8 scaling state); use pipeline.schedule = 'gpipe' or 'circular', or bf16")
    if not hasattr(layout.model_class, "LAYER_STACK"):
        raise ShardkitError("precision.policy", f"'fp8' needs a model with a stacked layer stack (LAYER_STACK); "
                            f"{layout.model_class.__name__} has none")


def check_batch(layout: Layout) -> None:
    """Each micro-batch must split evenly over the devices that share the batch."""
    train = layout.recipe.train
    degree = layout.degree("batch")
    micro = train.global_batch // train.grad_accum
    if micro % degree:
        raise ShardkitError(
            "train.global_batch",
            f"a micro-batch of {micro} rows (global_batch {train.global_batch} / grad_accum {train.grad_accum}) does "
            f"not split over the {degree} devices sharing the batch ({list(layout.rules.activations['batch'])}); "
            f"use a global_batch that is a multiple of {degree * train.grad_accum}",
        )


def next_loss_scale(loss_scale: Mapping, finite: jax.Array, period: int) -> dict:
    """Dynamic loss scaling: halve on non-finite gradients, double after `period` finite steps in a row."""
    scale, good = loss_scale["scale"], loss_scale["good_steps"]
    grow = jnp.logical_and(finite, good + 1 >= period)
    new_scale = jnp.where(finite, jnp.where(grow, scale * 2, scale), jnp.maximum(scale / 2, 1.0))
    new_good = jnp.where(jnp.logical_and(finite, jnp.logical_not(grow)), good + 1, 0)
    return {"scale": new_scale, "good_steps": new_good.astype(jnp.int32)}


def build_step(layout: Layout) -> StepBuilder:
    """The step builder for a layout: its precision policy, optimizer and schedule from the recipe."""
    recipe = layout.recipe
    check_step_layout(layout)
    settings = optimizer_settings(recipe, layout.model_class, layout.config)
    optimizer = make_optimizer(settings, recipe.train.steps, layout.logical)
    packing = packing_of(recipe.data, getattr(layout.config, "vocab", None))
    return StepBuilder(layout, optimizer, learning_rate_schedule(settings, recipe.train.steps),
                       packing=packing)
