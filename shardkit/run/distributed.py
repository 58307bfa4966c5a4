"""Joining a multi-process run: explicit flags, or the cluster's own environment (SLURM, Open MPI)."""

from __future__ import annotations

import os

from shardkit.errors import ShardkitError

# Variables whose value > 1 means "this process is one of several that a launcher started". SLURM's is the step's
# task count, set by `srun` for each task, not SLURM_NTASKS, which an `salloc` shell also carries: a plain command run
# there must not wait for peers that will never come.
CLUSTER_SIZE_VARIABLES = ("SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None, cpu: bool) -> None:
    """Call `jax.distributed.initialize` when this is one process of several; do nothing for a single process.

    Args:
        coordinator: `HOST:PORT` of process 0, for launches that are not SLURM or Open MPI (then the other two are
            required). Without it, SLURM and Open MPI launches are detected from their environment.
        num_processes: how many processes take part.
        process_id: this process's index, 0 .. num_processes - 1.
        cpu: the devices are (fake) CPU devices, whose collectives across processes go through gloo.
    """
    import jax

    explicit = (coordinator, num_processes, process_id)
    if any(value is not None for value in explicit):
        if any(value is None for value in explicit):
            raise ShardkitError("--coordinator", "give --coordinator HOST:PORT, --num-processes N and --process-id I together")
        if not 0 <= process_id < num_processes:
            raise ShardkitError("--process-id", f"must be in 0..{num_processes - 1}, got {process_id}")
        if cpu:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    elif launched_as_one_of_several():
        jax.distributed.initialize()  # JAX reads the coordinator, process count and index from the cluster


def launched_as_one_of_several() -> bool:
    """True under `srun` with several tasks or `mpirun` with several ranks."""
    for name in CLUSTER_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return True
    return False
