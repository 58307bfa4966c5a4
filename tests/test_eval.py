"""Held-out evaluation (`[eval]`): the same under every layout, logged in metrics.jsonl and on the progress output,
and bad settings refused."""

from __future__ import annotations

import io
import json

import jax
import numpy as np
import pytest

from shardkit.cli import main
from shardkit.errors import ShardkitError
from shardkit.run.loop import train
from tests.helpers import recipe

EVAL = ("train.steps=4", "eval.every=2", "eval.batches=2")
LAYOUT_TOLERANCE = 1e-5  # fp32; layouts sum in different orders


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 steps, evaluated after steps 2 and 4, on one device and under FSDP over 8."""
    out = {}
    for name, devices in (("single", 1), ("fsdp", 8)):
        log = io.StringIO()
        run = tmp_path_factory.mktemp(name)
        result = train(recipe(name, *EVAL), run, log=log, devices=jax.devices()[:devices])
        out[name] = (run, result.records, log.getvalue())
    return out


@pytest.mark.slow
def test_eval_loss_is_the_same_under_every_layout(runs):
    reference = [record["eval_loss"] for record in runs["single"][1] if "eval_loss" in record]
    assert len(reference) == 2 and reference[1] < reference[0]
    losses = [record["eval_loss"] for record in runs["fsdp"][1] if "eval_loss" in record]
    np.testing.assert_allclose(losses, reference, rtol=0, atol=LAYOUT_TOLERANCE)


@pytest.mark.slow
def test_eval_is_logged(runs):
    run, records, log = runs["fsdp"]
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in logged if "eval_loss" in line] == [2, 4]
    assert all(abs(line["eval_ppl"] - np.exp(line["eval_loss"])) < 1e-6 * line["eval_ppl"] for line in logged
               if "eval_loss" in line)
    assert "eval at step 2  loss " in log and "eval at step 4  loss " in log


@pytest.mark.parametrize("override, field", [("eval.every=-1", "eval.every"), ("eval.batches=0", "eval.batches")])
def test_bad_eval_settings_are_refused(override, field):
    with pytest.raises(ShardkitError, match=f"^{field}: "):
        recipe("single", override)


def test_missing_eval_path_is_refused(tmp_path, capsys):
    args = ["train", "recipes/fsdp.toml", "--out", str(tmp_path / "run"), "--set", "eval.every=1",
            "--set", "eval.path=nothing.bin"]
    assert main(args) == 2
    assert capsys.readouterr().err.startswith("shardkit: error: eval.path: ")
    assert not (tmp_path / "run").exists()
