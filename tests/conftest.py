"""Eight fake CPU devices, set before JAX initialises; numpy-style rank promotion is an error in tests.

Five settings make the suite's many traces and compiles cheaper:

- XLA:CPU compiles with `--xla_backend_optimization_level=0`: XLA's HLO passes run as usual (the optimized HLO, its
  collectives, buffer assignment and memory figures that the tests read are the same text), only LLVM's optimisation
  of the machine code is skipped, which halves a step's compile. Numbers move by an ulp or so (fp32 gradients by
  ~1e-8), far inside every tolerance; comparisons that must be exact run both sides under the same setting.
- XLA:CPU emits its fusions with its classic LLVM IR emitters (`--xla_cpu_use_fusion_emitters=false`) rather than
  the MLIR fusion emitters, which build and lower an MLIR module per fusion: fsdp's tiny step on 8 devices compiles
  in a quarter of the CPU time (7.1 -> 1.8 CPU-s), pp's 1F1B step in 0.7 of it (32.0 -> 22.7 CPU-s). This one does
  change the CPU program a little: which elementwise producers XLA:CPU fuses into an in-place dynamic-update-slice,
  so XLA:CPU's temporary bytes move. The memory checks on XLA:CPU pass under both (test_estimate's itemised
  temporaries within 3%, test_sequence_parallel's, test_one_f_one_b's growth per micro-batch), as do the bitwise
  checks of test_packing. Sharding propagation, SPMD partitioning and the collectives are the same; programs compiled
  for a GPU `--target` are untouched (a CPU-only flag); and the processes that run as users compile (tests that
  start `shardkit` with XLA_FLAGS cleared: test_cli, test_fit) keep XLA's default emitters.
- A persistent compilation cache for this session only (a fresh temporary directory, removed at the end): a program
  compiled twice, by two test modules or by the `shardkit train` processes a module starts one after another, is
  compiled once. Processes started by the tests inherit it through the environment. JAX cannot read back what a
  compile-only client (the deviceless `--target` GPU compiles) wrote to it, so those programs are kept in memory
  instead, per test process, under the same key (tests/compile_only_memo.py).
- XLA:GPU keeps the kernels it compiles for a `--target` in a per-process kernel cache (`xla_gpu_kernel_cache_file`):
  the pipelines compiled for h100x8 under several schedules share most of their fusions, and a kernel met again skips
  LLVM and ptxas. The optimized HLO and its buffer assignment, which the tests read, come before code generation.
- Python's cyclic garbage collector runs less often in the test processes (`gc.set_threshold`), and not over the
  objects imported before the tests start (`gc.freeze`): tracing and lowering allocate and drop millions of small
  objects, and each full collection walks the whole heap. The processes tests start keep Python's defaults.

`SHARDKIT_TEST_XLA_DEFAULTS=1` turns the first four off (to run the suite as users compile).

The modules run heaviest first (`pytest_collection_modifyitems` below; `make test` passes `--no-loadscope-reorder`
so that pytest-xdist keeps this order instead of ordering files by their number of tests): with `--dist loadfile`
each worker takes whole files from the front of the queue, so the files left for the end are the cheap ones and
neither worker waits long for the other to finish a heavy file it took last. Modules that compile the same programs
for a `--target` go to one worker together (`SAME_WORKER`, `pytest_xdist_make_scheduler`), since those programs are
shared only within a process.
"""

import atexit
import collections
import gc
import os
import shutil
import tempfile

import pytest

# Also kept by the processes tests start (tests/helpers.py, fresh_process_env).
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")

if os.environ.get("SHARDKIT_TEST_XLA_DEFAULTS") != "1":
    _FLAGS = os.environ.get("XLA_FLAGS", "").split()  # an xdist worker inherits its controller's, flags included
    os.environ["XLA_FLAGS"] = " ".join(_FLAGS + [flag for flag in SUITE_XLA_FLAGS if flag not in _FLAGS])
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # pytest-xdist workers inherit their controller's directory
        _CACHE = tempfile.mkdtemp(prefix="shardkit-tests-xla-cache-")
        atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"  # steps and kernels, not eager ops
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    # XLA:GPU's kernel cache for the deviceless `--target` compiles, one file per test process (not inherited by the
    # processes tests start: `fresh_process_env` keeps only SUITE_XLA_FLAGS).
    _KERNELS = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], f"gpu-kernels-{os.getpid()}.bin")
    os.environ["XLA_FLAGS"] = " ".join([flag for flag in os.environ["XLA_FLAGS"].split()
                                        if not flag.startswith("--xla_gpu_kernel_cache_file=")]
                                       + [f"--xla_gpu_kernel_cache_file={_KERNELS}"])

from shardkit.testing import use_test_devices  # noqa: E402  (JAX reads the settings above when it is imported)

use_test_devices(8)

# Young collections every 50,000 net allocations rather than 700; a full one still after 200 of them.
gc.freeze()
gc.set_threshold(50_000, 20, 10)

if os.environ.get("SHARDKIT_TEST_XLA_DEFAULTS") != "1":
    from tests import compile_only_memo

    compile_only_memo.install()


# Test modules, heaviest first: by their CPU time where bench/results/suite_time_cpu_2026-11-29*.md measured it, else by
# what they compile and start (test_pipeline_estimate stands for the unit of `SAME_WORKER`'s modules, the heaviest).
# What matters is that heavy modules come before the cheap ones, less their order here. The unit's other modules come
# last: their order here is their order inside the unit (test_plan_html reads test_pipeline_estimate's compile). The
# modules not named follow: those with more tests marked slow first, then the rest in file order.
HEAVIEST_FIRST = (
    "test_five_d.py", "test_pipeline_estimate.py", "test_one_f_one_b.py", "test_fp8_pipeline.py",
    "test_five_d_plan.py", "test_moe.py", "test_own_models.py", "test_fp8.py", "test_bf16_pipeline.py",
    "test_equivalence.py", "test_packed_attention.py", "test_sequence_parallel.py", "test_packing.py",
    "test_suggest.py", "test_lost_peer.py", "test_multiprocess.py", "test_preemption.py", "test_faults.py",
    "test_estimate.py", "test_checkpoint.py", "test_pipeline.py", "test_train.py", "test_split_k.py",
    "test_fsdp_sync_pipeline.py", "test_generate.py", "test_names_by_path.py", "test_flax_models.py",
    "test_bench.py", "test_accumulation.py", "test_wheel.py", "test_attention_kernel.py", "test_fit.py",
    "test_examples.py", "test_docs.py", "test_pipeline_maxtext.py",
    "test_plan_html.py", "test_overlap.py", "test_predict.py", "test_hlo.py", "test_cli.py",
)


def pytest_collection_modifyitems(config, items):
    """Order the modules heaviest first, keeping each module's own order of tests (the sort is stable)."""
    rank = {name: index for index, name in enumerate(HEAVIEST_FIRST)}
    slow = collections.Counter(item.path.name for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -slow[item.path.name]))


# Modules that compile some of the same programs for `--target h100x8` (tests/compile_only_memo.py shares them within
# one process only): `--dist loadfile` hands them to the workers as one unit. test_predict compiles every shipped
# recipe, among them pp and pp_fsdp_tp under gpipe (test_pipeline_estimate_shipped's and test_pipeline_estimate's
# gpipe cases) and the tiny fsdp and tp recipes (test_overlap's `hlo --target`, test_hlo's h100x8 cases);
# test_plan_html's pipeline page is test_pipeline_estimate's zero_bubble program (the module runs after it:
# `HEAVIEST_FIRST`).
SAME_WORKER = {name: "tests/compiled-for-h100x8" for name in (
    "test_predict.py", "test_pipeline_estimate.py", "test_pipeline_estimate_shipped.py", "test_overlap.py",
    "test_plan_html.py", "test_hlo.py")}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile`, the scheduler that keeps `SAME_WORKER`'s modules on one worker; otherwise xdist's."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedCompilesScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SAME_WORKER.get(path.rsplit("/", 1)[-1], path)

    return SharedCompilesScheduling(config, log)
