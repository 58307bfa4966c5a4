"""Run a recipe for a few steps and collect what equivalence tests compare: losses and first-step gradients."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from shardkit.data import TokenSource
from shardkit.partition import build_layout, path_str
from shardkit.train import build_step


@dataclasses.dataclass(frozen=True)
class Trace:
    losses: np.ndarray
    grads: dict[str, np.ndarray]  # at the initial parameters, on the first batch, gathered to the host
    # The compiled step that produced `losses`, so a test can inspect its HLO without compiling it again.
    compiled: Any = dataclasses.field(default=None, compare=False, repr=False)


def trace(recipe, steps: int = 4, devices=None) -> Trace:
    """Losses of `steps` optimizer steps, and the gradients of the first batch at the initial parameters."""
    builder = build_step(build_layout(recipe, devices))
    state = builder.init_state(recipe.train.seed)
    source = TokenSource(recipe.data, builder.layout.config.vocab, recipe.train.seq_len, recipe.train.seed)
    batches = [source.global_batch(step, recipe.train.global_batch, builder.batch_sharding()) for step in range(steps)]
    _, grads = jax.jit(builder.gradients)(state["params"], batches[0])
    flat = {path_str(path): np.asarray(jax.device_get(g)) for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    compiled = builder.compile()
    losses = []
    for batch in batches:
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss"]))
    return Trace(np.asarray(losses), flat, compiled)


def assert_traces_close(got: Trace, want: Trace, rtol: float) -> None:
    """Losses within `rtol` relative; each gradient within `rtol` of its largest entry (see the test module)."""
    np.testing.assert_allclose(got.losses, want.losses, rtol=rtol, atol=0)
    assert got.grads.keys() == want.grads.keys()
    for path, reference in want.grads.items():
        scale = np.abs(reference).max()
        np.testing.assert_allclose(got.grads[path], reference, rtol=rtol, atol=rtol * scale, err_msg=path)
