"""A multi-process run's process under a supervisor: when JAX's runtime ends it natively, one line still says why.

JAX's runtime can end a process from a C++ thread that no Python code can intercept: gloo may throw from its event
loop when a peer's connection closes mid-collective (std::terminate, SIGABRT), and JAX's distributed client aborts
every other process when the coordination service, which process 0 holds, is lost. The watchdog
(`shardkit.run.watchdog`) cannot speak then. So `shardkit train`, in a multi-process run, starts itself again as a
child and waits for it (the design of torchrun's agent, without its restarts: a scheduler retries the command):

- the child's own exit code passes through: shardkit's lines and the watchdog's verdicts are the child's;
- a child ended by a signal is reported in one line, read from its native report (`OUT/logs/process-I.log`): a
  report that names a lost connection or the coordination service is a peer's loss and ends with `EXIT_PEER_LOST`,
  as the watchdog's verdict would; SIGKILL is named as the kernel's out-of-memory killer or a kill -9; any other
  native crash ends with 128 + the signal, as a shell reports it, naming the report;
- SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 sent to the supervisor are passed on to the child, which runs in a
  process group of its own so that a terminal's Ctrl-C reaches it once, through the supervisor;
- the child dies with the supervisor (Linux's PR_SET_PDEATHSIG): a kill -9 of the supervisor is one of the host's
  training process, as a lost host is.

The supervisor imports no JAX and holds no device: it costs one small Python process per host. Elsewhere than Linux
(no PR_SET_PDEATHSIG) the command runs unsupervised.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from shardkit.run.exits import EXIT_PEER_LOST, native_log, newest_checkpoint, resume_advice

SUPERVISED_VARIABLE = "SHARDKIT_SUPERVISED"  # set in the child: it runs the command itself
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Lower-cased phrases by which JAX's runtime, gloo and the coordination service report a lost peer or a lost service.
PEER_LOSS_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo::ioexception",
                   "another task died", "coordination service", "distributed service detected fatal errors",
                   "failed to connect", "socket closed", "heartbeat")
REPORT_TAIL_BYTES = 65536  # how much of the end of a native report is read for those phrases


def can_supervise() -> bool:
    """Whether this process may start a supervised child: on Linux, and not already that child."""
    return sys.platform.startswith("linux") and os.environ.get(SUPERVISED_VARIABLE) != "1"


def supervise(argv: Sequence[str], out_dir: str | Path, process: int | None) -> int:
    """Run `shardkit *argv` as a supervised child (module note) and return the exit code this process ends with.

    Args:
        argv: the command's arguments, as given to this process.
        out_dir: the run's `--out`, where the child's native report and checkpoints are.
        process: this host's process index, for its report's name (None when only the launcher knows it).
    """
    return supervise_command([sys.executable, "-m", "shardkit", *argv], out_dir, process)


def supervise_command(command: Sequence[str], out_dir: str | Path, process: int | None) -> int:
    """`supervise` for any command line (the child's environment carries `SUPERVISED_VARIABLE`)."""
    parent, passed_on = os.getpid(), set()
    child = subprocess.Popen(list(command), env={**os.environ, SUPERVISED_VARIABLE: "1"}, process_group=0,
                             preexec_fn=lambda: _die_with(parent))

    def pass_on(signum, frame) -> None:
        passed_on.add(signum)
        if child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, pass_on) for sig in FORWARDED_SIGNALS}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code >= 0:
        return code
    if -code in passed_on:  # ended by a signal sent to this process (a second Ctrl-C): silent, as without us
        return 128 - code
    line, exit_code = ended_by_signal(-code, out_dir, process)
    print(line, file=sys.stderr, flush=True)
    return exit_code


def ended_by_signal(signum: int, out_dir: str | Path, process: int | None) -> tuple[str, int]:
    """The one line and the exit code for a child ended by signal `signum`."""
    log = native_log(out_dir, process)
    name = _signal_name(signum)
    advice = resume_advice(newest_checkpoint(Path(out_dir) / "checkpoints"))
    who = "this process" if process is None else f"process {process}"
    if signum == signal.SIGKILL:
        return (f"shardkit: error: {who} was killed (SIGKILL: the kernel's out-of-memory killer, see `dmesg`, or a "
                f"kill -9); {advice}"), 128 + signum
    if reports_peer_loss(log):
        return (f"shardkit: error: a peer process or the coordination service was lost, and JAX's runtime ended "
                f"{who} ({name}); {advice} (JAX's own report: {log})"), EXIT_PEER_LOST
    return (f"shardkit: error: {who} ended inside JAX's runtime on {name}, a native crash rather than a Python error "
            f"(its report: {log}); {advice}"), 128 + signum


def reports_peer_loss(log: Path) -> bool:
    """Whether the end of native report `log` (a file; a directory: any file in it) names a lost peer or service."""
    files = sorted(log.glob("process-*.log")) if log.is_dir() else [log]
    return any(mark in _tail(path) for path in files for mark in PEER_LOSS_MARKS)


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as stream:
            stream.seek(max(0, path.stat().st_size - REPORT_TAIL_BYTES))
            return stream.read().decode("utf-8", "replace").lower()
    except OSError:
        return ""


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _die_with(parent: int) -> None:
    """In the child, before exec: receive SIGKILL when the supervisor dies; end now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)
