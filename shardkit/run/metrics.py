"""Per-step metrics: fetched from the device off the training loop's thread, then written to `metrics.jsonl`,
TensorBoard, Weights & Biases and the terminal.

Why a pipe: reading a step's loss on the host waits for that step to finish. Done in the loop, every step would wait
for the previous one and the device would idle while the host builds the next batch and writes the logs. `MetricsPipe`
hands each step's (still on the device) metrics to a worker thread and the loop goes on dispatching; a bounded queue
keeps the loop at most a few steps ahead. Process 0 alone writes and prints (`sinks` is empty elsewhere), but every
process fetches its own copy of the replicated metrics, so every process sees a NaN and stops at the same step.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Protocol

import numpy as np

from shardkit.errors import ShardkitError
from shardkit.recipe import LoggingSection
from shardkit.run.evaluate import format_eval

TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"


class Sink(Protocol):
    """Where finished records go (the jsonl file, TensorBoard, W&B, the progress line)."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsLog:
    """Appends one JSON object per step, numbered as the console numbers it (`step 1/4` is step 1: the steps done
    once it has run, the state's `step` after it). On resume, lines past the resumed step are dropped first, so the
    file always reads as one uninterrupted run."""

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
    """The lines of the records of the first `step` steps (numbered 1 to `step`).

    A line that does not parse is what a kill mid-write leaves (a torn last line): it is dropped, and the resumed run
    writes that step again."""
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    return kept


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's numbers other than `step`, by their metrics.jsonl names: what TensorBoard and W&B get."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardLog:
    """TensorBoard event files under `directory` (tensorboardX: no TensorFlow), one scalar per metrics.jsonl key, tagged
    by that key, at the record's `step`."""

    def __init__(self, directory: Path, start_step: int):
        from tensorboardX import SummaryWriter

        # On resume TensorBoard hides the events at or past `purge_step` that the interrupted run had written, as
        # metrics.jsonl drops those lines (the records after the resumed step, numbered from start_step + 1).
        self.writer = SummaryWriter(str(directory), purge_step=(start_step + 1) if start_step else None, flush_secs=10)

    def write(self, record: dict[str, Any]) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """A Weights & Biases run in the run directory, with the resolved recipe as its config. Its id is kept in
    `RUN_DIR/wandb_run_id`, so a resumed shardkit run continues the same W&B run."""

    def __init__(self, out_dir: Path, section: LoggingSection, config: Mapping[str, Any]):
        wandb = import_wandb()
        id_file = out_dir / WANDB_ID_FILE
        if not id_file.is_file():
            id_file.write_text(uuid.uuid4().hex[:12] + "\n")
        try:
            self.run = wandb.init(project=section.wandb_project, mode=section.wandb_mode, dir=str(out_dir),
                                  id=id_file.read_text().strip(), resume="allow", config=dict(config),
                                  name=out_dir.name)
        except Exception as err:  # wandb raises its own types for no login, no network, a bad project
            raise ShardkitError("logging.wandb", f"wandb.init failed ({' '.join(str(err).split())}); log in with "
                                "`wandb login`, or set logging.wandb_mode=offline") from None

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def import_wandb():
    """The wandb module, or the one-line error saying how to get it (checked before a run starts)."""
    try:
        import wandb
    except ImportError:
        raise ShardkitError("logging.wandb", "needs the wandb package: pip install 'shardkit[wandb]' "
                                             "(or set logging.wandb=false)") from None
    return wandb


class Progress:
    """A one-line progress bar on a terminal; plain lines every `every` steps otherwise (CI logs, files). A record
    with a held-out loss also gets its own line."""

    def __init__(self, total: int, start: int, stream: IO | None = None, every: int = 10):
        stream = sys.stderr if stream is None else stream
        self.total, self.start, self.stream, self.every = total, start, stream, every
        self.tty = stream.isatty()
        self.began = time.perf_counter()

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
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
        if "eval_loss" in record:
            self.stream.write(("\n" if self.tty and step != self.total else "") + format_eval(step, record) + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """A dispatched step: its metrics still on the device, and when the loop began it (batch and dispatch)."""

    step: int
    metrics: Mapping[str, Any]
    began: float


@dataclasses.dataclass(frozen=True)
class EvalOutput:
    """The held-out figures of the step `step`, already on the host: merged into that step's record."""

    step: int
    values: Mapping[str, float]


_FLUSH = object()  # a queue item: write the held record now


class MetricsPipe:
    """Step outputs in, finished records out to the sinks, in step order; on a worker thread when `asynchronous`.

    Each record is held until the next item arrives, so a held-out loss computed after its step joins that step's
    record. `check(record)` runs after the sinks have the record (a NaN step is still logged) and may raise; the
    error is raised in the loop's thread at its next `submit` or `drain`, and nothing after it is written.

    Step time: from when the step's metrics were ready back to when the previous step's were, or to when this step
    began if the loop began it later (so time the loop spent on evaluation or a save between steps is not counted).
    With the asynchronous pipe the loop runs ahead, and this is the device's time per step; synchronously it is the
    time from the batch to the fetched loss.
    """

    def __init__(self, finish: Callable[[StepOutput, dict[str, Any], float], dict[str, Any]], sinks: list[Sink],
                 check: Callable[[dict[str, Any]], None], asynchronous: bool, depth: int = 2):
        self.finish, self.sinks, self.check = finish, sinks, check
        self.records: list[dict[str, Any]] = []
        self.failure: BaseException | None = None
        self._held: dict[str, Any] | None = None
        self._last_ready = 0.0
        self._queue: queue.Queue | None = None
        if asynchronous:
            self._queue = queue.Queue(maxsize=depth)  # the loop waits here when it is `depth` steps ahead
            self._worker = threading.Thread(target=self._work, name="shardkit-metrics", daemon=True)
            self._worker.start()

    def submit(self, item: StepOutput | EvalOutput) -> None:
        """Hand over a step's metrics (or its evaluation); raises the error of an earlier record, if one failed."""
        self.raise_failure()
        if self._queue is None:
            self._take(item)
            self.raise_failure()
        else:
            self._queue.put(item)

    def drain(self) -> None:
        """Write every record submitted so far (before a checkpoint: a NaN step must stop the run before its save)."""
        if self._queue is None:
            self._write_held()
        else:
            self._queue.put(_FLUSH)
            self._queue.join()
        self.raise_failure()

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Stop the worker and close the sinks, without raising (`drain` reports failures)."""
        if self._queue is not None:
            self._queue.put(None)
            self._worker.join()
        else:
            self._write_held()
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001 - a sink that cannot close must not hide the run's own outcome
                print(f"warning: closing {type(sink).__name__} failed: {err}", file=sys.stderr)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    self._write_held()
                    return
                if item is _FLUSH:
                    self._write_held()
                else:
                    self._take(item)
            finally:
                self._queue.task_done()

    def _take(self, item: StepOutput | EvalOutput) -> None:
        if self.failure is not None:
            return
        try:
            if isinstance(item, EvalOutput):
                self._held.update(item.values)
                return
            values = {key: _local_scalar(value) for key, value in item.metrics.items()}
            ready = time.perf_counter()
            seconds = ready - max(self._last_ready, item.began)
            self._last_ready = ready
            self._write_held()
            self._held = self.finish(item, values, seconds)
        except BaseException as err:  # noqa: BLE001 - raised again in the loop's thread
            self.failure = err

    def _write_held(self) -> None:
        record, self._held = self._held, None
        if record is None or self.failure is not None:
            return
        try:
            for sink in self.sinks:
                sink.write(record)
            self.records.append(record)
            self.check(record)
        except BaseException as err:  # noqa: BLE001 - raised again in the loop's thread
            self.failure = err


def _local_scalar(value) -> Any:
    """A replicated scalar's value from this process's own copy (works across processes, unlike device_get)."""
    return np.asarray(value.addressable_data(0)).item()
