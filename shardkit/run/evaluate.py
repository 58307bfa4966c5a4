"""Held-out evaluation during training: `[eval] every = N, batches = B` in a recipe.

Every N steps (and after the last) the run computes the mean next-token loss over B fixed batches of
`train.global_batch` rows and logs `eval_loss` and `eval_ppl` (exp of the loss) in that step's metrics.jsonl record and
as a line of the progress output. The batches are the same at every evaluation and under every layout: batch i is
the data source's batch at step EVAL_STEP_BASE + i (a step number training never reaches), drawn from

- the held-out split: `[eval] path`, or else the `val` split listed in the meta.json that `shardkit data prepare`
  wrote beside `data.path`;
- otherwise the training source itself (synthetic data: unseen rows of the same distribution).

The loss is `StepBuilder.eval_loss`: the training loss function in the layout's own model context (same precision
policy, attention kernel, pipeline and context parallelism; no dropout, no remat) on the layout's own shardings, so
its value differs between layouts only by the order of floating-point sums.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np

from shardkit.data.prepare import read_meta
from shardkit.data.source import TokenSource
from shardkit.errors import ShardkitError
from shardkit.recipe import DataSection

EVAL_STEP_BASE = 1 << 40


@dataclasses.dataclass
class Evaluator:
    """Runs the evaluation of one layout when it is due. Build it with `build_evaluator`."""

    every: int
    batches: int
    last_step: int
    source: TokenSource
    loss_fn: Callable
    batch_size: int
    sharding: Any

    def due(self, done: int) -> bool:
        return self.every > 0 and (done % self.every == 0 or done == self.last_step)

    def __call__(self, params) -> dict[str, float]:
        """{"eval_loss", "eval_ppl"} of `params` over the fixed evaluation batches."""
        total = 0.0
        for index in range(self.batches):
            batch = self.source.global_batch(EVAL_STEP_BASE + index, self.batch_size, self.sharding)
            total += float(np.asarray(self.loss_fn(params, batch).addressable_data(0)))
        loss = total / self.batches
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0))}


def build_evaluator(builder) -> Evaluator | None:
    """The evaluator of a StepBuilder's recipe, or None when `[eval] every` is 0."""
    recipe = builder.recipe
    section = recipe.eval
    if section.every == 0:
        return None
    vocab, seq_len = builder.layout.vocab, recipe.train.seq_len
    source = TokenSource(eval_data(recipe), vocab, seq_len, recipe.train.seed)
    return Evaluator(
        section.every, section.batches, recipe.train.steps, source, builder.eval_jit(),
        recipe.train.global_batch, builder.batch_sharding(),
    )


def eval_data(recipe) -> DataSection:
    """Where evaluation batches come from: [eval] path, the prepared val split beside data.path, or the train data."""
    section = recipe.eval
    if section.path:
        if not Path(section.path).is_file():
            raise ShardkitError("eval.path", f"no file at {section.path!r}")
        return DataSection(source="bin", path=section.path, dtype=recipe.data.dtype)
    if recipe.data.source == "bin":
        meta = read_meta(recipe.data.path)
        if meta is not None and "val" in meta.get("splits", {}):
            path = Path(recipe.data.path).parent / meta["splits"]["val"]["path"]
            return DataSection(source="bin", path=str(path), dtype=meta.get("dtype", recipe.data.dtype))
    return recipe.data


def format_eval(step: int, record: dict[str, float]) -> str:
    return f"eval at step {step}  loss {record['eval_loss']:.4f}  ppl {record['eval_ppl']:.2f}"
