"""Checkpoints in one process: resume onto another layout or device count, compatibility errors, partial checkpoints,
non-finite losses, and export round trips. (Kills and signals, which need subprocesses, are in test_preemption.py.)"""

from __future__ import annotations

import gc
import io
import json
import os
import shutil
import signal
import sys
import time
import types
import unittest.mock

import jax
import ml_dtypes
import numpy as np
import pytest

from shardkit import cli
from shardkit.errors import ShardkitError
from shardkit.hf.export import _write_array, load_export
from shardkit.layout import build_layout, path_str
from shardkit.precision import PRESETS, parse_policy
from shardkit.run import checkpoint
from shardkit.run.checkpoint import Checkpointer, check_compatible, model_meta, state_kind
from shardkit.run.loop import Agreed, NonFiniteLoss, SaveClock, StopRequested, _raise_if_not_finite, agree, train
from shardkit.step import build_step
from shardkit.testing import requires_devices
from tests.helpers import recipe

STEPS, EVERY = 4, 2
# A small batch of short rows: the checks are of checkpoints and layouts, not of learning.
BASE = ("model.preset=tiny", f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=5",
        "train.global_batch=8", "train.seq_len=16")
LAYOUT_TOLERANCE = 1e-5  # another layout sums in another order; fp32 losses agree to ~1e-6 after a few steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An fsdp run of STEPS steps on 8 devices with checkpoints at EVERY and STEPS: its directory and records."""
    out = tmp_path_factory.mktemp("reference")
    result = train(recipe("fsdp", *BASE), out, log=io.StringIO())
    return out, result.records


def _copy_at_step(reference_dir, tmp_path, step):
    """A copy of the reference run directory holding only the checkpoint at `step`."""
    out = tmp_path / "run"
    shutil.copytree(reference_dir, out)
    for name in os.listdir(out / "checkpoints"):
        if name.isdigit() and int(name) != step:
            shutil.rmtree(out / "checkpoints" / name)
    return out


def _losses(records):
    return np.array([record["loss"] for record in records])


@pytest.mark.slow
@requires_devices(8)
@pytest.mark.parametrize("name, devices", [("tp", 8), ("fsdp", 4)], ids=["fsdp8-to-tp8", "fsdp8-to-fsdp4"])
def test_resume_onto_another_layout(reference, tmp_path, name, devices):
    """A checkpoint written under fsdp on 8 devices continues under tp, or on 4 devices, as the original would."""
    reference_dir, reference_records = reference
    out = _copy_at_step(reference_dir, tmp_path, EVERY)
    log = io.StringIO()
    result = train(recipe(name, *BASE), out, log=log, devices=jax.devices()[:devices])
    assert f"resuming from the checkpoint at step {EVERY}" in log.getvalue()
    assert [record["step"] for record in result.records] == list(range(EVERY + 1, STEPS + 1))
    np.testing.assert_allclose(
        _losses(result.records), _losses(reference_records[EVERY:]), rtol=0, atol=LAYOUT_TOLERANCE
    )
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in metrics] == list(range(1, STEPS + 1))  # one uninterrupted run, as read


@pytest.mark.slow
def test_model_mismatch_names_the_dimension(reference, tmp_path):
    out = _copy_at_step(reference[0], tmp_path, EVERY)
    expected = r"model\.embed: .*model\.embed=64 \(this recipe: 128\); resume with --set model\.embed=64"
    with pytest.raises(ShardkitError, match=expected) as err:
        train(recipe("fsdp", *BASE, "model.embed=128"), out, log=io.StringIO())
    assert err.value.field == "model.embed"
    assert sorted(os.listdir(out / "checkpoints")) == [str(EVERY)]  # nothing written, nothing lost


@pytest.mark.slow
def test_seed_mismatch_is_refused(reference, tmp_path):
    """The seed fixes every batch: resuming under another one would silently change the run."""
    out = _copy_at_step(reference[0], tmp_path, EVERY)
    with pytest.raises(ShardkitError, match=r"train\.seed: .*--set train\.seed=0"):
        train(recipe("fsdp", *BASE, "train.seed=1"), out, log=io.StringIO())


def test_precision_switch_allowed_only_for_the_same_state_layout():
    """float32 <-> bf16 keep the same state (fp32 params, no master, no loss scale) and may resume each other."""
    layout = build_layout(recipe("fsdp", "model.preset=tiny"))
    saved = model_meta(recipe("fsdp", "precision.policy=float32"), layout.config)
    note = check_compatible(saved, model_meta(recipe("fsdp", "precision.policy=bf16"), layout.config), "run", 4)
    assert "same state layout" in note
    with pytest.raises(ShardkitError, match=r"precision\.policy: .*policies that can resume it: \['bf16', 'float32'\]"):
        check_compatible(saved, model_meta(recipe("fsdp", "precision.policy=bf16-params"), layout.config), "run", 4)


def test_state_kind_decides_the_checkpoint_structure():
    """Two policies have the same state_kind exactly when their train states have the same leaves and dtypes."""
    signatures = {}
    for name in PRESETS:
        builder = build_step(build_layout(recipe("fsdp", "model.preset=tiny", f"precision.policy={name}")))
        signatures[name] = jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), builder.abstract_state())
    for one in PRESETS:
        for other in PRESETS:
            same_kind = state_kind(parse_policy(one)) == state_kind(parse_policy(other))
            assert same_kind == (signatures[one] == signatures[other]), (one, other)
    assert signatures["float32"] == signatures["bf16"]


@pytest.mark.slow
def test_partly_written_checkpoint_is_never_picked_up(reference, tmp_path):
    """What a kill -9 during a save leaves behind (orbax's temporary directory) is ignored, then cleaned up."""
    out = _copy_at_step(reference[0], tmp_path, EVERY)
    partial = out / "checkpoints" / f"{STEPS}.orbax-checkpoint-tmp-1700000000000000"
    shutil.copytree(reference[0] / "checkpoints" / str(STEPS), partial)
    checkpointer = Checkpointer(out / "checkpoints", keep=2)
    try:
        assert checkpointer.latest_step() == EVERY
        assert checkpointer.all_steps() == [EVERY]
        checkpointer.save(EVERY + 1, {"x": jax.numpy.zeros(2)}, {})  # orbax finishes its cleanup before a save
        checkpointer.wait()
        assert not partial.exists()
    finally:
        checkpointer.close()


@pytest.mark.slow
def test_non_finite_gradient_stops_without_saving(tmp_path):
    """lr=1e30 blows the parameters up after warmup's first step; the run stops naming the step, all saved states
    are finite, and the bad step is not saved."""
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLoss, match=r"is nan at step (\d+)") as err:
        train(recipe("fsdp", "model.preset=tiny", "train.steps=8", "checkpoint.every=1", "optimizer.lr=1e30"),
              out, log=io.StringIO())
    bad_step = int(err.value.args[0].split("at step ")[1].split(";")[0])
    checkpointer = Checkpointer(out / "checkpoints", keep=5)
    try:
        # The step is named as the console numbers it (the first is 1): the state saved last is the one before it.
        assert checkpointer.latest_step() == bad_step - 1
        builder = build_step(build_layout(recipe("fsdp", "model.preset=tiny", "train.steps=8")))
        state = checkpointer.restore(bad_step - 1, builder.abstract_state())
    finally:
        checkpointer.close()
    assert all(np.isfinite(np.asarray(leaf)).all() for leaf in jax.tree.leaves(state))


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_record_raises_under_fp32_not_fp16(key, value):
    record = {"step": 7, "loss": 1.0, "grad_norm": 1.0, key: value}
    fp32 = build_step(build_layout(recipe("fsdp", "model.preset=tiny")))
    with pytest.raises(NonFiniteLoss, match=f"{key} is {value} at step 7"):
        _raise_if_not_finite(record, fp32)
    fp16 = build_step(build_layout(recipe("fsdp", "model.preset=tiny", "precision.policy=fp16")))
    _raise_if_not_finite(record, fp16)  # the loss scaler skips that step instead


def test_non_finite_exit_code_is_3():
    assert NonFiniteLoss("train", "x").exit_code == 3 != cli.EXIT_BAD_INPUT


def test_the_save_clock_is_due_after_its_minutes_and_never_at_0(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("shardkit.run.loop.time.monotonic", lambda: now[0])
    clock, never = SaveClock(15), SaveClock(0)
    now[0] += 15 * 60 - 1
    assert not clock.due() and not never.due()
    now[0] += 1
    assert clock.due() and not never.due()
    assert agree(StopRequested(), clock) == Agreed(None, True)  # one process: process 0's clock decides
    clock.saved()
    assert not clock.due()


@pytest.mark.slow
def test_a_run_without_checkpoint_every_saves_by_time(tmp_path):
    """checkpoint.every=0 with a clock that is always due: a save before every step (the time-based path), each a
    complete checkpoint, and the final one. (The step is fsdp8-to-fsdp4's: checkpoint settings are not compiled in,
    so the session's compilation cache serves it.)"""
    out = tmp_path / "run"
    overrides = (*BASE, "checkpoint.every=0", "checkpoint.every_minutes=1e-9", "checkpoint.keep=10")
    train(recipe("fsdp", *overrides), out, log=io.StringIO(), devices=jax.devices()[:4])
    assert sorted(os.listdir(out / "checkpoints"), key=int) == [str(step) for step in range(1, STEPS + 1)]


def test_first_signal_sets_the_flag_its_copies_are_one_and_a_second_one_acts_as_usual():
    before = signal.getsignal(signal.SIGINT)
    with StopRequested() as stop:
        os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread before the next bytecode
        assert stop.signal == signal.SIGINT and agree(stop, SaveClock(0)) == Agreed(signal.SIGINT, False)
        os.kill(os.getpid(), signal.SIGTERM)  # a copy from a launcher beside the supervisor's: ignored, still alive
        assert stop.signal == signal.SIGINT and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        began = time.monotonic()
        stop.arm_second()
        assert time.monotonic() - began >= StopRequested.DUPLICATE_SIGNAL_S * 0.9
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.slow
def test_export_round_trips_the_gathered_parameters(reference, tmp_path, capsys):
    reference_dir, _ = reference
    to = tmp_path / "export"
    assert cli.main(["export", str(reference_dir), "--to", str(to)]) == 0
    index = json.loads((to / "index.json").read_text())
    assert index["step"] == STEPS and index["model"] == "llama"
    layout = build_layout(recipe("fsdp", *BASE))
    builder = build_step(layout)
    checkpointer = Checkpointer(reference_dir / "checkpoints", read_only=True)
    try:
        params = checkpointer.restore(STEPS, builder.abstract_state())["params"]
    finally:
        checkpointer.close()
    exported = load_export(to)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    logical = dict(jax.tree_util.tree_flatten_with_path(layout.logical, is_leaf=lambda x: isinstance(x, tuple))[0])
    assert sorted(exported) == sorted(path_str(path) for path, _ in flat)
    assert any(not array.is_fully_replicated for _, array in flat)  # the export really gathered shards
    for path, array in flat:
        name = path_str(path)
        np.testing.assert_array_equal(exported[name], np.asarray(array), err_msg=name)
        assert index["params"][name]["logical"] == list(logical[path])
        plain = np.load(to / index["params"][name]["file"])  # plain numpy, no shardkit
        assert plain.dtype == np.float32 and plain.shape == array.shape


@pytest.mark.slow
def test_export_refuses_a_non_empty_target_and_a_missing_step(reference, tmp_path, capsys):
    to = tmp_path / "taken"
    to.mkdir()
    (to / "keep.txt").write_text("mine")
    assert cli.main(["export", str(reference[0]), "--to", str(to)]) == cli.EXIT_BAD_INPUT
    assert "--to:" in capsys.readouterr().err and (to / "keep.txt").read_text() == "mine"
    assert cli.main(["export", str(reference[0]), "--to", str(tmp_path / "new"), "--step", "3"]) == 2
    assert f"valid steps are [{EVERY}, {STEPS}]" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path), "--to", str(tmp_path / "new")]) == 2
    assert "has no checkpoints/" in capsys.readouterr().err


def test_export_writes_bfloat16_as_exact_float32(tmp_path):
    values = np.array([1.0, -2.5, 3.140625, 1e-3], dtype=ml_dtypes.bfloat16)
    entry = _write_array(tmp_path, "blocks/mlp/w_DF", values, ("embed", "mlp"))
    written = np.load(tmp_path / entry["file"])
    assert entry["saved_dtype"] == "bfloat16" and written.dtype == np.float32
    np.testing.assert_array_equal(written, values.astype(np.float32))


@pytest.mark.slow
def test_export_of_bf16_params_run_is_the_fp32_master_copy(tmp_path):
    """Under bf16-params the model is the optimizer's fp32 master copy; exporting the bf16 rounding would lose it."""
    r = recipe("dp", "precision.policy=bf16-params", "train.steps=2")
    train(r, tmp_path / "run", log=io.StringIO())
    assert cli.main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "export")]) == 0
    exported = load_export(tmp_path / "export")
    builder = build_step(build_layout(r))
    checkpointer = Checkpointer(tmp_path / "run" / "checkpoints", keep=2)
    master = checkpointer.restore(2, builder.abstract_state())["master"]
    checkpointer.close()
    for key_path, array in jax.tree_util.tree_flatten_with_path(master)[0]:
        np.testing.assert_array_equal(exported[path_str(key_path)], np.asarray(jax.device_get(array)))
    assert any(
        not np.array_equal(exported[path_str(p)],
                           np.asarray(jax.device_get(a)).astype(ml_dtypes.bfloat16).astype(np.float32))
        for p, a in jax.tree_util.tree_flatten_with_path(master)[0]
    ), "the master copy carries bits the bf16 parameters do not"


class _Pending:
    """An awaitable that never completes: the read it stands for is still in flight."""

    def __await__(self):
        yield


async def _read_in_flight(**_):
    await _Pending()


def _suspended_orbax_read():
    """An orbax read of a (tensorstore, in-memory) array, started and suspended at its shard read, as a failed restore
    leaves the reads it abandons: closing it raises orbax's "Encountered error while reading array index" from
    `close()`. The shard read never completes (a real one may finish before the coroutine suspends)."""
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import limits, serialization

    store = ts.open({"driver": "zarr", "kvstore": "memory://"}, create=True, dtype=ts.float32, shape=[4]).result()
    read = serialization._read_array_index_and_device_put(
        [], (slice(0, 4),), store, global_shape=(4,), new_shard_shape=(4,), dtype=None,
        byte_limiter=limits.UnlimitedInFlightBytes(), strict=True, dll=None, memory_kind=None)
    with unittest.mock.patch.object(serialization, "_read_shard", _read_in_flight):
        read.send(None)  # suspended at the shard read
    return read


def test_a_failed_restores_abandoned_reads_are_dropped_and_nothing_else():
    """What a skipped checkpoint leaves behind: orbax's read coroutines, finalized whenever their tasks are let go
    ("Exception ignored in: <coroutine object _read_array_index_and_device_put>"), and tensorstore's reports to a
    closed event loop. Within `_leftovers_dropped` those are dropped; any other report still reaches the hook."""
    seen = []
    previous, sys.unraisablehook = sys.unraisablehook, seen.append
    try:
        read = _suspended_orbax_read()
        del read
        gc.collect()
        assert [str(report.exc_value)[:40] for report in seen] == ["Encountered error while reading array in"]
        seen.clear()
        other = types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("a user's own"), exc_traceback=None,
                                      err_msg=None, object=object())
        with checkpoint._leftovers_dropped():
            read = _suspended_orbax_read()
            del read
            gc.collect()
            sys.unraisablehook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=RuntimeError(
                "Event loop is closed"), exc_traceback=None, err_msg=None, object=None))
            sys.unraisablehook(other)
        assert seen == [other]
    finally:
        sys.unraisablehook = previous
