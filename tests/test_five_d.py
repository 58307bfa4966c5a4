"""Every parallelism inside a pipeline (the 5D layout): accumulation with data parallelism, and the refusals that
remain naming their limit.

Equivalence runs on 16 fake CPU devices in a process of its own (tests/five_d_worker.py; the suite's own process has
8), fp32, held to one device within tests/equivalence.py's FP32_RTOL (1e-5): a pipeline and accumulation only
reorder fp32 sums (tests/test_pipeline.py's docstring says why that is the tolerance).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardkit.layout import build_layout
from shardkit.step import check_step_layout
from tests.helpers import ROOT, fresh_process_env, recipe

WORKER_TIMEOUT_S = 1200

# pipeline 2 x data 2 x fsdp 4, accumulation 2: 32 sequences, 16 a pass, 8 a pipeline micro-batch, 1 a replica.
ACCUMULATION = ("mesh.tensor=1", "mesh.data=2", "mesh.fsdp=4", "train.grad_accum=2", "train.global_batch=32",
                "pipeline.microbatches=2")


def run_worker(devices: int, cases: list) -> str:
    """Run tests/five_d_worker.py on `devices` fake devices; its output, asserting every case passed."""
    result = subprocess.run([sys.executable, "-m", "tests.five_d_worker", str(devices), json.dumps(cases)],
                            cwd=ROOT, env=fresh_process_env(), capture_output=True, text=True,
                            timeout=WORKER_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    return result.stdout


@pytest.mark.slow
def test_accumulation_with_pipeline_and_data_parallelism_is_one_device():
    """pipeline 2 x data 2 x fsdp 4 with train.grad_accum = 2, under GPipe and 1F1B: each replica runs its own
    pipeline per pass of the accumulation, and the passes' gradients add up to one device's."""
    cases = [["pp_fsdp_tp", [*ACCUMULATION, f"pipeline.schedule={schedule}"]] for schedule in ("gpipe", "1f1b")]
    output = run_worker(16, cases)
    assert output.count("ok ") == len(cases), output


def test_accumulation_with_a_pipeline_and_data_replicas_is_accepted():
    """The issue's command: `recipes/pp.toml --set mesh.pipeline=2 --set mesh.data=2 --set mesh.fsdp=2 --set
    train.grad_accum=2` builds and passes the step's checks (no compile)."""
    layout = build_layout(recipe("pp", "mesh.pipeline=2", "mesh.data=2", "mesh.fsdp=2", "train.grad_accum=2",
                                 "pipeline.microbatches=2"))
    check_step_layout(layout)
