"""Minimal repro of an XLA:CPU abort (jax/jaxlib 0.10.2): a bf16 psum inside a partially manual `jax.shard_map`.

    python tests/xla_cpu_bf16_psum_abort.py            # F... hlo_instruction.cc:1615] Invalid binary instruction
                                                       # opcode copy; SIGABRT (exit -6 / 134), core dump
    python tests/xla_cpu_bf16_psum_abort.py float32    # compiles (so do float16 and a fully manual region)

Why: inside a region manual over only some mesh axes, JAX lowers the psum's reducer with a sharding annotation on its
result; Shardy exports it as `ROOT copy(add(x, y))`. XLA:CPU's AllReducePromotion pass (bf16 -> fp32 all-reduce, CPU
only) rebuilds the reducer with HloInstruction::CreateBinary(root opcode), and `copy` is no binary opcode: a CHECK.
shardkit's pipeline regions are such regions; shardkit.manual's psum and to_varying sum bf16 in fp32 on CPU meshes.
Not collected by pytest (it aborts the process): tests/test_bf16_pipeline.py runs it in a subprocess.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P

dtype = jnp.dtype(sys.argv[1] if len(sys.argv) > 1 else "bfloat16")
mesh = jax.make_mesh((2, 1), ("manual", "auto"), axis_types=(AxisType.Auto, AxisType.Auto))
region = jax.shard_map(lambda x: jax.lax.psum(x, "manual"), mesh=mesh, in_specs=P("manual"), out_specs=P(),
                       axis_names={"manual"})
print(jax.jit(region)(jnp.ones((2, 4), dtype)))
