"""Eight fake CPU devices, set before JAX initialises; numpy-style rank promotion is an error in tests.

Two settings make the suite's many compiles cheaper without changing what any test sees:

- XLA:CPU compiles with `--xla_backend_optimization_level=0`: XLA's HLO passes run as usual (the optimized HLO, its
  collectives, buffer assignment and memory figures that the tests read are the same text), only LLVM's optimisation
  of the machine code is skipped, which halves a step's compile. Numbers move by an ulp or so (fp32 gradients by
  ~1e-8), far inside every tolerance; comparisons that must be exact run both sides under the same setting.
- A persistent compilation cache for this session only (a fresh temporary directory, removed at the end): a program
  compiled twice, by two test modules or by the `shardkit train` processes a module starts one after another, is
  compiled once. Processes started by the tests inherit it through the environment.

`SHARDKIT_TEST_XLA_DEFAULTS=1` turns both off (to run the suite as users compile).
"""

import atexit
import os
import shutil
import tempfile

if os.environ.get("SHARDKIT_TEST_XLA_DEFAULTS") != "1":
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # pytest-xdist workers inherit their controller's directory
        _CACHE = tempfile.mkdtemp(prefix="shardkit-tests-xla-cache-")
        atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"  # steps and kernels, not eager ops
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

from shardkit.testing import use_test_devices  # noqa: E402  (JAX reads the settings above when it is imported)

use_test_devices(8)
