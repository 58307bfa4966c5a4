"""Joining a multi-process run through JAX's own runtime (`jax.distributed.initialize`).

Three ways in, the first that applies wins:

    flags        --coordinator HOST:PORT --num-processes N --process-id I
    environment  JAX_COORDINATOR_ADDRESS (JAX's own variable) with JAX_NUM_PROCESSES and JAX_PROCESS_ID, which a
                 Kubernetes JobSet sets for each pod (examples/k8s/jobset.yaml)
    launcher     `srun` (SLURM) or `mpirun` (Open MPI): JAX reads the coordinator, the process count and this
                 process's index from the launcher's own variables (examples/slurm/train.sbatch)

A process that none of them names runs alone. On CPU, collectives across processes go through gloo in every case.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping

from shardkit.errors import ShardkitError

COORDINATOR_VARIABLE = "JAX_COORDINATOR_ADDRESS"
NUM_PROCESSES_VARIABLE = "JAX_NUM_PROCESSES"
PROCESS_ID_VARIABLE = "JAX_PROCESS_ID"
# Variables whose value > 1 means "this process is one of several that a launcher started". SLURM's is the step's
# task count, set by `srun` for each task, not SLURM_NTASKS, which an `salloc` shell also carries: a plain command run
# there must not wait for peers that will never come.
LAUNCHERS = {"SLURM_STEP_NUM_TASKS": "SLURM", "OMPI_COMM_WORLD_SIZE": "Open MPI"}
LAUNCHER_INDEX = {"SLURM": "SLURM_PROCID", "Open MPI": "OMPI_COMM_WORLD_RANK"}  # each launcher's process index
DEFAULT_PEER_TIMEOUT_S = 60.0  # `--peer-timeout`: how long a silent peer may take before the others give it up
JAX_HEARTBEAT_FACTOR = 2  # JAX's own heartbeat timeout, in units of the peer timeout: the watchdog acts first


@dataclasses.dataclass(frozen=True)
class Peers:
    """How this process joins a run: `source` names where the settings came from (for messages); a None field is
    left to JAX's cluster detection (SLURM, Open MPI)."""

    source: str
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def find_peers(coordinator: str | None, num_processes: int | None, process_id: int | None,
               environ: Mapping[str, str] = os.environ) -> Peers | None:
    """The multi-process run this process belongs to, from the flags, the environment or a launcher; None when alone.

    Raises:
        ShardkitError: flags or variables given only in part, a coordinator that is not HOST:PORT, or a process
            index outside 0 .. count - 1.
    """
    flags = (coordinator, num_processes, process_id)
    if any(value is not None for value in flags):
        if any(value is None for value in flags):
            together = "give --coordinator HOST:PORT, --num-processes N and --process-id I together"
            raise ShardkitError("--coordinator", together)
        peers = Peers("--coordinator", coordinator, num_processes, process_id)
        return _checked(peers, "--coordinator", "--num-processes", "--process-id")
    launcher = _launcher(environ)
    if COORDINATOR_VARIABLE in environ and launcher is None:
        count = _whole_number(environ, NUM_PROCESSES_VARIABLE)
        index = _whole_number(environ, PROCESS_ID_VARIABLE)
        peers = Peers(COORDINATOR_VARIABLE, environ[COORDINATOR_VARIABLE], count, index)
        return _checked(peers, COORDINATOR_VARIABLE, NUM_PROCESSES_VARIABLE, PROCESS_ID_VARIABLE)
    return Peers(launcher) if launcher else None


def process_index(peers: Peers, environ: Mapping[str, str] = os.environ) -> int | None:
    """This process's index in `peers`, known before JAX starts: given, or the launcher's; None if unreadable."""
    if peers.process_id is not None:
        return peers.process_id
    value = environ.get(LAUNCHER_INDEX.get(peers.source, ""), "")
    return int(value) if value.isdigit() else None


def launched_as_one_of_several(environ: Mapping[str, str] = os.environ) -> bool:
    """True under `srun` with several tasks or `mpirun` with several ranks."""
    return _launcher(environ) is not None


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S) -> None:
    """Join the multi-process run `find_peers` names (`jax.distributed.initialize`); do nothing for a single process.

    JAX's heartbeat timeout is `JAX_HEARTBEAT_FACTOR` times `peer_timeout_s`: shardkit's watchdog
    (`shardkit.run.watchdog`) ends the survivors of a lost process after `peer_timeout_s`, in one line, before JAX's
    coordination service would abort them.

    Raises:
        ShardkitError: bad flags or variables, or a launcher environment JAX cannot read (one line, no traceback).
    """
    peers = find_peers(coordinator, num_processes, process_id)
    if peers is None:
        return
    import jax

    # Only the CPU client reads this: fake CPU devices and CPU-only nodes need gloo for collectives across
    # processes, while GPUs keep NCCL whatever it says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(peers.coordinator, peers.num_processes, peers.process_id,
                                   heartbeat_timeout_seconds=math.ceil(JAX_HEARTBEAT_FACTOR * peer_timeout_s))
    except (ValueError, RuntimeError) as err:  # JAX's answers to an unreadable cluster environment
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ShardkitError(peers.source, f"cannot join the multi-process run: {first_line}") from None


def check_peer_timeout(seconds: float) -> float:
    """`--peer-timeout` as given, once checked: a positive number of seconds."""
    if not seconds > 0 or math.isinf(seconds):
        raise ShardkitError("--peer-timeout", f"must be a positive number of seconds, got {seconds}")
    return seconds


def _launcher(environ: Mapping[str, str]) -> str | None:
    for name, launcher in LAUNCHERS.items():
        value = environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            return launcher
    return None


def _whole_number(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name)
    if value is None or not value.strip().isdigit():
        shown = "it is not set" if value is None else f"got {value!r}"
        raise ShardkitError(name, f"a whole number is needed beside {COORDINATOR_VARIABLE}; {shown}")
    return int(value)


def _checked(peers: Peers, address_field: str, count_field: str, index_field: str) -> Peers:
    _check_address(peers.coordinator, address_field)
    if peers.num_processes < 1:
        raise ShardkitError(count_field, f"must be >= 1, got {peers.num_processes}")
    if not 0 <= peers.process_id < peers.num_processes:
        raise ShardkitError(index_field, f"must be in 0..{peers.num_processes - 1}, got {peers.process_id}")
    return peers


def _check_address(address: str, field: str) -> None:
    """HOST:PORT (an IPv6 host in brackets), checked here: JAX fails on anything else with an IndexError traceback."""
    host, _, port = address.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))  # `::1` is no HOST:PORT
    if not host or bare_ipv6 or not port.isdigit() or not 1 <= int(port) <= 65535:
        example = "e.g. 10.0.0.1:1234 or [::1]:1234"
        raise ShardkitError(field, f"must be HOST:PORT with a port in 1..65535 ({example}), got {address!r}")
