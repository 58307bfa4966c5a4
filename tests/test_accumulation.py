"""FSDP with gradient accumulation, `train.fsdp_sync = "per_step"`: parameters gathered once per step, gradients
reduced once per step, and still the same training as one device.

The default, "per_microbatch", is pinned by tests/test_inspect.py (`test_fsdp_accumulation_gathers_per_micro_batch`):
there the layer loop gathers each layer's weights in every micro-batch, forward and backward. Here the step must
gather a replica's parameters once, before the micro-batch loop, and reduce the accumulated gradients once, after it.

Figures: the tiny Llama, fp32, 8 fake CPU devices, 4 micro-batches of 8 rows. Collective counts are executions per
step (loop bodies multiplied by their trip counts). XLA:CPU reduces gradients with all-reduce (+ dynamic-slice) where
XLA:GPU emits reduce-scatter, so a "gradient reduction" is all-reduce + reduce-scatter bytes.

Equivalence tolerance: fp32, 1e-5 relative (the suite's rule, see tests/test_equivalence.py): only the order of fp32
sums changes, while a reduction missed or done twice, or a wrong scale, is off by tens of percent.
"""

from __future__ import annotations

import math

import jax
import pytest

from shardkit.analysis.compiled import hlo as si
from shardkit.analysis.predicted.estimate import communication_estimate, memory_estimate
from shardkit.analysis.predicted.memory_terms import replica_param_bytes
from shardkit.cli import main
from shardkit.layout import build_layout
from shardkit.microbatch import replica_axes
from shardkit.step import build_step
from tests.equivalence import assert_traces_close, trace
from tests.helpers import recipe

FP32_RTOL = 1e-5
BATCH32 = "train.global_batch=32"
PER_STEP = (BATCH32, "train.grad_accum=4", "train.fsdp_sync=per_step")
STEPS = 2  # the second step's loss is taken after the first update, from the gathered-once parameters


def _collectives(layout, compiled):
    return si.hlo_summary(compiled, layout.mesh).collectives


def _per_step_run(name: str, *overrides: str):
    """(layout, trace, collectives) of a per-step recipe: one compile serves the equivalence and the HLO tests."""
    per_step = recipe(name, *overrides, *PER_STEP)
    layout, run = build_layout(per_step), trace(per_step, steps=STEPS)
    return layout, run, _collectives(layout, run.compiled)


def _param_bytes(layout) -> int:
    return sum(math.prod(leaf.shape) * 4 for leaf in jax.tree.leaves(layout.abstract_params))


def _reduced_bytes(collectives, axes) -> float:
    return collectives.bytes("all-reduce", axes) + collectives.bytes("reduce-scatter", axes)


@pytest.fixture(scope="module")
def single():
    return trace(recipe("single", BATCH32), steps=STEPS, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def fsdp():
    return _per_step_run("fsdp")


@pytest.fixture(scope="module")
def fsdp_tp():
    return _per_step_run("fsdp_tp")


@pytest.fixture(scope="module")
def data_fsdp():
    layout = build_layout(recipe("fsdp", "mesh.data=2", *PER_STEP))  # data 2 x fsdp 4
    return layout, None, _collectives(layout, build_step(layout).compile())


# ---- collectives ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_fsdp_gathers_parameters_once_per_step(fsdp):
    """One all-gather of every parameter, outside any loop: 1.00x the parameter bytes (the default gathers 7.3x:
    the layer weights forward and backward in each of the 4 micro-batches). The token batch is not gathered: each
    replica reads its own rows."""
    layout, _, collectives = fsdp
    gathers = collectives.select("all-gather", ("fsdp",))
    assert gathers and all(op.count == 1 for op in gathers), [(op.count, op.op_name) for op in gathers]
    assert collectives.bytes("all-gather") == _param_bytes(layout)


@pytest.mark.slow
def test_fsdp_reduces_gradients_once_per_step(fsdp):
    """The accumulated gradients are reduced once, after the loop (parameter bytes; scalars such as the loss add a
    few bytes), and nothing crosses the fsdp axis inside the micro-batch loop: no op runs more than once per step."""
    layout, _, collectives = fsdp
    assert _reduced_bytes(collectives, ("fsdp",)) == pytest.approx(_param_bytes(layout), rel=1e-3)
    assert all(op.count == 1 for op in collectives.select(axes=("fsdp",)))
    assert collectives.count("all-to-all") == 0  # the embedding lookup reads the gathered table


@pytest.mark.slow
def test_fsdp_tp_gathers_and_reduces_a_tensor_shard_once_per_step(fsdp_tp):
    """Under fsdp 2 x tensor 4 a replica's parameters are the tensor shards: fsdp collectives move exactly those bytes,
    once each, while the tensor all-reduces of activations stay in the micro-batch loop where they belong."""
    layout, _, collectives = fsdp_tp
    replica = replica_param_bytes(layout, 4)
    assert _param_bytes(layout) / 4 < replica < _param_bytes(layout) / 3  # tensor shards plus the unsharded norms
    assert collectives.bytes("all-gather", ("fsdp",)) == replica
    assert _reduced_bytes(collectives, ("fsdp",)) == pytest.approx(replica, rel=1e-3)
    assert all(op.count == 1 for op in collectives.select(axes=("fsdp",)))
    assert collectives.count("all-reduce", ("tensor",)) >= 4 * layout.config.layers * 4  # 4 per layer per micro-batch


@pytest.mark.slow
def test_data_and_fsdp_reduce_gradients_once_over_both(data_fsdp):
    """data 2 x fsdp 4: both axes accumulate per replica; one gather over fsdp, one gradient reduction over both."""
    layout, _, collectives = data_fsdp
    assert replica_axes(layout) == ("data", "fsdp")
    assert collectives.bytes("all-gather", ("fsdp",)) == _param_bytes(layout)
    assert _reduced_bytes(collectives, ("data", "fsdp")) == pytest.approx(_param_bytes(layout), rel=1e-3)
    assert all(op.count == 1 for op in collectives.select(axes=("fsdp",)) + collectives.select(axes=("data", "fsdp")))


@pytest.mark.slow
def test_estimate_models_the_per_step_gather_and_its_memory(fsdp_tp):
    """The analytic model: one gather of a replica's parameters (within 1% of the compiled bytes; it counts the
    norms as tensor-sharded), and a gathered copy plus two unreduced fp32 gradient buffers of that size in memory."""
    layout, _, collectives = fsdp_tp
    (gather,) = [item for item in communication_estimate(layout) if item.kind == "all-gather"]
    assert gather.bytes == pytest.approx(collectives.bytes("all-gather", ("fsdp",)), rel=0.01)
    memory = memory_estimate(layout)
    replica = replica_param_bytes(layout, 4)
    assert (memory.gathered_params, memory.gradients) == (replica, 2 * replica)
    default = memory_estimate(build_layout(recipe("fsdp_tp", BATCH32, "train.grad_accum=4")))
    assert default.gathered_params < memory.gathered_params and default.gradients < memory.gradients


# ---- equivalence ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "fsdp_tp"])
def test_per_step_matches_one_device(name, request, single):
    _, run, _ = request.getfixturevalue(name)
    assert_traces_close(run, single, FP32_RTOL)


# ---- validation -----------------------------------------------------------------------------------------------------
def test_bad_value_exits_2_naming_the_field_and_the_choices(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "recipes/fsdp.toml", "--out", str(out), "--set", "train.fsdp_sync=sometimes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train.fsdp_sync" in err and "'per_microbatch', 'per_step'" in err, err
    assert not out.exists()


def test_without_accumulation_or_fsdp_nothing_changes():
    assert replica_axes(build_layout(recipe("fsdp", "train.fsdp_sync=per_step"))) == ()
    assert replica_axes(build_layout(recipe("dp", *PER_STEP))) == ("data",)
    assert replica_axes(build_layout(recipe("fsdp", BATCH32, "train.grad_accum=4"))) == ()
