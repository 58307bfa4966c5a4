"""Run a recipe for a few steps and collect what equivalence tests compare: losses and first-step gradients."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardkit.data.source import TokenSource
from shardkit.layout import build_layout, path_str
from shardkit.optimizer import optimizer_settings
from shardkit.step import build_step

FP32_RTOL = 1e-5  # the layouts only reorder floating-point sums: test_equivalence.py's docstring says why
BF16_RTOL = 2e-2  # about five bf16 unit roundoffs


@dataclasses.dataclass(frozen=True)
class Trace:
    losses: np.ndarray
    grads: dict[str, np.ndarray]  # at the initial parameters, on the first batch, gathered to the host
    # What produced them, for tests that look further without compiling again: the compiled step (None when no step
    # ran), the step builder, `gradients(params, tokens, scale)` (compiled on first use: `LazyCompiled`), the initial
    # parameters and first batch, and (with keep_states) the state before each step on the host.
    compiled: Any = dataclasses.field(default=None, compare=False, repr=False)
    builder: Any = dataclasses.field(default=None, compare=False, repr=False)
    gradients: Any = dataclasses.field(default=None, compare=False, repr=False)
    first_params: Any = dataclasses.field(default=None, compare=False, repr=False)
    first_batch: Any = dataclasses.field(default=None, compare=False, repr=False)
    states: tuple = dataclasses.field(default=(), compare=False, repr=False)
    # The evaluation step's loss at the initial parameters on the first batch (None without steps or with dropout):
    # what `assert_traces_close` holds equal to the first step's training loss, so every layout a test traces also
    # checks that evaluation runs the model training runs.
    eval_loss: float | None = dataclasses.field(default=None, compare=False)
    # Each step's mixture-of-experts metrics (`shardkit.moe.moe_metrics`: router losses, expert loads, dropped share).
    moe_metrics: tuple = dataclasses.field(default=(), compare=False)
    # (optimizer state, gradient norm) after the first step, where the gradients were read back from it.
    first_moment: tuple = dataclasses.field(default=(), compare=False, repr=False)

    def grads_at_scale(self, scale: float) -> dict[str, np.ndarray]:
        """First-batch gradients computed with the loss multiplied by `scale` (and divided back out)."""
        return flatten(self.gradients(self.first_params, self.first_batch, np.float32(scale))[1])


def flatten(tree) -> dict[str, np.ndarray]:
    """`{parameter path: host array}` of a gradient tree."""
    return {path_str(path): np.asarray(jax.device_get(g)) for path, g in jax.tree_util.tree_flatten_with_path(tree)[0]}


def trace(recipe, steps: int = 4, devices=None, keep_states: bool = False, gradients: bool = True) -> Trace:
    """Losses of `steps` optimizer steps (none when 0), and the gradients of the first batch at the initial
    parameters (step 0's dropout masks when dropout is on; with `gradients=False` none, one compile fewer)."""
    builder = build_step(build_layout(recipe, devices))
    state = builder.init_state(recipe.train.seed)
    source = TokenSource(recipe.data, builder.layout.vocab, recipe.train.seq_len, recipe.train.seed)
    sharding = builder.batch_sharding()
    batches = [source.global_batch(step, recipe.train.global_batch, sharding) for step in range(max(steps, 1))]
    # A copy: the step donates the state, so the initial parameters' buffers are gone once it has run.
    params, first = jax.tree.map(jnp.copy, state["params"]), batches[0]
    eval_loss = None
    if steps and recipe.train.dropout == 0:
        eval_loss = float(np.asarray(builder.eval_jit()(params, first)))
    if not gradients:
        partial = Trace(np.zeros(0), {}, None, builder, eval_loss=eval_loss)
        return _run_steps(builder, state, batches, keep_states, partial)
    at_scale = LazyCompiled(lambda: jax.jit(lambda p, t, scale: builder.gradients(p, t, scale, step=jnp.int32(0)))
                            .lower(params, first, np.float32(1)))
    partial = Trace(np.zeros(0), {}, None, builder, at_scale, params, first, eval_loss=eval_loss)
    if steps and _first_moment_holds_gradients(builder):
        # The first step's gradients, read back from what the optimizer made of them: one compile fewer.
        done = _run_steps(builder, state, batches, keep_states, partial, first_moment=True)
        return dataclasses.replace(done, grads=_gradients_from_first_moment(builder, *done.first_moment))
    partial = dataclasses.replace(partial, grads=flatten(at_scale(params, first, np.float32(1))[1]))
    return _run_steps(builder, state, batches, keep_states, partial) if steps else partial


class LazyCompiled:
    """A program lowered (by `lower()`) and compiled the first time it is called or inspected (`as_text`,
    `memory_analysis`, ...): a trace whose gradients came from the step compiles it only for the tests that look."""

    def __init__(self, lower: Callable):
        self._lower, self._compiled = lower, None

    def compiled(self):
        if self._compiled is None:
            self._compiled = self._lower().compile()
        return self._compiled

    def __call__(self, *args):
        return self.compiled()(*args)

    def __getattr__(self, name):
        return getattr(self.compiled(), name)


def _first_moment_holds_gradients(builder) -> bool:
    """Whether the state after the first step holds that step's gradients exactly enough to read them back: AdamW's
    first moment starts at zero, so after one update it is (1 - b1) x the clipped gradients, in fp32 here (fp32
    parameters or an fp32 master copy), with no loss scale that could skip the step and no FP8 state in the
    gradients."""
    policy = builder.policy
    if policy.fp8 or policy.loss_scaling:
        return False
    moments = optax.tree.get_all_with_path(builder.abstract_state()["opt_state"], "mu")
    return len(moments) == 1 and all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(moments[0][1]))


def _gradients_from_first_moment(builder, opt_state, grad_norm: float) -> dict[str, np.ndarray]:
    """The first step's gradients from the optimizer state after it: AdamW's first moment divided by (1 - b1), and
    the global-norm clip (`optax.clip_by_global_norm`, applied when the norm reached `clip`) undone with the norm the
    step reported. Each entry comes back within a few fp32 roundings of the gradient the step computed, far below
    FP32_RTOL."""
    settings = optimizer_settings(builder.recipe, builder.layout.model_class, builder.layout.config)
    (_, mu), = optax.tree.get_all_with_path(opt_state, "mu")
    unclip = grad_norm / settings.clip if grad_norm >= settings.clip else 1.0
    one_minus_b1 = np.float64(np.float32(1 - settings.b1))
    return {path: (g.astype(np.float64) / one_minus_b1 * unclip).astype(np.float32)
            for path, g in flatten(mu).items()}


def _run_steps(builder, state, batches, keep_states: bool, partial: Trace, first_moment: bool = False) -> Trace:
    """`partial` with the losses of one compiled step per batch (and the states before each, with `keep_states`;
    with `first_moment`, the optimizer state and gradient norm after the first step)."""
    compiled = builder.compile()
    losses, states, moe, after_first = [], [], [], ()
    for batch in batches:
        if keep_states:
            states.append(jax.device_get(state))
        state, metrics = compiled(state, batch)
        if first_moment and not after_first:
            after_first = (jax.device_get(state["opt_state"]), float(metrics["grad_norm"]))
        losses.append(float(metrics["loss"]))
        moe.append({key: float(value) for key, value in metrics.items() if key.startswith("moe_")})
    return dataclasses.replace(partial, losses=np.asarray(losses), compiled=compiled, states=tuple(states),
                               moe_metrics=tuple(moe), first_moment=after_first)


def assert_traces_close(got: Trace, want: Trace, rtol: float) -> None:
    """Losses within `rtol` relative; each gradient within `rtol` of its largest entry (see the test module)."""
    assert_losses_close(got, want, rtol)
    assert got.grads.keys() == want.grads.keys()
    for path, reference in want.grads.items():
        scale = np.abs(reference).max()
        np.testing.assert_allclose(got.grads[path], reference, rtol=rtol, atol=rtol * scale, err_msg=path)


def assert_losses_close(got: Trace, want: Trace, rtol: float) -> None:
    """Each step's loss within `rtol` relative; and each trace's evaluation loss within `rtol` of its own first
    training loss (same parameters, same batch: evaluation differs only by running the whole batch at once, without
    remat)."""
    np.testing.assert_allclose(got.losses, want.losses, rtol=rtol, atol=0)
    for trace_ in (got, want):
        if trace_.eval_loss is not None and len(trace_.losses):
            np.testing.assert_allclose(trace_.eval_loss, trace_.losses[0], rtol=rtol, atol=0,
                                       err_msg="evaluation loss against the first training loss")
