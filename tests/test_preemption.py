"""Faults with real processes and signals: kill -9 mid-save, SIGTERM, Ctrl-C and kill -9 mid-run as stages of one run.
Every rerun is the same command, and its losses must equal an uninterrupted run's exactly. (Two processes agreeing on
the step they stop at when only one is signalled is a stage of test_lost_peer.py's run: the same two-process command,
one SIGTERM, both saving that step.)

The runs use `--devices 2`, the tiny model and a small batch of short rows (`SMALL_BATCH`): the claims are about
processes and files, not about layouts (test_checkpoint.py covers those) or learning, and a small mesh and batch keep
each process short. They train the same `STEPS` (the
schedule's length is part of the compiled step), so that the runs of one layout compile one program and the rest read
it from the session's compilation cache.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    PROCESS_TIMEOUT_S,
    ROOT,
    losses_of,
    metrics_records,
    resumed_from,
    run_process,
    start_process,
    wait_for,
)

pytestmark = pytest.mark.slow  # every test runs `shardkit train` in fresh processes

STEPS = 14  # room for two signalled runs: a stop may come a few steps after the records it was sent at
# one tiny step plus one save and its commit take well under a second; this allows a loaded CI
SIGTERM_EXIT_BOUND_S = 20.0
TMP_MARKER = ".orbax-checkpoint-tmp"
SMALL_BATCH = ("train.global_batch=4", "train.seq_len=16")  # 4 rows of 16 tokens a step


def _train_command(out: Path, every: int, steps: int = STEPS) -> list[str]:
    return [
        sys.executable, "-m", "shardkit", "train", str(ROOT / "recipes" / "fsdp.toml"), "--devices", "2",
        "--out", str(out), "--steps", str(steps), "--set", "model.preset=tiny", "--set", "optimizer.min_lr_ratio=1.0",
        "--set", "checkpoint.keep=2", "--set", f"checkpoint.every={every}",
        *[item for setting in SMALL_BATCH for item in ("--set", setting)],
    ]


def _temporary_checkpoints(out: Path) -> list[str]:
    directory = out / "checkpoints"
    return [name for name in os.listdir(directory) if TMP_MARKER in name] if directory.is_dir() else []


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, float, float]]:
    """(step, loss, grad_norm) of a run that was never interrupted (saves do not change the numbers)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_process(_train_command(out, every=0), out.parent / "uninterrupted.log")
    losses = losses_of(out)
    assert [step for step, _, _ in losses] == list(range(1, STEPS + 1))
    return losses


def test_kill_9_mid_save_then_rerun_gives_the_same_losses(reference, tmp_path):
    """Saving every step keeps a save in flight nearly all the time; the kill lands while orbax's temporary
    directory exists, and the test checks that it is still there afterwards (the save really was cut short)."""
    out, command = tmp_path / "run", _train_command(tmp_path / "run", every=1)
    killed_mid_save = False
    for attempt in range(3):  # each attempt is itself a kill + rerun of the same command
        process = start_process(command, tmp_path / f"attempt{attempt}.log")
        wait_for(lambda: len(metrics_records(out)) >= 4 and _temporary_checkpoints(out), process, "a save in flight")
        process.send_signal(signal.SIGKILL)
        process.wait()
        if _temporary_checkpoints(out):
            killed_mid_save = True
            break
    assert killed_mid_save, "three kills in a row missed a save in flight"
    text = run_process(command, tmp_path / "rerun.log")
    assert 0 < resumed_from(text) < STEPS
    assert losses_of(out) == reference
    assert not _temporary_checkpoints(out)  # the leftover was cleaned up


def test_signal_saves_exits_in_bounded_time_and_the_rerun_continues(reference, tmp_path):
    """checkpoint.every=0: the only checkpoints before the end are the ones the signals cause. SIGTERM (preemption)
    exits 0; the rerun, the same command, resumes there and is itself stopped by Ctrl-C, which exits with the shell's
    conventional 130 (one signal per run: the second run is the first's rerun). The next rerun is killed with kill -9
    two steps past the Ctrl-C's checkpoint, mid-run with no save in flight (test_kill_9_mid_save kills one mid-save);
    the last rerun resumes from that checkpoint, drops the killed run's later records and ends the run with the
    uninterrupted losses. (Resuming after kill -9 from a periodic `checkpoint.every` save: test_fp8.py's kill -9.)"""
    out, command = tmp_path / "run", _train_command(tmp_path / "run", every=0)
    stops: list[int] = []
    for signum, exit_code in ((signal.SIGTERM, 0), (signal.SIGINT, 128 + signal.SIGINT)):
        log = tmp_path / f"stopped-by-{int(signum)}.log"
        process = start_process(command, log)
        at = stops[-1] + 1 if stops else 3  # a step of the rerun has run before it is signalled
        wait_for(lambda: len(metrics_records(out)) >= at, process, f"step {at}")
        sent = time.monotonic()
        process.send_signal(signum)
        code = process.wait(timeout=PROCESS_TIMEOUT_S)
        took = time.monotonic() - sent
        assert code == exit_code, log.read_text()[-3000:]
        assert took < SIGTERM_EXIT_BOUND_S, f"took {took:.1f}s to stop"
        if stops:
            assert resumed_from(log.read_text()) == stops[-1]
        stopped = int(re.search(rf"stopped at step (\d+) on signal {int(signum)}", log.read_text()).group(1))
        assert at <= stopped < STEPS
        stops.append(stopped)
        assert sorted(os.listdir(out / "checkpoints"), key=int) == [str(stop) for stop in stops]  # keep=2
        assert len(metrics_records(out)) == stopped  # the step in flight finished and was logged; no step after it ran
    process = start_process(command, tmp_path / "killed.log")
    wait_for(lambda: len(metrics_records(out)) >= stops[-1] + 2, process, f"step {stops[-1] + 2}")
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert len(metrics_records(out)) < STEPS  # it really was cut short
    assert sorted(os.listdir(out / "checkpoints"), key=int) == [str(stop) for stop in stops]  # kill -9 saves nothing
    text = run_process(command, tmp_path / "rerun.log")
    assert resumed_from(text) == stops[-1]
    assert losses_of(out) == reference
