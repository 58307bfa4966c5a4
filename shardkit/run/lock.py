"""One `train` per run directory: a lock file naming the holder's pid and host.

Two runs writing the same `--out` would interleave metrics and race each other's checkpoints. The lock is an
exclusive `flock` on `OUT/train.lock`: the kernel releases it when its process ends in any way, kill -9 included, so a
lock file left behind by a killed run is free to take, and taking it is atomic (two runs racing for a stale lock
cannot both win, and a pid reused by an unrelated process cannot keep a stale lock alive). The file's content, the
holder's pid and host, is for the message a refused run prints. With several processes only process 0 takes it (they
share the directory by design).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path

from shardkit.errors import ShardkitError

LOCK_NAME = "train.lock"


class RunLock:
    """Holds `directory/train.lock` from `acquire` to `release` (or the end of the process)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / LOCK_NAME
        self.fd: int | None = None
        self.took_over: dict | None = None  # the holder a stale lock named, when this run took it over

    def acquire(self) -> "RunLock":
        """Take the lock, or raise a ShardkitError naming `--out` and the live holder's pid and host."""
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ShardkitError("--out", f"{self.path.parent} is in use by {_describe(self._holder())}; wait for "
                                    f"it to finish or stop it, or give another --out") from None
            if not self._is_current_file(fd):  # the previous holder removed it between our open and our lock
                os.close(fd)
                continue
            self.took_over = self._holder()
            self._write_owner(fd)
            self.fd = fd
        return self

    def release(self) -> None:
        """Remove the lock file and drop the lock (removing first, so nobody locks a file that is going away)."""
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def _is_current_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return holder if isinstance(holder, dict) else None

    def _write_owner(self, fd: int) -> None:
        owner = json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, owner + b"\n", 0)


def describe_takeover(lock: RunLock) -> str | None:
    """A note for the log when the run took over a lock file whose holder had died (e.g. by kill -9)."""
    if not lock.took_over:
        return None
    return f"took over {lock.path.name} left by {_describe(lock.took_over)}, which is no longer running"


def _describe(holder: dict | None) -> str:
    if not holder:
        return "another train process (its lock file names no owner yet)"
    return f"pid {holder.get('pid')} on host {holder.get('host')}"
