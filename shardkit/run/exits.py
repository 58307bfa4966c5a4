"""What a multi-process run's process ends with when a peer is lost, shared by the watchdog (a silent peer) and the
supervisor (a native crash): the exit code a scheduler retries on, where the native reports go, and the newest
complete checkpoint a retry resumes from. No JAX here: the supervisor never imports it."""

from __future__ import annotations

import contextlib
from pathlib import Path

EXIT_PEER_LOST = 75  # sysexits' EX_TEMPFAIL: a temporary failure, retrying the same command is expected to succeed
LOG_DIR = "logs"  # under OUT: process-I.log, file descriptor 2 of process I (the C and C++ layers' reports)


def native_log(out_dir: str | Path, process: int | None) -> Path:
    """Process `process`'s native report file under `out_dir` (its logs directory when the index is unknown)."""
    logs = Path(out_dir) / LOG_DIR
    return logs if process is None else logs / f"process-{process}.log"


def newest_checkpoint(directory: Path) -> int | None:
    """The newest complete checkpoint's step under `directory` (orbax renames a step into `N/` only once it has
    committed), read from the directory listing alone: nothing a lost peer holds is waited on."""
    with contextlib.suppress(OSError):
        steps = [int(path.name) for path in directory.iterdir() if path.name.isdigit() and path.is_dir()]
        return max(steps) if steps else None
    return None


def resume_advice(newest: int | None) -> str:
    """What to do next, given the newest complete checkpoint."""
    if newest is None:
        return "no checkpoint is complete yet: rerun the same command on every host to start again"
    return f"the newest complete checkpoint is step {newest}: rerun the same command on every host to resume"
