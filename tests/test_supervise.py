"""The supervisor of a multi-process run's process (`shardkit.run.supervise`), with plain Python children standing in
for `shardkit train`: a native abort that follows a peer's loss ends in one line with the retry code, any other in one
line naming the report, signals reach the child once, and a kill -9 of the supervisor takes the child with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from shardkit.run.exits import EXIT_PEER_LOST, native_log
from shardkit.run.supervise import SUPERVISED_VARIABLE, ended_by_signal, reports_peer_loss, supervise_command
from tests.helpers import ROOT

GLOO_REPORT = ("terminate called after throwing an instance of 'gloo::IoException'\n"
               "  what():  [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:40123\n")
SERVICE_REPORT = ("F1129 05:01:02.000000 client.h:80] Terminating process because the JAX distributed service "
                  "detected fatal errors. This most likely indicates that another task died\n")


def _aborting_child(out: Path, report: str) -> list[str]:
    """A child that writes `report` to its native log (as JAX's runtime does on descriptor 2) and aborts."""
    log = native_log(out, 0)
    code = f"""
        import os, pathlib
        log = pathlib.Path({str(log)!r}); log.parent.mkdir(parents=True, exist_ok=True); log.write_text({report!r})
        os.abort()
    """
    return [sys.executable, "-c", textwrap.dedent(code)]


@pytest.mark.parametrize("report", [GLOO_REPORT, SERVICE_REPORT], ids=["gloo", "coordination-service"])
def test_an_abort_after_a_lost_peer_ends_in_one_line_with_the_retry_code(tmp_path, capfd, report):
    (tmp_path / "checkpoints" / "20").mkdir(parents=True)
    (tmp_path / "checkpoints" / "25.orbax-checkpoint-tmp").mkdir()  # not committed
    assert supervise_command(_aborting_child(tmp_path, report), tmp_path, 0) == EXIT_PEER_LOST
    lines = capfd.readouterr().err.splitlines()
    assert lines == [
        "shardkit: error: a peer process or the coordination service was lost, and JAX's runtime ended process 0 "
        "(SIGABRT); the newest complete checkpoint is step 20: rerun the same command on every host to resume "
        f"(JAX's own report: {tmp_path / 'logs' / 'process-0.log'})"]


def test_another_native_crash_names_its_report_and_ends_as_a_shell_reports_it(tmp_path, capfd):
    assert supervise_command(_aborting_child(tmp_path, "F external/xla/some.cc:12] Check failed: x == y\n"),
                             tmp_path, 0) == 128 + signal.SIGABRT
    assert capfd.readouterr().err.splitlines() == [
        "shardkit: error: process 0 ended inside JAX's runtime on SIGABRT, a native crash rather than a Python error "
        f"(its report: {tmp_path / 'logs' / 'process-0.log'}); no checkpoint is complete yet: rerun the same command "
        "on every host to start again"]


def test_sigkill_is_named_and_an_unknown_index_reads_every_report(tmp_path):
    line, code = ended_by_signal(signal.SIGKILL, tmp_path, 3)
    assert code == 137 and line.startswith("shardkit: error: process 3 was killed (SIGKILL: the kernel's out-of-memory")
    assert not reports_peer_loss(native_log(tmp_path, None))  # no logs directory at all
    native_log(tmp_path, 2).parent.mkdir()
    native_log(tmp_path, 2).write_text(GLOO_REPORT)
    assert reports_peer_loss(native_log(tmp_path, None))
    assert "ended this process (SIGABRT)" in ended_by_signal(signal.SIGABRT, tmp_path, None)[0]


def test_exit_codes_pass_through_and_the_child_knows_it_is_supervised(tmp_path):
    code = f"import os, sys; sys.exit(0 if os.environ.get({SUPERVISED_VARIABLE!r}) == '1' else 9)"
    assert supervise_command([sys.executable, "-c", code], tmp_path, 0) == 0
    assert supervise_command([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path, 0) == 3


def test_a_signal_to_the_supervisor_reaches_the_child_once(tmp_path):
    """SIGTERM to the supervisor is passed on: the child's handler runs (once) and its exit code comes back."""
    ready, count = tmp_path / "ready", tmp_path / "count"
    code = f"""
        import pathlib, signal, sys, time
        seen = []
        signal.signal(signal.SIGTERM, lambda *a: seen.append(1))
        pathlib.Path({str(ready)!r}).touch()
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # a second copy, were one passed on, would arrive meanwhile
        pathlib.Path({str(count)!r}).write_text(str(len(seen)))
        sys.exit(0 if seen else 1)
    """

    def terminate_when_ready():
        while not ready.exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)  # handled by the supervisor's handler in the main thread

    sender = threading.Thread(target=terminate_when_ready, daemon=True)
    sender.start()
    assert supervise_command([sys.executable, "-c", textwrap.dedent(code)], tmp_path, 0) == 0
    sender.join()
    assert count.read_text() == "1"


def test_a_killed_supervisor_takes_its_child_with_it(tmp_path):
    child_pid = tmp_path / "child.pid"
    child = f"import os, pathlib, time; pathlib.Path({str(child_pid)!r}).write_text(str(os.getpid())); time.sleep(120)"
    supervisor = (f"from shardkit.run.supervise import supervise_command; import sys; "
                  f"supervise_command([sys.executable, '-c', {child!r}], {str(tmp_path)!r}, 0)")
    process = subprocess.Popen([sys.executable, "-c", supervisor], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not child_pid.exists() or not child_pid.read_text():
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)
        pid = int(child_pid.read_text())
        process.kill()
        process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, "the child outlived its supervisor"
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            process.kill()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by init, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
