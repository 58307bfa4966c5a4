"""Logging (shardkit.run.metrics): TensorBoard and W&B get the scalars of metrics.jsonl, only process 0 writes, and
the metrics pipe fetches off the loop's thread without changing a record."""

from __future__ import annotations

import io
import json
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shardkit.errors import ShardkitError
from shardkit.run import loop
from shardkit.run.metrics import TENSORBOARD_DIR, EvalOutput, MetricsPipe, StepOutput, WandbLog, scalars
from tests.helpers import recipe

SMALL = ("train.steps=4", "train.global_batch=4", "train.seq_len=16", "eval.every=2", "eval.batches=1")


def _jsonl(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 4 steps with the asynchronous metrics pipe (default) and with the loop fetching each step itself."""
    outs = {}
    for mode in ("true", "false"):
        out = tmp_path_factory.mktemp(f"async-{mode}")
        loop.train(recipe("single", *SMALL, f"logging.async_metrics={mode}"), out, log=io.StringIO(),
                   devices=jax.devices()[:1])
        outs[mode] = out
    return outs


@pytest.mark.slow
def test_tensorboard_reader_returns_the_losses_of_metrics_jsonl(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = runs["true"]
    records = _jsonl(out)
    events = EventAccumulator(str(out / TENSORBOARD_DIR))
    events.Reload()
    for tag in ("loss", "grad_norm", "lr", "tokens_per_s", "step_time_s", "eval_loss"):
        logged = {record["step"]: record[tag] for record in records if tag in record}
        read = {event.step: event.value for event in events.Scalars(tag)}
        assert read.keys() == logged.keys(), tag
        # event files hold float32: the jsonl value rounded to float32 is what TensorBoard must show
        np.testing.assert_array_equal([read[s] for s in logged], np.float32([logged[s] for s in logged]), err_msg=tag)
    assert set(events.Tags()["scalars"]) == set().union(*(scalars(record) for record in records))


@pytest.mark.slow
def test_async_metrics_change_no_value(runs):
    """The pipe only moves where the fetch happens: the same losses, the eval joined to the same step."""
    fetched, waited = _jsonl(runs["true"]), _jsonl(runs["false"])
    assert [r["step"] for r in fetched] == [1, 2, 3, 4]
    timing = ("step_time_s", "tokens_per_s")
    strip = lambda records: [{k: v for k, v in r.items() if k not in timing} for r in records]
    assert strip(fetched) == strip(waited)
    assert [r["step"] for r in fetched if "eval_loss" in r] == [2, 4]


def _pipe(sinks, asynchronous, check=lambda record: None):
    finish = lambda output, values, seconds: {"step": output.step, **values, "step_time_s": seconds}
    return MetricsPipe(finish, sinks, check, asynchronous)


class _Collect:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("asynchronous", [True, False])
def test_pipe_writes_in_step_order_with_eval_merged(asynchronous):
    sink = _Collect()
    pipe = _pipe([sink], asynchronous)
    for step in range(5):
        pipe.submit(StepOutput(step, {"loss": jnp.float32(step)}, 0.0))
        if step == 2:
            pipe.submit(EvalOutput(step, {"eval_loss": 7.0}))
    pipe.drain()
    pipe.close()
    assert [r["step"] for r in sink.records] == list(range(5)) and sink.closed
    assert [r.get("eval_loss") for r in sink.records] == [None, None, 7.0, None, None]
    assert pipe.records == sink.records


@pytest.mark.parametrize("asynchronous", [True, False])
def test_a_nan_record_is_written_then_stops_the_run_at_drain(asynchronous):
    """A NaN step is logged, then its error reaches the loop's thread no later than the drain before a save."""

    def check(record):
        if not np.isfinite(record["loss"]):
            raise ShardkitError("train", f"loss is nan at step {record['step']}")

    sink = _Collect()
    pipe = _pipe([sink], asynchronous, check)
    with pytest.raises(ShardkitError, match="at step 1"):
        for step, loss in enumerate([1.0, float("nan"), 2.0]):
            pipe.submit(StepOutput(step, {"loss": jnp.float32(loss)}, 0.0))
        pipe.drain()
    pipe.close()
    assert [r["step"] for r in sink.records] == [0, 1]  # nothing after the failed record


def test_only_process_0_writes(tmp_path, monkeypatch):
    run = types.SimpleNamespace(recipe=recipe("single"), out_dir=tmp_path, log=io.StringIO())
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert loop._sinks(run, 0) == []
    assert not any(tmp_path.iterdir())


def test_wandb_gets_the_scalars_of_each_record(tmp_path, monkeypatch):
    """With a stand-in wandb module: the resolved recipe as config, one log call per record with its step."""
    calls = {}

    class Run:
        def log(self, values, step):
            calls.setdefault("log", []).append((step, values))

        def finish(self):
            calls["finished"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    section = recipe("single", "logging.wandb=true", "logging.wandb_mode=offline").logging
    sink = WandbLog(tmp_path, section, {"train": {"steps": 3}})
    record = {"step": 2, "loss": 1.5, "lr": 0.1, "tokens_per_s": 10}
    sink.write(record)
    sink.close()
    assert calls["log"] == [(2, {"loss": 1.5, "lr": 0.1, "tokens_per_s": 10.0})] and calls["finished"]
    assert calls["init"]["mode"] == "offline" and calls["init"]["config"] == {"train": {"steps": 3}}
    again = WandbLog(tmp_path, section, {})  # a resumed run continues the same W&B run
    assert calls["init"]["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    again.close()


def test_wandb_missing_is_one_line_before_the_run(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ShardkitError, match=r"pip install 'shardkit\[wandb\]'") as caught:
        loop.train(recipe("single", "logging.wandb=true"), tmp_path / "run", log=io.StringIO(),
                   devices=jax.devices()[:1])
    assert caught.value.field == "logging.wandb" and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_wandb_offline_run_needs_no_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    loop.train(recipe("single", "train.steps=2", "train.global_batch=4", "train.seq_len=16", "logging.wandb=true",
                      "logging.wandb_mode=offline"), out, log=io.StringIO(), devices=jax.devices()[:1])
    run_id = (out / "wandb_run_id").read_text().strip()
    assert list((out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
