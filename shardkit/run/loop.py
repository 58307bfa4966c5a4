"""The training loop behind `shardkit train`: restore or init, compile once, step, log, checkpoint, stop cleanly.

Fault behaviour (what a long run on rented machines relies on):
- Resume: an `--out` holding checkpoints resumes from the newest complete one, onto this recipe's layout. The batch at
  step s depends only on (seed, s), so the resumed losses equal those of a run that was never interrupted.
- Preemption: the first SIGTERM or SIGINT lets the step in flight finish, then the run saves, waits for the save to
  commit and returns; a second signal during the save kills the process at once (the previous complete checkpoint is
  then used). Copies of the first signal arriving together (from a launcher and a supervisor) count as one.
  With several processes, each step starts with a tiny all-gather of the stop flags, so all of them stop after the
  same step even when the signal reached only one.
- Saves by time: besides every `checkpoint.every` steps, a save starts before a step once `checkpoint.every_minutes`
  have passed on process 0's clock since the last one; the same all-gather carries that verdict, so every process
  saves the same step.
- A lost process (multi-process runs): the command line's watchdog (`shardkit.run.watchdog`) ends the others.
- One run per directory: process 0 holds `out_dir/train.lock` (`shardkit.run.lock`); a second run is refused, and a
  lock whose holder died (kill -9) is taken over.
- Unreadable checkpoints (truncated, missing manifest, bad meta) are skipped for the newest readable one, with a
  warning (`Checkpointer.restore_newest_readable`).
- Logging: each step's metrics are fetched on a worker thread while the next steps run (`shardkit.run.metrics`), and
  process 0 alone prints and writes them (metrics.jsonl, TensorBoard, W&B) and the resolved recipe (`recipe.toml`).
- Non-finite values: under policies without loss scaling (fp32, bf16) a NaN/Inf loss or gradient norm stops the run
  with `NonFiniteLoss`, naming the step, before anything of that step is saved; every save also checks that the state
  it writes is finite. Saves already started complete, so the last good checkpoint is kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from shardkit.analysis.compiled.fit import check_fit, device_memory_limit, out_of_memory_as_one_error
from shardkit.analysis.compiled.hlo import memory_stats
from shardkit.analysis.planning.model_names import layout_warnings
from shardkit.analysis.predicted.flops import active_parameters, mfu, training_flops_per_token
from shardkit.analysis.predicted.targets import peak_flops
from shardkit.data.source import TokenSource
from shardkit.errors import ShardkitError
from shardkit.layout import build_layout
from shardkit.optimizer import with_optimizer_settings
from shardkit.platforms import mesh_platform
from shardkit.recipe import RUN_RECIPE, Recipe, resolved_tables, resolved_toml
from shardkit.registry import model_dims
from shardkit.run.checkpoint import Checkpointer, Restored, check_compatible, model_meta
from shardkit.run.evaluate import Evaluator, build_evaluator
from shardkit.run.lock import RunLock, describe_takeover
from shardkit.run.metrics import (
    TENSORBOARD_DIR,
    EvalOutput,
    MetricsLog,
    MetricsPipe,
    Progress,
    StepOutput,
    TensorBoardLog,
    WandbLog,
    import_wandb,
)
from shardkit.run.outputs import check_output_dir
from shardkit.run.profiler import StepProfiler
from shardkit.step import StepBuilder, build_step
from shardkit.xla_flags import compile_lowered

EXIT_NON_FINITE = 3


class NonFiniteLoss(ShardkitError):
    """The loss, gradient norm or state became NaN/Inf under a policy without loss scaling. CLI exit code 3."""

    exit_code = EXIT_NON_FINITE


class StopRequested:
    """Turns the first SIGTERM/SIGINT into a flag the loop checks between steps; a second one acts as usual once the
    loop has stopped stepping (`arm_second`). Copies of the first arriving within `DUPLICATE_SIGNAL_S` of it are one
    signal: a launcher that signals every process of the job (SLURM's cgroup process tracking) and the supervisor
    passing it on (`shardkit.run.supervise`) both deliver it."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    DUPLICATE_SIGNAL_S = 1.0

    def __init__(self):
        self.signal: int | None = None
        self._at = 0.0
        self._previous: dict[int, Any] = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal, self._at = signum, time.monotonic()
        for sig in self.SIGNALS:  # ignored by the kernel itself until `arm_second`, even inside a native call
            signal.signal(sig, signal.SIG_IGN)

    def arm_second(self) -> None:
        """From here on, a second signal ends the process at once (a stuck save must still be endable), but not
        before `DUPLICATE_SIGNAL_S` have passed since the first; nothing if no signal reached this process."""
        if self.signal is None:
            return
        time.sleep(max(0.0, self._at + self.DUPLICATE_SIGNAL_S - time.monotonic()))
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class SaveClock:
    """Whether `checkpoint.every_minutes` have passed since the last save (or the start); never with 0 minutes."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.last = time.monotonic()

    def due(self) -> bool:
        return self.seconds > 0 and time.monotonic() - self.last >= self.seconds

    def saved(self) -> None:
        self.last = time.monotonic()


class Agreed(NamedTuple):
    """What every process does before a step, decided alike everywhere: stop on a signal (None: go on), save now."""

    signal: int | None
    save: bool


def agree(stop: StopRequested, clock: SaveClock) -> Agreed:
    """The stop signal (the highest number any process received) and whether process 0's clock says a save is due.

    Every process must call this at the same points: with several processes it is one tiny all-gather, so all of
    them stop after, and save, the same step, even when a signal reached only one of them.
    """
    local = np.array([stop.signal or 0, jax.process_index() == 0 and clock.due()], np.int32)
    if jax.process_count() > 1:
        local = multihost_utils.process_allgather(local).max(axis=0)
    return Agreed(int(local[0]) or None, bool(local[1]))


@dataclasses.dataclass
class RunResult:
    """What a run did: the metrics of the steps it ran, and why it stopped."""

    records: list[dict[str, Any]]
    stopped_by: int | None = None
    last_checkpoint: int | None = None


@out_of_memory_as_one_error  # XLA's RESOURCE_EXHAUSTED anywhere in the run (init, restore, a step): one line
def train(
    recipe: Recipe, out_dir: str | Path, log=None, devices=None, profile: tuple[int, int] | None = None
) -> RunResult:
    """Train `recipe` writing metrics and checkpoints under `out_dir`, resuming from its latest checkpoint.

    Everything that can refuse the run does so before anything is written: the recipe and data (`_Run.build`), the
    newest checkpoint's metadata (another model, seed or state layout), then the compiled step's memory; a run whose
    checkpoint already reaches `train.steps` is not compiled at all.

    Args:
        recipe: the validated recipe.
        out_dir: run directory; `metrics.jsonl` and `checkpoints/` go there.
        log: stream for progress and notes (default: the current sys.stderr, looked up at call time); only
            process 0 writes to it.
        devices: devices for the mesh (default: all), e.g. `jax.devices()[:4]` to resume on fewer.
        profile: (START, STOP) to write a profiler trace of those steps under `out_dir/profile`.

    Raises:
        ShardkitError: the checkpoint in `out_dir` belongs to another model, seed or state layout.
        NonFiniteLoss: a NaN/Inf appeared under a policy without loss scaling.
        OutOfMemory: the compiled step needs more memory than a device has (nothing written), or an allocation
            failed at run time.
    """
    log = (sys.stderr if log is None else log) if jax.process_index() == 0 else io.StringIO()
    run = _Run.build(recipe, Path(out_dir), log, devices)
    for line in layout_warnings(run.builder.layout):
        run.log.write(line + "\n")
    newest = _newest_resumable_step(run)
    finished = newest is not None and newest >= recipe.train.steps
    compiled = None if finished else _compile_within_memory(run.builder)  # a step that cannot fit writes nothing
    run.out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(run.out_dir, run.log), contextlib.closing(
        Checkpointer(run.out_dir / "checkpoints", recipe.checkpoint.keep)
    ) as checkpointer, StopRequested() as stop:
        restored = _resume(checkpointer, run)
        start = restored.step if restored else 0
        if start >= recipe.train.steps:
            run.log.write(f"the checkpoint at step {start} already reaches train.steps={recipe.train.steps}; "
                          "nothing to run (raise --steps to continue)\n")
            return RunResult([], None, start)
        if compiled is None:  # the newest checkpoint's state was unreadable: an older one resumes, and needs the step
            compiled = _compile_within_memory(run.builder)
        _write_resolved_recipe(run)
        run.log.write(compile_line(compiled, run.builder.mesh.size) + "\n")
        # A checkpoint at step 0 is an imported one (shardkit import-hf): restored like any other.
        state = run.builder.init_state(recipe.train.seed) if restored is None else restored.state
        return _train_loop(run, compiled.step, state, start, checkpointer, stop, profile)


@dataclasses.dataclass(frozen=True)
class _Run:
    """What one `shardkit train` run works with, built (and so checked) before anything is compiled or written."""

    builder: StepBuilder
    source: TokenSource
    evaluator: Evaluator | None
    meta: dict[str, Any]
    out_dir: Path
    log: Any

    @classmethod
    def build(cls, recipe: Recipe, out_dir: Path, log, devices) -> "_Run":
        check_output_dir("--out", out_dir)
        layout = build_layout(recipe, devices)
        builder = build_step(layout)
        source = TokenSource(recipe.data, layout.vocab, recipe.train.seq_len, recipe.train.seed)  # bad data
        evaluator = build_evaluator(builder)  # held-out data checked now too
        if recipe.logging.wandb and jax.process_index() == 0:
            import_wandb()  # a missing package is said now, not after the compile
        return cls(builder, source, evaluator, model_meta(recipe, layout.config), out_dir, log)

    @property
    def recipe(self) -> Recipe:
        return self.builder.recipe

    @functools.cached_property
    def flops_per_step(self) -> float:
        layout, train = self.builder.layout, self.recipe.train
        # An MoE model counts the parameters a token passes through (shared plus top_k experts), as MFU does.
        per_token = training_flops_per_token(layout.config, active_parameters(layout), train.seq_len)
        return per_token * train.global_batch * train.seq_len

    @functools.cached_property
    def peak_flops(self) -> float | None:
        """The device's peak FLOP/s, None where it is not known (CPU): then no `mfu` column."""
        return peak_flops(jax.devices()[0].device_kind)


def _newest_resumable_step(run: _Run) -> int | None:
    """The step of the newest checkpoint under `out_dir` whose metadata reads, once `check_compatible` has passed it
    (it raises a ShardkitError for another model, seed or state layout); None without one.

    Read-only and without restoring any state, so a mismatched resume or a finished run is told before the step is
    compiled. The restore after the compile (`_resume`) still tries each checkpoint for real and moves unreadable ones
    aside.
    """
    directory = run.out_dir / "checkpoints"
    if not directory.is_dir():
        return None
    with contextlib.closing(Checkpointer(directory, read_only=True)) as checkpointer:
        for step in reversed(checkpointer.all_steps()):
            try:
                saved = checkpointer.read_meta(step)
            except Exception:  # noqa: BLE001 - unreadable: `_resume` skips it, with a warning, after the compile
                continue
            if isinstance(saved, dict):
                check_compatible(saved, run.meta, run.out_dir, step)
                return step
    return None


class CompiledStep(NamedTuple):
    """The compiled step with what its compile line says: the seconds it took, its compiled peak per device (None
    where XLA gives no memory analysis) and what a device may allocate (None where the device reports no limit)."""

    step: Any
    seconds: float
    peak_bytes: int | None
    limit_bytes: int | None


def _compile_within_memory(builder: StepBuilder) -> CompiledStep:
    """Compile the step (with the recipe's XLA flags) and refuse it, before anything is written, when its compiled
    peak exceeds what a device may allocate (`shardkit.analysis.compiled.fit`)."""
    recipe = builder.recipe
    began = time.perf_counter()
    compiled = compile_lowered(builder.lower(), recipe, builder.mesh)
    seconds = time.perf_counter() - began
    stats = memory_stats(compiled)
    device = next(d for d in builder.mesh.devices.flat if d.process_index == jax.process_index())  # one of ours
    limit = device_memory_limit(device)
    if stats is not None:
        where = f"{device.platform}:{device.id} ({device.device_kind})"
        check_fit(stats["peak_bytes"], limit, recipe, where)
    return CompiledStep(compiled, seconds, None if stats is None else stats["peak_bytes"], limit)


def compile_line(compiled: CompiledStep, devices: int) -> str:
    """What the compile took and what the step holds: the seconds, the device count, the compiled peak per device and
    the device's limit; the peak alone where the device reports no limit (CPU), neither where XLA gives no memory
    analysis."""
    line = f"compiled the step in {compiled.seconds:.1f} s on {devices} device{'' if devices == 1 else 's'}"
    if compiled.peak_bytes is None:
        return line
    held = short_bytes(compiled.peak_bytes)
    if compiled.limit_bytes is not None:
        held += f" of {short_bytes(compiled.limit_bytes)}"
    return f"{line}: {held} per device"


def short_bytes(count: int) -> str:
    """A byte count in binary units with one decimal: `512 B`, `1.5 KiB`, `34.6 GiB`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


@contextlib.contextmanager
def _locked(out_dir: Path, log):
    """Process 0 holds out_dir's lock for the run (the processes of one multi-process run share out_dir)."""
    if jax.process_index() != 0:
        yield
        return
    with RunLock(out_dir) as lock:
        note = describe_takeover(lock)
        if note:
            log.write(note + "\n")
        yield


def _resume(checkpointer: Checkpointer, run: _Run) -> Restored | None:
    """The newest readable checkpoint this run may resume (warning about newer unreadable ones), or None."""
    notes = []

    def check(step, saved):
        notes.append(check_compatible(saved, run.meta, run.out_dir, step))

    restored = checkpointer.restore_newest_readable(run.builder.abstract_state(), check)
    if restored is None:
        return None
    for step, why, moved in restored.skipped:
        run.log.write(f"warning: skipped the checkpoint at step {step}: {why}; kept it as {moved}\n")
    if notes[-1]:
        run.log.write(notes[-1] + "\n")
    run.log.write(f"resuming from the checkpoint at step {restored.step}\n")
    return restored


def _train_loop(run: _Run, step_fn, state, start: int, checkpointer: Checkpointer, stop: StopRequested,
                profile: tuple[int, int] | None) -> RunResult:
    """Steps `start` to `train.steps` with the compiled `step_fn`: each step's metrics handed to the pipe (fetched,
    logged and checked for NaN/Inf off this thread), evaluated when due, and checkpointed every `checkpoint.every`
    steps, when `checkpoint.every_minutes` have passed (before the next step) and at the end, once every record before
    the save has been checked; a stop signal saves and ends the loop."""
    train, every = run.recipe.train, run.recipe.checkpoint.every
    clock = SaveClock(run.recipe.checkpoint.every_minutes)
    pipe = MetricsPipe(functools.partial(_record, run), _sinks(run, start), functools.partial(_raise_if_not_finite,
                       builder=run.builder), asynchronous=run.recipe.logging.async_metrics)
    profiler = StepProfiler(profile, run.out_dir / "profile")
    done, last_saved, stopped_by = start, (start or None), None
    try:
        for step in range(start, train.steps):
            agreed = agree(stop, clock)
            stopped_by = agreed.signal
            if stopped_by is not None:
                stop.arm_second()
                break
            if agreed.save and done != last_saved and done > 0:
                _save(checkpointer, pipe, done, state, run.meta)
                last_saved = done
                clock.saved()
            profiler.before_step(step)
            began = time.perf_counter()
            state, metrics = _run_step(run, step_fn, state, step)
            pipe.submit(StepOutput(step, metrics, began))
            if run.evaluator is not None and run.evaluator.due(step + 1):
                pipe.submit(EvalOutput(step, run.evaluator(state["params"])))
            profiler.after_step(step, state)
            done = step + 1
            if done == train.steps or (every and done % every == 0):
                _save(checkpointer, pipe, done, state, run.meta)
                last_saved = done
                clock.saved()
        if stopped_by is not None and done != last_saved and done > 0:
            _save(checkpointer, pipe, done, state, run.meta)
            last_saved = done
        pipe.drain()
        checkpointer.wait()
    finally:
        pipe.close()
        profiler.stop()
    if stopped_by is not None:
        run.log.write(f"\nstopped at step {done} on signal {stopped_by}; checkpoint at step {last_saved} committed\n")
    return RunResult(pipe.records, stopped_by, last_saved)


def _run_step(run: _Run, step_fn, state, step: int) -> tuple[dict, dict[str, Any]]:
    """Dispatch one training step on step `step`'s batch: the new state and the step's metrics, both still being
    computed (JAX returns before the device is done)."""
    train = run.recipe.train
    batch = run.source.global_batch(step, train.global_batch, run.builder.batch_sharding())
    return step_fn(state, batch)


def _record(run: _Run, output: StepOutput, values: dict[str, Any], seconds: float) -> dict[str, Any]:
    """A step's metrics.jsonl record: its number as the console prints it (steps done), its fetched metrics, time,
    throughput and, where the peak is known, MFU."""
    train = run.recipe.train
    record = {"step": output.step + 1, **values, "step_time_s": seconds,
              "tokens_per_s": train.global_batch * train.seq_len / seconds}
    if run.peak_flops is not None:
        record["mfu"] = mfu(run.flops_per_step, seconds, run.builder.mesh.size, run.peak_flops)
    return record


def _sinks(run: _Run, start: int) -> list:
    """Where process 0 writes each record (metrics.jsonl, the progress line, TensorBoard, W&B); nowhere elsewhere:
    the processes of one run share its directory."""
    if jax.process_index() != 0:
        return []
    section = run.recipe.logging
    sinks = [MetricsLog(run.out_dir / "metrics.jsonl", start), Progress(run.recipe.train.steps, start, stream=run.log)]
    if section.tensorboard:
        sinks.append(TensorBoardLog(run.out_dir / TENSORBOARD_DIR, start))
    if section.wandb:
        sinks.append(WandbLog(run.out_dir, section, resolved_tables(_resolved_recipe(run))))
    return sinks


def _write_resolved_recipe(run: _Run) -> None:
    """RUN/recipe.toml: this run's recipe with its overrides and every default, which `train` reruns as it is."""
    if jax.process_index() != 0:
        return
    path = run.out_dir / RUN_RECIPE
    comments = [shlex.join(["shardkit", "train", str(path), "--out", "NEW_DIR", *_devices_flag(run)]),
                f"NEW_DIR: a new directory for the rerun (--out {shlex.quote(str(run.out_dir))} resumes this run).",
                f"The resolved recipe of this run (from {run.recipe.name!r}): --set overrides and defaults included."]
    path.write_text(resolved_toml(_resolved_recipe(run), model_dims(run.builder.layout.config), comments))


def _resolved_recipe(run: _Run) -> Recipe:
    """The run's recipe with its optimizer resolved from the layout's model class and config."""
    layout = run.builder.layout
    return with_optimizer_settings(run.recipe, layout.model_class, layout.config)


def _devices_flag(run: _Run) -> list[str]:
    """`--devices N` when this run used N fake CPU devices in one process, which a rerun must ask for again; a GPU
    run (or a multi-process one) finds its devices as this one did."""
    mesh = run.builder.mesh
    if mesh_platform(mesh) != "cpu" or jax.process_count() > 1:
        return []
    return ["--devices", str(mesh.size)]


def _raise_if_not_finite(record: dict[str, Any], builder: StepBuilder) -> None:
    """Under fp32/bf16 a NaN/Inf loss or gradient would poison the state; fp16's loss scaler handles its own."""
    if builder.policy.loss_scaling:
        return
    for key in ("loss", "grad_norm"):
        if not np.isfinite(record[key]):
            raise NonFiniteLoss(
                "train",
                f"{key} is {record[key]} at step {record['step']}; stopped without saving this step, the last good "
                "checkpoint is kept (lower optimizer.lr, check the data, or check that train.seq_len is within the "
                "model's position table)",
            )


def _save(checkpointer: Checkpointer, pipe: MetricsPipe, step: int, state, meta) -> None:
    pipe.drain()  # a NaN/Inf record up to this step stops the run here, before its state is saved
    if not _local_scalar(_all_finite(state)):
        raise NonFiniteLoss("train", f"the state after step {step - 1} holds NaN/Inf values; it was not saved")
    checkpointer.save(step, state, meta)


@jax.jit
def _all_finite(state) -> jax.Array:
    """One boolean: every floating-point value of the state is finite."""
    leaves = [leaf for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in leaves]))


def _local_scalar(value: jax.Array) -> Any:
    """A replicated scalar's value from this process's own copy (works across processes, unlike device_get)."""
    return np.asarray(value.addressable_data(0)).item()
