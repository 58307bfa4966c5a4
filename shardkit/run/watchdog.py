"""A lost process of a multi-process run ends every other one promptly, in one line, ready to be retried.

What JAX does alone: a collective with a dead peer either fails at once (gloo sees the connection close) or waits
forever (NCCL, or a host that vanished without closing its sockets); the coordination service notices the missing
heartbeats only after its heartbeat timeout and then aborts every other process with a C++ stack trace, and a process
that raised waits at exit for peers that will never come.

The watchdog is shardkit's own answer. In every process a thread writes a heartbeat (a counter) into the coordination
service's key-value store every few seconds and reads everyone's. A peer whose counter has not moved for
`--peer-timeout` seconds is lost; so is process 0, which holds the store, when the store stops answering for as long.
Each survivor then prints one line naming the lost process and the newest complete checkpoint, and ends at once
(`os._exit`: no interpreter shutdown, whose JAX shutdown barrier would wait for the dead) with `EXIT_PEER_LOST`, a
code a scheduler can retry on. JAX's own heartbeat timeout is set to twice `--peer-timeout`
(`shardkit.run.distributed`), so the watchdog speaks first. A process that stops on an error of its own (bad data,
NaN losses, a bug) reports it as usual, marks itself failed in the store with its exit code and ends without JAX's
shutdown barrier; the others end at once with that code and one line naming it, instead of waiting in a collective.

The C and C++ layers (XLA, gloo, the coordination service) write their own reports to file descriptor 2; in a
multi-process run that descriptor goes to `OUT/logs/process-I.log`, and Python's `sys.stderr` (shardkit's lines,
warnings, tracebacks) stays on the terminal. When process 0 itself is lost, JAX's client in every other process
aborts at once from a C++ thread that no Python code can intercept (so may gloo, when a peer's connection closes
mid-collective); the supervisor around the process (`shardkit.run.supervise`) then reads that log file and says so in
one line.

The store is reached through JAX's private `jax._src.distributed.global_state.client`: JAX has no public key-value
API (orbax reaches it the same way). `_client` is the one place that reads it, and `STORE_METHODS` names the
client's methods used here; tests/test_lost_peer.py fails loudly when JAX renames or changes any of them.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import os
import sys
import threading
import time
from pathlib import Path

import jax
from jax._src import distributed as jax_distributed  # private: no public key-value API (see the module note)

from shardkit.errors import ShardkitError
from shardkit.run.checkpoint import SaveFailed
from shardkit.run.exits import EXIT_PEER_LOST, native_log, newest_checkpoint, resume_advice

HEARTBEAT_KEY = "shardkit/heartbeat/"
FINISHED = "finished"  # a process that left the run on purpose: not lost
FAILED = "failed:"  # then the exit code: a process that stopped on an error of its own, which its output reports
STORE_METHODS = {  # the distributed runtime client's methods used here, with the parameters passed
    "key_value_set": ("key", "value", "allow_overwrite"),
    "key_value_dir_get": ("key",),
}
VERDICT_WAIT_EXTRA_S = 10.0  # beyond the peer timeout, for the watchdog's own polling on a loaded machine


@dataclasses.dataclass(frozen=True)
class Lost:
    """The verdict: which process stopped answering, and for how long nothing was heard of it; or, with
    `exit_code`, which one stopped on an error of its own (its output says which) and with what code."""

    process: int
    count: int
    silent_s: float
    exit_code: int | None = None


class PeerWatchdog:
    """Heartbeats through `client` (JAX's distributed runtime client) for process `index` of `count`; `on_lost`
    is called once, from the watchdog's thread, with the first `Lost` verdict."""

    def __init__(self, client, index: int, count: int, timeout_s: float, on_lost):
        self.client, self.index, self.count, self.timeout_s, self.on_lost = client, index, count, timeout_s, on_lost
        self.interval_s = max(0.5, min(2.0, timeout_s / 10))
        began = time.monotonic()
        self._heard = {peer: began for peer in range(count) if peer != index}  # when each peer's counter last moved
        self._seen: dict[int, str] = {}
        self._finished: set[int] = set()
        self._failed: dict[int, int] = {}
        self._store_answered = began  # the last time a read of the store succeeded
        self._beats = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._beat_loop, name="shardkit-heartbeat", daemon=True),
                         threading.Thread(target=self._judge_loop, name="shardkit-watchdog", daemon=True)]

    def start(self) -> "PeerWatchdog":
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and watching; the others find this process lost once its heartbeat is `timeout_s` old."""
        self._stop.set()

    def finish(self, exit_code: int | None = None) -> None:
        """Leave the run: on purpose (the others stop watching this process), or with `exit_code` after an error of
        this process's own (the others end at once with the same code, a retry being as futile for them)."""
        self.stop()
        value = FINISHED if exit_code is None else f"{FAILED}{exit_code}"
        with contextlib.suppress(Exception):  # the store may be gone already; nobody is waiting for this then
            self.client.key_value_set(f"{HEARTBEAT_KEY}{self.index}", value, allow_overwrite=True)

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            self._beats += 1
            with contextlib.suppress(Exception):  # an unreachable store is judged by `_store_answered`
                self.client.key_value_set(f"{HEARTBEAT_KEY}{self.index}", str(self._beats), allow_overwrite=True)
                self._observe(dict(self.client.key_value_dir_get(HEARTBEAT_KEY)))
            self._stop.wait(self.interval_s)

    def _observe(self, values: dict[str, str]) -> None:
        now = time.monotonic()
        with self._lock:
            self._store_answered = now
            for key, value in values.items():
                peer = int(key.rsplit("/", 1)[-1])
                if peer not in self._heard:
                    continue
                if value == FINISHED:
                    self._finished.add(peer)
                elif value.startswith(FAILED):
                    self._failed[peer] = int(value.removeprefix(FAILED))
                elif self._seen.get(peer) != value:
                    self._seen[peer], self._heard[peer] = value, now

    def verdict(self) -> Lost | None:
        """The lost process, or None while everyone answers. Silence is measured up to the store's last answer, so
        a pause of this process's own (a stalled heartbeat thread) is not taken for a peer's."""
        with self._lock:
            now, answered = time.monotonic(), self._store_answered
            if self._failed:
                peer = min(self._failed)
                return Lost(peer, self.count, answered - self._heard[peer], self._failed[peer])
            if self.index != 0 and now - answered >= self.timeout_s:
                return Lost(0, self.count, now - min(answered, self._heard.get(0, answered)))
            silent = {peer: answered - heard for peer, heard in self._heard.items() if peer not in self._finished}
        if not silent:
            return None
        peer = max(silent, key=silent.get)
        return Lost(peer, self.count, silent[peer]) if silent[peer] >= self.timeout_s else None

    def _judge_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            lost = self.verdict()
            if lost is not None:
                self.on_lost(lost)
                return

    def wait_for_verdict(self) -> None:
        """After an error that may be a peer's loss: give the watchdog time to find the lost process (its
        `on_lost` ends the process); returns when nobody is found lost, so the error is this process's own."""
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s + VERDICT_WAIT_EXTRA_S
        while time.monotonic() < deadline and not self._stop.is_set():
            time.sleep(self.interval_s / 2)


def lost_line(lost: Lost, newest: int | None, log: Path | None) -> str:
    """The one line a survivor prints."""
    where = f" (JAX's own report: {log})" if log is not None else ""
    newest_text = f"step {newest}" if newest is not None else "none"
    if lost.exit_code is not None:
        return (f"shardkit: error: process {lost.process} of {lost.count} stopped with exit code {lost.exit_code} "
                f"(its own output says why); the newest complete checkpoint is {newest_text}{where}")
    return (f"shardkit: error: process {lost.process} of {lost.count} stopped answering (no heartbeat for "
            f"{lost.silent_s:.0f} s); {resume_advice(newest)}{where}")


def _keep_native_reports(log: Path):
    """File descriptor 2 (C/C++ reports) into `log`; `sys.stderr` kept on the original stream. Returns the stream
    shardkit's own lines go to."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    target = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 2)
    os.close(target)
    sys.stderr = io.TextIOWrapper(os.fdopen(terminal, "wb", buffering=0), errors="backslashreplace",
                                  line_buffering=True, write_through=True)
    return sys.stderr


def _client():
    """JAX's distributed runtime client (its coordination service's key-value store), or None outside a
    multi-process run."""
    return jax_distributed.global_state.client


def _peer_fault_possible(error: BaseException) -> bool:
    """Whether an error may be a peer's loss seen from here (then the process waits for the watchdog's verdict
    before reporting the error as its own): JAX's runtime errors (a collective whose connection closed) and anything
    else that is not one of shardkit's own refusals, and a failed save (a peer lost mid-save fails it)."""
    return not isinstance(error, ShardkitError) or isinstance(error, SaveFailed)


def _exit_code(error: BaseException) -> int:
    """The code the command line ends with for `error`: a ShardkitError's own (2 unless it says otherwise), 130 for
    Ctrl-C, 1 for anything else (Python's, after its traceback)."""
    if isinstance(error, ShardkitError):
        return getattr(error, "exit_code", 2)
    return 128 + 2 if isinstance(error, KeyboardInterrupt) else 1


def _end_without_waiting(code: int) -> None:
    """At exit, before JAX's own exit handlers: end with `code` without the distributed runtime's shutdown barrier,
    which would wait for peers that are ending on this process's error too."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@contextlib.contextmanager
def watching_peers(out_dir: str | Path, timeout_s: float):
    """Within: a multi-process run's processes watched (module note); nothing in a single-process run.

    Process-wide (it moves file descriptor 2 and ends the process with `os._exit`), so only the command line uses it.
    """
    if jax.process_count() == 1 or _client() is None:
        yield
        return
    out_dir = Path(out_dir)
    log = native_log(out_dir, jax.process_index())
    terminal = _keep_native_reports(log)

    def on_lost(lost: Lost) -> None:
        terminal.write(lost_line(lost, newest_checkpoint(out_dir / "checkpoints"), log) + "\n")
        terminal.flush()
        os._exit(EXIT_PEER_LOST if lost.exit_code is None else lost.exit_code)

    watchdog = PeerWatchdog(_client(), jax.process_index(), jax.process_count(), timeout_s, on_lost).start()
    try:
        yield
    except BaseException as error:
        if _peer_fault_possible(error):
            watchdog.wait_for_verdict()
        code = _exit_code(error)
        watchdog.finish(code)
        atexit.register(_end_without_waiting, code)  # after the error is reported (registered last: runs first)
        raise
    watchdog.finish()
