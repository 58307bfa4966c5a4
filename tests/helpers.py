"""Shared helpers for the test suite."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np

from shardkit.analysis.compiled import hlo, hlo_parse
from shardkit.recipe import load_recipe

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"
PROCESS_TIMEOUT_S = 180  # a `shardkit train` process a test starts and waits for
# The band the pipeline estimate tests hold analytic / compiled to, and the schedules they compile.
LOW, HIGH = 0.9, 1.1
CHUNKED = ("pipeline.repeats=2", "model.layers=8")  # two chunks per stage need 8 layers over 4 stages
SCHEDULES = {
    "gpipe": ("pipeline.schedule=gpipe",),
    "1f1b": ("pipeline.schedule=1f1b",),
    "zero_bubble": ("pipeline.schedule=zero_bubble",),
    "interleaved_1f1b": ("pipeline.schedule=interleaved_1f1b", *CHUNKED),
    "circular": ("pipeline.schedule=circular", *CHUNKED),
}


def recipe(name: str, *overrides: str):
    """A recipe from recipes/ with `section.key=value` overrides."""
    return load_recipe(RECIPES / f"{name}.toml", list(overrides))


def free_port() -> int:
    """A TCP port on the loopback that is free now (for a multi-process run's coordinator)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fresh_process_env() -> dict[str, str]:
    """This process's environment for a command a test starts as a user would: without JAX_PLATFORMS and XLA_FLAGS,
    whose settings (a platform, a device count) must not override the command's own `--devices`, except for the
    compile-time flags tests/conftest.py sets for the whole suite. Kept, the command compiles as cheaply as the test
    process and shares the session's compilation cache; `SHARDKIT_TEST_XLA_DEFAULTS=1` leaves them unset, so the
    command compiles as users compile."""
    from tests.conftest import SUITE_XLA_FLAGS  # set before JAX's import there, so not imported at the top here

    kept = [flag for flag in os.environ.get("XLA_FLAGS", "").split() if flag in SUITE_XLA_FLAGS]
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    return env | ({"XLA_FLAGS": " ".join(kept)} if kept else {})


# Runs each argv of the JSON list in argv[1] through `shardkit.cli.main` in turn, each between two marker lines.
_EACH_COMMAND = """
import json, sys
from shardkit.cli import main
for argv in json.loads(sys.argv[1]):
    print("<<< shardkit " + " ".join(argv), flush=True)
    code = main(argv)
    print(f">>> exit {code}", flush=True)
"""


def shardkit_commands(commands: list[list[str]], timeout: float = 900) -> list[tuple[int | None, str, str]]:
    """`shardkit COMMAND...` for each of `commands`, one after another in one fresh process (`fresh_process_env`), as
    `python -m shardkit` runs each: one process start for them all. Returns each command's (exit code, stdout, the
    process's stderr tail); the exit code is None for a command the process did not finish (an abort ends the
    process, and with it the commands after it)."""
    result = subprocess.run([sys.executable, "-c", _EACH_COMMAND, json.dumps(commands)], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout, env=fresh_process_env())
    outcomes = re.findall(r"^<<< shardkit .*\n((?:.*\n)*?)>>> exit (-?\d+)$", result.stdout, flags=re.MULTILINE)
    stderr = f"process exit {result.returncode}: {result.stderr[-2000:]}"
    done = [(int(code), stdout, stderr) for stdout, code in outcomes]
    return done + [(None, "", stderr)] * (len(commands) - len(done))


def start_process(command: list[str], log: Path) -> subprocess.Popen:
    """Start a process whose output goes to a file (a pipe nobody reads could block it)."""
    return subprocess.Popen(command, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


def run_process(command: list[str], log: Path) -> str:
    process = start_process(command, log)
    assert process.wait(timeout=PROCESS_TIMEOUT_S) == 0, log.read_text()[-3000:]
    return log.read_text()


def wait_for(condition, process: subprocess.Popen, what: str, timeout: float = PROCESS_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"the run ended (code {process.returncode}) before {what}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def metrics_records(out: Path) -> list[dict]:
    """Complete lines only: the file may be read while a line is being written."""
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def losses_of(out: Path) -> list[tuple[int, float, float]]:
    return [(record["step"], record["loss"], record["grad_norm"]) for record in metrics_records(out)]


def resumed_from(text: str) -> int:
    match = re.search(r"resuming from the checkpoint at step (\d+)", text)
    assert match, text[-3000:]
    return int(match.group(1))


def assert_gradients_reduced_over_data_once(compiled, layout) -> None:
    """The gradients cross `data` once per step, after the pipeline loop, as under plain data parallelism.

    Reduced over `data`, in bytes: the parameters one device holds (its stage's layers, the embedding, final norm and
    head, fp32), plus at most the 4-byte mean loss (GPipe sums it with them; 1F1B over pipeline x data). Nothing of
    1% of that size is reduced inside a loop, over any axis (each pipeline tick's layer gradients all-reduced over
    `data` inside the backward loop would be).
    """
    summary = hlo.collective_summary(compiled, layout.mesh)
    held = device_param_bytes(layout)
    # Over `data` alone, or over `data` with `pipeline` in one op (the 1F1B family sums the embedding's gradient and
    # the loss over both at once).
    over_data = [axes for axes in {op.axes for op in summary.ops}
                 if "data" in axes and set(axes) <= {"data", "pipeline"}]
    reduced = sum(summary.bytes(kind, axes) for kind in ("all-reduce", "reduce-scatter") for axes in over_data)
    assert 0 <= reduced - held <= 4, f"{reduced:,.0f} bytes reduced over data per step; {held:,} held per device"
    looped = [op for op in summary.ops if op.kind in ("all-reduce", "reduce-scatter") and op.count > 1
              and op.bytes >= 0.01 * held]
    assert not looped, looped


def device_param_bytes(layout) -> int:
    """fp32 bytes of the parameters one device holds: a pipeline stage's layers plus everything outside the stack."""
    total = 0
    for shape, sharding in zip(jax.tree.leaves(layout.abstract_params), jax.tree.leaves(layout.param_shardings)):
        total += 4 * int(np.prod(sharding.shard_shape(shape.shape)))
    return total


def permuted_bytes(hlo_text: str, selected) -> float:
    """Bytes the selected collective-permutes move per execution: operand x source-target pairs x executions.

    shardkit.inspect counts a collective-permute's operand once per execution; a permute with k pairs moves it k
    times, and the pipeline's permutes have as many pairs as stages holding real work, so the pairs are counted here.
    `selected(op_name)` picks the permutes by the JAX operation they come from.
    """
    module = hlo_parse.parse_hlo(hlo_text)
    counts, unknown = hlo_parse.execution_counts(module)
    assert not unknown, f"loops without a known trip count: {unknown}"
    total = 0.0
    for name, times in counts.items():
        computation = module.computations[name]
        shapes = computation.shapes()
        for instruction in computation.instructions:
            if not selected(instruction.op_name):
                continue
            if instruction.opcode in ("collective-permute", "collective-permute-start"):
                pairs = hlo_parse.replica_groups(instruction.attributes, module.num_partitions)
                total += hlo_parse.shape_bytes(shapes[instruction.operands[0]]) * len(pairs) * times
    return total
