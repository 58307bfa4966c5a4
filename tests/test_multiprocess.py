"""Real multi-process runs: 2 processes x 4 CPU devices over loopback (gloo collectives), started the way each launcher
starts them, must train like one process of 8.

Launchers whose processes are started here, each simulated on this machine with nothing but what it would set:
    slurm     examples/slurm/train.sbatch run by bash, with a stand-in `srun` that starts its tasks with the
              variables srun sets (SLURM_JOB_ID, SLURM_NTASKS, SLURM_STEP_NUM_TASKS, SLURM_PROCID, SLURM_LOCALID,
              SLURM_STEP_NODELIST=localhost) and nothing else shardkit could read
    open_mpi  the variables mpirun (Open MPI 4) sets: OMPI_MCA_orte_hnp_uri, OMPI_COMM_WORLD_SIZE/RANK/LOCAL_RANK
JAX finds the coordinator, the process count and the index of these two itself (its cluster detection), so only real
processes show that they join. The other two launchers hand JAX all three explicitly, by one call that real processes
run elsewhere:
    flags     `--coordinator --num-processes --process-id`: test_lost_peer.py's two-process runs, whose losses match
              one process's within the same tolerance
    jobset    examples/k8s/jobset.yaml's pods, whose JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID
              `find_peers` reads into the same three values as the flags
              (test_jobset_pods_name_the_coordinator_count_and_index, in this process)

Each process builds only its own rows of the batch and holds only its own shards; the losses must equal the
single-process run on 8 devices within the suite's fp32 tolerance (1e-5 relative: only the order of the cross-process
sums differs).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import shardkit.run.distributed as distributed
from shardkit.cli import build_parser, main
from shardkit.errors import ShardkitError
from shardkit.recipe import load_recipe
from shardkit.run.distributed import Peers, find_peers, launched_as_one_of_several
from tests.helpers import ROOT, fresh_process_env

STEPS = 2  # a second step shows the first update was applied on every process alike
RECIPE = "recipes/fsdp_tp.toml"  # fsdp across the two processes, tensor within each
SMALL_BATCH = ["--set", "train.global_batch=8", "--set", "train.seq_len=16"]  # a row of 16 tokens per device
TRAIN_ARGS = ["--devices", "4", "--steps", str(STEPS), *SMALL_BATCH]
SLURM_PORTS = (65535 - 2**12 + 1, 65535)  # JAX's SLURM coordinator port is SLURM_JOB_ID % 2**12 + the first of these
FAKE_SRUN = '''#!{python}
"""srun as far as the test needs it: its own options skipped, SLURM_NTASKS copies of the command, each with the
variables srun gives a task."""
import os, subprocess, sys

arguments = sys.argv[1:]
while arguments[0].startswith("-"):
    arguments.pop(0)
tasks = int(os.environ["SLURM_NTASKS"])
task_variables = lambda rank: {{"SLURM_NTASKS": str(tasks), "SLURM_STEP_NUM_TASKS": str(tasks),
                                "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
                                "SLURM_STEP_NODELIST": "localhost"}}
processes = [subprocess.Popen(arguments, env={{**os.environ, **task_variables(rank)}}) for rank in range(tasks)]
sys.exit(max(process.wait() for process in processes))
'''
SHARDKIT = "#!/bin/sh\nexec {python} -m shardkit \"$@\"\n"


def _losses(out) -> np.ndarray:
    return np.array([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])


def _base_env() -> dict[str, str]:
    """This test process's environment without the settings that give it 8 fake devices or a launcher's identity
    (`fresh_process_env`: the suite's compile-time XLA flags stay, so the four processes of the two launchers compile
    one program once and read it from the session's compilation cache after that)."""
    dropped = (*distributed.LAUNCHERS, distributed.COORDINATOR_VARIABLE)
    return {key: value for key, value in fresh_process_env().items()
            if key not in dropped and not key.startswith("SLURM_")}


def _free_port_in(first: int, last: int) -> int:
    for port in random.Random().sample(range(first, last + 1), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {first}..{last}")


def _run_all(processes: list[subprocess.Popen]) -> None:
    outputs = [process.communicate(timeout=400)[0] for process in processes]
    assert [process.returncode for process in processes] == [0] * len(processes), outputs


def _shardkit_processes(env_of_rank, out: Path) -> list[subprocess.Popen]:
    command = [sys.executable, "-m", "shardkit", "train", RECIPE, *TRAIN_ARGS, "--out", str(out)]
    return [subprocess.Popen(command, cwd=ROOT, env=env_of_rank(rank), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for rank in range(2)]


def launch_slurm(out: Path, tmp_path: Path) -> list[subprocess.Popen]:
    """`bash train.sbatch` as sbatch would run it on a 2-node allocation, with `srun` and `shardkit` on the PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("shardkit", SHARDKIT)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    job_id = _free_port_in(*SLURM_PORTS) - SLURM_PORTS[0] + 2**12 * 1000  # the port JAX derives from it is free
    env = {**_base_env(), "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": str(job_id),
           "SLURM_JOB_NAME": "test", "SLURM_NTASKS": "2"}
    command = ["bash", "examples/slurm/train.sbatch", RECIPE, *TRAIN_ARGS, "--out", str(out)]
    return [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]


def launch_open_mpi(out: Path, tmp_path: Path) -> list[subprocess.Popen]:
    job = (_free_port_in(*SLURM_PORTS) - SLURM_PORTS[0]) * 2**12  # JAX derives the port from the ORTE job id
    variables = lambda rank: {"OMPI_MCA_orte_hnp_uri": f"{job}.0;tcp://127.0.0.1:40000", "OMPI_COMM_WORLD_SIZE": "2",
                              "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_RANK": str(rank)}
    return _shardkit_processes(lambda rank: {**_base_env(), **variables(rank)}, out)


LAUNCHERS = {"slurm": launch_slurm, "open_mpi": launch_open_mpi}


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> np.ndarray:
    """The losses of one process on 8 devices."""
    out = tmp_path_factory.mktemp("single")
    assert main(["train", RECIPE, "--steps", str(STEPS), *SMALL_BATCH, "--out", str(out)]) == 0
    return _losses(out)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_two_processes_train_like_one(launcher, single, tmp_path):
    multi = tmp_path / "multi"
    _run_all(LAUNCHERS[launcher](multi, tmp_path))
    np.testing.assert_allclose(_losses(multi), single, rtol=1e-5, atol=0)
    assert (multi / "checkpoints" / str(STEPS)).is_dir()


def _jobset_pods() -> tuple[list[str], list[dict[str, str]]]:
    """The command of examples/k8s/jobset.yaml's pods and each pod's environment (its completion index as its rank)."""
    manifest = yaml.safe_load((ROOT / "examples" / "k8s" / "jobset.yaml").read_text())
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    assert job["parallelism"] == job["completions"] == 2

    def pod_env(rank: int) -> dict[str, str]:
        env = {}
        for variable in container["env"]:
            if "value" in variable:
                env[variable["name"]] = variable["value"]
            else:
                assert "job-completion-index" in variable["valueFrom"]["fieldRef"]["fieldPath"]
                env[variable["name"]] = str(rank)
        return env

    pod0 = f"{manifest['metadata']['name']}-workers-0-0."
    envs = [pod_env(rank) for rank in range(2)]
    assert all(env["JAX_COORDINATOR_ADDRESS"].startswith(pod0) for env in envs)
    return container["command"], envs


def test_jobset_pods_name_the_coordinator_count_and_index():
    """Each pod joins as a `--coordinator pod0:PORT --num-processes 2 --process-id RANK` process would (the flags'
    end-to-end run: test_lost_peer.py), and its command is a `shardkit train` of a recipe that loads."""
    command, envs = _jobset_pods()
    assert command[:3] == ["shardkit", "train", RECIPE]
    args = build_parser().parse_args(command[1:])
    assert args.coordinator is None and args.num_processes is None and args.process_id is None
    assert load_recipe(ROOT / args.recipe, list(args.overrides)).mesh is not None
    address = envs[0]["JAX_COORDINATOR_ADDRESS"]
    for rank, env in enumerate(envs):
        expected = Peers("JAX_COORDINATOR_ADDRESS", address, 2, rank)
        assert find_peers(None, None, None, env) == expected
        assert find_peers(address, 2, rank, {}) == Peers("--coordinator", address, 2, rank)


def test_incomplete_distributed_flags_are_refused(tmp_path, capsys):
    assert main(["train", "recipes/dp.toml", "--coordinator", "127.0.0.1:1234", "--out", str(tmp_path / "x")]) == 2
    assert "--num-processes N and --process-id I together" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["nohost", "host:", ":1234", "host:0", "host:65536", "host:port", "::1"])
def test_a_coordinator_that_is_not_host_port_is_one_line(address, monkeypatch, tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--coordinator", address, "--num-processes", "2", "--process-id", "0"]
    assert main(["train", "recipes/dp.toml", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardkit: error: --coordinator: must be HOST:PORT"), err
    for name in ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (("JAX_COORDINATOR_ADDRESS", address), ("JAX_NUM_PROCESSES", "2"), ("JAX_PROCESS_ID", "0")):
        monkeypatch.setenv(name, value)
    assert main(["train", "recipes/dp.toml", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardkit: error: JAX_COORDINATOR_ADDRESS: must be HOST:PORT"), err
    assert not out.exists()


def test_an_ipv6_coordinator_is_host_port():
    assert find_peers("[::1]:1234", 2, 1) == Peers("--coordinator", "[::1]:1234", 2, 1)


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
def test_cluster_launches_are_detected(environment, expected):
    assert launched_as_one_of_several(environment) is expected


@pytest.mark.parametrize("environment, expected", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"},
     Peers("JAX_COORDINATOR_ADDRESS", "h:1", 4, 3)),
    ({"SLURM_STEP_NUM_TASKS": "2", "JAX_COORDINATOR_ADDRESS": "h:1"}, Peers("SLURM")),  # JAX reads the address itself
    ({"OMPI_COMM_WORLD_SIZE": "2"}, Peers("Open MPI")),
    ({"JAX_NUM_PROCESSES": "4"}, None),
])
def test_peers_come_from_the_environment(environment, expected):
    assert find_peers(None, None, None, environment) == expected


@pytest.mark.parametrize("environment, field", [
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "two"}, "JAX_PROCESS_ID"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES"),
])
def test_incomplete_environment_is_refused(environment, field):
    with pytest.raises(ShardkitError) as err:
        find_peers(None, None, None, environment)
    assert str(err.value).startswith(f"{field}: ")


def test_a_cluster_jax_cannot_read_is_one_line(monkeypatch):
    """Open MPI 5 has no OMPI_MCA_orte_hnp_uri: JAX finds no coordinator and raises; shardkit says so in one line."""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)

    def no_coordinator(*args, **settings):
        raise ValueError("coordinator_address should be defined.")

    monkeypatch.setattr("jax.distributed.initialize", no_coordinator)
    monkeypatch.setattr("jax.config.update", lambda name, value: None)  # this process's CPU client stays as it is
    with pytest.raises(ShardkitError, match="^Open MPI: cannot join the multi-process run: coordinator_address"):
        distributed.initialize(None, None, None)
