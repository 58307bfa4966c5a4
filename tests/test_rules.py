"""The rules engine on its own: shorthands, raw tables, ZeRO tables, and strict resolution (no devices needed)."""

from __future__ import annotations

import pytest
from jax.sharding import PartitionSpec

from shardkit.errors import ShardkitError
from shardkit.recipe import recipe_from_tables
from shardkit.rules import build_rules, resolve_spec

SIZES = {"pipeline": 1, "data": 2, "fsdp": 2, "expert": 1, "sequence": 1, "tensor": 2}


def _rules(**rules):
    return build_rules(recipe_from_tables({"rules": rules}).rules)


def test_shorthand_names_exactly_what_goes_to_the_axis():
    rules = _rules(tensor=["heads", "mlp"])
    assert rules.params["heads"] == ("tensor",) and rules.activations["mlp"] == ("tensor",)
    assert "tensor" not in rules.params["vocab"] and "tensor" not in rules.params["kv_heads"]


def test_fsdp_shorthand_touches_parameters_only():
    """The context and expert ranks are FSDP ranks too: they follow the shorthand's names."""
    rules = _rules(fsdp=["mlp"])
    assert rules.params["mlp"] == ("tensor", "fsdp", "sequence", "expert") and rules.params["embed"] == ()
    assert rules.params["experts"] == ("expert",), "a rule leading with an axis keeps it"
    assert rules.activations["batch"] == ("data", "fsdp", "expert"), "the batch is still split over fsdp replicas"


def test_raw_table_wins_over_shorthand():
    rules = _rules(tensor=["heads"], params={"heads": []})
    assert rules.params["heads"] == () and rules.activations["heads"] == ("tensor",)


@pytest.mark.parametrize("zero, optimizer, gradients", [(0, (), ()), (1, ("data",), ()), (2, ("data",), ("data",))])
def test_zero_stages_shard_optimizer_state_then_gradients_over_data(zero, optimizer, gradients):
    rules = _rules(zero=zero, fsdp=["embed"])
    fsdp = ("fsdp", "sequence", "expert")
    assert rules.params["embed"] == fsdp
    assert rules.optimizer["embed"] == optimizer + fsdp
    assert rules.gradients["embed"] == gradients + fsdp


def test_parameters_are_sharded_over_the_context_and_expert_ranks_too():
    """Every rank that would hold a replica is an FSDP rank: `embed` over fsdp, sequence and expert; the experts'
    weights keep `expert` on their `experts` dimension (their embed yields it); a raw rule says otherwise."""
    sizes = dict(SIZES, data=1, fsdp=2, expert=2, sequence=2, tensor=1)
    params = _rules().params
    spec = resolve_spec("w", (8, 4), ("embed", "mlp"), params, sizes)
    assert spec == PartitionSpec(("fsdp", "sequence", "expert"), None)
    spec = resolve_spec("experts", (2, 8, 4), ("experts", "embed", "mlp"), params, sizes)
    assert spec == PartitionSpec("expert", ("fsdp", "sequence"), None)
    only_fsdp = _rules(params={"embed": ["fsdp"]}).params
    assert resolve_spec("w", (8, 4), ("embed", "mlp"), only_fsdp, sizes) == PartitionSpec("fsdp", None)
    with pytest.raises(ShardkitError, match="used twice"):  # activations stay strict
        resolve_spec("a", (2, 8), ("experts", "embed"), {"experts": ("expert",), "embed": ("fsdp", "expert")}, sizes,
                     "activations")


def test_resolution_drops_size_one_axes_and_joins_several():
    table = {"embed": ("data", "fsdp"), "mlp": ("tensor", "sequence")}
    spec = resolve_spec("w", (8, 4), ("embed", "mlp"), table, SIZES)
    assert spec == PartitionSpec(("data", "fsdp"), "tensor")


def test_a_size_one_axis_used_twice_is_still_an_error():
    """A misconfigured rule is wrong whatever the device count: checked before size-1 axes are dropped."""
    table = {"embed": ("sequence",), "mlp": ("sequence",)}
    with pytest.raises(ShardkitError, match="used twice"):
        resolve_spec("w", (8, 4), ("embed", "mlp"), table, SIZES)
