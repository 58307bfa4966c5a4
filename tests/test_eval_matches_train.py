"""Evaluation runs the model training runs: the eval step's loss equals the training loss of the same parameters and
batch, here for the pipelines that tests/equivalence.py's `trace` does not run (it checks every other layout).

Both come from one resolved layout (`Layout.context`): the same attention kernel, pipeline and context parallelism;
evaluation drops only dropout (off here) and remat (which changes no forward value) and takes the whole batch at once
where training accumulates micro-batches. fp32, so the two differ only in the order of sums: 1e-5 relative, as in
test_equivalence.py. Before the resolved layout, eval built its own context and, under ring context parallelism,
all-gathered K/V instead of running the ring, and on GPUs ran XLA's attention where training ran cuDNN's.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from shardkit.data.source import TokenSource
from shardkit.layout import build_layout
from shardkit.step import build_step
from tests.helpers import recipe

pytestmark = pytest.mark.slow  # two compiles per layout

FP32_RTOL = 1e-5
# Every layout traced by tests/equivalence.py's `trace` (the equivalence sweep, tp_sp, ring and all-gather context
# parallelism, 1F1B, MoE, accumulation) is checked there (`assert_losses_close`). GPipe and circular pipelines are
# compared with one device by tests/test_pipeline.py's own fixture, so they are checked here.
CASES = {
    "pp_gpipe": ("pp", ()),
    # 2 stages x 2 repeats of one layer a chunk (the 4-layer model), as many micro-batches as stages.
    "pp_circular": ("pp", ("mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.repeats=2",
                           "pipeline.microbatches=2")),
    "pp_fsdp_tp": ("pp_fsdp_tp", ()),
}


def _losses(name: str) -> tuple[float, float]:
    recipe_name, overrides = CASES[name]
    builder = build_step(build_layout(recipe(recipe_name, *overrides)))
    params = builder.init_state(0)["params"]
    train = builder.recipe.train
    batch = TokenSource(builder.recipe.data, builder.layout.config.vocab, train.seq_len, train.seed).global_batch(
        0, train.global_batch, builder.batch_sharding())
    # Only the loss is returned, so XLA drops the backward pass: this is the training forward (remat, micro-batches).
    train_loss = jax.jit(lambda p, b: builder.gradients(p, b)[0])(params, batch)
    eval_loss = builder.eval_jit()(params, batch)
    return float(np.asarray(train_loss)), float(np.asarray(eval_loss))


@pytest.mark.parametrize("name", sorted(CASES))
def test_eval_loss_equals_the_training_loss(name):
    train_loss, eval_loss = _losses(name)
    np.testing.assert_allclose(eval_loss, train_loss, rtol=FP32_RTOL)
