"""`shardkit bench collectives`: time all-reduce, reduce-scatter, all-gather, ppermute and all-to-all over sizes.

Bandwidths follow nccl-tests' conventions (PERFORMANCE.md there): `algbw = bytes / time` with `bytes` the full
buffer (the all-gather's output, the reduce-scatter's input), and `busbw = algbw x factor`, the factor making busbw
comparable with the hardware's link bandwidth: 2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and
all-to-all, 1 for a permute. Each (op, size) is compiled once, warmed up, then timed `repeats` times; the median wins.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

from shardkit.analysis.compiled.collective_kinds import RING_FACTORS
from shardkit.analysis.compiled.hlo import human_bytes
from shardkit.errors import ShardkitError
from shardkit.units import parse_size

OPS = ("all-reduce", "reduce-scatter", "all-gather", "ppermute", "all-to-all")
DEFAULT_SIZES = tuple(2**p for p in range(10, 29, 3))  # 2**10 .. 2**28 bytes, every factor of 8
BUS_FACTOR_KIND = {"ppermute": "collective-permute"}


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """One timed collective: op, full-buffer bytes (nccl-tests' size), devices and the median seconds."""

    op: str
    bytes: int
    devices: int
    seconds: float

    @property
    def algbw(self) -> float:
        """Algorithm bandwidth, bytes/s: the full buffer over the time."""
        return self.bytes / self.seconds

    @property
    def busbw(self) -> float:
        """Bus bandwidth, bytes/s (nccl-tests): algbw times the ring factor of the op."""
        return self.algbw * RING_FACTORS[BUS_FACTOR_KIND.get(self.op, self.op)](self.devices)


def parse_sizes(text: str) -> tuple[int, ...]:
    """Comma-separated sizes such as `1K,1M,256M` (`shardkit.units.parse_size`: bare letters are binary)."""
    return tuple(parse_size(part, "--sizes") for part in text.split(","))


def parse_ops(text: str | None) -> tuple[str, ...]:
    """Comma-separated op names (all of `OPS` when None or empty); an unknown name is an error naming `--ops`."""
    if not text:
        return OPS
    ops = tuple(op.strip() for op in text.split(",") if op.strip())
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise ShardkitError("--ops", f"unknown collective {(unknown or [text])[0]!r}; valid ones are {list(OPS)}")
    return ops


def check_repeats(repeats: int) -> int:
    """The number of timed repeats, at least 1."""
    if repeats < 1:
        raise ShardkitError("--repeats", f"must be >= 1, got {repeats}")
    return repeats


def _collective(op: str, axis: str, devices: int) -> Callable:
    import jax

    if op == "all-reduce":
        return lambda x: jax.lax.psum(x, axis)
    if op == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, axis, tiled=True)
    if op == "all-gather":
        return lambda x: jax.lax.all_gather(x, axis, tiled=True)
    if op == "ppermute":
        return lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % devices) for i in range(devices)])
    if op == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)
    raise ShardkitError("bench", f"unknown collective {op!r}; valid ones are {list(OPS)}")


def bench_one(op: str, size: int, mesh, repeats: int = 10, warmup: int = 2) -> BenchResult:
    """Median time of one collective whose full buffer is `size` bytes (fp32), over all devices of `mesh`."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    devices = mesh.size
    elements = max(size // 4 // (devices * devices), 1) * devices * devices  # divisible for every op's layout
    fn = _collective(op, "x", devices)
    mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x")))
    # all-gather's full buffer is its output, so each device starts with 1/n of it; the others start with it all.
    global_elements = elements if op == "all-gather" else elements * devices
    x = jax.device_put(jnp.ones((global_elements,), jnp.float32), NamedSharding(mesh, PartitionSpec("x")))
    compiled = mapped.lower(x).compile()
    for _ in range(warmup):
        compiled(x).block_until_ready()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        compiled(x).block_until_ready()
        times.append(time.perf_counter() - began)
    return BenchResult(op, elements * 4, devices, statistics.median(times))


def run_bench(ops: Sequence[str] = OPS, sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 10,
              log: Callable[[str], None] | None = None) -> list[BenchResult]:
    """Benchmark every op at every size over all devices (a 1-D mesh named `x`)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    check_repeats(repeats)
    parse_ops(",".join(ops))
    mesh = Mesh(np.asarray(jax.devices()), ("x",))
    results = []
    for op in ops:
        for size in sizes:
            result = bench_one(op, size, mesh, repeats)
            results.append(result)
            if log is not None:
                log(format_row(result))
    return results


HEADER = f"{'op':<15} {'bytes':>11} {'devices':>7} {'time (us)':>11} {'algbw GB/s':>11} {'busbw GB/s':>11}"


def format_row(result: BenchResult) -> str:
    """One line under `HEADER`: op, size, devices, time in microseconds, algbw and busbw in GB/s (10^9 bytes/s)."""
    return (f"{result.op:<15} {human_bytes(result.bytes):>11} {result.devices:>7} {result.seconds * 1e6:>11.1f} "
            f"{result.algbw / 1e9:>11.3f} {result.busbw / 1e9:>11.3f}")
