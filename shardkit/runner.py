"""The training loop behind `shardkit train`: compile once, restore or init, step, log, checkpoint, stop cleanly."""

from __future__ import annotations

import dataclasses
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from shardkit.checkpoint import Checkpointer, check_compatible, model_meta
from shardkit.data import TokenSource
from shardkit.errors import ShardkitError
from shardkit.estimate import peak_flops, training_flops_per_token
from shardkit.metrics import MetricsLog, Progress
from shardkit.partition import build_layout
from shardkit.recipe import Recipe
from shardkit.train import StepBuilder, build_step


class StopRequested:
    """Turns SIGTERM and SIGINT into a flag the loop checks between steps (the step in flight always finishes)."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class RunResult:
    """What a run did: the metrics of the steps it ran, and why it stopped."""

    records: list[dict[str, Any]]
    stopped_by: int | None = None


def train(recipe: Recipe, out_dir: str | Path, log=sys.stderr) -> RunResult:
    """Train `recipe` writing metrics and checkpoints under `out_dir`, resuming from its latest checkpoint."""
    out_dir = Path(out_dir)
    layout = build_layout(recipe)
    builder = build_step(layout)
    began = time.perf_counter()
    compiled = builder.compile()
    log.write(f"compiled the step in {time.perf_counter() - began:.1f}s on {layout.mesh.size} devices\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(out_dir / "checkpoints", recipe.checkpoint.keep)
    meta = model_meta(recipe, layout.config)
    state, start = _restore_or_init(builder, checkpointer, meta, out_dir, log)
    try:
        return _loop(builder, compiled, state, start, checkpointer, meta, out_dir, log)
    finally:
        checkpointer.close()


def _restore_or_init(builder: StepBuilder, checkpointer: Checkpointer, meta, out_dir: Path, log):
    step = checkpointer.latest_step()
    if step is None:
        return builder.init_state(builder.recipe.train.seed), 0
    check_compatible(checkpointer.read_meta(step), meta, out_dir)
    log.write(f"resuming from the checkpoint at step {step}\n")
    return checkpointer.restore(step, builder.abstract_state()), step


def _loop(builder, compiled, state, start, checkpointer, meta, out_dir, log) -> RunResult:
    recipe, layout = builder.recipe, builder.layout
    train = recipe.train
    source = TokenSource(recipe.data, layout.config.vocab, train.seq_len, train.seed)
    tokens_per_step = train.global_batch * train.seq_len
    parameters = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(layout.abstract_params))
    flops_per_step = training_flops_per_token(layout.config, parameters, train.seq_len) * tokens_per_step
    peak = peak_flops(jax.devices()[0].device_kind)
    metrics_log = MetricsLog(out_dir / "metrics.jsonl", start)
    progress = Progress(train.steps, start, stream=log)
    records = []
    stop = StopRequested()
    with stop:
        for step in range(start, train.steps):
            began = time.perf_counter()
            batch = source.global_batch(step, train.global_batch, builder.batch_sharding())
            state, metrics = compiled(state, batch)
            metrics = {key: value.item() for key, value in jax.device_get(metrics).items()}
            seconds = time.perf_counter() - began
            record = {"step": step, **metrics, "step_time_s": seconds, "tokens_per_s": tokens_per_step / seconds}
            if peak is not None:
                record["mfu"] = flops_per_step / seconds / (peak * layout.mesh.size)
            if not np.isfinite(record["loss"]) and not builder.policy.loss_scaling:
                raise ShardkitError("train", f"loss is {record['loss']} at step {step}; the last good checkpoint is kept")
            metrics_log.write(record)
            progress.update(record)
            records.append(record)
            done = step + 1
            if stop.signal is not None or done == train.steps or (recipe.checkpoint.every and done % recipe.checkpoint.every == 0):
                checkpointer.save(done, state, meta)
            if stop.signal is not None:
                log.write(f"\nstopping at step {done} on signal {stop.signal}; checkpoint saved\n")
                break
    checkpointer.wait()
    metrics_log.close()
    return RunResult(records, stop.signal)
