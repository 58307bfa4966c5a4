"""One process of a multi-process training run on this machine (CPU devices, gloo collectives), for test_preemption.

    python tests/preemption_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR [--set section.key=value ...]

Runs `shardkit.runner.train` on recipes/fsdp.toml over every process's devices (2 each) and exits like
`shardkit train` does.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICES_PER_PROCESS = 2


def main(argv: list[str]) -> int:
    process_id, processes, port, out_dir = int(argv[0]), int(argv[1]), int(argv[2]), argv[3]
    overrides = [value for flag, value in zip(argv[4::2], argv[5::2]) if flag == "--set"]
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", DEVICES_PER_PROCESS)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=processes, process_id=process_id
    )
    sys.path.insert(0, str(ROOT))
    from shardkit.recipe import load_recipe
    from shardkit.runner import train

    result = train(load_recipe(ROOT / "recipes" / "fsdp.toml", overrides), out_dir)
    print(f"process {process_id} stopped_by={result.stopped_by} last_checkpoint={result.last_checkpoint}", flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
