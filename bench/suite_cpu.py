"""The test suite's CPU time per test and per module, to find what to cut.

As a pytest plugin (`-p bench.suite_cpu`, with the repository root on PYTHONPATH), each test's CPU seconds are
appended as one JSON line to $SUITE_CPU_LOG: `self` (the test process, all its threads), `child` (the processes it
started and waited for, ptxas and `shardkit` runs among them), wall seconds, and the seconds JAX reports tracing,
lowering and compiling (its `/jax/core/compile/*` duration events). CPU time, unlike wall time, stays comparable on a
loaded machine and under pytest-xdist.

As a script, it sums such a log per module, heaviest first:

    PYTHONPATH=$PWD SUITE_CPU_LOG=/tmp/suite.jsonl make test PYTEST_ADDOPTS="-p bench.suite_cpu"
    python bench/suite_cpu.py /tmp/suite.jsonl
"""

from __future__ import annotations

import collections
import json
import os
import resource
import sys
import time

import pytest

FIGURES = ("self", "child", "wall", "trace", "lower", "compile")
_JAX_EVENTS = {"jaxpr_trace_duration": "trace", "jaxpr_to_mlir_module_duration": "lower",
               "backend_compile_duration": "compile"}
_seconds: collections.Counter = collections.Counter()


def _record_jax_event(event: str, duration: float, **_) -> None:
    name = _JAX_EVENTS.get(event.rsplit("/", 1)[-1])
    if name and event.startswith("/jax/core/compile/"):
        _seconds[name] += duration


def pytest_configure(config) -> None:
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_record_jax_event)


def _cpu_seconds() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Time the whole protocol of one test (setup, call, teardown), so module-scoped fixtures count where they run."""
    _seconds.clear()
    own, children = _cpu_seconds()
    start = time.time()
    yield
    own_after, children_after = _cpu_seconds()
    row = {"id": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "-"), "self": own_after - own,
           "child": children_after - children, "wall": time.time() - start,
           **{figure: _seconds[figure] for figure in _JAX_EVENTS.values()}}
    with open(os.environ.get("SUITE_CPU_LOG", "suite_cpu.jsonl"), "a") as log:
        log.write(json.dumps(row) + "\n")


def per_module(rows: list[dict]) -> dict[str, collections.Counter]:
    """Each module's figures summed over its tests, with its number of tests under `n`."""
    modules: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for row in rows:
        module = modules[row["id"].split("::")[0]]
        module.update({figure: row.get(figure, 0.0) for figure in FIGURES})
        module["n"] += 1
    return modules


def main(path: str) -> None:
    with open(path) as log:
        modules = per_module([json.loads(line) for line in log])
    total: collections.Counter = collections.Counter()
    for name, figures in sorted(modules.items(), key=lambda item: -(item[1]["self"] + item[1]["child"])):
        total.update(figures)
        print(f"{name:48s} cpu {figures['self'] + figures['child']:7.1f}  self {figures['self']:7.1f}  "
              f"child {figures['child']:6.1f}  compile {figures['compile']:6.1f}  tests {figures['n']}")
    print(f"{'total':48s} cpu {total['self'] + total['child']:7.1f}  self {total['self']:7.1f}  "
          f"child {total['child']:6.1f}  compile {total['compile']:6.1f}  tests {total['n']}")


if __name__ == "__main__":
    main(sys.argv[1])
