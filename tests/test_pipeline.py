"""Pipeline parallelism: schedules as data, the ppermute helper, validation, equivalence with one device, HLO bytes.

Tolerance for equivalence: fp32, 1e-5 absolute and relative. It is safe because a pipeline runs the same per-row
operations as one device; only the order of two sums changes (the gradient of a stacked weight is summed over
micro-batches, and the batch mean is taken over a different row split), which moves fp32 results by a few ulps.
"""

from __future__ import annotations

import functools
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from shardkit import cli
from shardkit.analysis.compiled import hlo
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout, init_params
from shardkit.pipeline import (
    PipelineBubbleWarning,
    PipelineConfig,
    boundary_sends,
    bubble_fraction,
    collective_permute_bytes,
    forward_grid,
    gpipe_grid,
    idle_fraction,
    microbatch_activation_bytes,
    one_f_one_b_grid,
    peak_live_activations,
    pipeline_config,
    send,
    svg_gantt,
    text_gantt,
)
from shardkit.step import build_step
from shardkit.testing import requires_devices
from tests.helpers import RECIPES, assert_gradients_reduced_over_data_once, permuted_bytes, recipe

TOLERANCE = 1e-5


# ---- schedules -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (2, 6), (8, 3)])
def test_gpipe_and_1f1b_bubbles_match_theory(p, m):
    theory = (p - 1) / (m + p - 1)
    assert bubble_fraction(PipelineConfig(p, m)) == pytest.approx(theory)
    assert idle_fraction(gpipe_grid(PipelineConfig(p, m))) == pytest.approx(theory)
    assert idle_fraction(one_f_one_b_grid(PipelineConfig(p, m, schedule="1f1b"))) == pytest.approx(theory)


@pytest.mark.parametrize("p,m,v", [(4, 4, 2), (4, 8, 2), (2, 4, 4)])
def test_circular_divides_the_bubble_by_repeats(p, m, v):
    config = PipelineConfig(p, m, v, "circular")
    assert bubble_fraction(config) == pytest.approx((p - 1) / (v * m + p - 1))
    assert idle_fraction(forward_grid(config)) == pytest.approx(bubble_fraction(config))


def test_1f1b_keeps_at_most_p_micro_batches_alive():
    p, m = 4, 8
    assert peak_live_activations(gpipe_grid(PipelineConfig(p, m))) == [m] * p
    assert peak_live_activations(one_f_one_b_grid(PipelineConfig(p, m, schedule="1f1b"))) == [4, 3, 2, 1]


def test_every_work_item_runs_once_and_in_dependency_order():
    p, m = 4, 6
    grid = one_f_one_b_grid(PipelineConfig(p, m, schedule="1f1b"))
    when = {(d, cell.kind, cell.micro): t for d, row in enumerate(grid) for t, cell in enumerate(row) if cell}
    assert len(when) == 2 * p * m
    for i in range(m):
        for d in range(1, p):
            assert when[(d, "F", i)] > when[(d - 1, "F", i)]
            assert when[(d - 1, "B", i)] > when[(d, "B", i)]
        assert when[(p - 1, "B", i)] > when[(p - 1, "F", i)]


def test_sends_are_micro_batches_times_boundaries():
    assert boundary_sends(PipelineConfig(4, 8)) == 8 * 3
    assert boundary_sends(PipelineConfig(4, 8, 2, "circular")) == 8 * (2 * 4 - 1)  # 7 hops: 3 + wrap + 3


def test_text_and_svg_gantt_show_work_and_bubbles():
    config = PipelineConfig(4, 4)
    grid = gpipe_grid(config)
    text = text_gantt(grid, config)
    rows = [line for line in text.splitlines() if line.startswith("stage")]
    assert len(rows) == 4 and "F0" in rows[0] and "b3" in rows[3] and ".." in rows[3]
    assert "42.9%" in text  # (4-1)/(4+4-1)
    svg = ET.fromstring(svg_gantt(grid, config))
    rects = [el for el in svg.iter() if el.tag.endswith("rect")]
    assert len(rects) == 4 * len(grid[0])
    assert sum(rect.get("fill") == "#e6e6e6" for rect in rects) == 4 * 2 * 3  # 3 idle ticks per stage per pass


def test_plan_draws_the_schedule_and_writes_the_svg(tmp_path, capsys):
    svg = tmp_path / "pp.svg"
    assert cli.main(["plan", str(RECIPES / "pp.toml"), "--no-compile", "--gantt", str(svg)]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and any(line.startswith("stage 3 |") for line in out.splitlines())
    assert ET.parse(svg).getroot().tag.endswith("svg")
    assert cli.main(["plan", str(RECIPES / "dp.toml"), "--gantt", str(tmp_path / "dp.svg")]) == 2
    assert "--gantt: the recipe has no pipeline" in capsys.readouterr().err and not (tmp_path / "dp.svg").exists()


# ---- the ppermute helper against a sequential reference ------------------------------------------------------------
@requires_devices(8)
def test_send_moves_each_stage_to_its_target_and_zeros_the_rest():
    mesh = Mesh(np.asarray(jax.devices()).reshape(8), ("pipeline",))
    x = jnp.arange(8 * 3, dtype=jnp.float32).reshape(8, 3)
    pairs = ((0, 1), (1, 2), (5, 6), (7, 0))
    moved = jax.shard_map(lambda s: send(s, pairs), mesh=mesh, in_specs=PartitionSpec("pipeline"),
                          out_specs=PartitionSpec("pipeline"))(x)
    expected = np.zeros((8, 3), np.float32)
    for source, target in pairs:
        expected[target] = np.asarray(x[source])
    np.testing.assert_array_equal(np.asarray(moved), expected)


# ---- validation ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,field", [
    (("model.layers=6",), "model.layers"),
    (("pipeline.microbatches=3",), "pipeline.microbatches"),
    (("pipeline.schedule=circular", "pipeline.repeats=2", "model.layers=4"), "model.layers"),
    (("pipeline.repeats=2",), "pipeline.repeats"),
    (("model.layers=8", "pipeline.schedule=circular", "pipeline.repeats=2", "pipeline.microbatches=2"),
     "pipeline.microbatches"),
])
def test_bad_pipeline_recipes_name_the_field(overrides, field):
    with pytest.raises(ShardkitError, match=field.replace(".", r"\.")):
        build_layout(recipe("pp", *overrides))


def test_bad_pipeline_recipe_exits_2_with_one_line(capsys):
    code = cli.main(["plan", str(RECIPES / "pp.toml"), "--set", "model.layers=6"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "model.layers" in err


def test_fewer_micro_batches_than_stages_warns_with_the_bubble():
    with pytest.warns(PipelineBubbleWarning, match=r"bubble is 60%"):  # (4-1)/(2+4-1)
        build_layout(recipe("pp", "pipeline.microbatches=2"))


# 1F1B trains: its tests (equivalence, memory, bytes, a model it cannot split) are in tests/test_one_f_one_b.py.


# ---- equivalence with one device and the compiled program's collective-permute bytes -------------------------------
CASES = {
    "gpipe": ("pp", ()),
    # 2 stages x 2 repeats of one layer a chunk, m = p: the 4-layer model, so it shares gpipe's one-device reference.
    "circular_v2": ("pp", ("mesh.pipeline=2", "pipeline.schedule=circular", "pipeline.repeats=2",
                           "pipeline.microbatches=2")),
    "pp_fsdp_tp": ("pp_fsdp_tp", ()),
}


def _tokens(r):
    return jax.random.randint(jax.random.key(1), (r.train.global_batch, r.train.seq_len + 1), 0, 256)


def _gradients(r, devices=None):
    layout = build_layout(r, devices)
    params = init_params(layout, seed=0)
    tokens = _tokens(r)
    compiled = jax.jit(build_step(layout).gradients).lower(params, tokens).compile()
    loss, grads = compiled(params, tokens)
    return layout, compiled, float(loss), jax.tree.map(np.asarray, grads)


@functools.cache
def _one_device(layers: int):
    """The one-device reference of a model depth (every case is the 4-layer model: they share it)."""
    return _gradients(recipe("single", f"model.layers={layers}"), jax.devices()[:1])


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    name, overrides = CASES[request.param]
    r = recipe(name, *overrides)
    layout, compiled, loss, grads = _gradients(r)
    _, _, loss_1, grads_1 = _one_device(layout.config.layers)
    return {"layout": layout, "compiled": compiled, "loss": loss, "grads": grads, "loss_1": loss_1,
            "grads_1": grads_1}


@pytest.mark.slow
@requires_devices(8)
def test_pipeline_equals_one_device(case):
    assert case["loss"] == pytest.approx(case["loss_1"], abs=TOLERANCE, rel=TOLERANCE)
    flat_1 = jax.tree_util.tree_flatten_with_path(case["grads_1"])[0]
    flat = dict(jax.tree_util.tree_flatten_with_path(case["grads"])[0])
    for path, expected in flat_1:
        np.testing.assert_allclose(flat[path], expected, atol=TOLERANCE, rtol=TOLERANCE, err_msg=str(path))


@pytest.mark.slow
@requires_devices(8)
def test_collective_permute_bytes_equal_the_analytic_value(case):
    layout = case["layout"]
    config = pipeline_config(layout.recipe)
    expected = collective_permute_bytes(config, microbatch_activation_bytes(layout))
    pipeline_groups = layout.mesh.size // layout.mesh.shape["pipeline"]
    text = case["compiled"].as_text()
    sends = permuted_bytes(text, lambda op_name: op_name.endswith("ppermute"))
    assert sends / pipeline_groups == expected
    if config.repeats == 1:
        # Inside the pipeline region nothing but the sends is permuted. (Outside it XLA may permute weights, e.g. the
        # embedding and head under FSDP x TP.) Circular is left out: its once-per-step re-layout of the stacked
        # weights into chunks (shardkit/pipeline.py) is also collective-permutes, which XLA places at the region.
        assert permuted_bytes(text, lambda op_name: "shard_map" in op_name) == sends


@pytest.mark.slow
@requires_devices(8)
def test_stage_gradients_are_reduced_over_data_once_per_step(case):
    if case["layout"].mesh.shape["data"] == 1:
        pytest.skip("no data-parallel axis in this layout")
    assert_gradients_reduced_over_data_once(case["compiled"], case["layout"])





def test_dropout_masks_differ_between_micro_batches_and_replicas():
    """Identical rows in different micro-batches (and data replicas) must not share dropout masks in the pipeline."""
    from shardkit.nn import dropout, model_context
    from shardkit.pipeline import layer_loop_for

    layout = build_layout(recipe("pp"))  # 4 stages x 2 data replicas, 8 micro-batches
    loop = layer_loop_for(layout)
    layers = layout.config.layers
    stacked = {"scale": jnp.ones((layers, 1, 1, 1))}
    layer = lambda x, state: dropout(x * state["scale"], "test")
    x_BSD = jnp.ones((32, 4, 8))
    with model_context(dropout_rate=0.1, dropout_key=jax.random.key(0)):
        out_BSD = np.asarray(jax.jit(lambda x, s: loop(layer, x, s))(x_BSD, stacked))
    rows = {tuple(row.ravel()) for row in out_BSD}
    assert len(rows) == 32, f"only {len(rows)} distinct masks among 32 rows"
    kept = np.unique(out_BSD[out_BSD > 0])
    np.testing.assert_allclose(kept, 0.9 ** -layers, rtol=1e-6, err_msg="inverted dropout scales what it keeps")


# ---- FSDP inside the pipeline: gathered once per step (pipeline.fsdp_gather) ----------------------------------------
@pytest.mark.slow
@requires_devices(8)
def test_fsdp_gathers_each_stage_once_per_step(case):
    """Under `pipeline.fsdp_gather = "per_step"` (the default) no FSDP collective runs inside the tick loop: every
    all-gather and reduce-scatter over `fsdp` executes once per step. Before, XLA gathered a stage's weights for every
    micro-batch, forward and backward (the 6x of issue 23 on recipes/pp_fsdp_tp.toml)."""
    layout = case["layout"]
    if layout.mesh.shape["fsdp"] == 1:
        pytest.skip("no fsdp axis in this layout")
    summary = hlo.collective_summary(case["compiled"], layout.mesh)
    looped = [op for op in summary.ops if op.kind in ("all-gather", "reduce-scatter") and "fsdp" in op.axes
              and op.count > 1]
    assert not looped, looped


def test_fsdp_gather_is_checked_by_name():
    with pytest.raises(ShardkitError, match=r"pipeline\.fsdp_gather"):
        recipe("pp_fsdp_tp", "pipeline.fsdp_gather=per_tick")


# ---- GPipe's loss region (shardkit.pipeline.gpipe.cross_entropy_for) -----------------------------------------------
ISSUE_23 = ("mesh.pipeline=2", "mesh.fsdp=4", "mesh.tensor=1", "model.embed=512", "model.vocab=8192",
            "train.seq_len=512", "train.global_batch=16")


CONTEXT_2 = ("mesh.tensor=1", "mesh.sequence=2")


@requires_devices(8)
def test_gpipe_loss_region_runs_where_the_region_gathers_per_step():
    """The loss region takes 1/p of a replica's sequences under gpipe with the per-step gather (issue 23's
    configuration: 4 sequences a replica, 2 each stage, 256-row chunks of their 1024 rows); the automatic loss stays
    under per_use (no `fsdp` in the region) and the 1F1B family (its loss is in the last stage)."""
    from shardkit.analysis.predicted.memory_terms import loss_chunk_rows
    from shardkit.pipeline import gpipe

    layout = build_layout(recipe("pp_fsdp_tp", *ISSUE_23))
    assert gpipe.loss_stage_rows(layout) == 2 and gpipe.cross_entropy_for(layout) is not None
    assert loss_chunk_rows(layout) == gpipe.LOSS_CHUNK_ROWS
    for other in ("pipeline.fsdp_gather=per_use", "pipeline.schedule=1f1b"):
        layout = build_layout(recipe("pp_fsdp_tp", *ISSUE_23, other))
        assert gpipe.loss_stage_rows(layout) is None and gpipe.cross_entropy_for(layout) is None, other


@requires_devices(8)
@pytest.mark.parametrize("vocab, seq, mesh", [(256, 64, ()), (258, 64, ()), (256, 128, CONTEXT_2)],
                         ids=["head_split_by_vocab", "head_gathered", "context_parallel"])
def test_gpipe_loss_region_equals_the_lean_loss(vocab, seq, mesh):
    """The loss region's sum and its gradients (hidden state, head) equal `shardkit.loss.cross_entropy_sum`'s on the
    whole batch, fp32, to 1e-5: with the head split over `fsdp` by vocabulary (256), and gathered where `fsdp` x
    `tensor` does not divide the vocabulary (258); under context parallelism, each context rank taking its own
    positions (the region manual over `sequence`); two 256-row chunks a stage each way (32 sequences)."""
    from shardkit.loss import cross_entropy_sum
    from shardkit.pipeline import gpipe

    layout = build_layout(recipe("pp_fsdp_tp", f"model.vocab={vocab}", "train.global_batch=32",
                                 f"train.seq_len={seq}", *mesh))
    region_loss = gpipe.cross_entropy_for(layout)
    keys = jax.random.split(jax.random.key(0), 3)
    hidden_BSD = jax.random.normal(keys[0], (32, seq, layout.config.embed))
    head_DV = jax.random.normal(keys[1], (layout.config.embed, vocab)) / 8
    targets_BS = jax.random.randint(keys[2], (32, seq), 0, vocab)

    def value_and_grads(loss_fn):
        return jax.jit(jax.value_and_grad(lambda h, w: loss_fn(h, w, targets_BS, jnp.float32), argnums=(0, 1)))(
            hidden_BSD, head_DV)

    loss, grads = value_and_grads(region_loss)
    want_loss, want_grads = value_and_grads(cross_entropy_sum)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want, name in zip(grads, want_grads, ("hidden", "head")):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()), err_msg=name)
