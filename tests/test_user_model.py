"""A user's own model plugs in by `module:Class`, without touching shardkit: plan, train, and match one device."""

from __future__ import annotations

import jax
import pytest

from shardkit.layout import build_layout
from shardkit.testing import sharding_specs
from tests.equivalence import assert_traces_close, trace
from tests.helpers import recipe

USER_MODEL = "model.name=tests.toy_models:UserModel"


def test_user_model_is_sharded_by_the_recipe():
    specs = sharding_specs(build_layout(recipe("fsdp_tp", USER_MODEL)))
    assert specs["layers/w_in_DF"] == [None, "fsdp", "tensor"]
    assert specs["embedding_VD"] == ["tensor", "fsdp"]


@pytest.mark.slow
def test_user_model_trains_like_one_device():
    """fp32, the suite's 1e-5 (see tests/test_equivalence.py for why that bound is safe)."""
    reference = trace(recipe("single", USER_MODEL), devices=jax.devices()[:1])
    assert_traces_close(trace(recipe("fsdp_tp", USER_MODEL)), reference, rtol=1e-5)
    assert reference.losses[-1] < reference.losses[0]
