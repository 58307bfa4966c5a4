"""Two processes on the loopback losing one of them: kill -9 of process 1, then of process 0 (each time the other ends
promptly in one line, exit 75, and the same command restarted on both continues as an uninterrupted run), then
SIGTERM to one (both save the same step and exit cleanly, and that checkpoint resumes on one process with fewer
devices). These are one run's stages, one test: each restart is the run the next fault lands in.
The watchdog's verdicts themselves are checked without processes, on a fake clock and store.

Both runs are compared with one process on as many devices (`reference`). The cross-process sums run in another
order, so the losses match to the suite's fp32 tolerance for another layout, not bit for bit; the learning-rate
schedule is flat after warmup (`optimizer.min_lr_ratio=1`). Every run trains the same `STEPS` (the schedule's length is
part of the compiled step), so that the two-process runs compile one program and the restarts read it from the
session's compilation cache; each kill lands two steps after a checkpoint and each run after a fault resumes and
trains a few steps. The reference and the one-process
resume run in the test's own process (no second JAX start), on as many of its devices.
"""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from shardkit.cli import main
from shardkit.run.loop import train
from shardkit.run.watchdog import (
    EXIT_PEER_LOST,
    FINISHED,
    HEARTBEAT_KEY,
    STORE_METHODS,
    Lost,
    PeerWatchdog,
    _client,
    lost_line,
    newest_checkpoint,
)
from tests.helpers import ROOT, free_port, losses_of, metrics_records, recipe, resumed_from, start_process, wait_for

STEPS, EVERY, KILL_AT, SECOND_KILL_AT, SIGTERM_AT = 15, 3, 5, 8, 10
PROCESS_TIMEOUT_S = 600  # two processes start, compile and train at once on a shared machine
PEER_TIMEOUT_S = 20
LOST_PEER_EXIT_BOUND_S = 60.0  # the peer timeout, the watchdog's polling, and a loaded machine
TOLERANCE = 1e-5  # relative: another order of the cross-process sums (as tests/test_multiprocess.py)
NATIVE_REPORT_MARKS = ("Check failure stack trace", "*** ", "Traceback", "client.h:")


# A small batch of short rows (one row of 16 tokens per device of the two processes): the claims are about processes,
# not learning, and each of the many steps the runs take stays cheap.
SETTINGS = ("model.preset=tiny", "optimizer.min_lr_ratio=1.0", "checkpoint.keep=2", "train.global_batch=4",
            "train.seq_len=16")


def _command(out: Path, devices: int, steps: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "shardkit", "train", str(ROOT / "recipes" / "fsdp.toml"), "--devices", str(devices),
        "--out", str(out), "--steps", str(steps), *[item for setting in SETTINGS for item in ("--set", setting)],
        *extra,
    ]


def _train_here(out: Path, devices: int) -> str:
    """`shardkit train` of `STEPS` on this process's first `devices` devices; its log."""
    log = io.StringIO()
    train(recipe("fsdp", *SETTINGS, f"train.steps={STEPS}"), out, log=log, devices=jax.devices()[:devices])
    return log.getvalue()


def _two_processes(out: Path, steps: int, *extra: str) -> list[list[str]]:
    """The command of each of two processes of 2 devices each (4 in all)."""
    port = free_port()
    return [_command(out, 2, steps, *extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                     "--process-id", str(rank)) for rank in range(2)]


def _start(commands: list[list[str]], logs: list[Path]) -> list[subprocess.Popen]:
    return [start_process(command, log) for command, log in zip(commands, logs)]


def _wait_all(workers: list[subprocess.Popen]) -> list[int]:
    try:
        return [worker.wait(timeout=PROCESS_TIMEOUT_S) for worker in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> np.ndarray:
    """The losses of one process on 4 devices, never interrupted."""
    out = tmp_path_factory.mktemp("reference")
    _train_here(out, 4)
    return np.array([loss for _, loss, _ in losses_of(out)])


# The survivor's one line: the watchdog's verdict on a silent peer, or the supervisor's report of JAX's runtime ending
# it natively (at once when process 0, the coordination service, is lost; sometimes gloo's, when a peer's connection
# closes mid-collective). Which one speaks is a race inside JAX's runtime; each ends with EXIT_PEER_LOST.
LOST_LINES = (r"process {lost} of 2 stopped answering \(no heartbeat for \d+ s\)",
              r"a peer process or the coordination service was lost, and JAX's runtime ended process {survivor} "
              r"\(SIGABRT\)")


def _kill_one(commands: list[list[str]], logs: list[Path], out: Path, victim: int, at: int) -> int:
    """Start both processes, kill -9 `victim` once `at` steps are logged; check the survivor's one line and code,
    and return the newest complete checkpoint it names."""
    workers, survivor = _start(commands, logs), 1 - victim
    try:
        wait_for(lambda: len(metrics_records(out)) >= at, workers[survivor], f"step {at}", PROCESS_TIMEOUT_S)
        workers[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = workers[survivor].wait(timeout=PROCESS_TIMEOUT_S)
        took = time.monotonic() - killed
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    text, native = logs[survivor].read_text(), out / "logs" / f"process-{survivor}.log"
    why = f"{text[-3000:]}\n--- {native}:\n{native.read_text()[-3000:] if native.exists() else ''}"
    assert code == EXIT_PEER_LOST, why
    assert took < LOST_PEER_EXIT_BOUND_S, f"took {took:.1f} s to end"
    errors = [line for line in text.splitlines() if line.startswith("shardkit: error:")]
    assert len(errors) == 1 and errors[0] == text.splitlines()[-1], why
    patterns = [pattern.format(lost=victim, survivor=survivor) for pattern in LOST_LINES]
    assert any(re.search(pattern, errors[0]) for pattern in patterns), errors[0]
    assert not [mark for mark in NATIVE_REPORT_MARKS if mark in text], why
    assert f"{native}" in errors[0]
    assert len(metrics_records(out)) < STEPS  # it really was cut short
    return int(re.search(r"newest complete checkpoint is step (\d+)", errors[0]).group(1))


@pytest.mark.slow
def test_a_run_that_loses_each_process_in_turn_ends_in_one_line_and_continues(reference, tmp_path):
    """kill -9 of process 1, then (restarted) of process 0, the coordination service's holder: each time the other
    ends promptly in one line with the retry code, and the same command restarted on both continues as one run.

    Restarted once more, SIGTERM reaches process 1 only (process 0 prints): both stop after the same step, which
    both write as one checkpoint (the signal's: committed as the run stops, the newest, no step after it logged).
    One process with half the devices then resumes it to the end: the recipe's `fsdp = -1` absorbs the difference.
    The losses of all of it are one uninterrupted run's."""
    out = tmp_path / "run"
    commands = _two_processes(out, STEPS, "--peer-timeout", str(PEER_TIMEOUT_S), "--set", f"checkpoint.every={EVERY}")
    newest = 0
    for attempt, (victim, at) in enumerate([(1, KILL_AT), (0, SECOND_KILL_AT)]):
        logs = [tmp_path / f"attempt{attempt}-worker{rank}.log" for rank in range(2)]
        killed_at = _kill_one(commands, logs, out, victim, at)
        if attempt:  # process 0 said where it resumed before it was killed
            assert resumed_from(logs[0].read_text()) == newest
        assert killed_at % EVERY == 0 and killed_at >= at - at % EVERY
        newest = killed_at

    # The records the killed run left must not reach SIGTERM_AT, or the signal would come before the restart ran.
    assert len(metrics_records(out)) < SIGTERM_AT
    logs = [tmp_path / f"restart-worker{rank}.log" for rank in range(2)]
    workers = _start(commands, logs)
    try:
        wait_for(lambda: len(metrics_records(out)) >= SIGTERM_AT, workers[0], f"step {SIGTERM_AT}",
                 PROCESS_TIMEOUT_S)
        workers[1].send_signal(signal.SIGTERM)
    finally:
        codes = _wait_all(workers)
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], [text[-3000:] for text in texts]
    assert resumed_from(texts[0]) == newest
    assert "stopped at step" not in texts[1] and "compiled the step" not in texts[1]  # only process 0 prints
    stop = int(re.search(r"stopped at step (\d+) on signal 15; checkpoint at step \1 committed", texts[0]).group(1))
    assert SIGTERM_AT <= stop < STEPS  # the records trail the steps run: the stop may come a few steps later
    steps = sorted(int(path.name) for path in (out / "checkpoints").iterdir() if path.name.isdigit())
    assert steps[-1] == stop and all(step % EVERY == 0 for step in steps[:-1]), steps
    written_by = sorted(path.name for path in (out / "checkpoints" / str(stop) / "state").glob("ocdbt.process_*"))
    assert written_by == ["ocdbt.process_0", "ocdbt.process_1"]
    assert len(metrics_records(out)) == stop

    assert resumed_from(_train_here(out, 2)) == stop
    losses = [(step, loss) for step, loss, _ in losses_of(out)]
    assert [step for step, _ in losses] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([loss for _, loss in losses], reference, rtol=TOLERANCE, atol=0)


class _Store:
    """The coordination service's key-value store as the watchdog uses it; `answering` False: process 0 is gone."""

    def __init__(self):
        self.values, self.answering = {}, True

    def key_value_set(self, key, value, allow_overwrite=False):
        self._check()
        self.values[key] = value

    def key_value_dir_get(self, prefix):
        self._check()
        return [(key, value) for key, value in self.values.items() if key.startswith(prefix)]

    def _check(self):
        if not self.answering:
            raise RuntimeError("UNAVAILABLE: Socket closed")


def test_the_watchdog_names_the_silent_process_and_only_after_the_timeout(monkeypatch, tmp_path):
    """Heartbeats driven by hand on a fake clock: a peer that stops beating is lost once `timeout_s` of the store's
    answers have passed without a change; one that finished on purpose never is; process 0 is lost when the store,
    which it serves, stops answering."""
    now = [0.0]
    monkeypatch.setattr("shardkit.run.watchdog.time.monotonic", lambda: now[0])
    store = _Store()
    watchers = [PeerWatchdog(store, index, 3, 20, on_lost=None) for index in range(3)]

    def beat(*indices):
        for index in indices:
            watchers[index]._beats += 1
            store.key_value_set(f"{HEARTBEAT_KEY}{index}", str(watchers[index]._beats))
        watchers[0]._observe(dict(store.key_value_dir_get(HEARTBEAT_KEY)))

    for _ in range(5):
        now[0] += 2
        beat(0, 1, 2)
    assert watchers[0].verdict() is None
    for _ in range(9):  # process 2 silent from here on
        now[0] += 2
        beat(0, 1)
        assert watchers[0].verdict() is None
    now[0] += 2
    beat(0, 1)
    assert watchers[0].verdict() == Lost(2, 3, 20.0)
    store.key_value_set(f"{HEARTBEAT_KEY}2", FINISHED)
    beat(0, 1)
    assert watchers[0].verdict() is None

    watchers[1]._observe(dict(store.key_value_dir_get(HEARTBEAT_KEY)))
    assert watchers[1].verdict() is None
    watchers[0].finish(exit_code=3)  # process 0 stopped on an error of its own: the others end with its code at once
    watchers[1]._observe(dict(store.key_value_dir_get(HEARTBEAT_KEY)))
    assert watchers[1].verdict() == Lost(0, 3, 0.0, exit_code=3)
    assert "process 0 of 3 stopped with exit code 3 (its own output says why)" in lost_line(Lost(0, 3, 0.0, 3), 5,
                                                                                             None)
    store.values[f"{HEARTBEAT_KEY}0"] = "99"  # process 0 beating again (a new run), then its store gone
    watchers[1] = PeerWatchdog(store, 1, 3, 20, on_lost=None)
    watchers[1]._observe(dict(store.key_value_dir_get(HEARTBEAT_KEY)))
    store.answering = False
    now[0] += 19
    assert watchers[1].verdict() is None
    now[0] += 1
    assert watchers[1].verdict().process == 0


def test_jax_private_key_value_store_still_has_what_the_watchdog_uses():
    """The watchdog reaches JAX's private distributed client (no public key-value API): if JAX moves the client or
    changes a method the watchdog calls, this fails here, not in a multi-process run that would then hang."""
    from jax._src import distributed
    from jax._src.lib import _jax

    assert hasattr(distributed.global_state, "client"), "jax._src.distributed.global_state lost client: update watchdog"
    assert _client() is None  # a single-process run: the watchdog stays out
    for method, parameters in STORE_METHODS.items():
        bound = getattr(_jax.DistributedRuntimeClient, method, None)
        assert bound is not None, f"JAX's DistributedRuntimeClient lost {method}: update shardkit/run/watchdog.py"
        signature = (bound.__doc__ or "").splitlines()[0]  # nanobind writes the signature as the first line
        assert signature.startswith(f"{method}(self, "), f"{method}'s signature is now {signature!r}"
        for name in parameters:
            assert f" {name}:" in signature, f"{method} no longer takes {name}: {signature!r}; update watchdog.py"


def test_the_lost_line_names_the_newest_complete_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert newest_checkpoint(checkpoints) is None
    for name in ("5", "10", "15.orbax-checkpoint-tmp-1234", "20.unreadable"):
        (checkpoints / name).mkdir(parents=True)
    assert newest_checkpoint(checkpoints) == 10
    line = lost_line(Lost(1, 2, 20.4), 10, tmp_path / "logs" / "process-0.log")
    assert line == (f"shardkit: error: process 1 of 2 stopped answering (no heartbeat for 20 s); the newest complete "
                    f"checkpoint is step 10: rerun the same command on every host to resume (JAX's own report: "
                    f"{tmp_path / 'logs' / 'process-0.log'})")
    assert "no checkpoint is complete yet" in lost_line(Lost(0, 4, 61), None, None)


@pytest.mark.parametrize("seconds", ["0", "-5", "nan", "inf"])
def test_a_peer_timeout_that_is_not_a_positive_time_is_one_line(seconds, tmp_path, capsys):
    assert main(["train", "recipes/dp.toml", "--peer-timeout", seconds, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardkit: error: --peer-timeout: must be a positive number"), err
