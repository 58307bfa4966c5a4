"""Mixture of experts: expert-parallel layouts train like one device, the all-to-all moves what the analytic model
says, bad input is one line, and the load-balancing loss balances a skewed router.

Tolerance: fp32, 1e-5 as in tests/test_equivalence.py (its docstring says why). Expert parallelism changes where a
(token, expert) product is computed and the order of the data-parallel gradient sums, not what is summed: the routed
tokens' outputs are the same dot products as the one-device grouped matmul, so the differences are fp32 roundoff.
bf16: BF16_RTOL as in tests/test_equivalence.py, for the MoE recipes trained through the CLI under the bf16 policy.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardkit.analysis.compiled.hlo import collective_summary
from shardkit.cli import main
from shardkit.data.source import TokenSource
from shardkit.layout import build_layout
from shardkit.moe import all_to_all_bytes, assign_slots, expert_placement
from shardkit.step import build_step
from tests.equivalence import BF16_RTOL, Trace, assert_traces_close, flatten, trace
from tests.helpers import recipe, shardkit_commands

FP32_RTOL = 1e-5
MOE = ("model.name=moe", "model.preset=moe-tiny")
# The equivalence traces read the first-batch gradients back from the first step (tests/equivalence.py's `trace`):
# each layout compiles evaluation and the step, not the gradients again.
STEPS = 3
CAPACITY = ("model.routing=capacity", "model.capacity_factor=1.0")


@pytest.fixture(scope="module")
def single():
    return trace(recipe("single", *MOE), steps=STEPS, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def moe_ep():
    return trace(recipe("moe_ep"), steps=STEPS)


def test_moe_ep_matches_one_device(moe_ep, single):
    assert_traces_close(moe_ep, single, FP32_RTOL)


@pytest.mark.slow
def test_moe_ep_fsdp_matches_one_device(single):
    assert_traces_close(trace(recipe("moe_ep_fsdp"), steps=STEPS), single, FP32_RTOL)


@pytest.mark.slow
def test_moe_in_a_pipeline_matches_one_device(single):
    """The dropless MoE model in a GPipe pipeline of 2 stages (pp.toml cut to `mesh.pipeline=2`, data 4), 2 layers
    a stage (the stages' scan over layers), 2 micro-batches: the router statistics travel through the stages with the
    residual stream. Experts not split here; split over `expert` inside the stages, with capacity routing, under
    GPipe, 1F1B and zero bubble (the 1F1B family's per-chunk statistics and auxiliary-loss share summed stage by
    stage, its gradient split between the B and W ticks): tests/test_five_d.py's
    test_expert_parallelism_inside_a_pipeline_is_one_device, which holds that zero-bubble case."""
    r = recipe("pp", *MOE, "mesh.pipeline=2", "pipeline.microbatches=2")
    assert_traces_close(trace(r, steps=STEPS), single, FP32_RTOL)


def test_all_to_all_bytes_are_the_analytic_figure(moe_ep):
    """Dispatch and combine, forward and backward: 4 all-to-alls per MoE layer of each rank's dispatch buffer, over
    `expert` only; and no expert weight is all-gathered (the other weights are, over `expert`: its ranks are FSDP
    ranks of the non-expert weights)."""
    layout = moe_ep.builder.layout
    collectives = collective_summary(moe_ep.compiled, layout.mesh)
    cfg, train = layout.config, layout.recipe.train
    rows = train.global_batch // (layout.mesh.shape["data"] * layout.mesh.shape["expert"])
    # Dropless: S slots per expert per sequence, so a buffer is rows x experts x S x embed, fp32.
    buffer = rows * cfg.experts * train.seq_len * cfg.embed * 4
    assert all_to_all_bytes(layout) == 4 * cfg.moe_layers * buffer
    dispatch = [op for op in collectives.select("all-to-all") if "shard_map" in op.op_name]
    assert sum(op.count * op.bytes for op in dispatch) == all_to_all_bytes(layout)
    assert all(op.axes == ("expert",) for op in dispatch), "no dispatch all-to-all over other axes"
    # The others exchange the embedding's looked-up rows (the table is split over `expert` by embed, as under FSDP).
    rows_bytes = rows * train.seq_len * cfg.embed * 4
    assert collectives.bytes("all-to-all") - all_to_all_bytes(layout) <= 2 * rows_bytes
    gathered = re.findall(r"= (.*?) all-gather(?:-start)?\(", moe_ep.compiled.as_text())  # the results' shapes
    assert any("expert" in (op.axes or ()) for op in collectives.select("all-gather")), "non-expert weights"
    for dims in ((cfg.experts, cfg.embed, cfg.mlp), (cfg.experts, cfg.mlp, cfg.embed)):
        assert not [shape for shape in gathered if "{},{},{}]".format(*dims) in shape], gathered


def test_plan_places_experts_on_ranks(moe_ep):
    placement = expert_placement(moe_ep.builder.layout)
    assert placement["axis"] == "expert" and placement["placement"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.slow
def test_capacity_routing_matches_one_device_with_the_same_rule():
    """Capacity 1.0 drops choices; expert parallelism drops exactly those a device running the same rule drops."""
    want_loss, want_grads, want_dropped = _first_batch(recipe("single", *MOE, *CAPACITY), jax.devices()[:1])
    got_loss, got_grads, got_dropped = _first_batch(recipe("moe_ep", *CAPACITY))
    assert_traces_close(got_grads, want_grads, FP32_RTOL)
    np.testing.assert_allclose(got_loss, want_loss, rtol=FP32_RTOL)
    assert got_dropped == want_dropped and 0 < want_dropped < 0.5, (got_dropped, want_dropped)


def _first_batch(r, devices=None) -> tuple[float, Trace, float]:
    """The loss, the gradients (as a Trace without steps) and the fraction of choices capacity routing dropped, on
    the first batch at the initial parameters: one compile of `gradients_with_aux` gives all three (tracing the
    gradients apart from it would compile the same backward twice)."""
    builder = build_step(build_layout(r, devices))
    params = builder.init_state(r.train.seed)["params"]
    source = TokenSource(r.data, builder.layout.config.vocab, r.train.seq_len, r.train.seed)
    tokens = source.global_batch(0, r.train.global_batch, builder.batch_sharding())
    loss, grads, aux = jax.jit(builder.gradients_with_aux)(params, tokens)
    return float(loss), Trace(np.zeros(0), flatten(grads)), float(aux["dropped"] / aux["choices"])


def test_capacity_slots_put_first_choices_first():
    expert_SK = jnp.array([[0, 1], [0, 2], [0, 1], [2, 0]])
    slot_SK = assign_slots(expert_SK, experts=3, slots=2)
    # First choices: expert 0 gets tokens 0, 1 (slots 0, 1) and drops token 2 (slot 2 = dropped); expert 2 gets
    # token 3 (slot 0). Then second choices: expert 1 gets tokens 0, 2; expert 2 token 1 (slot 1); expert 0 is full.
    np.testing.assert_array_equal(slot_SK, [[0, 0], [1, 1], [2, 1], [0, 2]])


BAD = {
    "expert_not_dividing": (("[model]\nname = \"moe\"\n[mesh]\nexpert = 4\ndata = -1\n", ["model.experts=6"]),
                            "mesh.expert", "4 expert ranks cannot hold model.experts = 6"),
    "top_k_above_experts": (("[model]\nname = \"moe\"\n[mesh]\ndata = -1\n", ["model.top_k=9"]), "model",
                            "top_k (9) must be at most model.experts (8)"),
    "experts_without_experts": (("[mesh]\ndata = -1\n[rules]\nexpert = \"experts\"\n", []), "rules.expert",
                                "has no experts"),
    "expert_axis_without_experts": (("[mesh]\nexpert = 2\ndata = -1\n", []), "mesh.expert", "has no experts"),
    "capacity_routing_in_1f1b_with_context": (("[model]\nname = \"moe\"\nrouting = \"capacity\"\n[mesh]\n"
                                               "pipeline = 2\nsequence = 2\ndata = -1\n[pipeline]\n"
                                               "schedule = \"1f1b\"\nmicrobatches = 2\n", []), "model.routing",
                                              "load-balanced order"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_exits_2_with_one_line(case, tmp_path, capsys):
    (text, overrides), field, fragment = BAD[case]
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    argv = ["plan", str(bad), "--no-compile"]
    for override in overrides:
        argv += ["--set", override]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"shardkit: error: {field}") and fragment in err, err


def test_balance_loss_balances_a_skewed_router():
    """Every token's input leans along one direction that the router maps onto expert 0: nearly all first choices go
    there. A large balance weight pulls the load back toward uniform within a few steps."""
    layout = build_layout(recipe("single", *MOE, "model.aux_loss_weight=1.0", "model.layers=1", "optimizer.lr=0.01",
                                 "optimizer.warmup=0"), jax.devices()[:1])
    builder = build_step(layout)
    state = _skewed(builder.init_state(0), layout.config)
    compiled = builder.compile()
    source = TokenSource(layout.recipe.data, layout.config.vocab, layout.recipe.train.seq_len, 0)
    history = []
    for step in range(12):
        state, metrics = compiled(state, source.global_batch(step, layout.recipe.train.global_batch,
                                                             builder.batch_sharding()))
        history.append((float(metrics["moe_balance_loss"]), float(metrics["moe_load_max"])))
    (first_balance, first_max), (last_balance, last_max) = history[0], history[-1]
    tokens = layout.recipe.train.global_batch * layout.recipe.train.seq_len
    uniform = tokens * layout.config.top_k / layout.config.experts
    assert first_max > 2.5 * uniform, f"the router is not skewed: {history}"
    assert last_balance < 1 + (first_balance - 1) / 3, history
    assert last_max < 0.6 * first_max, history


def _skewed(state, cfg):
    """Add a shared direction u to every embedding and point expert 0's router column along it."""
    u_D = jax.random.normal(jax.random.key(7), (cfg.embed,))
    u_D = u_D / jnp.linalg.norm(u_D)
    params = jax.tree.map(jnp.copy, state["params"])
    params["embedding_VD"] = params["embedding_VD"] + 2.0 * u_D[None, :]
    router_LDX = params["blocks"]["moe"]["router"]["w_DX"]
    params["blocks"]["moe"]["router"]["w_DX"] = router_LDX.at[:, :, 0].add(u_D[None, :])
    return {**state, "params": params}


@functools.cache
def _one_device_bf16(steps: int) -> dict[str, list[float]]:
    """Loss and gradient norm of the first `steps` steps of the MoE model on one device under the bf16 policy (run
    once for the module: both recipes are held to it)."""
    r = recipe("single", *MOE, "precision.policy=bf16", f"train.steps={steps}")
    builder = build_step(build_layout(r, jax.devices()[:1]))
    state, compiled = builder.init_state(r.train.seed), builder.compile()
    source = TokenSource(r.data, builder.layout.config.vocab, r.train.seq_len, r.train.seed)
    metrics = {"loss": [], "grad_norm": []}
    for step in range(steps):
        state, out = compiled(state, source.global_batch(step, r.train.global_batch, builder.batch_sharding()))
        for key in metrics:
            metrics[key].append(float(out[key]))
    return metrics


BF16_RECIPES, BF16_STEPS = ("moe_ep", "moe_ep_fsdp"), 3


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory) -> dict[str, tuple]:
    """`shardkit train recipes/NAME.toml --devices 8 --steps 3 --set precision.policy=bf16` for each of BF16_RECIPES,
    one after the other in one fresh process, as `shardkit` runs them (`tests.helpers.shardkit_commands`). Per name:
    (exit code, stderr tail, --out)."""
    outs = {name: tmp_path_factory.mktemp(name) / "run" for name in BF16_RECIPES}
    argvs = [["train", f"recipes/{name}.toml", "--devices", "8", "--steps", str(BF16_STEPS), "--out", str(outs[name]),
              "--set", "precision.policy=bf16"] for name in BF16_RECIPES]
    results = shardkit_commands(argvs)
    return {name: (code, stderr, outs[name]) for name, (code, _, stderr) in zip(BF16_RECIPES, results)}


@pytest.mark.slow
@pytest.mark.parametrize("name", BF16_RECIPES)
def test_moe_recipes_train_in_bf16_on_cpu(name, bf16_runs):
    """`shardkit train recipes/moe_ep*.toml --devices 8 --set precision.policy=bf16` compiles (no XLA:CPU abort: the
    expert weights' gradient psum inside the expert region sums in fp32 on CPU, see `shardkit.manual.to_varying`) and
    trains like one device within the bf16 bound. Run in a fresh process, as a user runs it, since an abort would end
    pytest's."""
    code, stderr, out = bf16_runs[name]
    assert code == 0, stderr
    got = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = _one_device_bf16(BF16_STEPS)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([row[key] for row in got], want[key], rtol=BF16_RTOL, atol=0, err_msg=key)
