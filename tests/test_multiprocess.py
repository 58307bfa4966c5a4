"""A real multi-process run from the command line: 2 processes x 4 CPU devices over loopback (gloo collectives).

Each process builds only its own rows of the batch and holds only its own shards; the losses must equal the
single-process run on 8 devices within the suite's fp32 tolerance (1e-5 relative: only the order of the cross-process
sums differs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shardkit.cli import main
from shardkit.run.distributed import launched_as_one_of_several
from tests.helpers import ROOT, free_port

STEPS = 3


def _losses(out) -> np.ndarray:
    return np.array([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fsdp_tp"])  # fsdp across the two hosts, tensor within each
def test_two_processes_train_like_one(recipe, tmp_path):
    port = free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    multi = tmp_path / "multi"
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "shardkit", "train", f"recipes/{recipe}.toml", "--devices", "4", "--steps",
             str(STEPS), "--out", str(multi), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(index)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for index in range(2)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], outputs
    single = tmp_path / "single"
    assert main(["train", f"recipes/{recipe}.toml", "--steps", str(STEPS), "--out", str(single)]) == 0
    np.testing.assert_allclose(_losses(multi), _losses(single), rtol=1e-5, atol=0)
    assert (multi / "checkpoints" / str(STEPS)).is_dir()


def test_incomplete_distributed_flags_are_refused(tmp_path, capsys):
    assert main(["train", "recipes/dp.toml", "--coordinator", "127.0.0.1:1234", "--out", str(tmp_path / "x")]) == 2
    assert "--num-processes N and --process-id I together" in capsys.readouterr().err


@pytest.mark.parametrize(
    "environment, expected",
    [
        ({}, False),
        ({"SLURM_NTASKS": "8", "SLURM_JOB_ID": "1"}, False),  # an salloc shell: one process, do not wait for peers
        ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "3"}, True),  # a task of `srun -n 8`
        ({"SLURM_STEP_NUM_TASKS": "1"}, False),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, True),
    ],
)
def test_cluster_launches_are_detected(environment, expected, monkeypatch):
    for name in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert launched_as_one_of_several() is expected
