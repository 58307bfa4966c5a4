"""Per-step metrics: `metrics.jsonl` on disk and progress on the terminal."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any


class MetricsLog:
    """Appends one JSON object per step. On resume, lines at or past the resumed step are dropped first, so the file
    always reads as one uninterrupted run."""

    def __init__(self, path: Path, start_step: int):
        self.path = path
        kept = _records_before(path, start_step) if path.exists() and start_step > 0 else []
        path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _records_before(path: Path, step: int) -> list[str]:
    """The lines of records before `step`. A line that does not parse is what a kill mid-write leaves (a torn last
    line): it is dropped, and the resumed run writes that step again."""
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < step:
            kept.append(line)
    return kept


class Progress:
    """A one-line progress bar on a terminal; plain lines every `every` steps otherwise (CI logs, files)."""

    def __init__(self, total: int, start: int, stream: IO | None = None, every: int = 10):
        stream = sys.stderr if stream is None else stream
        self.total, self.start, self.stream, self.every = total, start, stream, every
        self.tty = stream.isatty()
        self.began = time.perf_counter()

    def update(self, record: dict[str, Any]) -> None:
        step = record["step"] + 1
        done = step - self.start
        elapsed = time.perf_counter() - self.began
        eta = elapsed / max(done, 1) * (self.total - step)
        text = (
            f"step {step}/{self.total}  loss {record['loss']:.4f}  tok/s {record['tokens_per_s']:,.0f}  "
            f"eta {eta:.0f}s"
        )
        if self.tty:
            width = 24
            filled = int(width * step / self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            if step == self.total:
                self.stream.write("\n")
        elif step % self.every == 0 or step == self.total or done == 1:
            self.stream.write(text + "\n")
        self.stream.flush()
