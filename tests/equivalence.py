"""Run a recipe for a few steps and collect what equivalence tests compare: losses and first-step gradients."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardkit.data.source import TokenSource
from shardkit.layout import build_layout, path_str
from shardkit.step import build_step

FP32_RTOL = 1e-5  # the layouts only reorder floating-point sums: test_equivalence.py's docstring says why
BF16_RTOL = 2e-2  # about five bf16 unit roundoffs


@dataclasses.dataclass(frozen=True)
class Trace:
    losses: np.ndarray
    grads: dict[str, np.ndarray]  # at the initial parameters, on the first batch, gathered to the host
    # What produced them, for tests that look further without compiling again: the compiled step (None when no step
    # ran), the step builder, the compiled `gradients(params, tokens, scale)`, the initial parameters and first batch,
    # and (with keep_states) the state before each step on the host.
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
    at_scale = jax.jit(lambda p, t, scale: builder.gradients(p, t, scale, step=jnp.int32(0)))
    at_scale = at_scale.lower(params, first, np.float32(1)).compile()
    first_grads = Trace(np.zeros(0), flatten(at_scale(params, first, np.float32(1))[1]), None, builder, at_scale,
                        params, first, eval_loss=eval_loss)
    return _run_steps(builder, state, batches, keep_states, first_grads) if steps else first_grads


def _run_steps(builder, state, batches, keep_states: bool, partial: Trace) -> Trace:
    """`partial` with the losses of one compiled step per batch (and the states before each, with `keep_states`)."""
    compiled = builder.compile()
    losses, states, moe = [], [], []
    for batch in batches:
        if keep_states:
            states.append(jax.device_get(state))
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
        moe.append({key: float(value) for key, value in metrics.items() if key.startswith("moe_")})
    return dataclasses.replace(partial, losses=np.asarray(losses), compiled=compiled, states=tuple(states),
                               moe_metrics=tuple(moe))


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
